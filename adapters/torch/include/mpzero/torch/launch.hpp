// mpzero::torch: the world a launcher started this process in, and the communicator
// initialize sets up for it when none is passed (as DeepSpeed's init_distributed does).
//
//   mpirun -np 2 ./train                         (OMPI_COMM_WORLD_SIZE / PMI_SIZE, ..._RANK)
//   torchrun --nproc-per-node 2 ./train          (WORLD_SIZE, RANK, LOCAL_RANK)
//
// With CPU parameters under mpirun, initialize joins the launched processes through
// MPI_COMM_WORLD (the adapter built with MPI: MPZERO_TORCH_MPI, on when MPI is found),
// initialising MPI if the program did not. A world of one process, or no launcher, is
// the single-process engine. A launched world it cannot join (CUDA parameters, which need
// a device communicator such as NCCL; torchrun's variables, since LibTorch's C++
// distribution cannot create a Gloo group; an adapter without MPI) is refused with what to
// pass instead, never trained rank by rank.
#pragma once

#include <string>
#include <utility>

#include <mpzero/torch/communicator.hpp>

namespace mpzero::torch {

struct launch_environment {
  std::string launcher;  // "torchrun", "openmpi", "pmi" (MPICH, Intel MPI, Slurm's PMI), or "" (none)
  int world_size = 1;
  int rank = 0;
  int local_rank = 0;
};

// Reads the variables above; WORLD_SIZE (torchrun, DeepSpeed's launcher) first, then
// OpenMPI's, then PMI's. Throws mpzero::invalid_argument naming a variable that is not
// a number in range (RANK >= WORLD_SIZE, say) or a launcher's rank without its size.
launch_environment read_launch_environment();

// The communicator for `env` (see above); cuda_device < 0 for CPU parameters. A world of
// one process gives the local communicator. MPI initialised here is finalized at exit.
any_communicator communicator_from_environment(const launch_environment& env, int cuda_device);

// AutoTP's communicators, made by the program (DeepSpeed's mpu): the world, this rank's
// tensor-parallel group (the config's autotp_size ranks) and its data-parallel group
// (world / autotp_size ranks). Any communicators initialize takes: MPI communicators of
// MPI_Comm_split, c10d ProcessGroups (process_group_communicator), ... The groups must
// form a grid: every rank of a tensor-parallel group has the same data-parallel rank,
// every rank of a data-parallel group the same tensor-parallel rank; initialize checks it
// (collective over the world) and refuses, naming the ranks, where they do not.
struct parallel_groups {
  any_communicator world;            // every rank; empty: the world mpirun started (as initialize)
  any_communicator tensor_parallel;  // this rank's tensor-parallel group
  any_communicator data_parallel;    // this rank's data-parallel group
};

// AutoTP: {the tensor-parallel group of this rank, its data-parallel group}: groups of
// `tp` consecutive ranks of `world`, and the ranks at one position in each. `world` must
// be MPI's world (launched by mpirun); config_error otherwise. Collective over `world`.
std::pair<any_communicator, any_communicator> tensor_parallel_groups(const any_communicator& world, int tp);

}  // namespace mpzero::torch

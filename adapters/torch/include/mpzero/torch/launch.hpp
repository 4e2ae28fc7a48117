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

// AutoTP: {the tensor-parallel group of this rank, its data-parallel group}: groups of
// `tp` consecutive ranks of `world`, and the ranks at one position in each. `world` must
// be MPI's world (launched by mpirun); config_error otherwise. Collective over `world`.
std::pair<any_communicator, any_communicator> tensor_parallel_groups(const any_communicator& world, int tp);

}  // namespace mpzero::torch

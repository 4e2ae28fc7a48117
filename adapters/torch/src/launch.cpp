// mpzero::torch: the launcher's environment and the communicator initialize sets up from
// it (launch.hpp).
#include <mpzero/torch/launch.hpp>

#include <torch/nn/module.h>

#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <system_error>
#include <utility>

#include <mpzero/error.hpp>
#include <mpzero/torch/engine.hpp>

#ifdef MPZERO_TORCH_MPI
#include <mpi.h>

#include <mpzero/comm/mpi.hpp>
#endif

namespace mpzero::torch {

namespace {

[[noreturn]] void refuse(const std::string& what) { throw mpzero::invalid_argument("mpzero::torch::initialize: " + what); }

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

// The variable's value as an integer in [lo, hi], or nullopt when it is unset.
std::optional<int> env_int(const char* name, int lo, int hi) {
  const auto v = env(name);
  if (!v) return std::nullopt;
  int x = 0;
  const auto r = std::from_chars(v->data(), v->data() + v->size(), x);
  if (r.ec != std::errc{} || r.ptr != v->data() + v->size() || x < lo || x > hi) {
    refuse(std::string("the environment variable ") + name + "='" + *v + "' is not an integer in [" +
           std::to_string(lo) + ", " + std::to_string(hi) + "]; fix or unset it (the launcher sets it)");
  }
  return x;
}

constexpr int max_int = std::numeric_limits<int>::max();

// One launcher's (size, rank, local rank) variables into `e`, when its size is set.
bool read_world(launch_environment& e, const char* launcher, const char* size, const char* rank, const char* local) {
  const auto n = env_int(size, 1, max_int);
  if (!n) return false;
  const auto r = env_int(rank, 0, *n - 1);
  if (!r) {
    refuse(std::string(size) + "=" + std::to_string(*n) + " is set but " + rank +
           " is not; launch with torchrun or mpirun, or set both");
  }
  e.launcher = launcher;
  e.world_size = *n;
  e.rank = *r;
  e.local_rank = env_int(local, 0, max_int).value_or(0);
  return true;
}

std::string describe(const launch_environment& e) {
  return std::to_string(e.world_size) + " processes launched by " + e.launcher + " (this is rank " +
         std::to_string(e.rank) + ")";
}

#ifdef MPZERO_TORCH_MPI
// MPI for the engine's calls, initialised here when the program did not (finalized at
// exit, after the engine's communicators are gone).
void ensure_mpi() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) return;
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  std::atexit([] {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  });
}
#endif

// Why `e` cannot be joined here, and what to do instead.
[[noreturn]] void refuse_world(const launch_environment& e, int cuda_device) {
  std::string why = describe(e);
  if (cuda_device >= 0) {
    why += " with parameters on cuda:" + std::to_string(cuda_device) +
           "; initialize sets up host communicators only: pass one that reads device memory, "
           "mpzero::comm::nccl_communicator or process_group_communicator over your c10d NCCL group (docs/torch.md, "
           "\"Several processes\")";
  } else if (e.launcher == "torchrun") {
    why += ", but initialize joins a world through MPI only (LibTorch's C++ distribution has no Gloo headers to "
           "create a c10d group with): launch with mpirun -np " + std::to_string(e.world_size) +
           ", or pass process_group_communicator over a c10d group you create";
  } else {
    why += ", but this mpzero was built without MPI (MPZERO_TORCH_MPI=OFF): rebuild it with MPI installed, or "
           "pass a communicator (any_communicator::wrap(mpzero::comm::mpi_communicator))";
  }
  refuse(why + "; any_communicator::local() trains each process alone");
}

}  // namespace

launch_environment read_launch_environment() {
  launch_environment e;
  (void)(read_world(e, "torchrun", "WORLD_SIZE", "RANK", "LOCAL_RANK") ||
         read_world(e, "openmpi", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK") ||
         read_world(e, "pmi", "PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID"));
  return e;
}

any_communicator communicator_from_environment(const launch_environment& e, int cuda_device) {
  if (e.world_size <= 1) return any_communicator::local();
#ifdef MPZERO_TORCH_MPI
  if ((e.launcher == "openmpi" || e.launcher == "pmi") && cuda_device < 0) {
    ensure_mpi();
    int size = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size != e.world_size) {
      refuse(describe(e) + ", but MPI's world has " + std::to_string(size) +
             " processes: this mpzero's MPI is not the launcher's; launch with the mpirun of the MPI mpzero was "
             "built with");
    }
    return any_communicator::own(comm::mpi_communicator(MPI_COMM_WORLD), "MPI_COMM_WORLD");
  }
#endif
  refuse_world(e, cuda_device);
}

std::pair<any_communicator, any_communicator> tensor_parallel_groups(const any_communicator& world, int tp) {
  const int size = world.size(), rank = world.rank();
  if (tp < 1 || size % tp != 0) {
    throw config_error("mpzero: tensor_parallel.autotp_size = " + std::to_string(tp) + " does not divide the " +
                       std::to_string(size) + " ranks");
  }
#ifdef MPZERO_TORCH_MPI
  int initialized = 0;
  MPI_Initialized(&initialized);
  int mpi_size = 0, mpi_rank = 0;
  if (initialized) {
    MPI_Comm_size(MPI_COMM_WORLD, &mpi_size);
    MPI_Comm_rank(MPI_COMM_WORLD, &mpi_rank);
  }
  if (initialized && mpi_size == size && mpi_rank == rank) {
    // Tensor-parallel groups of consecutive ranks (DeepSpeed's default); the
    // data-parallel groups join the ranks at one position in each.
    const auto split = [&](int color, int key, const std::string& name) {
      MPI_Comm c = MPI_COMM_NULL;
      MPI_Comm_split(MPI_COMM_WORLD, color, key, &c);
      any_communicator out = any_communicator::own(comm::mpi_communicator(c), name);  // duplicates c
      MPI_Comm_free(&c);
      return out;
    };
    any_communicator tp_group = split(rank / tp, rank % tp, "tensor-parallel group " + std::to_string(rank / tp));
    any_communicator dp_group = split(rank % tp, rank / tp, "data-parallel group " + std::to_string(rank % tp));
    return {std::move(tp_group), std::move(dp_group)};
  }
#endif
  throw config_error("mpzero: tensor_parallel.autotp_size = " + std::to_string(tp) +
                     ": the engine makes its tensor- and data-parallel groups from MPI_COMM_WORLD, and the "
                     "communicator '" + world.name() + "' (" + std::to_string(size) + " ranks) is not MPI's world" +
#ifdef MPZERO_TORCH_MPI
                     "; launch with mpirun and pass MPI's world, or none"
#else
                     "; this mpzero was built without MPI (MPZERO_TORCH_MPI=OFF): rebuild it with MPI installed"
#endif
  );
}

namespace detail {

any_communicator launched(any_communicator comm, const ::torch::nn::Module& m) {
  if (!comm.is_default()) return comm;
  const launch_environment e = read_launch_environment();
  if (e.world_size <= 1) return comm;
  int device = -1;
  for (const auto& p : m.parameters()) {
    if (p.is_cuda()) device = p.device().index();
    break;
  }
  any_communicator joined = communicator_from_environment(e, device);
  if (joined.rank() == 0) {
    std::fprintf(stderr, "mpzero: %s: joined through %s\n", describe(e).c_str(), joined.name().c_str());
  }
  return joined;
}

}  // namespace detail

}  // namespace mpzero::torch

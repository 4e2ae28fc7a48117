// Writes the checkpoint fuzz target's seed inputs: real checkpoints of its model, saved
// by each of its optimizers after two steps, at every world size from 1 to the number of
// MPI ranks (so the seeds hold sets of 1 to 3 shard files at stages 0-3), each paired with
// each optimizer that loads. Run under mpirun:
//
//   mpirun -np 3 fuzz_checkpoint_seeds OUT_DIR
//
// OUT_DIR/w<W>_save<V>_load<L> is a fuzz input (checkpoint_model.hpp has the format).
#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include <mpzero/comm/mpi.hpp>

#include "checkpoint_model.hpp"

namespace {

namespace fs = std::filesystem;
using namespace mpzero;

template <int K>
void save_one(comm::mpi_communicator& c, const fs::path& dir) {
  using Z = fuzzing::variant_t<K, comm::mpi_communicator>;
  using G = typename Z::grad_type;
  Z z(c, fuzzing::model_numels, typename Z::optimizer::options{}, fuzzing::zero_options_of<Z>());
  for (std::size_t p = 0; p < z.num_params(); ++p) {
    std::vector<float> v(z.numel(p));
    for (std::size_t e = 0; e < v.size(); ++e) v[e] = 0.01f * static_cast<float>((p * 7 + e * 3) % 41) - 0.2f;
    z.load_param(p, v.data());
  }
  for (int s = 1; s <= 2; ++s) {
    const float scale = static_cast<float>(z.loss_scale());
    for (std::size_t p = z.num_params(); p-- > 0;) {
      std::vector<G> g(z.numel(p));
      for (std::size_t e = 0; e < g.size(); ++e) {
        g[e] = from_float<G>(scale * 0x1p-5f * static_cast<float>(static_cast<int>((p + e * 5 + s + c.rank()) % 9) - 4));
      }
      z.accumulate_grad(p, g.data());
    }
    z.end_backward();
    z.step();
  }
  z.save_checkpoint(dir);
}

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (argc != 2) {
    if (rank == 0) std::cerr << "usage: mpirun -np N fuzz_checkpoint_seeds OUT_DIR\n";
    MPI_Finalize();
    return 2;
  }
  const fs::path out = argv[1];
  int written = 0;
  try {
    if (rank == 0) fs::create_directories(out);
    for (int w = 1; w <= size; ++w) {
      MPI_Comm sub = MPI_COMM_NULL;
      MPI_Comm_split(MPI_COMM_WORLD, rank < w ? 0 : MPI_UNDEFINED, rank, &sub);
      for (int v = 0; v < fuzzing::n_variants; ++v) {
        const fs::path dir = out / ("tmp-w" + std::to_string(w) + "-v" + std::to_string(v));
        if (rank == 0) fs::create_directories(dir);
        MPI_Barrier(MPI_COMM_WORLD);
        if (sub != MPI_COMM_NULL) {
          comm::mpi_communicator c(sub, comm::mpi_options{60.0});
          fuzzing::visit_variant(v, [&]<int K>() { save_one<K>(c, dir); });
        }
        MPI_Barrier(MPI_COMM_WORLD);
        if (rank == 0) {
          std::vector<std::string> files;
          for (std::uint32_t k = 0; fs::exists(checkpoint::shard_path(dir, k)); ++k) {
            files.push_back(read_all(checkpoint::shard_path(dir, k)));
          }
          for (int l = 0; l < fuzzing::n_variants; ++l) {
            const std::string seed = fuzzing::encode(l, files);
            std::ofstream f(out / ("w" + std::to_string(w) + "_save" + std::to_string(v) + "_load" + std::to_string(l)),
                            std::ios::binary | std::ios::trunc);
            f.write(seed.data(), static_cast<std::streamsize>(seed.size()));
            if (!f.flush()) throw std::runtime_error("cannot write a seed into " + out.string());
            ++written;
          }
          fs::remove_all(dir);
        }
      }
      if (sub != MPI_COMM_NULL) MPI_Comm_free(&sub);
    }
  } catch (const std::exception& e) {
    std::cerr << "fuzz_checkpoint_seeds (rank " << rank << "): " << e.what() << "\n";
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  if (rank == 0) std::cout << "fuzz_checkpoint_seeds: " << written << " seeds in " << out.string() << "\n";
  MPI_Finalize();
  return 0;
}

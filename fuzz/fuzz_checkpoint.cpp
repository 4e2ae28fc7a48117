// Fuzz target: ZeroOptimizer::load_checkpoint on shard files it did not write
// (include/mpzero/zero/checkpoint.hpp's reader and the optimizer's checks).
//
// The input (checkpoint_model.hpp) is one of five optimizers and up to four shard files.
// The files go into a directory of this process's own, and that optimizer, at world size
// 1, loads them. What must hold:
// - load_checkpoint returns, or throws mpzero::error; anything else it throws (a
//   std::bad_alloc from a size read off the file, a std::length_error, a filesystem
//   error) is a finding, as is a crash or a sanitizer's report;
// - a load that throws changes nothing: parameters, master weights, states, step count
//   and loss scale keep their bits;
// - a load that succeeds saves again and loads into a second optimizer of the same kind
//   to the same bits.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <typeinfo>
#include <vector>

#include <stdlib.h>  // mkdtemp

#include <mpzero/comm/local.hpp>

#include "checkpoint_model.hpp"

extern const char* const mpzero_fuzz_target_name = "checkpoint";

namespace {

namespace fs = std::filesystem;
using namespace mpzero;
using mpzero::comm::local_communicator;

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "fuzz checkpoint: %s\n", what.c_str());
  std::abort();
}

// This process's scratch directories, removed at exit.
struct scratch {
  fs::path root;
  scratch() {
    std::error_code ec;
    std::string t = (fs::temp_directory_path(ec) / "mpzero-fuzz-checkpoint-XXXXXX").string();
    if (ec || mkdtemp(t.data()) == nullptr) finding("cannot create a scratch directory " + t);
    root = t;
    fs::create_directory(root / "in");
    fs::create_directory(root / "again");
  }
  ~scratch() {
    std::error_code ec;
    fs::remove_all(root, ec);
  }
  static void clear(const fs::path& dir) {
    for (const auto& e : fs::directory_iterator(dir)) fs::remove(e.path());
  }
};

// Every value the optimizer holds, as bits, with its flat index; the step count and the
// loss scale's bits.
template <class Z>
std::vector<std::uint64_t> snapshot(Z& z) {
  std::vector<std::uint64_t> out;
  auto bits = [&](std::uint64_t i, float v) {
    std::uint32_t b;
    std::memcpy(&b, &v, 4);
    out.push_back(i << 32 | b);
  };
  const std::size_t n = z.num_params();
  if constexpr (Z::zero_stage == 3) z.gather(0, n);
  for (std::size_t p = 0; p < n; ++p) {
    const auto span = z.param(p);
    for (std::size_t e = 0; e < span.size(); ++e) bits(z.flat_offset(p) + e, to_float(span[e]));
  }
  if constexpr (Z::zero_stage == 3) z.release(0, n);
  out.push_back(~0ull);
  z.read_master_shard(bits);
  for (int s = 0; s < Z::n_states; ++s) {
    out.push_back(~0ull);
    z.read_state_shard(s, bits);
  }
  out.push_back(z.steps());
  const double scale = z.loss_scale();
  std::uint64_t sb;
  std::memcpy(&sb, &scale, 8);
  out.push_back(sb);
  return out;
}

template <int K>
struct pair_of_optimizers {
  using Z = fuzzing::variant_t<K, local_communicator>;
  local_communicator comm;
  Z target{comm, fuzzing::model_numels, typename Z::optimizer::options{}, fuzzing::zero_options_of<Z>()};
  Z twin{comm, fuzzing::model_numels, typename Z::optimizer::options{}, fuzzing::zero_options_of<Z>()};
};

template <int K>
pair_of_optimizers<K>& optimizers() {
  static pair_of_optimizers<K> p;  // built once: the loads below overwrite them
  return p;
}

template <int K>
void load(const scratch& dirs) {
  auto& z = optimizers<K>().target;
  auto& twin = optimizers<K>().twin;
  const std::vector<std::uint64_t> before = snapshot(z);
  try {
    z.load_checkpoint(dirs.root / "in");
  } catch (const mpzero::error& e) {
    if (std::string(e.what()).empty()) finding("a refusal with an empty message");
    if (snapshot(z) != before) {
      finding(std::string("a load that threw changed the optimizer (variant ") + std::to_string(K) + "): " + e.what());
    }
    return;
  } catch (const std::exception& e) {
    finding(std::string("load_checkpoint threw ") + typeid(e).name() + ", not mpzero::error (variant " +
            std::to_string(K) + "): " + e.what());
  }
  // Accepted: it must save and load again to the same bits.
  const std::vector<std::uint64_t> loaded = snapshot(z);
  scratch::clear(dirs.root / "again");
  try {
    z.save_checkpoint(dirs.root / "again");
    twin.load_checkpoint(dirs.root / "again");
  } catch (const std::exception& e) {
    finding(std::string("an accepted checkpoint does not save and load again (variant ") + std::to_string(K) +
            "): " + e.what());
  }
  if (snapshot(twin) != loaded) {
    finding("an accepted checkpoint saved and loaded again to other values (variant " + std::to_string(K) + ")");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const scratch dirs;
  const fuzzing::fuzz_input in = fuzzing::decode(data, size);
  scratch::clear(dirs.root / "in");
  for (std::size_t k = 0; k < in.files.size(); ++k) {
    std::ofstream out(checkpoint::shard_path(dirs.root / "in", static_cast<std::uint32_t>(k)),
                      std::ios::binary | std::ios::trunc);
    out.write(in.files[k].data(), static_cast<std::streamsize>(in.files[k].size()));
    if (!out.flush()) finding("cannot write the input's shard file " + std::to_string(k));
  }
  fuzzing::visit_variant(in.variant, [&]<int K>() { load<K>(dirs); });
  return 0;
}

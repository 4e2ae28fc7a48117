// The model and optimizers the checkpoint fuzz target loads into, and its seed maker
// saves from: one layout (an empty parameter, a one-element one, sizes that do not
// divide by the world sizes), five optimizers that cover the stages, the policies'
// dtypes, a loss scaler, CPU offload, and another optimizer family. The input format
// the target reads is here too, so that target and seed maker agree on it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <utility>
#include <string>
#include <vector>

#include <mpzero/backend/host.hpp>
#include <mpzero/zero/zero_optimizer.hpp>

namespace mpzero::fuzzing {

inline const std::vector<std::uint64_t> model_numels{7, 33, 0, 64, 5, 1};

inline zero_options zero_options_for(bool fp16) {
  zero_options zo;
  zo.reduce_bucket_numel = 40;
  zo.param_persistence_threshold = 6;  // stage 3: the small parameters stay whole on every rank
  zo.offload_sub_group_numel = 50;
  zo.seed = 11;
  if (fp16) {
    zo.loss_scaling = true;
    zo.loss_scale.initial_scale_power = 6;
  }
  return zo;
}

// The optimizers, by index: variant<K, Comm>.
template <int K, class Comm>
struct variant;
template <class Comm>
struct variant<0, Comm> {
  using type = ZeroOptimizer<policies::fp32, optim::adamw, stage<0>, Comm>;
};
template <class Comm>
struct variant<1, Comm> {
  using type = ZeroOptimizer<policies::bf16_fp32_master, optim::adamw, stage<2>, Comm>;
};
template <class Comm>
struct variant<2, Comm> {
  using type = ZeroOptimizer<policies::bf16_all_sr, optim::adamw, stage<3>, Comm>;
};
template <class Comm>
struct variant<3, Comm> {
  using type = ZeroOptimizer<policies::fp16_fp32_master, optim::adam, stage<1>, Comm, host_backend, offload_cpu>;
};
template <class Comm>
struct variant<4, Comm> {
  using type = ZeroOptimizer<policies::fp32, optim::sgd, stage<2>, Comm>;
};
inline constexpr int n_variants = 5;

template <int K, class Comm>
using variant_t = typename variant<K, Comm>::type;

// Calls f.template operator()<K>() for the variant whose index is k.
template <class F>
void visit_variant(int k, F&& f) {
  [&]<int... K>(std::integer_sequence<int, K...>) {
    ((k == K ? (f.template operator()<K>(), 0) : 0), ...);
  }(std::make_integer_sequence<int, n_variants>{});
}

template <class Z>
zero_options zero_options_of() {
  return zero_options_for(Z::policy::needs_loss_scaling);
}

// The fuzz input: byte 0 chooses the optimizer that loads (modulo n_variants); then up to
// max_files shard files, file k as a little-endian u32 byte count and its bytes (a count
// past the input's end takes what is left), saved as zero_shard_0000k.mpz.
inline constexpr std::size_t max_files = 4;

struct fuzz_input {
  int variant = 0;
  std::vector<std::string> files;
};

inline fuzz_input decode(const std::uint8_t* data, std::size_t size) {
  fuzz_input in;
  if (size == 0) return in;
  in.variant = data[0] % n_variants;
  std::size_t at = 1;
  while (in.files.size() < max_files && at + 4 <= size) {
    std::uint32_t n = 0;
    std::memcpy(&n, data + at, 4);
    at += 4;
    const std::size_t take = std::min<std::size_t>(n, size - at);
    in.files.emplace_back(reinterpret_cast<const char*>(data + at), take);
    at += take;
  }
  return in;
}

inline std::string encode(int variant, const std::vector<std::string>& files) {
  std::string out(1, static_cast<char>(variant));
  for (const std::string& f : files) {
    const auto n = static_cast<std::uint32_t>(f.size());
    out.append(reinterpret_cast<const char*>(&n), 4);
    out += f;
  }
  return out;
}

}  // namespace mpzero::fuzzing

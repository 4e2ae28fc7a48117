// [gpu] tests: the CUDA backend against CUDA's own conversion intrinsics and against
// the host backend, bit for bit where the design promises it.
//
// Every case starts with require_device(): these tests run only under `ctest -L gpu`,
// so a machine without a usable device is an error here, never a silent pass.
// Every device operation goes on one non-blocking stream per case and is checked
// (MPZERO_CUDA_CHECK); results are read only after that stream is synchronised.
#include <catch2/catch.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iomanip>
#include <limits>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <mpzero/cuda/check.cuh>
#include <mpzero/cuda/fused_step.cuh>
#include <mpzero/mpzero.hpp>

using namespace mpzero;

namespace {

// ---- device, memory, streams --------------------------------------------------------

void require_device() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  INFO("the [gpu] tests need a CUDA device; cudaGetDeviceCount returned "
       << cudaGetErrorName(e) << " with " << count << " device(s). Run them with `ctest -L gpu` on a GPU machine.");
  REQUIRE(e == cudaSuccess);
  REQUIRE(count > 0);
  MPZERO_CUDA_CHECK(cudaSetDevice(0));
}

// Destructors cannot throw; a failure here follows an error that a checked call
// has already reported, so it is only printed.
void report_cleanup(const char* call, cudaError_t e) noexcept {
  if (e != cudaSuccess) std::fprintf(stderr, "test_gpu: %s failed: %s\n", call, cudaGetErrorString(e));
}

struct cuda_free {
  void operator()(void* p) const noexcept { report_cleanup("cudaFree", cudaFree(p)); }
};

template <class T>
using device_ptr = std::unique_ptr<T, cuda_free>;

template <class T>
device_ptr<T> device_alloc(std::size_t n) {
  void* p = nullptr;
  MPZERO_CUDA_CHECK(cudaMalloc(&p, (n > 0 ? n : 1) * sizeof(T)));
  return device_ptr<T>(static_cast<T*>(p));
}

class cuda_stream {
 public:
  cuda_stream() { MPZERO_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~cuda_stream() { report_cleanup("cudaStreamDestroy", cudaStreamDestroy(s_)); }
  cuda_stream(const cuda_stream&) = delete;
  cuda_stream& operator=(const cuda_stream&) = delete;
  operator cudaStream_t() const noexcept { return s_; }
  void sync() const { MPZERO_CUDA_CHECK(cudaStreamSynchronize(s_)); }

 private:
  cudaStream_t s_{};
};

std::string hex(std::uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%llX", static_cast<unsigned long long>(v));
  return buf;
}

template <class T>
std::uint64_t bits_of(const T& x) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
  std::uint64_t u = 0;
  std::memcpy(&u, &x, sizeof(T));
  return u;
}

// ---- 1. conversions: every input against CUDA's intrinsics ---------------------------

struct mismatch_counter {
  unsigned long long checked;  // inputs compared: proves the whole range was covered
  unsigned long long count;
  unsigned long long first;  // smallest input pattern that mismatched; ~0 while none did
};

__device__ void record(mismatch_counter* m, unsigned long long checked, unsigned long long count,
                       unsigned long long first) {
  atomicAdd(&m->checked, checked);
  if (count != 0) {
    atomicAdd(&m->count, count);
    atomicMin(&m->first, first);
  }
}

// Checks the float patterns [first, first + n): mpzero's integer conversions (what the
// host runs) against __float2bfloat16_rn and __float2half_rn, in the same kernel, and the
// device's own (the hardware's cvt) against the integer ones.
__global__ void from_float_kernel(std::uint32_t first, std::uint32_t n, mismatch_counter* bf,
                                  mismatch_counter* hf) {
  unsigned long long checked = 0, bf_count = 0, hf_count = 0, bf_first = ~0ull, hf_first = ~0ull;
  const std::uint32_t stride = gridDim.x * blockDim.x;
  for (std::uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    ++checked;
    const std::uint32_t u = first + i;
    const float f = __uint_as_float(u);
    const std::uint16_t bf_soft = detail::bf16_from_float_rn_soft(f).bits;
    const std::uint16_t hf_soft = detail::fp16_from_float_rn_soft(f).bits;
    if (bf_soft != __bfloat16_as_ushort(__float2bfloat16_rn(f)) || bf16_from_float_rn(f).bits != bf_soft) {
      if (bf_count++ == 0) bf_first = u;  // u grows along a thread's loop: the first is its smallest
    }
    if (hf_soft != __half_as_ushort(__float2half_rn(f)) || fp16_from_float_rn(f).bits != hf_soft) {
      if (hf_count++ == 0) hf_first = u;
    }
  }
  record(bf, checked, bf_count, bf_first);
  record(hf, checked, hf_count, hf_first);
}

// Every 16-bit pattern: to_float against __bfloat162float and __half2float. For a NaN
// input both must give a NaN; whether the payload matches too is counted apart
// (`*_payload`): for bf16, sm_90 widens with cvt.f32.bf16, which may return the
// canonical NaN where CUDA's host conversion (and mpzero, on host and device alike)
// keeps the payload; for fp16 both mpzero and CUDA's host code give the canonical NaN
// 0x7fffffff. `ours` gets mpzero's device results, which the host compares with its own;
// the fp16 widening the device runs (the hardware's, NaN made canonical) must equal the
// integer one (the host's) for every input, NaN included.
__global__ void to_float_kernel(mismatch_counter* bf, mismatch_counter* hf, mismatch_counter* bf_payload,
                                mismatch_counter* hf_payload, std::uint32_t* ours_bf, std::uint32_t* ours_hf) {
  const std::uint32_t h = blockIdx.x * blockDim.x + threadIdx.x;
  if (h > 0xffffu) return;
  const auto s = static_cast<std::uint16_t>(h);
  const float our_bf = to_float(bf16{s}), cuda_bf = __bfloat162float(__ushort_as_bfloat16(s));
  const float our_hf = detail::fp16_to_float_soft(fp16{s}), cuda_hf = __half2float(__ushort_as_half(s));
  const bool hf_device_differs = __float_as_uint(to_float(fp16{s})) != __float_as_uint(our_hf);
  ours_bf[h] = __float_as_uint(our_bf);
  ours_hf[h] = __float_as_uint(our_hf);
  const bool bf_nan = (s & 0x7f80u) == 0x7f80u && (s & 0x007fu) != 0;
  const bool hf_nan = (s & 0x7c00u) == 0x7c00u && (s & 0x03ffu) != 0;
  const bool bf_bits = __float_as_uint(our_bf) != __float_as_uint(cuda_bf);
  const bool hf_bits = __float_as_uint(our_hf) != __float_as_uint(cuda_hf);
  const bool bf_differs = bf_nan ? !(isnan(our_bf) && isnan(cuda_bf)) : bf_bits;
  const bool hf_differs = (hf_nan ? !(isnan(our_hf) && isnan(cuda_hf)) : hf_bits) || hf_device_differs;
  record(bf, 1, bf_differs ? 1 : 0, bf_differs ? h : ~0ull);
  record(hf, 1, hf_differs ? 1 : 0, hf_differs ? h : ~0ull);
  record(bf_payload, bf_nan ? 1 : 0, bf_nan && bf_bits ? 1 : 0, bf_nan && bf_bits ? h : ~0ull);
  record(hf_payload, hf_nan ? 1 : 0, hf_nan && hf_bits ? 1 : 0, hf_nan && hf_bits ? h : ~0ull);
}

// Both sides' results for one input, to report a mismatch: {mpzero bf16, CUDA bf16,
// mpzero fp16, CUDA fp16}.
__global__ void probe_from_float_kernel(std::uint32_t u, std::uint32_t* out) {
  const float f = __uint_as_float(u);
  out[0] = detail::bf16_from_float_rn_soft(f).bits;
  out[1] = __bfloat16_as_ushort(__float2bfloat16_rn(f));
  out[2] = detail::fp16_from_float_rn_soft(f).bits;
  out[3] = __half_as_ushort(__float2half_rn(f));
}

__global__ void probe_to_float_kernel(std::uint16_t h, std::uint32_t* out) {
  out[0] = __float_as_uint(to_float(bf16{h}));
  out[1] = __float_as_uint(__bfloat162float(__ushort_as_bfloat16(h)));
  out[2] = __float_as_uint(detail::fp16_to_float_soft(fp16{h}));
  out[3] = __float_as_uint(__half2float(__ushort_as_half(h)));
}

std::array<std::uint32_t, 4> probe(bool from_float, std::uint32_t input, cudaStream_t s) {
  auto d = device_alloc<std::uint32_t>(4);
  if (from_float) {
    probe_from_float_kernel<<<1, 1, 0, s>>>(input, d.get());
  } else {
    probe_to_float_kernel<<<1, 1, 0, s>>>(static_cast<std::uint16_t>(input), d.get());
  }
  MPZERO_CUDA_CHECK(cudaGetLastError());
  std::array<std::uint32_t, 4> out{};
  MPZERO_CUDA_CHECK(cudaMemcpyAsync(out.data(), d.get(), sizeof(out), cudaMemcpyDeviceToHost, s));
  MPZERO_CUDA_CHECK(cudaStreamSynchronize(s));
  return out;
}

// Reads back the two counters and fails with the first mismatching input and both
// results when either counter is not zero.
void check_counters(const mismatch_counter* d_counters, bool from_float, unsigned long long inputs,
                    const char* input_kind, cudaStream_t s) {
  mismatch_counter c[2];
  MPZERO_CUDA_CHECK(cudaMemcpyAsync(c, d_counters, sizeof(c), cudaMemcpyDeviceToHost, s));
  MPZERO_CUDA_CHECK(cudaStreamSynchronize(s));
  const char* format[2] = {"bf16", "fp16"};
  for (int k = 0; k < 2; ++k) {
    INFO(format[k] << ": " << c[k].count << " of the " << input_kind
                   << " inputs differ from CUDA's intrinsic (mpzero's integer conversion), or the device's "
                      "conversion differs from the integer one");
    CHECK(c[k].checked == inputs);
    if (c[k].count != 0) {
      const auto r = probe(from_float, static_cast<std::uint32_t>(c[k].first), s);
      INFO("first mismatch at input " << hex(c[k].first) << ": mpzero's integer conversion gives " << hex(r[2 * k]) << ", CUDA gives "
                                      << hex(r[2 * k + 1]));
      CHECK(c[k].count == 0);
    } else {
      CHECK(c[k].first == ~0ull);
    }
  }
}

// ---- host/device mirrors of one buffer ---------------------------------------------

// Elements after each device buffer (and before it, when it is offset) that no
// kernel may touch; filled with this byte and checked after the run.
constexpr std::size_t kGuard = 16;
constexpr unsigned char kGuardByte = 0xA5;

// The same initial contents on the host (for the host backend) and on the device.
// The device copy may start `offset` elements past a 256-byte-aligned allocation,
// which for offset 1 makes it not 16-byte aligned.
template <class T>
struct mirror {
  std::vector<T> host;
  device_ptr<T> storage;  // offset + numel + kGuard elements
  std::size_t offset = 0;

  std::size_t numel() const noexcept { return host.size(); }
  T* host_ptr() noexcept { return host.empty() ? nullptr : host.data(); }
  T* device() const noexcept { return host.empty() ? nullptr : storage.get() + offset; }
};

template <class T>
mirror<T> make_mirror(std::vector<T> init, std::size_t offset, cudaStream_t s) {
  mirror<T> m;
  m.host = std::move(init);
  m.offset = offset;
  if (m.host.empty()) return m;  // an empty tensor: null pointers on both sides
  const std::size_t total = offset + m.numel() + kGuard;
  m.storage = device_alloc<T>(total);
  MPZERO_CUDA_CHECK(cudaMemsetAsync(m.storage.get(), kGuardByte, total * sizeof(T), s));
  MPZERO_CUDA_CHECK(cudaMemcpyAsync(m.device(), m.host.data(), m.numel() * sizeof(T), cudaMemcpyHostToDevice, s));
  return m;
}

// The device buffer equals the host one bit for bit, and the guards are intact.
template <class T>
void check_mirror(const mirror<T>& m, const char* what, cudaStream_t s) {
  if (m.numel() == 0) return;
  const std::size_t total = m.offset + m.numel() + kGuard;
  std::vector<T> back(total);
  MPZERO_CUDA_CHECK(cudaMemcpyAsync(back.data(), m.storage.get(), total * sizeof(T), cudaMemcpyDeviceToHost, s));
  MPZERO_CUDA_CHECK(cudaStreamSynchronize(s));
  INFO(what << " (" << m.numel() << " elements, device pointer offset by " << m.offset << ")");

  const auto* raw = reinterpret_cast<const unsigned char*>(back.data());
  std::size_t damaged = 0;
  for (std::size_t b = 0; b < m.offset * sizeof(T); ++b) damaged += raw[b] != kGuardByte;
  for (std::size_t b = (m.offset + m.numel()) * sizeof(T); b < total * sizeof(T); ++b) damaged += raw[b] != kGuardByte;
  INFO("bytes written outside the buffer: " << damaged);
  CHECK(damaged == 0);

  std::size_t differ = 0, first = 0;
  for (std::size_t i = 0; i < m.numel(); ++i) {
    if (std::memcmp(&back[m.offset + i], &m.host[i], sizeof(T)) != 0 && differ++ == 0) first = i;
  }
  if (differ != 0) {
    INFO(differ << " elements differ; first at " << first << ": host " << hex(bits_of(m.host[first])) << ", device "
                << hex(bits_of(back[m.offset + first])));
    CHECK(differ == 0);
  }
}

template <class T>
std::size_t count_changed(const std::vector<T>& before, const std::vector<T>& after) {
  std::size_t n = 0;
  for (std::size_t i = 0; i < before.size(); ++i) n += std::memcmp(&before[i], &after[i], sizeof(T)) != 0;
  return n;
}

// ---- inputs -----------------------------------------------------------------------

// Deterministic inputs of realistic shape: mostly O(1) weights with a few small ones,
// gradients with exact zeros and values below fp16's normal range.
struct value_source {
  std::mt19937_64 rng;
  std::normal_distribution<float> normal{0.0f, 1.0f};
  std::uniform_real_distribution<float> unit{0.0f, 1.0f};

  explicit value_source(std::uint64_t seed) : rng(seed) {}

  float weight() { return normal(rng) * (unit(rng) < 0.1f ? 1e-3f : 0.5f); }
  float grad() {
    const float u = unit(rng);
    if (u < 0.05f) return 0.0f;
    if (u < 0.06f) return normal(rng) * 1e-6f;
    return normal(rng) * 2.0f;
  }
  float moment() { return normal(rng) * 0.1f; }
};

template <class T, class Gen>
std::vector<T> generate(std::size_t n, Gen&& gen) {
  std::vector<T> v(n);
  for (auto& x : v) x = from_float<T>(gen());
  return v;
}

template <class T>
std::vector<T> convert(const std::vector<float>& src) {
  std::vector<T> v(src.size());
  for (std::size_t i = 0; i < src.size(); ++i) v[i] = from_float<T>(src[i]);
  return v;
}

// ---- 2. the fused step: CUDA against the host backend -----------------------------

enum class placement { aligned, all_offset, grad_offset };

struct tensor_spec {
  std::size_t numel;
  placement where;
};

// Empty; one element; a tail shorter than one vector; one element past a chunk; several
// chunks with a ragged end; then a tensor whose every device pointer is one element
// past a 16-byte boundary (the kernel's scalar path, over two chunks) and one where only
// the gradient is (mixed alignment must fall back as well).
const std::vector<tensor_spec> kStepTensors = {{0, placement::aligned},          {1, placement::aligned},
                                               {7, placement::aligned},          {65537, placement::aligned},
                                               {300001, placement::aligned},     {70001, placement::all_offset},
                                               {4099, placement::grad_offset}};
constexpr std::size_t kLargest = 4;  // index of the 300001-element tensor

// Global element indices start just below 2^33: stochastic rounding hashes the counter
// 2 x index, whose high word changes at index 2^33, inside the largest tensor. The
// tensors start at even and at odd indices (offsets 0, 0, 1, 8, 65545, 365546, 435547
// from here), and the second plan's odd chunk size starts chunks at odd indices: the
// kernel's bits must match the host's wherever a thread's elements begin.
constexpr std::uint64_t kFirstGlobalIndex = (1ull << 33) - 100000;
constexpr std::uint64_t kRoundingSeed = 0x0123456789ABCDEFull;

// The default plan, and one whose odd chunk size puts some chunk starts off 16-byte
// boundaries and whose limits split the work into many launches.
const plan_options kPlans[2] = {plan_options{}, plan_options{12345, 3, 2}};

template <class Optimizer>
inline constexpr bool has_second_moment =
    std::is_same_v<Optimizer, optim::adam> || std::is_same_v<Optimizer, optim::adamw> ||
    std::is_same_v<Optimizer, optim::adam_runtime>;

template <class Policy>
std::string policy_name() {
  return "precision<" + std::string(name_of(Policy::param_dtype)) + ", " + std::string(name_of(Policy::master_dtype)) +
         ", " + std::string(name_of(Policy::grad_dtype)) + ", " + std::string(name_of(Policy::state_dtype)) + ", " +
         std::string(Policy::rounding::name) + ">";
}

template <class Policy, class Optimizer>
void check_fused_step(const typename Optimizer::options& opts, std::size_t plan_index) {
  using P = typename Policy::param_type;
  using M = typename Policy::master_type;
  using G = typename Policy::grad_type;
  using S = typename Policy::state_type;
  using tensor_t = step_tensor<Policy, Optimizer>;
  constexpr int n_states = Optimizer::n_states;

  INFO(policy_name<Policy>() << ", " << Optimizer::name << ", plan " << plan_index);
  cuda_stream stream;
  value_source src(0x6D707A65726Full + plan_index);

  struct buffers {
    mirror<P> param;
    mirror<M> master;  // empty when the parameter is the master
    mirror<G> grad;
    std::array<mirror<S>, n_states> states;
  };
  std::vector<buffers> bufs;
  bufs.reserve(kStepTensors.size());
  std::vector<tensor_t> host_tensors, device_tensors;
  for (const tensor_spec& spec : kStepTensors) {
    const std::size_t n = spec.numel;
    const std::size_t offset = spec.where == placement::all_offset ? 1 : 0;
    const std::size_t grad_offset = spec.where == placement::aligned ? 0 : 1;
    buffers& b = bufs.emplace_back();

    std::vector<float> w(n);
    for (auto& x : w) x = src.weight();
    if constexpr (Policy::master_is_param) {
      b.param = make_mirror(convert<P>(w), offset, stream);
    } else {
      b.master = make_mirror(convert<M>(w), offset, stream);
      // Unrelated initial values: the step must overwrite every parameter.
      b.param = make_mirror(generate<P>(n, [&] { return src.weight() * 4.0f; }), offset, stream);
    }
    b.grad = make_mirror(generate<G>(n, [&] { return src.grad(); }), grad_offset, stream);
    std::vector<float> first_moment(n);
    for (auto& x : first_moment) x = src.moment();
    b.states[0] = make_mirror(convert<S>(first_moment), offset, stream);
    for (int k = 1; k < n_states; ++k) {
      std::vector<float> s(n);
      for (std::size_t i = 0; i < n; ++i) {
        // Adam's second moment is never negative; keep m / sqrt(v) of order one.
        s[i] = has_second_moment<Optimizer>
                   ? first_moment[i] * first_moment[i] + 1e-4f * std::fabs(src.normal(src.rng))
                   : src.moment();
      }
      b.states[k] = make_mirror(convert<S>(s), offset, stream);
    }

    tensor_t h{}, d{};
    h.numel = d.numel = n;
    h.param = b.param.host_ptr();
    d.param = b.param.device();
    if constexpr (!Policy::master_is_param) {
      h.master = b.master.host_ptr();
      d.master = b.master.device();
    }
    h.grad = b.grad.host_ptr();
    d.grad = b.grad.device();
    for (int k = 0; k < n_states; ++k) {
      h.states[k] = b.states[k].host_ptr();
      d.states[k] = b.states[k].device();
    }
    host_tensors.push_back(h);
    device_tensors.push_back(d);
  }
  assign_global_offsets(std::span<tensor_t>(host_tensors), kFirstGlobalIndex);
  assign_global_offsets(std::span<tensor_t>(device_tensors), kFirstGlobalIndex);

  const fused_step<Policy, Optimizer> host_step(host_tensors, kPlans[plan_index]);
  const fused_step<Policy, Optimizer> device_step(device_tensors, kPlans[plan_index]);
  mpzero::cuda::fused_step_launcher<Policy, Optimizer> launcher(device_step);
  const std::size_t ws_bytes = launcher.workspace_bytes();
  auto workspace = device_alloc<unsigned char>(ws_bytes);
  launcher.upload(workspace.get(), ws_bytes, stream);
  // The device has its inputs before the host backend starts changing its copies.
  stream.sync();

  const buffers& largest = bufs[kLargest];
  const auto initial_weights = [&] {
    if constexpr (Policy::master_is_param) {
      return largest.param.host;
    } else {
      return largest.master.host;
    }
  }();

  // Unscaled, then loss-scale and clipping multipliers that are not powers of two.
  const float grad_scales[3] = {1.0f, 0.37f, 1.0f / 3.0f};
  for (std::uint64_t step = 1; step <= 3; ++step) {
    const auto args = make_step_args<Optimizer>(opts, step, grad_scales[step - 1], kRoundingSeed);
    launcher.run(args, stream);
    host::run(host_step, args);
  }
  stream.sync();

  // The steps must have done something, or equal outputs would prove nothing.
  if constexpr (Policy::master_is_param) {
    CHECK(count_changed(initial_weights, largest.param.host) > 0);
  } else {
    CHECK(count_changed(initial_weights, largest.master.host) > 0);
  }

  for (std::size_t i = 0; i < bufs.size(); ++i) {
    INFO("tensor " << i);
    const buffers& b = bufs[i];
    check_mirror(b.param, "param", stream);
    check_mirror(b.master, "master", stream);
    check_mirror(b.grad, "grad (read only)", stream);
    for (int k = 0; k < n_states; ++k) {
      INFO("optimizer state " << k);
      check_mirror(b.states[k], "state", stream);
    }
  }
}

// ---- 3. gradient statistics ---------------------------------------------------------

// Independent decoding for the reference: CUDA's own host conversions.
float reference_float(float x) { return x; }
float reference_float(bf16 x) { return __bfloat162float(__ushort_as_bfloat16(x.bits)); }
float reference_float(fp16 x) { return __half2float(__ushort_as_half(x.bits)); }

template <class G>
grad_stats device_stats(const mpzero::cuda::gradient_stats_launcher<G>& launcher, double* d_norm, int* d_flag,
                        int flag_before, cudaStream_t s) {
  // A NaN in the output slot: a run that never writes it cannot pass.
  MPZERO_CUDA_CHECK(cudaMemsetAsync(d_norm, 0xFF, sizeof(double), s));
  MPZERO_CUDA_CHECK(cudaMemcpyAsync(d_flag, &flag_before, sizeof(int), cudaMemcpyHostToDevice, s));
  launcher.run(d_norm, d_flag, s);
  double norm = 0;
  int flag = 0;
  MPZERO_CUDA_CHECK(cudaMemcpyAsync(&norm, d_norm, sizeof(double), cudaMemcpyDeviceToHost, s));
  MPZERO_CUDA_CHECK(cudaMemcpyAsync(&flag, d_flag, sizeof(int), cudaMemcpyDeviceToHost, s));
  MPZERO_CUDA_CHECK(cudaStreamSynchronize(s));
  return grad_stats{norm, flag != 0};
}

template <class G>
void set_element(mirror<G>& m, std::size_t i, G value, cudaStream_t s) {
  m.host[i] = value;
  MPZERO_CUDA_CHECK(cudaMemcpyAsync(m.device() + i, &value, sizeof(G), cudaMemcpyHostToDevice, s));
  MPZERO_CUDA_CHECK(cudaStreamSynchronize(s));
}

// ---- 4. workspace misuse ------------------------------------------------------------

template <class T>
void zero_device(T* p, std::size_t n, cudaStream_t s) {
  MPZERO_CUDA_CHECK(cudaMemsetAsync(p, 0, n * sizeof(T), s));
}

}  // namespace

// =====================================================================================

TEST_CASE("bf16 and fp16 conversions on the device equal CUDA's intrinsics for every input", "[gpu][numeric]") {
  require_device();
  cuda_stream stream;
  auto counters = device_alloc<mismatch_counter>(2);
  const mismatch_counter clear[2] = {{0, 0, ~0ull}, {0, 0, ~0ull}};

  SECTION("float -> bf16 and fp16, round to nearest even: all 2^32 inputs") {
    MPZERO_CUDA_CHECK(cudaMemcpyAsync(counters.get(), clear, sizeof(clear), cudaMemcpyHostToDevice, stream));
    // No per-input memory: 16 launches of 2^28 inputs keep each launch short.
    constexpr std::uint64_t batch = 1ull << 28;
    for (std::uint64_t first = 0; first < (1ull << 32); first += batch) {
      from_float_kernel<<<1024, 256, 0, stream>>>(static_cast<std::uint32_t>(first),
                                                  static_cast<std::uint32_t>(batch), counters.get(),
                                                  counters.get() + 1);
      MPZERO_CUDA_CHECK(cudaGetLastError());
    }
    check_counters(counters.get(), true, 1ull << 32, "2^32 float", stream);
  }

  SECTION("bf16 and fp16 -> float: all 65536 inputs") {
    auto payload = device_alloc<mismatch_counter>(2);
    auto ours = device_alloc<std::uint32_t>(2 * 65536);
    MPZERO_CUDA_CHECK(cudaMemcpyAsync(counters.get(), clear, sizeof(clear), cudaMemcpyHostToDevice, stream));
    MPZERO_CUDA_CHECK(cudaMemcpyAsync(payload.get(), clear, sizeof(clear), cudaMemcpyHostToDevice, stream));
    to_float_kernel<<<65536 / 256, 256, 0, stream>>>(counters.get(), counters.get() + 1, payload.get(),
                                                     payload.get() + 1, ours.get(), ours.get() + 65536);
    MPZERO_CUDA_CHECK(cudaGetLastError());
    check_counters(counters.get(), false, 1ull << 16, "65536 16-bit", stream);

    // NaN payloads: reported, not required (see to_float_kernel).
    mismatch_counter p[2];
    MPZERO_CUDA_CHECK(cudaMemcpyAsync(p, payload.get(), sizeof(p), cudaMemcpyDeviceToHost, stream));
    std::vector<std::uint32_t> got(2 * 65536);
    MPZERO_CUDA_CHECK(cudaMemcpyAsync(got.data(), ours.get(), got.size() * 4, cudaMemcpyDeviceToHost, stream));
    stream.sync();
    CHECK(p[0].checked == 2 * 127);   // bf16 NaNs: 2 signs x 127 nonzero 7-bit mantissas
    CHECK(p[1].checked == 2 * 1023);  // fp16 NaNs: 2 signs x 1023 nonzero 10-bit mantissas
    if (p[0].count != 0 || p[1].count != 0) {
      WARN("CUDA's device widening gives other NaN payloads than its host conversion (and mpzero): bf16 "
           << p[0].count << " of " << p[0].checked << " NaN inputs (first " << hex(p[0].first) << "), fp16 "
           << p[1].count << " of " << p[1].checked << " (first " << hex(p[1].first) << ")");
    }
    // mpzero's own conversion: the device gives the host's bits for every input (this is
    // what keeps the CUDA step and the host backend identical).
    std::uint64_t bf_bad = 0, hf_bad = 0;
    for (std::uint32_t h = 0; h < 65536; ++h) {
      const auto s = static_cast<std::uint16_t>(h);
      bf_bad += got[h] != std::bit_cast<std::uint32_t>(to_float(bf16{s}));
      hf_bad += got[65536 + h] != std::bit_cast<std::uint32_t>(to_float(fp16{s}));
    }
    CHECK(bf_bad == 0);
    CHECK(hf_bad == 0);
  }
}

namespace {
using fp32_bf16_states_sr = precision<float, float, float, bf16, round_stochastic>;
}  // namespace

TEMPLATE_TEST_CASE("CUDA fused step equals the host backend bit for bit: Adam and AdamW", "[gpu][optim]",
                   policies::fp32, policies::bf16_fp32_master, policies::bf16_master_fp32_states, policies::bf16_all,
                   policies::bf16_all_sr, policies::fp16_fp32_master, fp32_bf16_states_sr) {
  require_device();
  for (std::size_t plan = 0; plan < 2; ++plan) {
    optim::adam_options adam;
    adam.lr = 1e-2;
    adam.weight_decay = 1e-2;
    check_fused_step<TestType, optim::adam>(adam, plan);

    optim::adam_options adamw;
    adamw.lr = 1e-2;
    adamw.weight_decay = 0.1;
    adamw.bias_correction = plan == 0;
    check_fused_step<TestType, optim::adamw>(adamw, plan);
  }
}

// adam_runtime, the rule the engine's tables run: the launcher runs Adam's or AdamW's
// kernel as the step's options choose, the host step chooses once per chunk.
TEMPLATE_TEST_CASE("CUDA fused step equals the host backend bit for bit: adam_runtime in both modes", "[gpu][optim]",
                   policies::bf16_all_sr, policies::fp16_fp32_master) {
  require_device();
  for (std::size_t plan = 0; plan < 2; ++plan) {
    optim::adam_runtime_options o;
    o.lr = 1e-2;
    o.weight_decay = 0.1;
    o.decoupled_weight_decay = plan == 0;
    check_fused_step<TestType, optim::adam_runtime>(o, plan);
  }
}

TEMPLATE_TEST_CASE("CUDA fused step equals the host backend bit for bit: SGD", "[gpu][optim]",
                   policies::fp16_fp32_master, policies::bf16_all_sr) {
  require_device();
  for (std::size_t plan = 0; plan < 2; ++plan) {
    optim::sgd_options o;
    o.lr = 0.05;
    o.momentum = 0.9;
    o.weight_decay = 1e-3;
    o.nesterov = plan == 1;
    o.dampening = o.nesterov ? 0.0 : 0.1;
    check_fused_step<TestType, optim::sgd>(o, plan);
  }
}

TEMPLATE_TEST_CASE("CUDA fused step equals the host backend bit for bit: Lion", "[gpu][optim]",
                   policies::bf16_fp32_master, fp32_bf16_states_sr) {
  require_device();
  for (std::size_t plan = 0; plan < 2; ++plan) {
    optim::lion_options o;
    o.lr = 3e-3;
    o.weight_decay = plan == 0 ? 0.1 : 0.0;
    check_fused_step<TestType, optim::lion>(o, plan);
  }
}

// The device and host sum the same squares in different orders. Each square of a
// float is exact in double (24-bit significands give a 48-bit product, and float's
// exponent range squared fits double's), and every partial sum is of non-negative
// terms, so any order of N terms is within gamma_{N-1} = (N-1)u / (1 - (N-1)u) of the
// exact sum S, u = 2^-53 (Higham, Accuracy and Stability of Numerical Algorithms,
// sec. 4.2); adding exact zeros (idle threads) and contracting v*v+acc into an FMA
// change nothing. Hence |device - host| <= 2 gamma S, and each is within gamma S of a
// long double reference (whose own error, N 2^-64 S, is covered by the 1.01 factor).
TEMPLATE_TEST_CASE("CUDA gradient norm and non-finite check agree with the host backend", "[gpu][numeric]", float,
                   mpzero::bf16, mpzero::fp16) {
  using G = TestType;
  require_device();
  cuda_stream stream;
  value_source src(0x6E6F726Dull);

  const std::vector<tensor_spec> specs = {{0, placement::aligned},      {1, placement::aligned},
                                          {7, placement::aligned},      {65537, placement::aligned},
                                          {300001, placement::aligned}, {70001, placement::all_offset}};
  // Per-tensor scales spread the squares over many binades.
  const float scales[] = {1.0f, 0.25f, 30.0f, 1e-3f, 1.0f, 7.0f};
  std::vector<mirror<G>> grads;
  grads.reserve(specs.size());
  std::vector<grad_view<G>> host_views, device_views;
  std::vector<std::uint64_t> numels;
  for (std::size_t t = 0; t < specs.size(); ++t) {
    mirror<G>& m = grads.emplace_back(make_mirror(
        generate<G>(specs[t].numel, [&] { return src.grad() * scales[t]; }),
        specs[t].where == placement::aligned ? 0 : 1, stream));
    host_views.push_back(grad_view<G>{m.host_ptr(), m.numel()});
    device_views.push_back(grad_view<G>{m.device(), m.numel()});
    numels.push_back(m.numel());
  }
  auto d_norm = device_alloc<double>(1);
  auto d_flag = device_alloc<int>(1);
  stream.sync();

  for (std::size_t plan_index = 0; plan_index < 2; ++plan_index) {
    INFO("plan " << plan_index);
    const multi_tensor_plan plan(numels, kPlans[plan_index]);
    const std::span<const grad_view<G>> host_span(host_views);
    mpzero::cuda::gradient_stats_launcher<G> launcher(plan, device_views);
    const std::size_t ws_bytes = launcher.workspace_bytes();
    auto workspace = device_alloc<unsigned char>(ws_bytes);
    launcher.upload(workspace.get(), ws_bytes, stream);

    {
      long double reference = 0;
      for (const mirror<G>& m : grads) {
        for (const G& x : m.host) {
          const long double v = reference_float(x);
          reference += v * v;
        }
      }
      const long double n = static_cast<long double>(plan.total_elements());
      const long double gamma = 1.01L * n * 0x1p-53L;

      const grad_stats h = host::gradient_stats(plan, host_span);
      const grad_stats d1 = device_stats(launcher, d_norm.get(), d_flag.get(), 0, stream);
      const grad_stats d2 = device_stats(launcher, d_norm.get(), d_flag.get(), 0, stream);
      INFO(std::setprecision(17) << "host " << h.norm_squared << ", device " << d1.norm_squared << " then " << d2.norm_squared
                   << ", reference " << static_cast<double>(reference));
      REQUIRE(reference > 0);
      CHECK_FALSE(h.nonfinite);
      CHECK_FALSE(d1.nonfinite);
      CHECK_FALSE(d2.nonfinite);
      CHECK(bits_of(d1.norm_squared) == bits_of(d2.norm_squared));  // deterministic
      CHECK(std::fabs(static_cast<long double>(d1.norm_squared) - h.norm_squared) <= 2 * gamma * reference);
      CHECK(std::fabs(static_cast<long double>(d1.norm_squared) - reference) <= gamma * reference);
      CHECK(std::fabs(static_cast<long double>(h.norm_squared) - reference) <= gamma * reference);

      // The flag is only ever set: a flag already raised stays raised on clean data.
      CHECK(device_stats(launcher, d_norm.get(), d_flag.get(), 1, stream).nonfinite);
    }

    struct poison {
      std::size_t tensor, index;
      float value;
      const char* name;
    };
    const poison cases[] = {
        {4, 200000, std::numeric_limits<float>::quiet_NaN(), "NaN in the 4th chunk of a large tensor"},
        {5, 70000, std::numeric_limits<float>::infinity(), "+Inf, last element of the offset tensor"},
        {1, 0, -std::numeric_limits<float>::infinity(), "-Inf, the one-element tensor"},
    };
    for (const poison& c : cases) {
      INFO(c.name);
      mirror<G>& m = grads[c.tensor];
      const G saved = m.host[c.index];
      set_element(m, c.index, from_float<G>(c.value), stream);
      const grad_stats h = host::gradient_stats(plan, host_span);
      const grad_stats d = device_stats(launcher, d_norm.get(), d_flag.get(), 0, stream);
      CHECK(h.nonfinite);
      CHECK(d.nonfinite);
      if (std::isnan(c.value)) {
        CHECK(std::isnan(h.norm_squared));
        CHECK(std::isnan(d.norm_squared));
      } else {
        CHECK(std::isinf(h.norm_squared));
        CHECK(std::isinf(d.norm_squared));
      }
      set_element(m, c.index, saved, stream);
    }
    // Restored: clean again.
    CHECK_FALSE(device_stats(launcher, d_norm.get(), d_flag.get(), 0, stream).nonfinite);
  }
}

TEST_CASE("CUDA launchers refuse a bad workspace and a run before upload", "[gpu][multi_tensor]") {
  require_device();
  cuda_stream stream;
  using Policy = policies::bf16_fp32_master;
  using Opt = optim::adamw;
  constexpr std::size_t n = 1000;
  auto param = device_alloc<bf16>(n);
  auto master = device_alloc<float>(n);
  auto grad = device_alloc<bf16>(n);
  auto m = device_alloc<float>(n);
  auto v = device_alloc<float>(n);
  zero_device(param.get(), n, stream);
  zero_device(master.get(), n, stream);
  zero_device(grad.get(), n, stream);
  zero_device(m.get(), n, stream);
  zero_device(v.get(), n, stream);

  SECTION("fused_step_launcher") {
    step_tensor<Policy, Opt> t{};
    t.param = param.get();
    t.master = master.get();
    t.grad = grad.get();
    t.states[0] = m.get();
    t.states[1] = v.get();
    t.numel = n;
    const fused_step<Policy, Opt> step({t});
    mpzero::cuda::fused_step_launcher<Policy, Opt> launcher(step);
    const std::size_t need = launcher.workspace_bytes();
    auto ws = device_alloc<unsigned char>(need + 256);
    const auto args = make_step_args<Opt>(optim::adam_options{}, 1);

    REQUIRE_THROWS_AS(launcher.run(args, stream), invalid_argument);
    REQUIRE_THROWS_WITH(launcher.upload(ws.get(), need - 1, stream),
                        Catch::Matchers::Contains(std::to_string(need - 1)) &&
                            Catch::Matchers::Contains("workspace_bytes()"));
    REQUIRE_THROWS_AS(launcher.upload(ws.get(), need - 1, stream), invalid_argument);
    REQUIRE_THROWS_AS(launcher.upload(nullptr, need, stream), invalid_argument);
    REQUIRE_THROWS_AS(launcher.upload(ws.get() + 16, need, stream), invalid_argument);
    REQUIRE_THROWS_WITH(launcher.upload(ws.get() + 16, need, stream), Catch::Matchers::Contains("256-byte aligned"));
    // A refused upload leaves the launcher as it was: still not runnable.
    REQUIRE_THROWS_AS(launcher.run(args, stream), invalid_argument);

    REQUIRE_NOTHROW(launcher.upload(ws.get(), need, stream));
    REQUIRE_NOTHROW(launcher.run(args, stream));
    stream.sync();
  }

  SECTION("an empty step needs no workspace") {
    // No tensors (a rank whose shard is empty): nothing to upload, nothing to run; the
    // backend's stepper passes the null data() of a zero-byte buffer.
    const fused_step<Policy, Opt> step(std::vector<step_tensor<Policy, Opt>>{});
    mpzero::cuda::fused_step_launcher<Policy, Opt> launcher(step);
    REQUIRE(launcher.workspace_bytes() == 0);
    REQUIRE_NOTHROW(launcher.upload(nullptr, 0, stream));
    REQUIRE_NOTHROW(launcher.run(make_step_args<Opt>(optim::adam_options{}, 1), stream));
    stream.sync();
  }

  SECTION("empty gradient stats need no workspace and give 0") {
    // No gradient views (a rank with no gradients): nothing to upload, the norm is 0.
    const std::vector<grad_view<bf16>> views;
    const multi_tensor_plan plan(std::vector<std::uint64_t>{});
    mpzero::cuda::gradient_stats_launcher<bf16> launcher(plan, views);
    REQUIRE(launcher.workspace_bytes() == 0);
    REQUIRE_NOTHROW(launcher.upload(nullptr, 0, stream));
    auto d_norm = device_alloc<double>(1);
    auto d_flag = device_alloc<int>(1);
    const double poison = -1.0;
    MPZERO_CUDA_CHECK(cudaMemcpyAsync(d_norm.get(), &poison, sizeof poison, cudaMemcpyHostToDevice, stream));
    zero_device(d_flag.get(), 1, stream);
    REQUIRE_NOTHROW(launcher.run(d_norm.get(), d_flag.get(), stream));
    double norm = -1.0;
    int flag = -1;
    MPZERO_CUDA_CHECK(cudaMemcpyAsync(&norm, d_norm.get(), sizeof norm, cudaMemcpyDeviceToHost, stream));
    MPZERO_CUDA_CHECK(cudaMemcpyAsync(&flag, d_flag.get(), sizeof flag, cudaMemcpyDeviceToHost, stream));
    stream.sync();
    CHECK(norm == 0.0);
    CHECK(flag == 0);
  }

  SECTION("gradient_stats_launcher") {
    const std::vector<grad_view<bf16>> views = {grad_view<bf16>{grad.get(), n}};
    const std::vector<std::uint64_t> numels = {n};
    const multi_tensor_plan plan(numels);
    mpzero::cuda::gradient_stats_launcher<bf16> launcher(plan, views);
    const std::size_t need = launcher.workspace_bytes();
    auto ws = device_alloc<unsigned char>(need + 256);
    auto d_norm = device_alloc<double>(1);
    auto d_flag = device_alloc<int>(1);
    zero_device(d_flag.get(), 1, stream);

    REQUIRE_THROWS_AS(launcher.run(d_norm.get(), d_flag.get(), stream), invalid_argument);
    REQUIRE_THROWS_AS(launcher.upload(ws.get(), need - 1, stream), invalid_argument);
    REQUIRE_THROWS_AS(launcher.upload(nullptr, need, stream), invalid_argument);
    REQUIRE_THROWS_AS(launcher.upload(ws.get() + 16, need, stream), invalid_argument);
    REQUIRE_THROWS_AS(launcher.run(d_norm.get(), d_flag.get(), stream), invalid_argument);

    REQUIRE_NOTHROW(launcher.upload(ws.get(), need, stream));
    REQUIRE_NOTHROW(launcher.run(d_norm.get(), d_flag.get(), stream));
    double norm = -1;
    MPZERO_CUDA_CHECK(cudaMemcpyAsync(&norm, d_norm.get(), sizeof(double), cudaMemcpyDeviceToHost, stream));
    stream.sync();
    CHECK(norm == 0.0);  // all-zero gradients
  }
  MPZERO_CUDA_CHECK(cudaGetLastError());
}

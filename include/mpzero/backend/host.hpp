// mpzero: the host backend. Runs a plan's chunks on OpenMP threads (serially when
// built without OpenMP); each chunk is a plain loop over restrict pointers that the
// compiler vectorizes, calling the same per-element code as the CUDA kernel.
#pragma once

#include <algorithm>
#include <bit>
#include <concepts>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

#include "../config.hpp"
#include "../multi_tensor/plan.hpp"
#include "../numeric/dtype.hpp"
#include "../step/fused_step.hpp"
#include "../step/grad_stats.hpp"

#if (defined(__x86_64__) || defined(__i386__)) && defined(__SSE2__) && defined(__GNUC__) && !defined(__clang__) && \
    (!defined(__CUDACC__) || __CUDACC_VER_MAJOR__ >= 13) && !defined(MPZERO_NO_RUNTIME_SIMD)
// x86 GCC: the host step picks AVX2 or AVX-512 at run time (detail::simd_level). Also in
// nvcc's host pass from CUDA 13 (checked: tests/test_simd_nvcc.cu), so that CPU offload
// on the CUDA backend gets the vectorized host step; older nvcc takes the portable loops.
#define MPZERO_RUNTIME_SIMD 1
#include <immintrin.h>
#endif

namespace mpzero::host {

// The code below differs with MPZERO_RUNTIME_SIMD (on for g++ and nvcc 13's host pass on
// x86, off elsewhere). Each variant lives in its own inline namespace, so a program that
// links translation units of both kinds gets two sets of functions, not two bodies
// for one name (which would break the one-definition rule).
#if defined(MPZERO_RUNTIME_SIMD)
inline namespace simd_dispatch {
#else
inline namespace portable {
#endif

struct options {
  int threads = 0;  // 0: OpenMP's default (OMP_NUM_THREADS or all cores)
};

namespace detail {

// One chunk runs on the calling thread: a team would start only to leave all but one
// thread idle (a small parameter's gradient, accumulated in a backward hook, is one chunk).
template <class Body>
void for_each_chunk(std::size_t num_chunks, const options& opt, Body&& body) {
  const auto n = static_cast<std::int64_t>(num_chunks);
#if defined(_OPENMP)
  if (opt.threads > 0) {
#pragma omp parallel for schedule(static) num_threads(opt.threads) if (n > 1)
    for (std::int64_t c = 0; c < n; ++c) body(static_cast<std::size_t>(c));
  } else {
#pragma omp parallel for schedule(static) if (n > 1)
    for (std::int64_t c = 0; c < n; ++c) body(static_cast<std::size_t>(c));
  }
#else
  (void)opt;
  for (std::int64_t c = 0; c < n; ++c) body(static_cast<std::size_t>(c));
#endif
}

// ---- fp16 blocks --------------------------------------------------------------------
//
// fp16 <-> float in integer arithmetic (numeric/fp16.hpp) is the price of bit-identical
// host and device results, and costs more than the whole AdamW update (docs/perf.md,
// "Host step: SIMD variants and build flags"). x86's F16C
// instructions (vcvtph2ps, vcvtps2ph) convert exactly as IEEE says, subnormals
// included; only NaN differs (they keep a payload; CUDA and numeric/fp16.hpp give the
// canonical NaN), and a blend fixes that. So the vector loops convert a block's fp16
// inputs to float before the element loop and its fp16 outputs under nearest rounding
// after it, with those instructions; `Half` says whether a loop does (half_scalar: no,
// the element loop converts with the shared functions).
struct half_scalar {
  static constexpr bool enabled = false;
};

#if defined(MPZERO_RUNTIME_SIMD)
namespace simd {

// fp16 blocks with F16C / AVX-512F, each element as numeric/fp16.hpp converts it
// (tests/test_simd.cpp: all 65536 halves and all 2^32 floats). Not always_inline: GCC
// inlines callees into the generic step code before that code is inlined into the
// target("avx2") / target("avx512f") loops, and refuses an always_inline callee whose
// target the (default-target) caller lacks; these are inlined later, in the right
// target. The zero-masked intrinsics with every lane selected are the unmasked
// instructions; the unmasked intrinsics trip GCC 12's -Wmaybe-uninitialized on their
// undefined pass-through operand.
struct half_avx512 {
  static constexpr bool enabled = true;
  static constexpr __mmask16 all = 0xffff;
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static void widen(const fp16* MPZERO_RESTRICT in,
                                                                                   float* MPZERO_RESTRICT out,
                                                                                   std::uint32_t n) {
    const __m512i magnitude = _mm512_set1_epi32(0x7fff), inf = _mm512_set1_epi32(0x7c00);
    const __m512 nan = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (std::uint32_t i = 0; i < n; i += 16) {
      const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1u);
      const __m256i h = _mm256_maskz_loadu_epi16(m, in + i);
      const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(_mm512_maskz_cvtepu16_epi32(all, h), magnitude), inf);
      _mm512_mask_storeu_ps(out + i, m, _mm512_mask_blend_ps(is_nan, _mm512_maskz_cvtph_ps(all, h), nan));
    }
  }
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static void narrow(const float* MPZERO_RESTRICT in,
                                                                                    fp16* MPZERO_RESTRICT out,
                                                                                    std::uint32_t n) {
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    const __m256i nan = _mm256_set1_epi16(0x7fff);
    for (std::uint32_t i = 0; i < n; i += 16) {
      const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1u);
      const __m512 f = _mm512_maskz_loadu_ps(m, in + i);
      const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(_mm512_castps_si512(f), magnitude), inf);
      const __m256i h = _mm512_maskz_cvtps_ph(all, f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm256_mask_storeu_epi16(out + i, m, _mm256_mask_blend_epi16(is_nan, h, nan));
    }
  }
};

// The same with AVX2 + F16C, eight at a time; the last n % 8 through the scalar functions.
struct half_avx2 {
  static constexpr bool enabled = true;
  __attribute__((target("avx2,f16c"))) static void widen(const fp16* MPZERO_RESTRICT in, float* MPZERO_RESTRICT out,
                                                         std::uint32_t n) {
    const __m256i magnitude = _mm256_set1_epi32(0x7fff), inf = _mm256_set1_epi32(0x7c00);
    const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    std::uint32_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
      const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_cvtepu16_epi32(h), magnitude), inf);
      _mm256_storeu_ps(out + i, _mm256_blendv_ps(_mm256_cvtph_ps(h), nan, _mm256_castsi256_ps(is_nan)));
    }
    for (; i < n; ++i) out[i] = to_float(in[i]);
  }
  __attribute__((target("avx2,f16c"))) static void narrow(const float* MPZERO_RESTRICT in, fp16* MPZERO_RESTRICT out,
                                                          std::uint32_t n) {
    const __m256i magnitude = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    std::uint32_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 f = _mm256_loadu_ps(in + i);
      // Signed compare: magnitudes are below 2^31. Lanes of all ones where NaN, packed
      // to 16 bits (saturating keeps -1 and 0) to select 0x7fff.
      const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(f), magnitude), inf);
      const __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(is_nan), _mm256_extracti128_si256(is_nan, 1));
      const __m128i h = _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                       _mm_blendv_epi8(h, _mm_set1_epi16(0x7fff), nan16));
    }
    for (; i < n; ++i) out[i] = fp16_from_float_rn(in[i]);
  }
};

}  // namespace simd
#endif

// The step over elements [begin, begin + size) of one tensor. Half converts fp16
// blocks (half_scalar: the element loop converts, or a simd::half_*). Mode is the
// optimizer's mode (optim::moded_rule), chosen by the caller for the whole range.
template <precision_policy Policy, optim::rule Optimizer, int Mode, class Half = half_scalar>
MPZERO_FORCEINLINE void step_range_body(const step_tensor<Policy, Optimizer>& t, std::uint64_t begin,
                                        std::uint32_t size, const step_args<Optimizer>& args) {
  // A local copy: the loop's float stores (master, states) could otherwise alias the
  // arguments' float fields in GCC's eyes, which then re-reads them every element and,
  // with fp32 gradients as well, needs more run-time alias checks than it makes
  // (vect-max-version-for-alias-checks): the loop stayed scalar (bf16_fp32_grads ran at
  // a third of its bandwidth).
  const step_args<Optimizer> a = args;
  using param_t = typename Policy::param_type;
  using master_t = typename Policy::master_type;
  using grad_t = typename Policy::grad_type;
  using state_t = typename Policy::state_type;
  constexpr int n = Optimizer::n_states;
  param_t* MPZERO_RESTRICT param = t.param + begin;
  const grad_t* MPZERO_RESTRICT grad = t.grad + begin;
  master_t* MPZERO_RESTRICT master = nullptr;
  if constexpr (Policy::master_is_param) {
    master = param;
  } else {
    master = t.master + begin;
  }
  state_t* MPZERO_RESTRICT s0 = t.states[0] + begin;
  state_t* MPZERO_RESTRICT s1 = n > 1 ? t.states[n > 1 ? 1 : 0] + begin : nullptr;
  state_t* MPZERO_RESTRICT s2 = n > 2 ? t.states[n > 2 ? 2 : 0] + begin : nullptr;
  // Blocks of `block` elements. Under stochastic rounding a loop over the block's pairs
  // of elements hashes each pair's state once and branches the words its elements read
  // (numeric/rounding_bits.hpp: 32-bit lane arithmetic, vectorized), into buffers the
  // element loop reads from; the key is made once per range, and the key word of the
  // pairs' high half once per block, so a block never spans a multiple of 2^33
  // elements in global index (where that half changes). Those blocks are short: while
  // a block's pairs are hashed no load is in flight and the prefetchers have nothing to
  // follow, so a step bound by memory took 1.28x nearest rounding's time at 128M
  // elements with blocks of 1024 elements, and 1.0x with 192. Blocks after the first
  // start at even global indices, so that they hash whole pairs.
  constexpr bool sr = Policy::rounding::stochastic;
  constexpr int halves = rounding_halves<Policy, Optimizer>;
  constexpr std::uint32_t block = sr ? 192 : 1024;
  rounding_key key{};
  if constexpr (sr) key = rounding_key_of(a.seed, a.step);
  // Element j of a block reads position j + (first index odd) of these: w0 (halves 0
  // and 1) and the 16-bit halves 2 and 3.
  alignas(64) std::uint32_t w0buf[sr ? block + 2 : 1];
  alignas(64) std::uint16_t h2buf[sr && halves > 2 ? block + 2 : 1], h3buf[sr && halves > 3 ? block + 2 : 1];
  // fp16 blocks converted by Half: gradients and the master read, the master written
  // under nearest rounding (stochastic rounding stays in the element loop), the
  // parameter copy written (always nearest).
  constexpr bool half_grad = Half::enabled && std::same_as<grad_t, fp16>;
  constexpr bool half_master = Half::enabled && std::same_as<master_t, fp16>;
  constexpr bool half_master_out = half_master && !sr;
  constexpr bool half_param = Half::enabled && !Policy::master_is_param && std::same_as<param_t, fp16>;
  alignas(64) float gbuf[half_grad ? block : 1], mbuf[half_master ? block : 1], pbuf[half_param ? block : 1];
  const std::uint64_t first = t.global_offset + begin;
  constexpr std::uint64_t high_span = std::uint64_t{1} << 33;  // elements per pair-index high word
  for (std::uint64_t b = 0, next = 0; b < size; b = next) {
    const auto len = static_cast<std::uint32_t>(std::min<std::uint64_t>(
        {block - (sr ? (first + b) & 1u : 0u), size - b, high_span - ((first + b) & (high_span - 1))}));
    next = b + len;
    std::uint32_t odd = 0;
    if constexpr (sr) {
      const std::uint64_t g0 = first + b;
      odd = static_cast<std::uint32_t>(g0 & 1u);
      const std::uint32_t inner = rounding_inner_key(key, static_cast<std::uint32_t>(g0 >> 33));
      const auto pair0 = static_cast<std::uint32_t>(g0 >> 1);
      const std::uint32_t pairs = (odd + len + 1) / 2;
      // Half t of a word goes to element 2 q + t: on a little-endian host, the word's
      // own bytes (a plain store, no shuffle).
      const auto halves_of = [](std::uint16_t* to, std::uint32_t h) MPZERO_FORCEINLINE_LAMBDA {
        if constexpr (std::endian::native == std::endian::little) {
          std::memcpy(to, &h, sizeof h);
        } else {
          to[0] = static_cast<std::uint16_t>(h);
          to[1] = static_cast<std::uint16_t>(h >> 16);
        }
      };
      for (std::uint32_t q = 0; q < pairs; ++q) {
        const std::uint32_t x = rounding_pair_state(key, pair0 + q);
        w0buf[2 * q] = rounding_word(key, inner, x, rounding_salt(0));
        w0buf[2 * q + 1] = rounding_word(key, inner, x, rounding_salt(1));
        if constexpr (halves > 2) halves_of(h2buf + 2 * q, rounding_word(key, inner, x, rounding_salt(2)));
        if constexpr (halves > 3) halves_of(h3buf + 2 * q, rounding_word(key, inner, x, rounding_salt(3)));
      }
    }
    if constexpr (half_grad) Half::widen(grad + b, gbuf, len);
    if constexpr (half_master) Half::widen(master + b, mbuf, len);
    const auto element = [&](std::uint32_t j) MPZERO_FORCEINLINE_LAMBDA {
      const std::uint64_t i = b + j;
      element_bits bits{};
      if constexpr (sr) {
        bits.w[0] = w0buf[j + odd];
        if constexpr (halves > 2) bits.w[1] = h2buf[j + odd];
        if constexpr (halves > 3) bits.w[1] |= std::uint32_t{h3buf[j + odd]} << 16;
      }
      master_t w = master[i];
      state_t s[n];
      s[0] = s0[i];
      if constexpr (n > 1) s[1] = s1[i];
      if constexpr (n > 2) s[2] = s2[i];
      float wf = 0.0f, g = 0.0f;
      if constexpr (half_master) {
        wf = mbuf[j];
      } else {
        wf = to_float(w);
      }
      if constexpr (half_grad) {
        g = gbuf[j];
      } else {
        g = to_float(grad[i]);
      }
      wf = update_element_float<Policy, Optimizer, Mode>(a, bits, wf, g, s, w);
      if constexpr (half_master_out) {
        mbuf[j] = wf;
      } else {
        master[i] = w;
      }
      if constexpr (half_param) {
        pbuf[j] = wf;
      } else if constexpr (!Policy::master_is_param) {
        param[i] = from_float<param_t>(wf);
      }
      s0[i] = s[0];
      if constexpr (n > 1) s1[i] = s[1];
      if constexpr (n > 2) s2[i] = s[2];
    };
    if constexpr (half_grad || half_master || half_param) {
      // No iteration depends on another (the pointers are restrict, the block buffers
      // are this function's). Said outright: with the fp16 buffers GCC would need more
      // run-time alias checks than it makes (vect-max-version-for-alias-checks) and
      // leave the loop scalar. The other loops keep the checks GCC chooses.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC ivdep
#endif
      for (std::uint32_t j = 0; j < len; ++j) element(j);
    } else {
      for (std::uint32_t j = 0; j < len; ++j) element(j);
    }
    if constexpr (half_master_out) Half::narrow(mbuf, master + b, len);
    if constexpr (half_param) Half::narrow(pbuf, param + b, len);
  }
}

// Each host loop (the step, the gradient check, accumulate / convert) is a Kernel:
// a struct whose `run<Kit>(args...)` is the loop, inlined into one function per variant
// compiled for the widest vectors the CPU has and chosen at run time, so a binary built
// for baseline x86-64 still uses AVX2 or AVX-512. A Kit is what a variant's loops use
// besides the compiler's vectorization: its fp16 block converter. No FMA is enabled in
// these targets (and -ffp-contract=off forbids contraction anyway): every variant
// rounds alike, bit for bit.
template <class Half>
struct kit {
  using half = Half;
};
using portable_kit = kit<half_scalar>;  // non-x86, Clang: the shared scalar functions

#if defined(MPZERO_RUNTIME_SIMD)

// The build's baseline (SSE2 on x86-64, or whatever -m flags the build adds).
using baseline_kit = kit<half_scalar>;
using avx2_kit = kit<simd::half_avx2>;
using avx512_kit = kit<simd::half_avx512>;

// noinline: in a build whose own flags already have the ISA (-march=native), GCC would
// otherwise inline a variant into run_widest and compile its loop with the caller's
// tuning (256-bit vectors on recent Intel), not the variant's.
template <class Kernel, class... Args>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,prefer-vector-width=512"), noinline)) decltype(auto)
run_avx512(Args&&... args) {
  return Kernel::template run<avx512_kit>(std::forward<Args>(args)...);
}
template <class Kernel, class... Args>
__attribute__((target("avx2,f16c"), noinline)) decltype(auto) run_avx2(Args&&... args) {
  return Kernel::template run<avx2_kit>(std::forward<Args>(args)...);
}
template <class Kernel, class... Args>
decltype(auto) run_baseline(Args&&... args) {
  return Kernel::template run<baseline_kit>(std::forward<Args>(args)...);
}

// 2: AVX-512 (F, BW, VL, DQ), 1: AVX2 with F16C, 0: the build's baseline. MPZERO_HOST_SIMD=0/1/2
// caps it (for comparisons and tests).
inline int simd_level() {
  static const int level = [] {
    __builtin_cpu_init();
    int l = 0;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) l = 1;
    if (l == 1 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      l = 2;
    if (const char* cap = std::getenv("MPZERO_HOST_SIMD"); cap != nullptr && cap[0] >= '0' && cap[0] <= '2' && cap[1] == '\0')
      l = std::min(l, cap[0] - '0');
    return l;
  }();
  return level;
}
#endif

// Kernel::run in the widest variant this CPU has.
template <class Kernel, class... Args>
decltype(auto) run_widest(Args&&... args) {
#if defined(MPZERO_RUNTIME_SIMD)
  switch (simd_level()) {
    case 2: return run_avx512<Kernel>(std::forward<Args>(args)...);
    case 1: return run_avx2<Kernel>(std::forward<Args>(args)...);
    default: return run_baseline<Kernel>(std::forward<Args>(args)...);
  }
#else
  return Kernel::template run<portable_kit>(std::forward<Args>(args)...);
#endif
}

// Mode: the optimizer's mode (optim::moded_rule); 0 for a rule without modes.
template <precision_policy Policy, optim::rule Optimizer, int Mode = 0>
struct step_kernel {
  template <class Kit>
  MPZERO_FORCEINLINE static void run(const step_tensor<Policy, Optimizer>& t, std::uint64_t begin, std::uint32_t size,
                                     const step_args<Optimizer>& a) {
    step_range_body<Policy, Optimizer, Mode, typename Kit::half>(t, begin, size, a);
  }
};

// The step over one range in the widest variant, with the optimizer's mode
// (optim::moded_rule) chosen once for the range: each mode's loop is a function of its
// own, compiled and vectorized as a rule without modes is (inlined side by side into one
// variant they run slower: docs/perf.md, "Adam and AdamW in one instantiation").
template <precision_policy Policy, optim::rule Optimizer>
void step_range(const step_tensor<Policy, Optimizer>& t, std::uint64_t begin, std::uint32_t size,
                const step_args<Optimizer>& a) {
  optim::visit_mode<Optimizer>(a.opt, [&](auto mode) {
    run_widest<step_kernel<Policy, Optimizer, decltype(mode)::value>>(t, begin, size, a);
  });
}

}  // namespace detail

// Which vector instructions the host step uses on this CPU: "avx512", "avx2" or "baseline".
inline const char* simd_name() {
#if defined(MPZERO_RUNTIME_SIMD)
  switch (detail::simd_level()) {
    case 2: return "avx512";
    case 1: return "avx2";
    default: return "baseline";
  }
#else
  return "baseline";
#endif
}

// Runs one optimizer step over every tensor of `step`.
template <precision_policy Policy, optim::rule Optimizer>
void run(const fused_step<Policy, Optimizer>& step, const step_args<Optimizer>& args, const options& opt = {}) {
  const auto chunks = step.plan().chunks();
  const auto tensors = step.tensors();
  detail::for_each_chunk(chunks.size(), opt, [&](std::size_t c) {
    const chunk& ch = chunks[c];
    detail::step_range<Policy, Optimizer>(tensors[ch.tensor], ch.begin, ch.size, args);
  });
}

namespace detail {

// Sum of squares of one chunk in fp64 and its non-finite check. Element e of the chunk
// adds into accumulator e % 16, and the sixteen are combined in a fixed tree, so the
// result is the same whatever the vector width (each accumulator is one lane, its
// additions in element order) and, chunk partials being added in plan order, whatever
// the thread count. Written with GCC vector types (plain loops over an accumulator
// array stay scalar: docs/perf.md, "Host gradient statistics and accumulation") and compiled for
// AVX2 / AVX-512 like the step; 16-bit gradients are widened to float a block at a
// time first (fp16 with F16C where Half says so).
using f64x8 = double __attribute__((vector_size(64)));
using f32x8 = float __attribute__((vector_size(32)));
using u32x8 = std::uint32_t __attribute__((vector_size(32)));

template <storage_type G, class Half = half_scalar>
MPZERO_FORCEINLINE grad_stats chunk_stats_body(const G* MPZERO_RESTRICT x, std::uint32_t n) {
  constexpr std::uint32_t block = 1024;  // a multiple of 16
  f64x8 acc_lo{}, acc_hi{};               // lanes 0-7 and 8-15
  u32x8 bad_lanes{};
  std::uint32_t bad = 0;
  alignas(64) float buf[std::same_as<G, float> ? 1 : block];
  for (std::uint32_t b = 0; b < n; b += block) {
    const std::uint32_t len = std::min(block, n - b);
    const float* f = nullptr;
    if constexpr (std::same_as<G, float>) {
      f = x + b;
    } else if constexpr (Half::enabled && std::same_as<G, fp16>) {
      Half::widen(x + b, buf, len);
      f = buf;
    } else {
      const G* MPZERO_RESTRICT xb = x + b;  // not x[b + j]: a 32-bit index may wrap, which stops vectorization
      for (std::uint32_t j = 0; j < len; ++j) buf[j] = to_float(xb[j]);
      f = buf;
    }
    const u32x8 exponent = u32x8{} + 0x7f800000u;
    std::uint32_t j = 0;
    for (; j + 16 <= len; j += 16) {
      f32x8 v[2];
      __builtin_memcpy(v, f + j, sizeof v);
      for (int h = 0; h < 2; ++h) {
        bad_lanes |= reinterpret_cast<u32x8>((reinterpret_cast<u32x8>(v[h]) & exponent) == exponent);
        const f64x8 d = __builtin_convertvector(v[h], f64x8);
        (h == 0 ? acc_lo : acc_hi) += d * d;
      }
    }
    for (; j < len; ++j) {  // the chunk's last elements, into their own lanes
      const float v = f[j];
      bad |= static_cast<std::uint32_t>(!fp::is_finite(v));
      const double d = static_cast<double>(v) * static_cast<double>(v);
      if (j % 16 < 8) {
        acc_lo[j % 8] += d;
      } else {
        acc_hi[j % 8] += d;
      }
    }
  }
  for (int k = 0; k < 8; ++k) bad |= bad_lanes[k];
  const f64x8 sum8 = acc_lo + acc_hi;  // lane k + lane k + 8
  double a[8];
  __builtin_memcpy(a, &sum8, sizeof a);
  return {((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])), bad != 0};
}

template <storage_type G>
struct stats_kernel {
  template <class Kit>
  MPZERO_FORCEINLINE static grad_stats run(const G* x, std::uint32_t n) {
    return chunk_stats_body<G, typename Kit::half>(x, n);
  }
};

// Element-wise work of the ZeRO core on host memory (host_backend::accumulate and
// ::convert): dst[i] = round(dst[i] + src[i] * scale) when Accumulate, else
// dst[i] = round(src[i]), in fp32 with nearest rounding. It runs on every gradient of
// every backward (accumulation into the partition), so it gets the step's treatment:
// AVX2 / AVX-512 variants, fp16 through F16C a block at a time. Same bits as the
// scalar expression in every variant (tests/test_simd.cpp).
template <bool Accumulate, storage_type D, storage_type S, class Half = half_scalar>
MPZERO_FORCEINLINE void elementwise_body(D* MPZERO_RESTRICT dst, const S* MPZERO_RESTRICT src, std::uint64_t n,
                                         float scale) {
  constexpr bool half_src = Half::enabled && std::same_as<S, fp16>;
  constexpr bool half_dst = Half::enabled && std::same_as<D, fp16>;
  if constexpr (!half_src && !half_dst) {
    for (std::uint64_t i = 0; i < n; ++i) {
      if constexpr (Accumulate) {
        dst[i] = from_float<D>(fp::add(to_float(dst[i]), fp::mul(to_float(src[i]), scale)));
      } else {
        dst[i] = from_float<D>(to_float(src[i]));
      }
    }
  } else {
    constexpr std::uint32_t block = 1024;
    alignas(64) float sb[block], db[block];
    for (std::uint64_t b = 0; b < n; b += block) {
      const std::uint32_t len = static_cast<std::uint32_t>(std::min<std::uint64_t>(block, n - b));
      D* MPZERO_RESTRICT d = dst + b;
      const S* MPZERO_RESTRICT s = src + b;
      if constexpr (half_src) {
        Half::widen(s, sb, len);
      } else {
        for (std::uint32_t j = 0; j < len; ++j) sb[j] = to_float(s[j]);
      }
      float* result = sb;
      if constexpr (Accumulate) {
        if constexpr (half_dst) {
          Half::widen(d, db, len);
        } else {
          for (std::uint32_t j = 0; j < len; ++j) db[j] = to_float(d[j]);
        }
        for (std::uint32_t j = 0; j < len; ++j) db[j] = fp::add(db[j], fp::mul(sb[j], scale));
        result = db;
      }
      if constexpr (half_dst) {
        Half::narrow(result, d, len);
      } else {
        for (std::uint32_t j = 0; j < len; ++j) d[j] = from_float<D>(result[j]);
      }
    }
  }
}

template <bool Accumulate, storage_type D, storage_type S>
struct elementwise_kernel {
  template <class Kit>
  MPZERO_FORCEINLINE static void run(D* dst, const S* src, std::uint64_t n, float scale) {
    elementwise_body<Accumulate, D, S, typename Kit::half>(dst, src, n, scale);
  }
};

template <bool Accumulate, storage_type D, storage_type S>
void elementwise(D* dst, const S* src, std::uint64_t n, float scale) {
  run_widest<elementwise_kernel<Accumulate, D, S>>(dst, src, n, scale);
}

}  // namespace detail

// Squared global L2 norm and non-finite check of many gradient tensors, in one pass.
// The result does not depend on the thread count: chunk partials are summed in plan order.
template <storage_type G>
grad_stats gradient_stats(const multi_tensor_plan& plan, std::span<const grad_view<G>> grads,
                          const options& opt = {}) {
  const auto chunks = plan.chunks();
  std::vector<grad_stats> partial(chunks.size());
  detail::for_each_chunk(chunks.size(), opt, [&](std::size_t c) {
    const chunk& ch = chunks[c];
    partial[c] = detail::run_widest<detail::stats_kernel<G>>(grads[ch.tensor].data + ch.begin, ch.size);
  });
  grad_stats total;
  for (const grad_stats& p : partial) {
    total.norm_squared += p.norm_squared;
    total.nonfinite = total.nonfinite || p.nonfinite;
  }
  return total;
}

}  // inline namespace simd_dispatch / portable
}  // namespace mpzero::host

// A consumer of mpzero: one fused optimizer step on the host, checked against values
// worked out by hand. Built by the find_package and add_subdirectory consumer tests;
// it sets no C++ standard or include path of its own, so it also proves that linking
// mpzero::mpzero carries C++20 and the headers.
#include <mpzero/mpzero.hpp>

#include <cmath>
#include <cstdio>
#include <utility>
#include <vector>

namespace {

int failures = 0;

void expect(bool ok, const char* what, std::size_t i, double got, double want) {
  if (!ok && failures++ < 10) std::printf("  %s[%zu] = %.9g, expected %.9g\n", what, i, got, want);
}

// fp32 SGD, first step (the momentum buffer starts as the gradient):
// w = 1 - 0.25 * 0.5 = 0.875 exactly, momentum = 0.5.
void sgd_fp32() {
  using P = mpzero::policies::fp32;
  using O = mpzero::optim::sgd;
  const std::size_t n = 70000;  // more than one chunk
  std::vector<float> w(n, 1.0f), g(n, 0.5f), mom(n, 0.0f);
  std::vector<mpzero::step_tensor<P, O>> t(1);
  t[0].param = w.data();
  t[0].grad = g.data();
  t[0].states[0] = mom.data();
  t[0].numel = n;
  mpzero::fused_step<P, O> step(std::move(t));
  mpzero::optim::sgd_options o;
  o.lr = 0.25;
  o.momentum = 0.9;
  mpzero::host::run(step, mpzero::make_step_args<O>(o, 1));
  for (std::size_t i = 0; i < n; ++i) {
    expect(w[i] == 0.875f, "sgd w", i, w[i], 0.875);
    expect(mom[i] == 0.5f, "sgd momentum", i, mom[i], 0.5);
  }
}

// bf16 params and grads, fp32 master, Adam, first step with bias correction:
// m = 0.1 g, v = 0.001 g^2, so the step is lr * g / (|g| + eps) = 1e-3 for g = 0.5.
void adam_bf16_fp32_master() {
  using P = mpzero::policies::bf16_fp32_master;
  using O = mpzero::optim::adam;
  const std::size_t n = 1000;
  const mpzero::bf16 half = mpzero::bf16_from_float_rn(0.5f);  // exact in bf16
  std::vector<mpzero::bf16> p(n, mpzero::bf16_from_float_rn(1.0f)), g(n, half);
  std::vector<float> master(n, 1.0f), m(n, 0.0f), v(n, 0.0f);
  std::vector<mpzero::step_tensor<P, O>> t(1);
  t[0].param = p.data();
  t[0].master = master.data();
  t[0].grad = g.data();
  t[0].states[0] = m.data();
  t[0].states[1] = v.data();
  t[0].numel = n;
  mpzero::fused_step<P, O> step(std::move(t));
  mpzero::optim::adam_options o;
  o.lr = 1e-3;
  mpzero::host::run(step, mpzero::make_step_args<O>(o, 1));
  for (std::size_t i = 0; i < n; ++i) {
    expect(std::fabs(master[i] - 0.999) < 1e-6, "adam master", i, master[i], 0.999);
    expect(std::fabs(m[i] - 0.05) < 1e-8, "adam m", i, m[i], 0.05);
    expect(std::fabs(v[i] - 0.00025) < 1e-9, "adam v", i, v[i], 0.00025);
    // The bf16 parameter is the master rounded to nearest: within half a bf16 ulp
    // (2^-9 just below 1.0).
    const float pf = mpzero::to_float(p[i]);
    expect(std::fabs(pf - master[i]) <= std::ldexp(1.0, -9), "adam param", i, pf, master[i]);
  }
}

}  // namespace

int main() {
  std::printf("mpzero %d.%d.%d consumer\n", MPZERO_VERSION_MAJOR, MPZERO_VERSION_MINOR, MPZERO_VERSION_PATCH);
  sgd_fp32();
  adam_bf16_fp32_master();
  if (failures) {
    std::printf("mpzero consumer: FAILED (%d mismatches)\n", failures);
    return 1;
  }
  std::printf("mpzero consumer: ok\n");
  return 0;
}

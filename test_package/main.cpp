// One fused SGD step over a few elements, checked against the value worked out by hand:
// w = 1 - 0.25 * 0.5 = 0.875 exactly.
#include <mpzero/mpzero.hpp>

#include <cstdio>
#include <vector>

int main() {
  using policy = mpzero::policies::fp32;
  using sgd = mpzero::optim::sgd;
  const std::size_t n = 1000;
  std::vector<float> w(n, 1.0f), g(n, 0.5f), momentum(n, 0.0f);
  mpzero::step_tensor<policy, sgd> t;
  t.param = w.data();
  t.grad = g.data();
  t.states[0] = momentum.data();
  t.numel = n;
  mpzero::fused_step<policy, sgd> step({t});
  sgd::options opt;
  opt.lr = 0.25;
  opt.momentum = 0.9;
  mpzero::host::run(step, mpzero::make_step_args<sgd>(opt, 1));
  for (float x : w) {
    if (x != 0.875f) {
      std::printf("mpzero %d.%d.%d test_package: FAILED (w = %.9g, expected 0.875)\n", MPZERO_VERSION_MAJOR,
                  MPZERO_VERSION_MINOR, MPZERO_VERSION_PATCH, static_cast<double>(x));
      return 1;
    }
  }
  std::printf("mpzero %d.%d.%d test_package: ok\n", MPZERO_VERSION_MAJOR, MPZERO_VERSION_MINOR, MPZERO_VERSION_PATCH);
  return 0;
}

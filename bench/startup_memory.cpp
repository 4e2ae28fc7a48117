// Peak host memory of mpzero::torch::initialize, above the resident set before it, with
// the start-up broadcast's default host window and with a window of the whole model (all
// of rank 0's values staged at once in fp32). On the CPU the engine's core holds the
// model states in host memory too, so each line gives them (memory()) beside the peak:
// the difference is what start-up itself needs.
//
//   mpzero_bench_startup [--tensors K] [--elements N] [--precision fp32|bf16]
//
// A model of K fp32 parameters of N elements each (default 64 x 4 Mi = 256 Mi elements,
// 1 GiB in fp32), ZeRO stage 0, AdamW, one process. Linux only (/proc/self/status; the
// peak is reset through /proc/self/clear_refs before each initialize).
#include <mpzero/torch/engine.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

// A /proc/self/status field in KiB ("VmRSS:", "VmHWM:"), -1 when absent.
long status_kib(const std::string& key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::stol(line.substr(key.size()));
  return -1;
}

struct FlatImpl : torch::nn::Module {
  FlatImpl(std::int64_t k, std::int64_t n) {
    for (std::int64_t i = 0; i < k; ++i) {
      std::string name = "w";  // appended, not "w" + ...: GCC 12's false -Wrestrict
      name += std::to_string(i);
      register_parameter(name, torch::randn({n}));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) { return x; }
};
TORCH_MODULE(Flat);

void usage() {
  std::printf("usage: mpzero_bench_startup [--tensors K] [--elements N] [--precision fp32|bf16]\n");
}

}  // namespace

int main(int argc, char** argv) try {
  std::int64_t k = 64, n = std::int64_t{4} << 20;
  std::string precision = "bf16";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      usage();
      return 0;
    }
    if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value (see --help)");
    const std::string v = argv[++i];
    if (a == "--tensors") k = std::stoll(v);
    else if (a == "--elements") n = std::stoll(v);
    else if (a == "--precision") precision = v;
    else throw std::invalid_argument("unknown flag " + a + " (see --help)");
  }
  if (k < 1 || n < 1) throw std::invalid_argument("--tensors and --elements must be at least 1");
  if (precision != "fp32" && precision != "bf16")
    throw std::invalid_argument("--precision " + precision + ": use fp32 or bf16");
  if (status_kib("VmHWM:") < 0) throw std::runtime_error("/proc/self/status has no VmHWM: Linux only");

  nlohmann::json cfg = {{"train_micro_batch_size_per_gpu", 1},
                        {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
                        {"zero_optimization", {{"stage", 0}}}};
  if (precision == "bf16") cfg["bf16"] = {{"enabled", true}};
  const std::uint64_t window = mpzero::torch::detail::startup_window_elements();
  const std::uint64_t whole = static_cast<std::uint64_t>(k) * static_cast<std::uint64_t>(n);
  std::printf("mpzero_bench_startup: %lld x %lld fp32 elements (%.1f MiB), %s, ZeRO-0, AdamW\n", (long long)k,
              (long long)n, static_cast<double>(whole) * 4 / 1048576.0, precision.c_str());
  std::printf("%-24s %12s %12s %14s %16s\n", "window (elements)", "peak (MiB)", "states (MiB)", "start-up (MiB)",
              "window (MiB)");
  // The whole-model window first and last: the first initialize of a process also
  // settles the allocators, so the two whole-model lines show how much that moves.
  for (const std::uint64_t w : {whole, window, whole}) {
    Flat model(k, n);
    mpzero::torch::detail::set_startup_window_elements(w);
    { std::ofstream("/proc/self/clear_refs") << "5"; }  // resets VmHWM to the current RSS
    const long before = status_kib("VmRSS:");
    auto engine = mpzero::torch::initialize(model, cfg);
    const long peak = status_kib("VmHWM:");
    const double states = static_cast<double>(engine.memory().model_state_bytes() + engine.memory().buckets) / 1048576.0;
    const double grown = static_cast<double>(peak - before) / 1024.0;
    std::printf("%-24llu %12.1f %12.1f %14.1f %16.1f\n", (unsigned long long)w, grown, states, grown - states,
                static_cast<double>(std::min(whole, std::max(w, static_cast<std::uint64_t>(n)))) * 4 / 1048576.0);
  }
  mpzero::torch::detail::set_startup_window_elements(window);
  std::printf("peak: the resident set's growth during initialize; states: the core's model states and buckets\n"
              "(engine.memory()); start-up: peak - states, what initialize needs beyond them; window: the\n"
              "host window in fp32 (at least the largest tensor, which loads whole).\n");
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "mpzero_bench_startup: %s\n", e.what());
  return 2;
}

// Per-rank memory and step time of ZeroOptimizer, every stage x the named policies,
// on the CPU under mpirun, beside the memory model's prediction.
//
//   mpirun -np 4 zero_bench [--params N] [--tensors T] [--embedding E] [--bucket B] [--iters I]
//
// The layout: an embedding-like first tensor of E elements (none by default), then the
// rest of the N parameters in T equal tensors. One iteration: every rank reports a
// gradient for every tensor (in reverse order, as backward does), ends the backward pass
// and steps. Time is the median over iterations of the slowest rank. Memory is what the
// optimizer holds on rank 0, per parameter: between steps (model states and whatever
// communication buffers stay), and at most during the step (model states and the most
// communication buffers held at once), beside the ZeRO formula.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include <mpzero/comm/mpi.hpp>
#include <mpzero/zero/zero_optimizer.hpp>

namespace {

struct options {
  std::uint64_t params = 8u << 20;
  std::uint64_t tensors = 32;
  std::uint64_t embedding = 0;
  std::uint64_t bucket = 1u << 20;
  int iters = 5;
};

// The most communication-buffer bytes held at once: memory_report::peak_buckets where the
// library reports it, else the most this program saw after a backward pass.
template <class Report>
std::uint64_t peak_of(const Report& m, std::uint64_t seen) {
  if constexpr (requires { m.peak_buckets; }) {
    return std::max<std::uint64_t>(seen, m.peak_buckets);
  } else {
    return seen;
  }
}

template <class Policy, int Stage>
void run(mpzero::comm::mpi_communicator& c, const options& o, const char* name) {
  using G = typename Policy::grad_type;
  std::vector<std::uint64_t> numels(o.tensors, (o.params - std::min(o.embedding, o.params)) / o.tensors);
  if (o.embedding > 0) numels.insert(numels.begin(), o.embedding);
  mpzero::zero_options zo;
  zo.reduce_bucket_numel = o.bucket;
  zo.param_persistence_threshold = 0;
  zo.loss_scaling = Policy::needs_loss_scaling;
  mpzero::ZeroOptimizer<Policy, mpzero::optim::adamw, mpzero::stage<Stage>, mpzero::comm::mpi_communicator> z(
      c, numels, {}, zo);
  std::vector<G> grad(*std::max_element(numels.begin(), numels.end()), mpzero::from_float<G>(1e-3f));
  std::vector<double> times;
  std::uint64_t peak_buckets = 0;
  for (int it = 0; it < o.iters + 1; ++it) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = std::chrono::steady_clock::now();
    if constexpr (Stage == 3) z.gather(0, numels.size());  // forward needs the parameters
    if constexpr (Stage == 3) z.release(0, numels.size());
    for (std::size_t p = numels.size(); p-- > 0;) z.accumulate_grad(p, grad.data());
    z.end_backward();
    peak_buckets = std::max(peak_buckets, z.memory().buckets);
    z.step();
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    MPI_Allreduce(MPI_IN_PLACE, &dt, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (it > 0) times.push_back(dt);  // the first iteration allocates buckets
  }
  std::sort(times.begin(), times.end());
  const mpzero::memory_report m = z.memory();
  peak_buckets = peak_of(m, peak_buckets);
  const double model = mpzero::bytes_per_param<Policy, mpzero::optim::adamw, mpzero::stage<Stage>>(c.size()).device_bytes;
  const double n = static_cast<double>(m.model_numel);
  const double states = static_cast<double>(m.model_state_bytes());
  if (c.rank() == 0) {
    std::printf("| %d | %d | %-24s | %6.2f | %6.2f | %6.2f | %8.1f |\n", c.size(), Stage, name, model,
                (states + static_cast<double>(m.buckets)) / n, (states + static_cast<double>(peak_buckets)) / n,
                1e3 * times[times.size() / 2]);
  }
}

template <class Policy>
void all_stages(mpzero::comm::mpi_communicator& c, const options& o, const char* name) {
  run<Policy, 0>(c, o, name);
  run<Policy, 1>(c, o, name);
  run<Policy, 2>(c, o, name);
  run<Policy, 3>(c, o, name);
}

std::uint64_t parse(const char* flag, const char* v) {
  char* end = nullptr;
  const unsigned long long x = std::strtoull(v, &end, 10);
  if (end == v || *end != '\0' || x == 0) {
    std::fprintf(stderr, "zero_bench: %s needs a positive whole number, got '%s'\n", flag, v);
    std::exit(2);
  }
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "zero_bench: %s needs a value (--params N, --tensors T, --embedding E, --bucket B, --iters I)\n",
                   argv[i]);
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
    if (a == "--params") o.params = parse("--params", argv[++i]);
    else if (a == "--tensors") o.tensors = parse("--tensors", argv[++i]);
    else if (a == "--iters") o.iters = static_cast<int>(parse("--iters", argv[++i]));
    else if (a == "--embedding") o.embedding = parse("--embedding", argv[++i]);
    else if (a == "--bucket") o.bucket = parse("--bucket", argv[++i]);
    else {
      std::fprintf(stderr, "zero_bench: unknown argument '%s'\n", argv[i]);
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
  }
  {
    mpzero::comm::mpi_communicator c;
    if (c.rank() == 0) {
      std::printf("ZeroOptimizer, AdamW, %llu parameters (embedding %llu, then %llu tensors), bucket %llu elements, "
                  "%d iterations\n\n",
                  static_cast<unsigned long long>(o.params), static_cast<unsigned long long>(o.embedding),
                  static_cast<unsigned long long>(o.tensors), static_cast<unsigned long long>(o.bucket), o.iters);
      std::printf("| ranks | stage | policy | ZeRO formula B/param | held B/param | peak B/param | step ms |\n");
      std::printf("|---|---|---|---|---|---|---|\n");
    }
    namespace pol = mpzero::policies;
    all_stages<pol::fp32>(c, o, "fp32");
    all_stages<pol::bf16_fp32_master>(c, o, "bf16_fp32_master");
    all_stages<pol::bf16_master_fp32_states>(c, o, "bf16_master_fp32_states");
    all_stages<pol::bf16_all_sr>(c, o, "bf16_all_sr");
  }
  MPI_Finalize();
  return 0;
}

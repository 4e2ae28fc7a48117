// ZeroOptimizer on the CUDA backend with an NCCL communicator (world size 1), or
// cuda_local_communicator, checked bit for bit against the same optimizer on the host
// backend with the local communicator: same gradients, same steps, same parameters,
// masters and states. The [gpu] cases run only under `ctest -L gpu`; the [zero] case
// (a communicator in the wrong memory space is refused) needs no device.
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <mpzero/backend/cuda_backend.cuh>
#include <mpzero/comm/cuda_local.cuh>
#include <mpzero/comm/local.hpp>
#include <mpzero/comm/nccl.cuh>
#include <mpzero/zero/zero_optimizer.hpp>

using namespace mpzero;

namespace {

void require_device() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) FAIL("no CUDA device: run the [gpu] tests on a machine with a GPU");
}

float grad_value(std::uint64_t step, int pass, std::size_t p, std::uint64_t e) {
  const auto bits = element_random_bits(500 + p, step * 8 + static_cast<std::uint64_t>(pass), e);
  return (static_cast<float>(bits.v[0] % 2001u) - 1000.0f) * 1e-4f;
}

struct snapshot {
  std::vector<float> params, master, s0;
  std::vector<double> norms;
};

template <class Policy>
zero_options test_options(bool pinned, const std::vector<dtype>& wire) {
  zero_options zo;
  zo.wire_dtypes = wire;
  zo.pin_memory = pinned;
  zo.offload_sub_group_numel = 30000;  // several sub-groups: uploads overlap the host step
  zo.reduce_bucket_numel = 5000;
  zo.param_persistence_threshold = 64;
  zo.loss_scaling = Policy::needs_loss_scaling;
  zo.gradient_clipping = 1.0;
  zo.seed = 7;
  return zo;
}

// Parameters, master weights and first moments of z (world size 1: the whole model).
template <class Z, class Backend>
snapshot read_back(Z& z, Backend& backend) {
  snapshot out;
  backend.synchronize();
  const std::size_t n = z.num_params();
  if constexpr (Z::zero_stage == 3) z.gather(0, n);
  for (std::size_t p = 0; p < n; ++p) {
    const auto s = z.param(p);
    std::vector<typename Z::param_type> h(s.size());
    backend.download(h.data(), s.data(), s.size());
    for (auto v : h) out.params.push_back(to_float(v));
  }
  if constexpr (Z::zero_stage == 3) z.release(0, n);
  z.read_master_shard([&](std::uint64_t, float v) { out.master.push_back(v); });
  z.read_state_shard(0, [&](std::uint64_t, float v) { out.s0.push_back(v); });
  return out;
}

// Four steps of two backward passes; with `save_to`, a checkpoint at the end.
template <class Policy, class Opt, int Stage, class Comm, class Backend, class Offload = offload_none>
snapshot train(Comm& comm, Backend backend, const std::vector<std::uint64_t>& numels, bool pinned = true,
               const std::vector<dtype>& wire = {}, const std::string& save_to = "") {
  typename Opt::options o;
  ZeroOptimizer<Policy, Opt, stage<Stage>, Comm, Backend, Offload> z(comm, numels, o, test_options<Policy>(pinned, wire),
                                                                     backend);
  using G = typename Policy::grad_type;
  // Host staging, then the backend's memory (device or host alike through upload()).
  auto to_backend = [&](const std::vector<float>& v) {
    std::vector<G> h(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) h[i] = from_float<G>(v[i]);
    auto buf = backend.template allocate<G>(v.size());
    backend.upload(buf.data(), h.data(), h.size());
    return buf;
  };
  for (std::size_t p = 0; p < numels.size(); ++p) {
    std::vector<float> init(numels[p]);
    for (std::uint64_t e = 0; e < init.size(); ++e) init[e] = 0.01f * static_cast<float>(e % 13) - 0.05f;
    auto b = backend.template allocate<float>(init.size());
    backend.upload(b.data(), init.data(), init.size());
    z.load_param(p, b.data());
  }
  std::vector<double> norms;
  for (std::uint64_t step = 1; step <= 4; ++step) {
    for (int pass = 0; pass < 2; ++pass) {
      for (std::size_t p = numels.size(); p-- > 0;) {
        std::vector<float> g(numels[p]);
        for (std::uint64_t e = 0; e < g.size(); ++e) g[e] = grad_value(step, pass, p, e) * static_cast<float>(z.loss_scale());
        auto b = to_backend(g);
        z.accumulate_grad(p, b.data());
        backend.synchronize();  // b is freed at the end of this scope
      }
      z.end_backward();
    }
    norms.push_back(z.step().grad_norm);
  }
  if (!save_to.empty()) z.save_checkpoint(save_to);
  snapshot out = read_back(z, backend);
  out.norms = norms;
  return out;
}

// A fresh optimizer that loads the checkpoint in `dir`.
template <class Policy, class Opt, int Stage, class Comm, class Backend, class Offload = offload_none>
snapshot load_from(Comm& comm, Backend backend, const std::vector<std::uint64_t>& numels, const std::string& dir) {
  ZeroOptimizer<Policy, Opt, stage<Stage>, Comm, Backend, Offload> z(comm, numels, typename Opt::options{},
                                                                     test_options<Policy>(true, {}), backend);
  z.load_checkpoint(dir);
  return read_back(z, backend);
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The device run's communicator: NCCL, or cuda_local_communicator (device copies on the
// backend's stream, no NCCL).
enum class device_comm { nccl, local };

template <class Policy, class Opt, int Stage, class Offload = offload_none>
void compare_backends(bool pinned = true, const std::vector<dtype>& wire = {}, device_comm dc = device_comm::nccl) {
  require_device();
  const std::vector<std::uint64_t> numels{70001, 0, 33, 12345, 7, 100000};
  comm::local_communicator local;
  const snapshot host = train<Policy, Opt, Stage>(local, host_backend{}, numels, true, wire);
  cudaStream_t stream = nullptr;
  MPZERO_CUDA_CHECK(cudaStreamCreate(&stream));
  auto train_on = [&]<class C>(C& c) {
    return train<Policy, Opt, Stage, C, cuda_backend, Offload>(c, cuda_backend{stream}, numels, pinned, wire);
  };
  snapshot dev;
  if (dc == device_comm::nccl) {
    comm::nccl_communicator nccl;
    dev = train_on(nccl);
  } else {
    comm::cuda_local_communicator copies(stream);
    dev = train_on(copies);
  }
  MPZERO_CUDA_CHECK(cudaStreamDestroy(stream));
  INFO("stage " << Stage << (pinned ? "" : ", pageable host memory")
                << (dc == device_comm::nccl ? ", NCCL" : ", cuda_local_communicator"));
  REQUIRE(same_bits(host.params, dev.params));
  REQUIRE(same_bits(host.master, dev.master));
  REQUIRE(same_bits(host.s0, dev.s0));
  // Norms: fp64 sums in another order inside a chunk; far below fp32 resolution.
  REQUIRE(host.norms.size() == dev.norms.size());
  for (std::size_t i = 0; i < host.norms.size(); ++i) REQUIRE(dev.norms[i] == Approx(host.norms[i]).epsilon(1e-12));
}

}  // namespace

TEST_CASE("ZeRO on CUDA + NCCL equals ZeRO on the host, bit for bit: all bf16, stochastic rounding", "[gpu][zero]") {
  compare_backends<policies::bf16_all_sr, optim::adamw, 0>();
  compare_backends<policies::bf16_all_sr, optim::adamw, 1>();
  compare_backends<policies::bf16_all_sr, optim::adamw, 2>();
  compare_backends<policies::bf16_all_sr, optim::adamw, 3>();
}

TEST_CASE("ZeRO on CUDA + NCCL equals ZeRO on the host: bf16 with fp32 master, fp16 with loss scaling", "[gpu][zero]") {
  compare_backends<policies::bf16_fp32_master, optim::adam, 2>();
  compare_backends<policies::fp16_fp32_master, optim::adamw, 2>();
  compare_backends<policies::fp16_fp32_master, optim::adamw, 3>();
}

TEST_CASE("ZeRO-Offload on CUDA (device parameters, host states and step) equals ZeRO on the host", "[gpu][offload]") {
  compare_backends<policies::bf16_all_sr, optim::adamw, 1, offload_cpu>();
  compare_backends<policies::bf16_fp32_master, optim::adamw, 2, offload_cpu>();
  compare_backends<policies::bf16_master_fp32_states, optim::adamw, 3, offload_cpu>();
}

TEST_CASE("ZeRO-Offload on CUDA with pageable host memory (pin_memory = false) gives the same bits", "[gpu][offload]") {
  compare_backends<policies::bf16_fp32_master, optim::adamw, 2, offload_cpu>(false);
}

TEST_CASE("CUDA backend: pinned host memory; copy-stream transfers ordered after and before compute-stream work",
          "[gpu][offload]") {
  require_device();
  cudaStream_t stream = nullptr;
  MPZERO_CUDA_CHECK(cudaStreamCreate(&stream));
  {
    const cuda_backend be{stream};
    const std::uint64_t n = std::uint64_t{1} << 22;
    host_buffer<float> pinned(n, be.host_memory(true)), pageable(n, be.host_memory(false));
    REQUIRE(pinned.pinned());
    REQUIRE_FALSE(pageable.pinned());
    cudaPointerAttributes a{};
    MPZERO_CUDA_CHECK(cudaPointerGetAttributes(&a, pinned.data()));
    REQUIRE(a.type == cudaMemoryTypeHost);

    for (std::uint64_t i = 0; i < n; ++i) pinned.data()[i] = static_cast<float>(i % 1000) * 0.5f;
    auto src = be.allocate<float>(n);
    auto dst = be.allocate<float>(n);
    // Upload on the copy stream, then compute-stream work ordered after it (no host wait).
    auto up = be.upload_async(src.data(), pinned.data(), n);
    be.order_after(up);
    be.convert(dst.data(), src.data(), n);  // on `stream`
    up.wait();  // before the host rewrites the upload's source
    // A download queued now must see the convert (it is ordered after the stream's work).
    std::memset(pinned.data(), 0, n * sizeof(float));
    auto down = be.download_async(pinned.data(), dst.data(), n);
    down.wait();
    REQUIRE(down.done());
    std::uint64_t bad = 0;
    for (std::uint64_t i = 0; i < n; ++i) bad += pinned.data()[i] != static_cast<float>(i % 1000) * 0.5f;
    REQUIRE(bad == 0);
    // An empty transfer is done at once.
    auto none = be.download_async(pinned.data(), dst.data(), 0);
    REQUIRE(none.done());
  }
  MPZERO_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE("ZeRO on CUDA + NCCL with per-parameter wire dtypes equals the host backend", "[gpu][zero]") {
  // numels {70001, 0, 33, 12345, 7, 100000}: runs of bf16, fp16 and fp32 on the wire,
  // buckets of 5000 elements mixing them.
  const std::vector<dtype> wire{dtype::bf16, dtype::fp32, dtype::fp16, dtype::fp32, dtype::bf16, dtype::bf16};
  compare_backends<policies::fp32, optim::adamw, 0>(true, wire);
  compare_backends<policies::fp32, optim::adamw, 2>(true, wire);
  // A bf16 policy's gradients travel in bf16 or fp32, never fp16 (ZeroOptimizer refuses the mix).
  const std::vector<dtype> wire_bf16{dtype::bf16, dtype::fp32, dtype::bf16, dtype::fp32, dtype::bf16, dtype::fp32};
  compare_backends<policies::bf16_fp32_master, optim::adamw, 3>(true, wire_bf16);
  compare_backends<policies::bf16_fp32_master, optim::adamw, 2, offload_cpu>(true, wire_bf16);
}

TEST_CASE("ZeRO on CUDA with cuda_local_communicator (no NCCL) equals the host backend", "[gpu][zero]") {
  // Stages 1-3 copy between distinct device buffers (reduce-scatter into the partition,
  // all-gather of the parameters), which a host communicator would do with memmove.
  compare_backends<policies::bf16_all_sr, optim::adamw, 1>(true, {}, device_comm::local);
  compare_backends<policies::bf16_fp32_master, optim::adamw, 2>(true, {}, device_comm::local);
  compare_backends<policies::fp16_fp32_master, optim::adamw, 3>(true, {}, device_comm::local);
  compare_backends<policies::bf16_fp32_master, optim::adamw, 2, offload_cpu>(true, {}, device_comm::local);
}

TEST_CASE("Checkpoints move between the CUDA and the host backend, bit for bit", "[gpu][zero]") {
  require_device();
  const std::vector<std::uint64_t> numels{70001, 0, 33, 12345, 7, 100000};
  const std::string dir_dev = std::filesystem::temp_directory_path() / "mpzero_gpu_ckpt_dev";
  const std::string dir_host = std::filesystem::temp_directory_path() / "mpzero_gpu_ckpt_host";
  std::filesystem::create_directories(dir_dev);
  std::filesystem::create_directories(dir_host);
  using P = policies::bf16_all_sr;
  cudaStream_t stream = nullptr;
  MPZERO_CUDA_CHECK(cudaStreamCreate(&stream));
  comm::local_communicator local;
  comm::cuda_local_communicator copies(stream);
  // Saved on the device at stage 2 (through the offload path at stage 1 too), loaded on the host at stage 3.
  const snapshot dev = train<P, optim::adamw, 2, comm::cuda_local_communicator, cuda_backend>(
      copies, cuda_backend{stream}, numels, true, {}, dir_dev);
  const snapshot on_host = load_from<P, optim::adamw, 3>(local, host_backend{}, numels, dir_dev);
  REQUIRE(same_bits(on_host.params, dev.params));
  REQUIRE(same_bits(on_host.master, dev.master));
  REQUIRE(same_bits(on_host.s0, dev.s0));
  // Saved on the host, loaded on the device (with offload: host states, device parameters).
  const snapshot host = train<P, optim::adamw, 1>(local, host_backend{}, numels, true, {}, dir_host);
  const snapshot on_dev = load_from<P, optim::adamw, 1, comm::cuda_local_communicator, cuda_backend, offload_cpu>(
      copies, cuda_backend{stream}, numels, dir_host);
  REQUIRE(same_bits(on_dev.params, host.params));
  REQUIRE(same_bits(on_dev.master, host.master));
  REQUIRE(same_bits(on_dev.s0, host.s0));
  MPZERO_CUDA_CHECK(cudaStreamDestroy(stream));
  std::filesystem::remove_all(dir_dev);
  std::filesystem::remove_all(dir_host);
}

TEST_CASE("ZeroOptimizer refuses a communicator that reads the other memory space", "[zero]") {
  // Needs no device: the check runs before anything is allocated or launched.
  STATIC_REQUIRE(comm::stream_ordered<comm::nccl_communicator>);
  STATIC_REQUIRE(comm::stream_ordered<comm::cuda_local_communicator>);
  CHECK(comm::reads_device_memory(comm::cuda_local_communicator{}));
  CHECK_FALSE(comm::reads_device_memory(comm::local_communicator{}));
  const std::vector<std::uint64_t> numels{10, 3};
  comm::local_communicator host_comm;
  using OnDevice = ZeroOptimizer<policies::bf16_fp32_master, optim::adamw, stage<2>, comm::local_communicator, cuda_backend>;
  REQUIRE_THROWS_MATCHES(OnDevice(host_comm, numels, optim::adamw::options{}, zero_options{}, cuda_backend{}),
                         mpzero::invalid_argument,
                         Catch::Matchers::Predicate<mpzero::invalid_argument>([](const mpzero::invalid_argument& e) {
                           const std::string w = e.what();
                           return w.find("device memory, but the communicator (rank 0 of 1) moves host memory") !=
                                      std::string::npos &&
                                  w.find("nccl_communicator") != std::string::npos &&
                                  w.find("cuda_local_communicator") != std::string::npos &&
                                  w.find("bool reads_device_memory() const { return true; }") != std::string::npos &&
                                  w.find("host_addressable = true") != std::string::npos;
                         }));
  // The same type with cuda_local_communicator passes the check (constructing it would
  // allocate on the device, so only the types and the rule are checked here).
  comm::cuda_local_communicator dev_comm;
  CHECK(comm::reads_device_memory(dev_comm) == cuda_backend::device_memory);
  // Its copies are ordered only on its own stream: following another one is refused
  // (streams are never dereferenced here).
  const auto a = reinterpret_cast<cudaStream_t>(std::uintptr_t{0x10});
  const auto b = reinterpret_cast<cudaStream_t>(std::uintptr_t{0x20});
  comm::cuda_local_communicator on_a(a);
  CHECK_NOTHROW(on_a.wait_for(a));
  REQUIRE_THROWS_WITH(on_a.wait_for(b), Catch::Contains("asked to follow stream 0x20, but its copies run on 0x10") &&
                                            Catch::Contains("Construct it with the backend's stream"));
  // ZeroOptimizer asks at construction, before it allocates: not at the first bucket.
  using Local = ZeroOptimizer<policies::bf16_all, optim::adamw, stage<2>, comm::cuda_local_communicator, cuda_backend>;
  REQUIRE_THROWS_WITH(Local(on_a, numels, optim::adamw::options{}, zero_options{}, cuda_backend{b}),
                      Catch::Contains("asked to follow stream 0x20, but its copies run on 0x10"));
  // A garbage size (a negative count cast to unsigned) is refused before cudaMalloc sees a
  // wrapped byte count.
  REQUIRE_THROWS_AS(cuda_buffer<float>(std::uint64_t{1} << 62, nullptr), mpzero::invalid_argument);
  REQUIRE_THROWS_WITH(cuda_buffer<float>(std::uint64_t{1} << 62, nullptr),
                      Catch::Contains("4611686018427387904 elements of 4 bytes exceeds the address space"));
}

TEST_CASE("ZeroOptimizer on CUDA refuses pageable host memory as a source unless the GPU reads it", "[gpu][zero]") {
  require_device();
  int device = 0, pageable = 0;
  MPZERO_CUDA_CHECK(cudaGetDevice(&device));
  MPZERO_CUDA_CHECK(cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess, device));
  cudaStream_t stream = nullptr;
  MPZERO_CUDA_CHECK(cudaStreamCreate(&stream));
  {
    const cuda_backend be{stream};
    comm::cuda_local_communicator copies(stream);
    const std::vector<std::uint64_t> numels{100, 0};
    ZeroOptimizer<policies::bf16_all, optim::adamw, stage<1>, comm::cuda_local_communicator, cuda_backend> z(
        copies, numels, optim::adamw::options{}, zero_options{}, be);
    std::vector<float> pageable_values(100, 0.5f);
    host_buffer<float> pinned(100, be.host_memory(true));
    std::fill(pinned.data(), pinned.data() + 100, 0.5f);
    auto on_device = be.allocate<float>(100);
    be.upload(on_device.data(), pinned.data(), 100);
    INFO("device " << device << ", pageable memory access " << pageable);
    if (pageable == 0) {
      REQUIRE_THROWS_WITH(z.load_param(0, pageable_values.data()),
                          Catch::Contains("load_param(0)") && Catch::Contains("is pageable host memory") &&
                              Catch::Contains("pass device memory"));
      REQUIRE_THROWS_WITH(z.accumulate_grad(0, pageable_values.data()), Catch::Contains("accumulate_grad(0)"));
      REQUIRE_FALSE(z.grads_pending());  // refused before it counted
    } else {
      REQUIRE_NOTHROW(z.load_param(0, pageable_values.data()));  // HMM / ATS: kernels read it
    }
    REQUIRE_NOTHROW(z.load_param(0, on_device.data()));
    REQUIRE_NOTHROW(z.load_param(0, pinned.data()));
    z.accumulate_grad(0, on_device.data());
    z.accumulate_grad(0, pinned.data());
    const std::vector<float> g = z.full_grad(0);
    REQUIRE(std::count(g.begin(), g.end(), 1.0f) == 100);
    REQUIRE(z.step().step == 1);
    be.synchronize();
  }
  MPZERO_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE("cuda_backend::all_reduce_host and broadcast_host: host values through reused device scratch, in pieces",
          "[gpu][zero]") {
  require_device();
  cudaStream_t stream = nullptr;
  MPZERO_CUDA_CHECK(cudaStreamCreate(&stream));
  {
    const cuda_backend be{stream};
    comm::nccl_communicator nccl;
    // One rank: the sum and the max are the values themselves, through the device and back.
    // 1.5M doubles: three pieces of 4 MiB, the last one short; the scratch stays one piece.
    for (const std::uint64_t n : {std::uint64_t{1}, std::uint64_t{1000}, std::uint64_t{3}, std::uint64_t{5000},
                                  std::uint64_t{1'500'000}}) {
      std::vector<double> v(n);
      for (std::uint64_t i = 0; i < n; ++i) v[i] = 0.5 * static_cast<double>(i) - 7.25;
      const std::vector<double> want = v;
      be.all_reduce_host(nccl, v.data(), n, comm::reduce_op::sum);
      CHECK(v == want);
      std::vector<std::int32_t> flags(n, 0);
      flags[n - 1] = 1;
      be.all_reduce_host(nccl, flags.data(), n, comm::reduce_op::max);
      CHECK(flags[n - 1] == 1);
      CHECK(std::count(flags.begin(), flags.end(), 1) == 1);
      CHECK(be.host_collective_scratch_bytes() <= cuda_backend::host_collective_piece_bytes);
      std::vector<float> b(n);
      for (std::uint64_t i = 0; i < n; ++i) b[i] = static_cast<float>(i % 977) - 3.5f;
      const std::vector<float> b_want = b;
      be.broadcast_host(nccl, b.data(), n, 0);
      CHECK(b == b_want);
    }
  }
  MPZERO_CUDA_CHECK(cudaStreamDestroy(stream));
}

// nccl_communicator at world size 1 on one GPU: every call is a copy (or nothing, in
// place), so the results are known exactly; what is tested is the plumbing: stream
// ordering (wait_for, requests), the grouped and the equal-count paths, validation,
// bootstrap through a communicator, and the deadline: a request whose work can never
// finish throws comm_error and aborts the communicator instead of hanging.
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include <mpzero/backend/cuda_backend.cuh>
#include <mpzero/comm/local.hpp>
#include <mpzero/comm/nccl.cuh>
#include <mpzero/cuda/check.cuh>

using namespace mpzero;
using namespace mpzero::comm;
using u64 = std::uint64_t;

namespace {

template <class T>
struct device_buffer {
  T* p = nullptr;
  u64 n = 0;
  explicit device_buffer(u64 count) : n(count) { MPZERO_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p), (n ? n : 1) * sizeof(T))); }
  ~device_buffer() { cudaFree(p); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  // Setup runs on the legacy default stream, which the communicator's non-blocking
  // stream does not wait for (and a pageable cudaMemcpy may return before its DMA
  // lands): both finish on the device before the buffer is handed to NCCL.
  void upload(const std::vector<T>& v) {
    MPZERO_CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    MPZERO_CUDA_CHECK(cudaDeviceSynchronize());
  }
  void clear() {
    MPZERO_CUDA_CHECK(cudaMemset(p, 0, (n ? n : 1) * sizeof(T)));
    MPZERO_CUDA_CHECK(cudaDeviceSynchronize());
  }
  std::vector<T> download() const {
    std::vector<T> v(n);
    MPZERO_CUDA_CHECK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
};

template <class T>
std::vector<T> pattern(u64 n, std::uint32_t salt) {
  std::vector<T> v(n);
  for (u64 i = 0; i < n; ++i) {
    const std::uint32_t k = static_cast<std::uint32_t>(i * 2654435761u + salt * 97u);
    if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, fp16>) {
      v[i] = T::from_bits(static_cast<std::uint16_t>((k >> 7) & 0x7bff));  // finite, no NaN
    } else if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      v[i] = static_cast<T>(static_cast<int>(k % 2001) - 1000) / 8;
    } else {
      v[i] = static_cast<T>(k);
    }
  }
  return v;
}

template <class T>
bool same_bytes(const std::vector<T>& a, const std::vector<T>& b, u64 n) {
  return a.size() >= n && b.size() >= n && std::memcmp(a.data(), b.data(), n * sizeof(T)) == 0;
}

template <class T>
void check_type(nccl_communicator& c) {
  const u64 n = 4099;
  const auto host = pattern<T>(n, 5);
  device_buffer<T> in(n), out(n);
  in.upload(host);
  for (const reduce_op op : {reduce_op::sum, reduce_op::max}) {
    out.clear();
    c.all_reduce(in.p, out.p, n, op);
    CHECK(same_bytes(out.download(), host, n));
    c.all_reduce(in.p, in.p, n, op);  // in place
    CHECK(same_bytes(in.download(), host, n));
  }
  const std::vector<u64> counts{n - 3};
  out.clear();
  c.reduce_scatter_v(in.p, out.p, counts, reduce_op::sum);
  auto got = out.download();
  CHECK(same_bytes(got, host, n - 3));
  CHECK(std::memcmp(&got[n - 3], std::vector<T>(3).data(), 3 * sizeof(T)) == 0);  // nothing past the block
  out.clear();
  c.all_gather_v(in.p, n - 3, out.p, counts);
  CHECK(same_bytes(out.download(), host, n - 3));
  c.all_gather_v(out.p, n - 3, out.p, counts);  // in place
  CHECK(same_bytes(out.download(), host, n - 3));
  c.broadcast(in.p, n, 0);
  CHECK(same_bytes(in.download(), host, n));
}

// Spins until *flag != 0, or about `cycles` clock cycles as a safety net.
__global__ void spin_until(const volatile int* flag, long long cycles) {
  const long long start = clock64();
  while (*flag == 0 && clock64() - start < cycles) {
  }
}

__global__ void fill(float* p, u64 n, float value) {
  const u64 i = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x;
  if (i < n) p[i] = value;
}

}  // namespace

TEST_CASE("nccl_communicator at world size 1: every wire type, every call", "[gpu]") {
  nccl_options opt;
  opt.timeout_s = 60;
  nccl_communicator c(opt);
  CHECK(c.rank() == 0);
  CHECK(c.size() == 1);
  CHECK(c.usable());
  check_type<float>(c);
  check_type<double>(c);
  check_type<bf16>(c);
  check_type<fp16>(c);
  check_type<std::int32_t>(c);
  check_type<std::uint8_t>(c);
  c.barrier();

  device_buffer<float> b(8);
  const std::vector<u64> two{4, 4};
  CHECK_THROWS_AS(c.reduce_scatter_v(b.p, b.p, two, reduce_op::sum), mpzero::invalid_argument);
  CHECK_THROWS_AS(c.broadcast(b.p, 8, 1), mpzero::invalid_argument);
  CHECK_THROWS_AS(c.all_reduce(b.p, b.p + 1, 4, reduce_op::sum), mpzero::invalid_argument);
  CHECK(c.usable());
}

TEST_CASE("nccl_communicator: bootstrapped from a communicator; wait_for and requests order streams", "[gpu]") {
  local_communicator boot;
  nccl_options opt;
  opt.timeout_s = 60;
  nccl_communicator c(boot, opt);
  CHECK(c.size() == 1);

  const u64 n = 1 << 22;
  device_buffer<float> x(n), y(n);
  cudaStream_t compute;
  MPZERO_CUDA_CHECK(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  for (int round = 1; round <= 3; ++round) {
    // Produce on the compute stream; the communicator must see it only through wait_for.
    fill<<<static_cast<unsigned>((n + 255) / 256), 256, 0, compute>>>(x.p, n, static_cast<float>(round));
    MPZERO_CUDA_CHECK(cudaGetLastError());
    c.wait_for(compute);
    auto r = c.iall_reduce(x.p, y.p, n, reduce_op::sum);
    // The consumer waits on the request without blocking the host, then reads y.
    r.enqueue_wait(compute);
    std::vector<float> host(n);
    MPZERO_CUDA_CHECK(cudaMemcpyAsync(host.data(), y.p, n * sizeof(float), cudaMemcpyDeviceToHost, compute));
    MPZERO_CUDA_CHECK(cudaStreamSynchronize(compute));
    r.wait();
    CHECK(r.done());
    u64 bad = 0;
    for (float v : host) bad += v != static_cast<float>(round);
    INFO("round " << round);
    CHECK(bad == 0);
  }
  MPZERO_CUDA_CHECK(cudaStreamDestroy(compute));
}

TEST_CASE("nccl_communicator: a request that cannot finish times out and aborts", "[gpu]") {
  // The communicator's stream waits on a kernel that spins on a host flag; an empty
  // all_reduce (no NCCL kernel queued behind it) must time out after 0.3 s with
  // comm_error, after which the communicator refuses work. Construction has its own
  // deadline (NCCL's setup may take longer than 0.3 s). A thread releases the flag after
  // 2 s, in case ncclCommAbort waits for the device.
  int* flag = nullptr;
  MPZERO_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&flag), sizeof(int), cudaHostAllocMapped));
  *flag = 0;
  int* dflag = nullptr;
  MPZERO_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dflag), flag, 0));
  cudaStream_t producer;
  MPZERO_CUDA_CHECK(cudaStreamCreateWithFlags(&producer, cudaStreamNonBlocking));
  {
    nccl_options opt;
    opt.timeout_s = 0.3;
    opt.init_timeout_s = 120;
    nccl_communicator c(opt);
    spin_until<<<1, 1, 0, producer>>>(dflag, 20'000'000'000LL);  // ~10 s at 2 GHz at most
    MPZERO_CUDA_CHECK(cudaGetLastError());
    std::jthread release([flag] {  // joined on every way out
      std::this_thread::sleep_for(std::chrono::seconds(2));
      *reinterpret_cast<volatile int*>(flag) = 1;
    });
    c.wait_for(producer);
    device_buffer<float> b(4);
    auto r = c.iall_reduce(b.p, b.p, 0, reduce_op::sum);
    std::string msg;
    const auto start = std::chrono::steady_clock::now();
    try {
      r.wait();
    } catch (const comm_error& e) {
      msg = e.what();
    }
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    release.join();
    INFO(msg);
    CHECK(msg.find("NCCL all_reduce<float, sum> timed out on rank 0 of 1") != std::string::npos);
    CHECK(msg.find("aborted") != std::string::npos);
    CHECK(waited >= 0.3);
    CHECK_FALSE(c.usable());
    CHECK_THROWS_AS(c.barrier(), comm_error);
    MPZERO_CUDA_CHECK(cudaStreamSynchronize(producer));
    MPZERO_CUDA_CHECK(cudaStreamSynchronize(c.stream()));
  }
  MPZERO_CUDA_CHECK(cudaStreamDestroy(producer));
  MPZERO_CUDA_CHECK(cudaFreeHost(flag));
}

TEST_CASE("Polling unfinished work (a request, a transfer) leaves no error for the next launch check", "[gpu]") {
  // cudaEventQuery's "not ready" may be recorded as the thread's last error; the launch
  // checks (cudaGetLastError after each kernel) must not then blame the next kernel.
  int* flag = nullptr;
  MPZERO_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&flag), sizeof(int), cudaHostAllocMapped));
  *flag = 0;
  int* dflag = nullptr;
  MPZERO_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dflag), flag, 0));
  cudaStream_t producer, other;
  MPZERO_CUDA_CHECK(cudaStreamCreateWithFlags(&producer, cudaStreamNonBlocking));
  MPZERO_CUDA_CHECK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  {
    nccl_options opt;
    opt.timeout_s = 60;
    nccl_communicator c(opt);
    device_buffer<float> x(1024), y(1024), z(1024);
    const cuda_backend be{producer};
    host_buffer<float> pinned(1024, be.host_memory(true));
    spin_until<<<1, 1, 0, producer>>>(dflag, 20'000'000'000LL);
    MPZERO_CUDA_CHECK(cudaGetLastError());
    std::jthread release([flag] {  // the safety net if a check below throws; started after the
      std::this_thread::sleep_for(std::chrono::seconds(5));  // (possibly slow) setup above
      *reinterpret_cast<volatile int*>(flag) = 1;
    });
    c.wait_for(producer);
    auto r = c.iall_reduce(x.p, y.p, 1024, reduce_op::sum);
    auto t = be.download_async(pinned.data(), x.p, 1024);
    CHECK_FALSE(r.test());
    CHECK_FALSE(t.done());
    fill<<<4, 256, 0, other>>>(z.p, 1024, 1.0f);  // an unrelated launch, then its check
    REQUIRE_NOTHROW(MPZERO_CUDA_CHECK(cudaGetLastError()));
    const cuda_backend be_other{other};
    REQUIRE_NOTHROW(be_other.convert(z.p, z.p, 1024));  // a backend kernel, checked with cudaGetLastError
    *reinterpret_cast<volatile int*>(flag) = 1;
    r.wait();
    t.wait();
    CHECK(t.done());
    MPZERO_CUDA_CHECK(cudaStreamSynchronize(producer));
  }
  MPZERO_CUDA_CHECK(cudaStreamDestroy(producer));
  MPZERO_CUDA_CHECK(cudaStreamDestroy(other));
  MPZERO_CUDA_CHECK(cudaFreeHost(flag));
}

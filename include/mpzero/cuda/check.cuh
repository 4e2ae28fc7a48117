// mpzero: CUDA error checking for the host API.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "../error.hpp"

namespace mpzero {

class cuda_error : public error {
 public:
  cuda_error(cudaError_t code, const std::string& what) : error(what), code_(code) {}
  cudaError_t code() const noexcept { return code_; }

 private:
  cudaError_t code_;
};

namespace detail {
inline void cuda_check(cudaError_t e, const char* call, const char* file, int line) {
  if (e != cudaSuccess) {
    throw cuda_error(e, std::string("mpzero: CUDA call ") + call + " failed at " + file + ":" + std::to_string(line) +
                            ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
  }
}

// cudaEventQuery without side effects: a "not ready" answer may be recorded as the
// thread's last error, and the launch checks (cudaGetLastError) would then report it
// against the next, unrelated kernel. Cleared only when nothing else was pending before
// the query, so an earlier error is not cleared by it. (PyTorch's CUDAEvent::query
// clears it after a "not ready" too.)
inline cudaError_t query_event(cudaEvent_t e) noexcept {
  const bool clean = cudaPeekAtLastError() == cudaSuccess;
  const cudaError_t r = cudaEventQuery(e);
  if (r == cudaErrorNotReady && clean) (void)cudaGetLastError();
  return r;
}
}  // namespace detail
}  // namespace mpzero

#define MPZERO_CUDA_CHECK(call) ::mpzero::detail::cuda_check((call), #call, __FILE__, __LINE__)

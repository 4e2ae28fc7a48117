// mpzero: the world-size-1 communicator for device memory. local_communicator's
// collectives (the same argument checks) as device-to-device copies on one CUDA stream,
// so a single process can run the CUDA backend without NCCL. It has wait_for(stream),
// like nccl_communicator, which is what marks it as a device communicator
// (comm::reads_device_memory).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <sstream>
#include <string>

#include "../cuda/check.cuh"
#include "../error.hpp"
#include "local.hpp"

namespace mpzero::comm {

// Copies device memory on `stream` (asynchronously).
struct device_copy {
  cudaStream_t stream = nullptr;
  void operator()(void* out, const void* in, std::size_t bytes) const {
    MPZERO_CUDA_CHECK(cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice, stream));
  }
};

// Its requests are complete when returned, which holds for work queued later on the
// same stream: so the backend that consumes the results must run on `stream` (pass the
// backend's stream). wait_for checks that, since ZeroOptimizer calls it with the
// backend's stream before every collective.
class cuda_local_communicator : public basic_local_communicator<device_copy> {
 public:
  cuda_local_communicator() = default;  // the legacy default stream
  explicit cuda_local_communicator(cudaStream_t stream) : basic_local_communicator(device_copy{stream}) {}

  cudaStream_t stream() const noexcept { return copier().stream; }

  // Work queued on `producer` is ordered before the copies because they share the stream;
  // another stream is refused (the consumer would not wait for the copies).
  // (Checked at the first collective: the communicator cannot see the backend before.)
  void wait_for(cudaStream_t producer) const {
    if (producer != stream()) {
      throw invalid_argument("cuda_local_communicator: asked to follow stream " + name(producer) +
                             ", but its copies run on " + name(stream()) +
                             ", which the backend would not wait for. Construct it with the backend's stream: "
                             "cuda_local_communicator(backend.stream)");
    }
  }

 private:
  static std::string name(cudaStream_t s) {
    if (s == nullptr) return "0 (the legacy default stream)";
    std::ostringstream o;
    o << static_cast<const void*>(s);
    return o.str();
  }
};

static_assert(communicator<cuda_local_communicator>);

}  // namespace mpzero::comm

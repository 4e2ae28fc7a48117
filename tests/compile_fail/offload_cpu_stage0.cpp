// CPU offload keeps each rank's partition on the host, so stage 0 (nothing
// partitioned) cannot offload. The typed form refuses it at compile time.
#include <mpzero/optim/adam.hpp>
#include <mpzero/policy/memory_model.hpp>

double device_bytes(int world) {
  return mpzero::bytes_per_param<mpzero::policies::bf16_fp32_master, mpzero::optim::adam, mpzero::stage<0>,
                                 mpzero::offload_cpu>(world)
      .device_bytes;
}

# Planner, optimizers and the fused step, host side.
mpzero_add_test(test_plan SOURCES test_plan.cpp test_simd.cpp TAGS multi_tensor)
mpzero_add_test(test_optim SOURCES test_optim_a.cpp test_optim_b.cpp test_fused_step.cpp test_kernel_threads.cpp
                TAGS optim multi_tensor)
# The same SIMD checks compiled by nvcc (its host pass runs CPU offload's host step on
# the CUDA backend). Runs on the CPU.
if(MPZERO_HAS_CUDA)
  mpzero_add_test(test_simd_nvcc SOURCES test_simd_nvcc.cu TAGS multi_tensor)
  mpzero_cuda_target(test_simd_nvcc)
endif()

# [gpu] tests: the CUDA backend checked against the host backend and CUDA's own
# intrinsics. They build wherever nvcc is found and run only under `ctest -L gpu`.
if(MPZERO_HAS_CUDA)
  mpzero_add_test(test_gpu SOURCES test_gpu.cu TAGS gpu)
  mpzero_cuda_target(test_gpu)
endif()

# [gpu] tests: the CUDA backend checked against the host backend and CUDA's own
# intrinsics. They build wherever nvcc is found and run only under `ctest -L gpu`.
if(MPZERO_HAS_CUDA)
  mpzero_add_test(test_gpu SOURCES test_gpu.cu TAGS gpu)
  target_link_libraries(test_gpu PRIVATE CUDA::cudart)
  # CUDA::cudart is the shared runtime: keep CMake from linking the static one as well.
  set_target_properties(test_gpu PROPERTIES CUDA_RUNTIME_LIBRARY Shared)
  if(DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set_target_properties(test_gpu PROPERTIES CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON CUDA_EXTENSIONS OFF)
  else()
    # CMake before 3.26 knows no C++20 flag for nvcc (it refuses CUDA_STANDARD 20).
    target_compile_options(test_gpu PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
  endif()
  # mpzero_add_test warns for CXX only; warn on the host side of the .cu as well.
  # The mpzero target turns off FMA contraction for CXX only, but the host backend
  # compiled inside this .cu must round like the device code it is compared with.
  target_compile_options(test_gpu PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-ffp-contract=off>)
endif()

# mpzero_cuda_target(<target>): settings every CUDA executable of mpzero's own
# (tests, benchmarks, examples) needs.
function(mpzero_cuda_target target)
  target_link_libraries(${target} PRIVATE CUDA::cudart)
  # CUDA::cudart is the shared runtime: keep CMake from linking the static one as well.
  set_target_properties(${target} PROPERTIES CUDA_RUNTIME_LIBRARY Shared)
  if(DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set_target_properties(${target} PROPERTIES CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON CUDA_EXTENSIONS OFF)
  else()
    # CMake before 3.26 knows no C++20 flag for nvcc (it refuses CUDA_STANDARD 20).
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
  endif()
  # Warnings on the host side of .cu files too.
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
endfunction()

# NCCL: under the CUDA toolkit or NCCL_HOME. Sets MPZERO_NCCL_FOUND and the target mpzero_nccl.
if(NOT TARGET mpzero_nccl)
  find_path(MPZERO_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ENV NCCL_HOME PATH_SUFFIXES include)
  # libnccl.so.2 too: pip's nvidia-nccl wheels ship no unversioned libnccl.so.
  find_library(MPZERO_NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR HINTS ${CUDAToolkit_LIBRARY_DIR} ENV NCCL_HOME
               PATH_SUFFIXES lib lib64)
  if(MPZERO_NCCL_INCLUDE_DIR AND MPZERO_NCCL_LIBRARY)
    add_library(mpzero_nccl INTERFACE)
    target_include_directories(mpzero_nccl SYSTEM INTERFACE ${MPZERO_NCCL_INCLUDE_DIR})
    target_link_libraries(mpzero_nccl INTERFACE ${MPZERO_NCCL_LIBRARY})
    set(MPZERO_NCCL_FOUND ON)
  else()
    set(MPZERO_NCCL_FOUND OFF)
    message(STATUS "mpzero: NCCL not found (nccl.h, libnccl); NCCL tests and examples are not built")
  endif()
endif()

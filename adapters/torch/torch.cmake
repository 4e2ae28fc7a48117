# mpzero::torch: the LibTorch engine (autograd hooks, run-time policy dispatch, c10d).
# Included (OPTIONAL) by adapters/torch/CMakeLists.txt after mpzero::torch_config.
#
# Finding LibTorch. Two ways:
#  - MPZERO_TORCH_FIND_PACKAGE=ON: find_package(Torch) as LibTorch documents. A CUDA
#    build of LibTorch (e.g. PyPI's default wheel) then insists on finding the CUDA
#    toolkit at configure time, and links libtorch_cuda.
#  - OFF (the default): the headers and libraries are imported directly from the
#    LibTorch prefix, which works with CPU and CUDA builds alike: libtorch_cpu and
#    libc10, plus libtorch_cuda and libc10_cuda when the prefix has them and CUDA is
#    built (MPZERO_HAS_CUDA). LibTorch's CMake package is not needed.
# The prefix is Torch_DIR/../../.. when Torch_DIR is set, else the installed Python
# package's (python3 -c "import torch"), else not found: then nothing is defined.
#
# MPZERO_TORCH_CUDA (default: on when CUDA is built and LibTorch has CUDA): the engine's
# CUDA cores (src/cuda_cores.cu: the CUDA backend and step kernels) for CUDA parameters.
# The engine itself needs no CUDA headers: it reaches torch's streams through c10.
set(_mpzero_torch_fp_default OFF)
option(MPZERO_TORCH_FIND_PACKAGE "Find LibTorch with find_package(Torch) (needs CUDA for CUDA builds of LibTorch)"
       ${_mpzero_torch_fp_default})

set(_mpzero_torch_prefix "")
set(_mpzero_torch_dir "")
find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_Interpreter_FOUND)
  execute_process(COMMAND "${Python3_EXECUTABLE}" -c
                          "import os, sys, torch; print(os.path.dirname(torch.__file__)); print(sys.executable)"
                  OUTPUT_VARIABLE _mpzero_torch_py RESULT_VARIABLE _mpzero_torch_rc
                  OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(_mpzero_torch_rc EQUAL 0)
    string(REPLACE "\n" ";" _mpzero_torch_py "${_mpzero_torch_py}")
    list(GET _mpzero_torch_py 0 _mpzero_torch_dir)
    list(GET _mpzero_torch_py 1 _mpzero_torch_exe)
  endif()
endif()
if(Torch_DIR AND EXISTS "${Torch_DIR}")
  get_filename_component(_mpzero_torch_prefix "${Torch_DIR}/../../.." ABSOLUTE)
elseif(_mpzero_torch_dir AND EXISTS "${_mpzero_torch_dir}/share/cmake/Torch")
  set(_mpzero_torch_prefix "${_mpzero_torch_dir}")
  set(Torch_DIR "${_mpzero_torch_dir}/share/cmake/Torch" CACHE PATH "LibTorch's CMake package directory")
endif()
# The interpreter whose torch LibTorch comes from, by absolute path (under mpirun,
# `python3` may resolve to another one): tests that read checkpoints from Python use it.
unset(MPZERO_TORCH_PYTHON CACHE)
if(_mpzero_torch_dir AND _mpzero_torch_prefix)
  get_filename_component(_mpzero_torch_dir "${_mpzero_torch_dir}" REALPATH)
  get_filename_component(_mpzero_torch_real "${_mpzero_torch_prefix}" REALPATH)
  if(_mpzero_torch_dir STREQUAL _mpzero_torch_real)
    set(MPZERO_TORCH_PYTHON "${_mpzero_torch_exe}" CACHE INTERNAL "python3 with the torch LibTorch comes from")
  endif()
endif()

set(_mpzero_torch_libs "")
set(_mpzero_torch_has_cuda OFF)
if(MPZERO_TORCH_FIND_PACKAGE)
  # GLOBAL: the imported targets must be visible to tests/ and examples/ too.
  find_package(Torch QUIET GLOBAL)
  if(Torch_FOUND)
    set(_mpzero_torch_libs torch)
    if(MPZERO_HAS_CUDA AND TARGET torch_cuda)
      set(_mpzero_torch_has_cuda ON)
    endif()
  endif()
elseif(_mpzero_torch_prefix)
  find_library(MPZERO_LIBTORCH_CPU torch_cpu PATHS "${_mpzero_torch_prefix}/lib" NO_DEFAULT_PATH)
  find_library(MPZERO_LIBC10 c10 PATHS "${_mpzero_torch_prefix}/lib" NO_DEFAULT_PATH)
  find_library(MPZERO_LIBTORCH_CUDA torch_cuda PATHS "${_mpzero_torch_prefix}/lib" NO_DEFAULT_PATH)
  find_library(MPZERO_LIBC10_CUDA c10_cuda PATHS "${_mpzero_torch_prefix}/lib" NO_DEFAULT_PATH)
  if(MPZERO_LIBTORCH_CPU AND MPZERO_LIBC10 AND EXISTS "${_mpzero_torch_prefix}/include/torch/csrc/api/include")
    # GLOBAL: bench/ links it too (mpzero_bench_torch).
    add_library(mpzero_libtorch_cpu INTERFACE IMPORTED GLOBAL)
    # SYSTEM (the default for imported targets): LibTorch's headers do not pass -Wextra.
    # Linked by name with an explicit rpath rather than by full path: LibTorch's lib/
    # ships its own libgomp.so.1, which would make CMake warn that the rpath it computes
    # for full paths may hide the compiler's libgomp (one OpenMP runtime is loaded either way).
    get_filename_component(_mpzero_torch_libdir "${MPZERO_LIBTORCH_CPU}" DIRECTORY)
    # libtorch_cuda registers CUDA with LibTorch when it is loaded (static initialisers),
    # hence --no-as-needed: nothing references it by symbol.
    set(_mpzero_torch_link "-ltorch_cpu;-lc10")
    if(MPZERO_HAS_CUDA AND MPZERO_LIBTORCH_CUDA AND MPZERO_LIBC10_CUDA)
      set(_mpzero_torch_link "${_mpzero_torch_link};-ltorch_cuda;-lc10_cuda")
      set(_mpzero_torch_has_cuda ON)
    endif()
    set_target_properties(mpzero_libtorch_cpu PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${_mpzero_torch_prefix}/include;${_mpzero_torch_prefix}/include/torch/csrc/api/include"
      INTERFACE_COMPILE_DEFINITIONS "USE_DISTRIBUTED"
      INTERFACE_LINK_OPTIONS "-L${_mpzero_torch_libdir};-Wl,-rpath,${_mpzero_torch_libdir}"
      INTERFACE_LINK_LIBRARIES "-Wl,--no-as-needed;${_mpzero_torch_link};-Wl,--as-needed")
    set(_mpzero_torch_libs mpzero_libtorch_cpu)
  endif()
endif()

if(NOT _mpzero_torch_libs)
  message(STATUS "mpzero: LibTorch not found (set Torch_DIR, or install torch for python3); "
                 "the LibTorch engine (mpzero::torch) is not built")
  return()
endif()
option(MPZERO_TORCH_CUDA "Build the LibTorch engine's CUDA cores (needs CUDA and a CUDA build of LibTorch)"
       ${_mpzero_torch_has_cuda})
if(MPZERO_TORCH_CUDA AND NOT _mpzero_torch_has_cuda)
  message(FATAL_ERROR "mpzero: MPZERO_TORCH_CUDA=ON needs nvcc (MPZERO_ENABLE_CUDA) and a CUDA build of LibTorch "
                      "(libtorch_cuda, libc10_cuda under ${_mpzero_torch_prefix}/lib); set MPZERO_TORCH_CUDA=OFF "
                      "for CPU tensors only")
endif()
message(STATUS "mpzero: LibTorch engine against ${_mpzero_torch_prefix} "
               "(find_package: ${MPZERO_TORCH_FIND_PACKAGE}, CUDA cores: ${MPZERO_TORCH_CUDA})")

# The engine's units. zero_core.cpp compiles the run-time ZeRO core once; host_kernels.cpp
# the host step kernels of every named policy and optimizer (src/kernel_table.hpp);
# cuda_cores.cu, with MPZERO_TORCH_CUDA, their CUDA kernels and the CUDA backend (nvcc
# sees no torch header). engine.cpp, zero_to_fp32.cpp and process_group.cpp include torch.
set(_mpzero_torch_units
  ${CMAKE_CURRENT_SOURCE_DIR}/src/zero_core.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/src/host_kernels.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/src/engine.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/src/param_use.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/src/zero_to_fp32.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/src/process_group.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/src/launch.cpp)
if(MPZERO_TORCH_CUDA)
  list(APPEND _mpzero_torch_units ${CMAKE_CURRENT_SOURCE_DIR}/src/cuda_cores.cu)
endif()
add_library(mpzero_torch STATIC ${_mpzero_torch_units})
add_library(mpzero::torch ALIAS mpzero_torch)
target_link_libraries(mpzero_torch PUBLIC mpzero::torch_config ${_mpzero_torch_libs})
target_compile_features(mpzero_torch PUBLIC cxx_std_20)
target_compile_options(mpzero_torch PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>)
set_target_properties(mpzero_torch PROPERTIES POSITION_INDEPENDENT_CODE ON)
# initialize without a communicator joins the world mpirun launched through MPI
# (src/launch.cpp); without MPI it refuses a launched world of several processes.
find_package(MPI COMPONENTS CXX QUIET)
option(MPZERO_TORCH_MPI "initialize joins an mpirun-launched world through MPI" ${MPI_CXX_FOUND})
if(MPZERO_TORCH_MPI)
  if(NOT MPI_CXX_FOUND)
    message(FATAL_ERROR "mpzero: MPZERO_TORCH_MPI=ON needs MPI (Debian: libopenmpi-dev); set "
                        "MPZERO_TORCH_MPI=OFF (initialize then needs a communicator for several processes)")
  endif()
  target_link_libraries(mpzero_torch PRIVATE MPI::MPI_CXX)
  set_source_files_properties(${CMAKE_CURRENT_SOURCE_DIR}/src/launch.cpp PROPERTIES COMPILE_DEFINITIONS
                              MPZERO_TORCH_MPI)
endif()
if(MPZERO_TORCH_CUDA)
  # nvcc sees cuda_cores.cu alone (torch-free).
  target_compile_definitions(mpzero_torch PUBLIC MPZERO_TORCH_CUDA)
  mpzero_cuda_target(mpzero_torch)
  # LibTorch's include directories are not for nvcc (it never includes them).
endif()

# mpzero_zero_to_fp32: an engine checkpoint as one fp32 state dict file (zero_to_fp32.hpp).
add_executable(mpzero_zero_to_fp32 ${CMAKE_CURRENT_SOURCE_DIR}/tools/zero_to_fp32.cpp)
target_link_libraries(mpzero_zero_to_fp32 PRIVATE mpzero::torch)
target_compile_options(mpzero_zero_to_fp32 PRIVATE -Wall -Wextra)
# Installed, it still finds LibTorch's shared libraries where the build linked them.
set_target_properties(mpzero_zero_to_fp32 PROPERTIES INSTALL_RPATH_USE_LINK_PATH TRUE)

# ---- install: the adapter as the `torch` component of the mpzero package -------------
# find_package(mpzero 0.1 REQUIRED COMPONENTS torch) gives mpzero::torch. The libraries are
# static and compiled against this LibTorch, so the installed package links the same one:
# mpzeroLibTorch.cmake (written here) re-creates the LibTorch target with its paths, or,
# when LibTorch came from find_package(Torch), finds Torch again.
if(MPZERO_INSTALL)
  set_target_properties(mpzero_torch PROPERTIES EXPORT_NAME torch)
  set_target_properties(mpzero_torch_config PROPERTIES EXPORT_NAME torch_config)
  install(TARGETS mpzero_torch_config mpzero_torch EXPORT mpzeroTorchTargets
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
  install(TARGETS mpzero_zero_to_fp32 RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  install(DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/include/mpzero/torch DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/mpzero)
  install(EXPORT mpzeroTorchTargets NAMESPACE mpzero:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/mpzero)
  set(_lt "# Written by mpzero's build (adapters/torch/torch.cmake): the LibTorch mpzero::torch was compiled against.\n")
  if(_mpzero_torch_libs STREQUAL "torch")
    string(APPEND _lt "find_dependency(Torch)\n")
  else()
    string(APPEND _lt "if(NOT TARGET mpzero_libtorch_cpu)\n  add_library(mpzero_libtorch_cpu INTERFACE IMPORTED)\n"
                      "  set_target_properties(mpzero_libtorch_cpu PROPERTIES\n")
    foreach(_prop INTERFACE_INCLUDE_DIRECTORIES INTERFACE_COMPILE_DEFINITIONS INTERFACE_LINK_OPTIONS
                  INTERFACE_LINK_LIBRARIES)
      get_target_property(_v mpzero_libtorch_cpu ${_prop})
      string(APPEND _lt "    ${_prop} \"${_v}\"\n")
    endforeach()
    string(APPEND _lt "  )\nendif()\n")
  endif()
  if(MPZERO_TORCH_CUDA)
    string(APPEND _lt "find_dependency(CUDAToolkit)  # CUDA::cudart, the CUDA cores' runtime\n")
  endif()
  if(MPZERO_TORCH_MPI)
    string(APPEND _lt "find_dependency(MPI COMPONENTS CXX)  # initialize joins mpirun's world through MPI\n")
  endif()
  file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/mpzeroLibTorch.cmake "${_lt}")
  install(FILES ${CMAKE_CURRENT_BINARY_DIR}/mpzeroLibTorch.cmake DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/mpzero)
endif()

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
# CUDA cores (src/cuda_row.cuh: cuda_backend instantiations, the same combinations as
# the host table) for CUDA parameters.
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

# The ZeroOptimizer instantiations (no torch headers): one generated unit per part of
# each table (src/table_part.in; the combinations are add_table_part in src/core_impl.hpp),
# so a parallel build compiles them side by side; zero_core.cpp concatenates the parts.
# engine.cpp, zero_to_fp32.cpp and process_group.cpp are the translation units that include torch.
set(_mpzero_torch_table_parts 4)  # core_impl.hpp static_asserts the same number
# MPZERO_TORCH_POLICIES: the precision policies the tables compile. Each one costs a fused
# step per optimizer, stage and offload choice (and a CUDA kernel with MPZERO_TORCH_CUDA),
# so a project that trains with one or two can leave the others out of its build; the
# engine then refuses a config that needs a left-out policy, naming it and this variable.
# The names, in the order of core_impl.hpp's table_policies (bit i of the mask):
set(_mpzero_torch_policy_names fp32 bf16_fp32_grads bf16_fp32_master bf16_master_fp32_states bf16_all bf16_all_sr
    fp16_fp32_master fp16_master_fp32_states)
set(MPZERO_TORCH_POLICIES "all" CACHE STRING
    "Precision policies the LibTorch engine compiles: all, or a list (';' or ',') of: fp32 bf16_fp32_grads bf16_fp32_master bf16_master_fp32_states bf16_all bf16_all_sr fp16_fp32_master fp16_master_fp32_states")
# Names separated by ';', ',' or spaces, in any case; empty items (a trailing comma) ignored.
string(TOLOWER "${MPZERO_TORCH_POLICIES}" _mpzero_torch_selected)
string(REGEX REPLACE "[,; \t\n]+" ";" _mpzero_torch_selected "${_mpzero_torch_selected}")
list(REMOVE_ITEM _mpzero_torch_selected "")
if(_mpzero_torch_selected STREQUAL "all")
  set(_mpzero_torch_selected ${_mpzero_torch_policy_names})
endif()
list(REMOVE_DUPLICATES _mpzero_torch_selected)
set(_mpzero_torch_policy_mask 0)
foreach(_p IN LISTS _mpzero_torch_selected)
  list(FIND _mpzero_torch_policy_names "${_p}" _i)
  if(_i LESS 0)
    string(JOIN ", " _names ${_mpzero_torch_policy_names})
    message(FATAL_ERROR "mpzero: MPZERO_TORCH_POLICIES=\"${MPZERO_TORCH_POLICIES}\" names '${_p}', which is not a "
                        "policy of the engine's tables; use all (the default) or a list of: ${_names} "
                        "(docs/precision.md describes each)")
  endif()
  math(EXPR _mpzero_torch_policy_mask "${_mpzero_torch_policy_mask} | (1 << ${_i})")
endforeach()
if(_mpzero_torch_policy_mask EQUAL 0)
  message(FATAL_ERROR "mpzero: MPZERO_TORCH_POLICIES=\"${MPZERO_TORCH_POLICIES}\" selects no policy; use all (the "
                      "default) or name at least one, e.g. fp32;bf16_fp32_master")
endif()
list(LENGTH _mpzero_torch_policy_names _n)
math(EXPR _mpzero_torch_all_mask "(1 << ${_n}) - 1")
if(NOT _mpzero_torch_policy_mask EQUAL _mpzero_torch_all_mask)
  message(STATUS "mpzero: the LibTorch engine compiles only the policies ${_mpzero_torch_selected} "
                 "(MPZERO_TORCH_POLICIES)")
endif()
math(EXPR _mpzero_torch_last_part "${_mpzero_torch_table_parts} - 1")
set(_mpzero_torch_table_units "")
set(_mpzero_torch_tables host)
if(MPZERO_TORCH_CUDA)
  list(APPEND _mpzero_torch_tables cuda)
endif()
foreach(MPZERO_TABLE IN LISTS _mpzero_torch_tables)
  if(MPZERO_TABLE STREQUAL "cuda")
    set(MPZERO_ROW_HEADER "${CMAKE_CURRENT_SOURCE_DIR}/src/cuda_row.cuh")
    set(_ext cu)
  else()
    set(MPZERO_ROW_HEADER "${CMAKE_CURRENT_SOURCE_DIR}/src/host_row.hpp")
    set(_ext cpp)
  endif()
  foreach(MPZERO_PART RANGE 0 ${_mpzero_torch_last_part})
    set(_unit "${CMAKE_CURRENT_BINARY_DIR}/table/${MPZERO_TABLE}_part${MPZERO_PART}.${_ext}")
    configure_file(${CMAKE_CURRENT_SOURCE_DIR}/src/table_part.in "${_unit}" @ONLY)
    list(APPEND _mpzero_torch_table_units "${_unit}")
  endforeach()
endforeach()
# MPZERO_TORCH_TABLES_O1: the table units at -O1 in optimized builds. They instantiate
# ZeroOptimizer once per row: bookkeeping, whose optimization bought nothing measurable,
# and most of the adapter's build time (docs/perf.md, "Session 23 ... the engine's build"). The loops
# that run per element (the fused host step, gradient statistics, conversions) are
# compiled once at the build's own level in src/host_kernels.cpp, which the host units
# (and nvcc's host pass, where it compiles the same variant) declare extern
# (src/host_kernels.hpp); the CUDA kernels' device code keeps nvcc's full optimization
# (nvcc's -O is for host code).
option(MPZERO_TORCH_TABLES_O1 "Compile the LibTorch engine's table units at -O1 (the per-element loops stay optimized)"
       ON)
if(MPZERO_TORCH_TABLES_O1)
  foreach(_unit IN LISTS _mpzero_torch_table_units)
    if(_unit MATCHES "/host_part[0-9]+\\.cpp$")
      set_source_files_properties("${_unit}" PROPERTIES COMPILE_OPTIONS "$<$<NOT:$<CONFIG:Debug>>:-O1>")
    endif()
  endforeach()
  # The adapter's only CUDA sources are the table units; nvcc warns at a second -O, so the
  # build type's own is replaced (these variables are this directory's).
  foreach(_config RELEASE RELWITHDEBINFO)
    string(REGEX REPLACE "(^| )-O[0-9]( |$)" "\\1-O1\\2" CMAKE_CUDA_FLAGS_${_config} "${CMAKE_CUDA_FLAGS_${_config}}")
  endforeach()
endif()
add_library(mpzero_torch STATIC
  ${CMAKE_CURRENT_SOURCE_DIR}/src/zero_core.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/src/host_kernels.cpp
  ${_mpzero_torch_table_units}
  ${CMAKE_CURRENT_SOURCE_DIR}/src/engine.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/src/zero_to_fp32.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/src/process_group.cpp)
add_library(mpzero::torch ALIAS mpzero_torch)
target_link_libraries(mpzero_torch PUBLIC mpzero::torch_config ${_mpzero_torch_libs})
target_compile_features(mpzero_torch PUBLIC cxx_std_20)
target_compile_options(mpzero_torch PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>)
target_compile_definitions(mpzero_torch PRIVATE MPZERO_TORCH_TABLE_PARTS=${_mpzero_torch_table_parts}
                                                 MPZERO_TORCH_POLICY_MASK=${_mpzero_torch_policy_mask})
set_target_properties(mpzero_torch PROPERTIES POSITION_INDEPENDENT_CODE ON)
if(MPZERO_TORCH_CUDA)
  # nvcc sees only the CUDA table's generated units (torch-free: cuda_backend rows).
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
  file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/mpzeroLibTorch.cmake "${_lt}")
  install(FILES ${CMAKE_CURRENT_BINARY_DIR}/mpzeroLibTorch.cmake DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/mpzero)
endif()

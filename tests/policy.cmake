# Policy, build-system and packaging tests. Included by tests/CMakeLists.txt.
#
#   ctest -L policy    precision<> traits and the memory model (test_policy), the
#                      compile-fail cases and their positive control, and the
#                      header self-containment check
#   ctest -L install   consumer projects: find_package after install, add_subdirectory

# ---- [policy] unit tests -----------------------------------------------------------
mpzero_add_test(test_policy SOURCES test_policy.cpp TAGS policy)

# ---- compile-fail tests ----------------------------------------------------------------
# Each case compiles one file of compile_fail/ with the project's include path and
# passes when the compiler prints the expected part of the message (the exit status
# is not enough: any error would give it). The patterns start at the message itself:
# GCC prefixes it with "static assertion failed: ", Clang with its own words. valid_policies.cpp is the positive control:
# the same command must succeed, so a broken include path or flag cannot pass.
if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  set(_mpzero_syntax_only ${CMAKE_CXX_COMPILER} -std=c++20 -fsyntax-only -I${PROJECT_SOURCE_DIR}/include)

  function(mpzero_compile_fail name regex)
    add_test(NAME policy.compile_fail.${name}
             COMMAND ${_mpzero_syntax_only} ${CMAKE_CURRENT_SOURCE_DIR}/compile_fail/${name}.cpp)
    # LC_ALL=C: plain ASCII quotes in the diagnostics.
    set_tests_properties(policy.compile_fail.${name} PROPERTIES LABELS policy PASS_REGULAR_EXPRESSION "${regex}"
                                                                ENVIRONMENT LC_ALL=C)
  endfunction()

  mpzero_compile_fail(fp16_states "mpzero: fp16 optimizer states are refused")
  mpzero_compile_fail(master_narrower_fp32_param
                      "mpzero: master weights must represent every parameter value")
  mpzero_compile_fail(master_narrower_bf16_param
                      "mpzero: master weights must represent every parameter value")
  mpzero_compile_fail(mix_bf16_fp16 "mpzero: a policy may not mix bf16 and fp16")
  mpzero_compile_fail(stochastic_fp32_master_states
                      "mpzero: stochastic rounding applies to low-precision master weights")
  mpzero_compile_fail(stage4 "mpzero: the ZeRO stage must be 0, 1, 2 or 3")
  mpzero_compile_fail(offload_cpu_stage0
                      "mpzero: CPU offload keeps each rank's partition on the host")
  mpzero_compile_fail(wire_mixes_bf16_fp16 "mpzero: the gradient wire type mixes bf16 and fp16")
  mpzero_compile_fail(unsupported_storage_double
                      "mpzero: precision<Param, Master, Grad, State> stores model states as")

  # The plans' views (spans into the plan) on a temporary plan: deleted, as they would
  # dangle. The same file without the define takes them from variables and compiles.
  add_test(NAME policy.compile_fail.plan_views
           COMMAND ${_mpzero_syntax_only} -DMPZERO_VIEW_OF_TEMPORARY ${CMAKE_CURRENT_SOURCE_DIR}/compile_fail/plan_views.cpp)
  set_tests_properties(policy.compile_fail.plan_views PROPERTIES LABELS policy ENVIRONMENT LC_ALL=C
                       PASS_REGULAR_EXPRESSION "deleted (member )?function.*buckets")
  add_test(NAME policy.compile_ok.plan_views
           COMMAND ${_mpzero_syntax_only} ${CMAKE_CURRENT_SOURCE_DIR}/compile_fail/plan_views.cpp)
  set_tests_properties(policy.compile_ok.plan_views PROPERTIES LABELS policy)

  # The named policies and their lookup stay constant expressions under UBSan.
  add_test(NAME policy.compile_ok.ubsan_policy_list
           COMMAND ${_mpzero_syntax_only} -fsanitize=undefined ${CMAKE_CURRENT_SOURCE_DIR}/compile_fail/ubsan_policy_list.cpp)
  set_tests_properties(policy.compile_ok.ubsan_policy_list PROPERTIES LABELS policy)

  add_test(NAME policy.compile_ok.valid_policies
           COMMAND ${_mpzero_syntax_only} ${CMAKE_CURRENT_SOURCE_DIR}/compile_fail/valid_policies.cpp)
  set_tests_properties(policy.compile_ok.valid_policies PROPERTIES LABELS policy)
else()
  message(STATUS "mpzero: compile-fail tests need GCC or Clang (-fsyntax-only); skipped for ${CMAKE_CXX_COMPILER_ID}")
endif()

# ---- every public header compiles on its own ----------------------------------------
# One generated .cpp per include/mpzero/**/*.hpp that includes only that header (twice,
# so a missing #pragma once shows too), compiled with plain C++ (no CUDA) into one
# OBJECT library. It is left out of the default build, so day-to-day `make` does not
# pay for ~30 extra translation units, and built by a CTest test instead, so CI's
# `ctest` reports a header that is not self-contained by name. CONFIGURE_DEPENDS: a
# new header is picked up on the next build without re-running cmake by hand.
file(GLOB_RECURSE _mpzero_headers CONFIGURE_DEPENDS RELATIVE ${PROJECT_SOURCE_DIR}/include
     ${PROJECT_SOURCE_DIR}/include/mpzero/*.hpp)
set(_mpzero_header_sources)
set(_mpzero_header_check_mpi OFF)
foreach(_h IN LISTS _mpzero_headers)
  # A header built on MPI (comm/mpi.hpp) needs mpi.h on the include path; without MPI
  # it is left out rather than failing the check.
  file(STRINGS ${PROJECT_SOURCE_DIR}/include/${_h} _needs_mpi REGEX "^#[ \t]*include[ \t]*<mpi\\.h>")
  if(_needs_mpi)
    if(NOT MPI_CXX_FOUND)
      message(STATUS "mpzero: header check skips ${_h} (needs MPI, not found)")
      continue()
    endif()
    set(_mpzero_header_check_mpi ON)
  endif()
  string(MAKE_C_IDENTIFIER "${_h}" _id)
  set(_src ${CMAKE_CURRENT_BINARY_DIR}/header_check/${_id}.cpp)
  # file(CONFIGURE) rewrites only on change, so unchanged headers are not recompiled.
  file(CONFIGURE OUTPUT ${_src} CONTENT "// Generated by tests/policy.cmake: ${_h} must compile on its own.\n#include <${_h}>\n#include <${_h}>\n")
  list(APPEND _mpzero_header_sources ${_src})
endforeach()
add_library(mpzero_header_check OBJECT EXCLUDE_FROM_ALL ${_mpzero_header_sources})
target_link_libraries(mpzero_header_check PRIVATE mpzero::mpzero)
if(_mpzero_header_check_mpi)
  # Only puts mpi.h on the path: a header that uses MPI without including it still fails.
  target_link_libraries(mpzero_header_check PRIVATE MPI::MPI_CXX)
endif()
target_compile_options(mpzero_header_check PRIVATE -Wall -Wextra)
add_test(NAME policy.header_check
         COMMAND ${CMAKE_COMMAND} --build ${CMAKE_BINARY_DIR} --target mpzero_header_check --config $<CONFIG>)
set_tests_properties(policy.header_check PROPERTIES LABELS "policy;build")

# ---- consumer projects ------------------------------------------------------------------
# Run by tests/consumer/run_consumer.cmake in a scratch directory under this build tree.
# torch_find_package, torch_add_subdirectory: a LibTorch program using the engine from
# its own project (when this build has the adapter): built and run against the installed
# `torch` component (this build's libraries), or, through add_subdirectory, configured,
# compiled with the usage requirements it gets and its link line checked (the adapter's
# sources are this build's, with the same flags).
set(_modes find_package add_subdirectory)
if(TARGET mpzero_torch)
  list(APPEND _modes torch_find_package torch_add_subdirectory)
endif()
foreach(_mode IN LISTS _modes)
  if(_mode MATCHES "find_package$" AND NOT MPZERO_INSTALL)
    continue()  # nothing to install
  endif()
  add_test(NAME install.consumer_${_mode}
           COMMAND ${CMAKE_COMMAND} -DMODE=${_mode} -DMPZERO_SOURCE_DIR=${PROJECT_SOURCE_DIR}
                   -DMPZERO_BINARY_DIR=${PROJECT_BINARY_DIR} -DWORK_DIR=${CMAKE_CURRENT_BINARY_DIR}/consumer_${_mode}
                   "-DGENERATOR=${CMAKE_GENERATOR}" -DCXX_COMPILER=${CMAKE_CXX_COMPILER}
                   -DMAKE_PROGRAM=${CMAKE_MAKE_PROGRAM} -DBUILD_TYPE=$<CONFIG> "-DTORCH_DIR=${Torch_DIR}"
                   -P ${CMAKE_CURRENT_SOURCE_DIR}/consumer/run_consumer.cmake)
  set_tests_properties(install.consumer_${_mode} PROPERTIES LABELS install TIMEOUT 1200)
endforeach()

# The GPU machine has no MPI: a configure without it must still generate (the
# multi-rank tests are left out, the [gpu] tests stay).
add_test(NAME build.configure_without_mpi
         COMMAND ${CMAKE_COMMAND} -S ${PROJECT_SOURCE_DIR} -B ${CMAKE_CURRENT_BINARY_DIR}/configure_without_mpi
                 "-G${CMAKE_GENERATOR}" -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON -DMPZERO_ENABLE_CUDA=${MPZERO_ENABLE_CUDA}
                 "-DTorch_DIR=${Torch_DIR}")
set_tests_properties(build.configure_without_mpi PROPERTIES LABELS "policy;build" TIMEOUT 300
                     FAIL_REGULAR_EXPRESSION "CMake Error;Generate step failed")


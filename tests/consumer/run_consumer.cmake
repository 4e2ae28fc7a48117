# Builds and runs a consumer project of mpzero in a fresh directory, then removes it.
#
#   cmake -DMODE=find_package|add_subdirectory|torch_find_package|torch_add_subdirectory -DMPZERO_SOURCE_DIR=<src>
#         [-DMPZERO_BINARY_DIR=<configured mpzero build, find_package mode>]
#         -DWORK_DIR=<scratch dir> -DGENERATOR=<gen> -DCXX_COMPILER=<c++>
#         [-DMAKE_PROGRAM=<make>] [-DBUILD_TYPE=Release] [-DTORCH_DIR=<LibTorch's cmake dir>] -P run_consumer.cmake
#
# find_package: installs mpzero from MPZERO_BINARY_DIR into WORK_DIR/prefix, checks the
# installed files, then configures consumer/find_package against that prefix only.
# add_subdirectory: configures consumer/add_subdirectory on the source tree.
# torch_find_package / torch_add_subdirectory: the same with the LibTorch adapter
# (find_package(mpzero COMPONENTS torch); consumer/torch_main.cpp).
# Each but torch_add_subdirectory then builds the consumer and runs it. WORK_DIR is
# removed before the run and after a successful one; after a failure it is kept for
# inspection and named.
cmake_minimum_required(VERSION 3.24)

foreach(_v MODE MPZERO_SOURCE_DIR WORK_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${_v} OR "${${_v}}" STREQUAL "")
    message(FATAL_ERROR "run_consumer.cmake: -D${_v}=... is required")
  endif()
endforeach()
if(NOT MODE MATCHES "^(find_package|add_subdirectory|torch_find_package|torch_add_subdirectory)$")
  message(FATAL_ERROR "run_consumer.cmake: MODE must be find_package, add_subdirectory, torch_find_package or "
                      "torch_add_subdirectory, got '${MODE}'")
endif()
if(NOT BUILD_TYPE)
  set(BUILD_TYPE Release)
endif()
# torch_add_subdirectory checks the wiring a LibTorch project gets from add_subdirectory
# (the option, the mpzero::torch target, C++20, include paths, LibTorch's libraries on the
# link line) without building the adapter a second time: the calling build compiles the
# same sources with the same flags, and torch_find_package links and runs a program
# against them. It compiles the consumer's source with the flags CMake generated for it
# (at -O0) and reads the consumer's link line instead of building and running it.

set(_consumer "${CMAKE_CURRENT_LIST_DIR}/${MODE}")
set(_build "${WORK_DIR}/build")
set(_prefix "${WORK_DIR}/prefix")
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

# Runs a command; on failure stops with its output. Leaves the output in _out.
function(step what)
  string(TIMESTAMP _t0 "%s")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE _rc OUTPUT_VARIABLE _o ERROR_VARIABLE _o)
  string(TIMESTAMP _t1 "%s")
  math(EXPR _dt "${_t1} - ${_t0}")
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "${MODE} consumer: ${what} failed (${_rc}):\n${_o}\nscratch kept in ${WORK_DIR}")
  endif()
  message(STATUS "${MODE} consumer: ${what}: ok (${_dt} s)")
  set(_out "${_o}" PARENT_SCOPE)
endfunction()

function(fail what)
  message(FATAL_ERROR "${MODE} consumer: ${what}\nscratch kept in ${WORK_DIR}")
endfunction()

set(_configure "${CMAKE_COMMAND}" -S "${_consumer}" -B "${_build}" -G "${GENERATOR}"
    "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}")
if(MAKE_PROGRAM)
  list(APPEND _configure "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
endif()

if(MODE MATCHES "find_package$")
  if(NOT IS_DIRECTORY "${MPZERO_BINARY_DIR}")
    fail("-DMPZERO_BINARY_DIR must name a configured mpzero build tree")
  endif()
  step("install" "${CMAKE_COMMAND}" --install "${MPZERO_BINARY_DIR}" --prefix "${_prefix}")
  if(NOT EXISTS "${_prefix}/include/mpzero/mpzero.hpp")
    fail("install did not put the headers in ${_prefix}/include/mpzero")
  endif()
  set(_files mpzeroConfig.cmake mpzeroConfigVersion.cmake mpzeroTargets.cmake)
  if(MODE STREQUAL "torch_find_package")
    list(APPEND _files mpzeroTorchTargets.cmake mpzeroLibTorch.cmake libmpzero_torch.a engine.hpp)
  endif()
  foreach(_f IN LISTS _files)
    file(GLOB_RECURSE _found "${_prefix}/*/${_f}")
    if(NOT _found)
      fail("install did not produce ${_f} under ${_prefix}")
    endif()
  endforeach()
  # Only the fresh prefix: no package registry, no other prefix.
  list(APPEND _configure "-DCMAKE_PREFIX_PATH=${_prefix}" "-DEXPECTED_PREFIX=${_prefix}"
       -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF)
else()
  list(APPEND _configure "-DMPZERO_SOURCE_DIR=${MPZERO_SOURCE_DIR}")
  if(MODE STREQUAL "torch_add_subdirectory" AND TORCH_DIR)
    list(APPEND _configure "-DTorch_DIR=${TORCH_DIR}")  # the LibTorch the calling build uses
  endif()
endif()

# torch_add_subdirectory: compiles the consumer's source with its generated command, and
# checks that its link line names the adapter's and LibTorch's libraries.
function(check_torch_wiring)
  file(READ "${_build}/compile_commands.json" _db)
  string(JSON _n LENGTH "${_db}")
  math(EXPR _last "${_n} - 1")
  set(_cmd "")
  foreach(_i RANGE ${_last})
    string(JSON _file GET "${_db}" ${_i} file)
    if(_file MATCHES "torch_main\\.cpp$")
      string(JSON _cmd GET "${_db}" ${_i} command)
      string(JSON _dir GET "${_db}" ${_i} directory)
    endif()
  endforeach()
  if(_cmd STREQUAL "")
    fail("compile_commands.json has no command for torch_main.cpp")
  endif()
  if(NOT _cmd MATCHES "-std=(gnu|c)\\+\\+(20|2a|23|2b)")
    fail("linking mpzero::torch did not carry C++20 to the consumer: ${_cmd}")
  endif()
  # At -O0: the usage requirements are what is checked, not the code (GCC takes longer for
  # -fsyntax-only than for -O0 on this unit).
  separate_arguments(_argv UNIX_COMMAND "${_cmd} -O0")
  list(FIND _argv "-o" _o_at)
  if(_o_at GREATER_EQUAL 0)
    math(EXPR _o_at "${_o_at} + 1")
    list(GET _argv ${_o_at} _obj)
    get_filename_component(_obj_dir "${_obj}" DIRECTORY BASE_DIR "${_dir}")
    file(MAKE_DIRECTORY "${_obj_dir}")
  endif()
  execute_process(COMMAND ${_argv} WORKING_DIRECTORY "${_dir}" RESULT_VARIABLE _rc OUTPUT_VARIABLE _o ERROR_VARIABLE _o)
  if(NOT _rc EQUAL 0)
    fail("compiling the consumer with its generated command failed (${_rc}):\n${_cmd}\n${_o}")
  endif()
  message(STATUS "${MODE} consumer: compiles (-O0) with mpzero::torch's usage requirements: ok")
  # The link line: Makefiles write it to link.txt, Ninja into build.ninja.
  set(_link "")
  if(EXISTS "${_build}/CMakeFiles/consumer.dir/link.txt")
    file(READ "${_build}/CMakeFiles/consumer.dir/link.txt" _link)
  elseif(EXISTS "${_build}/build.ninja")
    file(STRINGS "${_build}/build.ninja" _link REGEX "LINK_LIBRARIES = .*mpzero")
  endif()
  foreach(_lib mpzero_torch torch_cpu c10)
    if(NOT _link MATCHES "${_lib}")
      fail("the consumer's link line does not name ${_lib}:\n${_link}")
    endif()
  endforeach()
  message(STATUS "${MODE} consumer: link line names mpzero_torch, torch_cpu and c10: ok")
endfunction()

if(MODE STREQUAL "torch_add_subdirectory")
  list(APPEND _configure -DCMAKE_EXPORT_COMPILE_COMMANDS=ON)
endif()
step("configure" ${_configure})
if(MODE MATCHES "add_subdirectory$")
  # Nothing of mpzero's own test, benchmark or example trees was generated or built.
  foreach(_d tests bench examples)
    if(EXISTS "${_build}/mpzero/${_d}")
      fail("add_subdirectory generated mpzero's ${_d}/ (${_build}/mpzero/${_d})")
    endif()
  endforeach()
  file(STRINGS "${_build}/CMakeCache.txt" _cached REGEX "^MPZERO_BUILD_TESTS:")
  if(NOT _cached STREQUAL "MPZERO_BUILD_TESTS:BOOL=OFF")
    fail("expected MPZERO_BUILD_TESTS:BOOL=OFF in the consumer's cache, found '${_cached}'")
  endif()
endif()

if(MODE STREQUAL "torch_add_subdirectory")
  check_torch_wiring()
  file(REMOVE_RECURSE "${WORK_DIR}")
  return()
endif()
step("build" "${CMAKE_COMMAND}" --build "${_build}" --config "${BUILD_TYPE}" --parallel 2)

find_program(_exe consumer PATHS "${_build}" "${_build}/${BUILD_TYPE}" NO_DEFAULT_PATH NO_CACHE)
if(NOT _exe)
  fail("no consumer executable under ${_build}")
endif()
step("run" "${_exe}")
if(NOT _out MATCHES "mpzero consumer: ok")
  fail("the consumer did not report success:\n${_out}")
endif()
message(STATUS "${MODE} consumer: ${_out}")

file(REMOVE_RECURSE "${WORK_DIR}")

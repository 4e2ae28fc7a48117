# Packaging: mpzero as a user gets it from a package manager ([packaging]).
# packaging.conan_create: scripts/conan_check.sh runs `conan create` on a copy of this
#   checkout (conanfile.py, then test_package/: a consumer built with
#   find_package(mpzero)), in a Conan home inside this build tree; it installs PyPI's
#   conan first when none is on PATH.
# packaging.vcpkg_port: scripts/vcpkg_check.sh does what ports/mpzero/portfile.cmake
#   does with plain CMake (vcpkg itself is not run) and builds tests/consumer/find_package
#   against the result; it also checks that vcpkg.json's version is config.hpp's.
find_program(MPZERO_BASH bash)
if(MPZERO_BASH)
  add_test(NAME packaging.conan_create
           COMMAND ${CMAKE_COMMAND} -E env CONAN_HOME=${CMAKE_CURRENT_BINARY_DIR}/packaging/conan_home
                   ${MPZERO_BASH} ${PROJECT_SOURCE_DIR}/scripts/conan_check.sh ${CMAKE_CURRENT_BINARY_DIR}/packaging/conan)
  set_tests_properties(packaging.conan_create PROPERTIES LABELS packaging TIMEOUT 900
                       PASS_REGULAR_EXPRESSION "conan_check: ok")
  add_test(NAME packaging.vcpkg_port
           COMMAND ${MPZERO_BASH} ${PROJECT_SOURCE_DIR}/scripts/vcpkg_check.sh ${CMAKE_CURRENT_BINARY_DIR}/packaging/vcpkg)
  set_tests_properties(packaging.vcpkg_port PROPERTIES LABELS packaging TIMEOUT 600 PASS_REGULAR_EXPRESSION "vcpkg_check: ok")
else()
  message(STATUS "mpzero: bash not found; the packaging and docs checks are not registered")
endif()

# The documentation's checks live beside these (tests/docs.cmake; include_guard'ed, so
# listing `docs` among the areas of tests/CMakeLists.txt as well is harmless).
include(${CMAKE_CURRENT_LIST_DIR}/docs.cmake)

# Included by the find_package consumers after find_package(mpzero): the package must be
# the one the driver installed (EXPECTED_PREFIX), not one found elsewhere.
if(DEFINED EXPECTED_PREFIX)
  cmake_path(IS_PREFIX EXPECTED_PREFIX "${mpzero_DIR}" NORMALIZE _inside)
  if(NOT _inside)
    message(FATAL_ERROR "mpzero found at ${mpzero_DIR}, outside the test prefix ${EXPECTED_PREFIX}")
  endif()
endif()

# CHANGELOG.md has an entry for the version being built:
#   cmake -DCHANGELOG=<CHANGELOG.md> -DVERSION=<x.y.z> -P changelog_check.cmake
# (The version itself is written once, in include/mpzero/config.hpp.)
file(READ "${CHANGELOG}" _text)
string(REPLACE "." "\\." _v "${VERSION}")
if(NOT _text MATCHES "\n## \\[${_v}\\]")
  message(FATAL_ERROR "${CHANGELOG} has no '## [${VERSION}]' entry: add one for this version")
endif()
message(STATUS "CHANGELOG.md has an entry for ${VERSION}")

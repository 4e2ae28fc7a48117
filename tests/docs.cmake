include_guard(GLOBAL)
# Documentation checks ([docs]; the README's C++ example, docs.readme_snippet, is compiled
# and run by tests/CMakeLists.txt).
# docs.forbidden_words: no file speaks of the project's development history
#   (tests/forbidden_words.sh holds the patterns).
# docs.changelog: CHANGELOG.md has an entry for this version.
# docs.readme_torch_snippet: the README's LibTorch example, compiled and run as it
#   stands there, when this build has the LibTorch engine.
find_program(MPZERO_BASH bash)
if(MPZERO_BASH)
  add_test(NAME docs.forbidden_words COMMAND ${MPZERO_BASH} ${CMAKE_CURRENT_LIST_DIR}/forbidden_words.sh ${PROJECT_SOURCE_DIR})
  set_tests_properties(docs.forbidden_words PROPERTIES LABELS docs)
endif()

add_test(NAME docs.changelog
         COMMAND ${CMAKE_COMMAND} -DCHANGELOG=${PROJECT_SOURCE_DIR}/CHANGELOG.md -DVERSION=${PROJECT_VERSION}
                 -P ${CMAKE_CURRENT_LIST_DIR}/changelog_check.cmake)
set_tests_properties(docs.changelog PROPERTIES LABELS docs)

if(TARGET mpzero_torch)
  file(READ ${PROJECT_SOURCE_DIR}/README.md _mpzero_readme)
  string(REGEX MATCH "### With LibTorch[^`]*```cpp\n(.*)" _mpzero_m "${_mpzero_readme}")
  string(FIND "${CMAKE_MATCH_1}" "```" _mpzero_end)
  if(_mpzero_end LESS 0)
    message(FATAL_ERROR "README.md has no ```cpp block under '### With LibTorch'")
  endif()
  string(SUBSTRING "${CMAKE_MATCH_1}" 0 ${_mpzero_end} _mpzero_snippet)
  # Rewritten only when the snippet's text changed, so a re-configure does not rebuild it.
  file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/readme_torch_snippet.cpp.in "${_mpzero_snippet}")
  configure_file(${CMAKE_CURRENT_BINARY_DIR}/readme_torch_snippet.cpp.in
                 ${CMAKE_CURRENT_BINARY_DIR}/readme_torch_snippet.cpp COPYONLY)
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/README.md)
  add_executable(readme_torch_snippet ${CMAKE_CURRENT_BINARY_DIR}/readme_torch_snippet.cpp)
  target_link_libraries(readme_torch_snippet PRIVATE mpzero::torch)
  add_test(NAME docs.readme_torch_snippet COMMAND readme_torch_snippet)
  set_tests_properties(docs.readme_torch_snippet PROPERTIES LABELS "docs;torch" ENVIRONMENT OMP_NUM_THREADS=1)
endif()

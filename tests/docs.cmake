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
  mpzero_readme_snippet("### With LibTorch" readme_torch_snippet mpzero::torch "docs;torch")
endif()

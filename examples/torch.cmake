# Examples of the LibTorch engine (need mpzero::torch, i.e. LibTorch: adapters/torch/torch.cmake).
# Each checks its own result; CTest runs them under the label "examples".
if(TARGET mpzero_torch)
  add_executable(multimodal ${CMAKE_CURRENT_LIST_DIR}/multimodal/multimodal.cpp)
  target_link_libraries(multimodal PRIVATE mpzero::torch)
  target_compile_options(multimodal PRIVATE -Wall -Wextra)
  if(MPZERO_BUILD_TESTS)
    add_test(NAME examples.multimodal COMMAND multimodal)
    set_tests_properties(examples.multimodal PROPERTIES LABELS "examples;torch" ENVIRONMENT OMP_NUM_THREADS=1)
  endif()
endif()

# examples/gpt: the precision-configuration comparison (a small GPT trained through the
# LibTorch engine; scripts/main_gpt.sh runs it). Only where LibTorch was found
# (adapters/torch/torch.cmake defines mpzero_torch then).
if(TARGET mpzero_torch)
  add_executable(train_gpt ${CMAKE_CURRENT_SOURCE_DIR}/gpt/train_gpt.cpp)
  target_link_libraries(train_gpt PRIVATE mpzero::torch)
  target_compile_options(train_gpt PRIVATE -Wall -Wextra)
  # With MPI, `mpirun -n N train_gpt` trains data parallel; a plain run stays world size 1.
  find_package(MPI COMPONENTS CXX QUIET)
  if(MPI_CXX_FOUND)
    target_link_libraries(train_gpt PRIVATE MPI::MPI_CXX)
    target_compile_definitions(train_gpt PRIVATE MPZERO_GPT_MPI)
  endif()
endif()

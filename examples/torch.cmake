# Examples of the LibTorch engine (need mpzero::torch, i.e. LibTorch: adapters/torch/torch.cmake).
# Each checks its own result; CTest runs them under the label "examples".
if(TARGET mpzero_torch)
  add_executable(multimodal ${CMAKE_CURRENT_LIST_DIR}/multimodal/multimodal.cpp)
  target_link_libraries(multimodal PRIVATE mpzero::torch)
  target_compile_options(multimodal PRIVATE -Wall -Wextra)
  if(MPZERO_BUILD_TESTS)
    add_test(NAME examples.multimodal COMMAND multimodal)
    set_tests_properties(examples.multimodal PROPERTIES LABELS "examples;torch" ENVIRONMENT OMP_NUM_THREADS=1)
    if(MPI_CXX_FOUND AND MPZERO_TORCH_MPI)
      # Launched by mpirun with no communicator in the code: the engines join MPI_COMM_WORLD
      # (MPI initialised by mpzero). Every rank must report the match at world size 2.
      add_test(NAME examples.multimodal.np2
               COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 2 ${MPZERO_MPIEXEC_FLAGS} $<TARGET_FILE:multimodal>)
      set_tests_properties(examples.multimodal.np2 PROPERTIES LABELS "examples;torch;mpi" PROCESSORS 2
                           ENVIRONMENT OMP_NUM_THREADS=1
                           PASS_REGULAR_EXPRESSION "like one model \\(2 processes\\).*like one model \\(2 processes\\)")
    endif()
  endif()
endif()

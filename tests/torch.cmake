# The LibTorch engine: [torch] (REFERENCE.md section 1's scenarios) and [hooks] (the
# DeepSpeed regressions), under mpirun at 1 and 2 ranks. Needs LibTorch (adapters/torch/torch.cmake).
if(TARGET mpzero_torch AND MPI_CXX_FOUND)
  mpzero_add_test(test_torch SOURCES test_torch.cpp TAGS torch hooks MPI 1 2 LIBS mpzero::torch)
  foreach(tag torch hooks)
    foreach(np 1 2)
      set_tests_properties(test_torch.${tag}.np${np} PROPERTIES TIMEOUT 900)
    endforeach()
  endforeach()
elseif(TARGET mpzero_torch)
  message(STATUS "mpzero: MPI not found; the [torch] tests are not built")
endif()

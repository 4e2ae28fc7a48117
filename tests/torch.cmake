# The LibTorch engine: [torch] (REFERENCE.md section 1's scenarios) and [hooks] (the
# DeepSpeed regressions), under mpirun at 1 and 2 ranks. Needs LibTorch (adapters/torch/torch.cmake).
if(TARGET mpzero_torch AND MPI_CXX_FOUND)
  mpzero_add_test(test_torch SOURCES test_torch.cpp TAGS torch hooks MPI 1 2 LIBS mpzero::torch)
  # Gradient reduction dtypes (torch_autocast, communication_data_type) and the LR
  # schedules end to end; a TU of its own so that it rebuilds without test_torch.cpp.
  mpzero_add_test(test_torch_wire SOURCES test_torch_wire.cpp TAGS torch MPI 1 2 LIBS mpzero::torch)
  foreach(np 1 2)
    set_tests_properties(test_torch.torch.np${np} test_torch.hooks.np${np} test_torch_wire.torch.np${np}
                         PROPERTIES TIMEOUT 900)
  endforeach()
elseif(TARGET mpzero_torch)
  message(STATUS "mpzero: MPI not found; the [torch] tests are not built")
endif()

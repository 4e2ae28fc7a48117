# Communicators: [comm] cases under mpirun at 1-4 ranks; [gpu] NCCL cases at world size 1.
if(MPI_CXX_FOUND)
  mpzero_add_test(test_comm SOURCES test_comm.cpp TAGS comm MPI 1 2 3 4)
  # A backstop only: the communicators' own 60 s deadlines end a stuck case first.
  foreach(np 1 2 3 4)
    set_tests_properties(test_comm.comm.np${np} PROPERTIES TIMEOUT 300)
  endforeach()
  # MPI's own scratch for collectives in flight, counted at malloc (the program replaces it).
  mpzero_add_test(test_comm_memory SOURCES test_comm_memory.cpp TAGS comm_memory MPI 2 3 4)
else()
  message(STATUS "mpzero: MPI not found; the [comm] tests are not built")
endif()

if(MPZERO_HAS_CUDA AND MPZERO_NCCL_FOUND)
  mpzero_add_test(test_comm_gpu SOURCES test_comm_gpu.cu TAGS gpu LIBS mpzero_nccl)
  mpzero_cuda_target(test_comm_gpu)
  set_tests_properties(test_comm_gpu.gpu PROPERTIES TIMEOUT 240)  # within gpu_run.sh's --timeout 240
endif()

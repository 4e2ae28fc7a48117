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
  # The GPT comparison (scripts/main.sh), checked end to end on a tiny model
  # (examples/gpt/smoke_test.py; the tests are named examples.main_job.*): every
  # output, measured vs predicted bytes, learning, bit-identity across stages; at world
  # size 1 and, with MPI, 2.
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(MPZERO_BUILD_TESTS AND Python3_FOUND)
    set(_gpt ${CMAKE_CURRENT_SOURCE_DIR}/gpt)
    set(_args --train-gpt $<TARGET_FILE:train_gpt> --plot ${_gpt}/plot.py --repo ${PROJECT_SOURCE_DIR})
    add_test(NAME examples.main_job.np1
             COMMAND ${Python3_EXECUTABLE} ${_gpt}/smoke_test.py ${_args} --work ${CMAKE_CURRENT_BINARY_DIR}/main_job_np1)
    set_tests_properties(examples.main_job.np1 PROPERTIES LABELS "examples;torch;gpt" ENVIRONMENT OMP_NUM_THREADS=1)
    if(MPI_CXX_FOUND)
      string(JOIN " " _mpiflags ${MPZERO_MPIEXEC_FLAGS})
      add_test(NAME examples.main_job.np2
               COMMAND ${Python3_EXECUTABLE} ${_gpt}/smoke_test.py ${_args} --work ${CMAKE_CURRENT_BINARY_DIR}/main_job_np2
                       --world 2 "--launcher=${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 2 ${_mpiflags}")
      set_tests_properties(examples.main_job.np2 PROPERTIES LABELS "examples;torch;gpt;mpi" PROCESSORS 2
                           ENVIRONMENT OMP_NUM_THREADS=1)
    endif()
  endif()
endif()

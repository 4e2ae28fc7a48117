# The LibTorch engine: [torch] (the training API of docs/torch.md: loss.backward(),
# GAS, engine.backward/scale, fp16 loss scaling, shared losses, offload, configs) and
# [hooks] (docs/torch.md's "What the hooks guarantee", the DeepSpeed regressions), under
# mpirun at 1, 2 and 3 ranks (stage 3's scenarios included). Needs LibTorch (adapters/torch/torch.cmake).
if(TARGET mpzero_torch AND MPI_CXX_FOUND)
  mpzero_add_test(test_torch SOURCES test_torch.cpp TAGS torch hooks MPI 1 2 3 LIBS mpzero::torch)
  # Gradient reduction dtypes (torch_autocast, communication_data_type), the LR schedules
  # end to end, launch, and the low-precision model states ([precision], also at 3 ranks,
  # where MPI's reduction order is its own: within twice each master dtype's epsilon
  # there); a TU of its own so that it rebuilds without test_torch.cpp.
  mpzero_add_test(test_torch_wire SOURCES test_torch_wire.cpp TAGS torch MPI 1 2 LIBS mpzero::torch)
  add_test(NAME test_torch_wire.precision.np3
           COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 3 ${MPZERO_MPIEXEC_FLAGS} $<TARGET_FILE:test_torch_wire>
                   "[precision]~[gpu]")
  set_tests_properties(test_torch_wire.precision.np3 PROPERTIES LABELS "torch;mpi" PROCESSORS 3
                       ENVIRONMENT OMP_NUM_THREADS=1 TIMEOUT 900)
  # ZeRO-3 in the engine ([zero3]): stage 3 against stage 2 bit for bit, gathered_forward's
  # gathers and releases, checkpoints across stages, partitioned construction (zero_init;
  # at 3 ranks too, where slices are uneven).
  mpzero_add_test(test_torch_zero3 SOURCES test_torch_zero3.cpp TAGS zero3 MPI 1 2 3 LIBS mpzero::torch)
  # AutoTP ([torch]): a block split over 2 tensor-parallel ranks, at 2 ranks (TP 2 x DP 1)
  # and 4 (TP 2 x DP 2), against the whole block trained on one process.
  mpzero_add_test(test_torch_autotp SOURCES test_torch_autotp.cpp TAGS torch MPI 2 4 LIBS mpzero::torch)
  set_tests_properties(test_torch_autotp.torch.np4 PROPERTIES TIMEOUT 900)
  foreach(np 1 2)
    set_tests_properties(test_torch.torch.np${np} test_torch.hooks.np${np} test_torch_wire.torch.np${np}
                         test_torch_zero3.zero3.np${np} PROPERTIES TIMEOUT 900)
  endforeach()
  set_tests_properties(test_torch.torch.np3 test_torch.hooks.np3 test_torch_zero3.zero3.np3 PROPERTIES TIMEOUT 900)
elseif(TARGET mpzero_torch)
  message(STATUS "mpzero: MPI not found; the [torch] tests are not built")
endif()
# The engine on CUDA parameters ([gpu]; one process: NCCL takes one rank per GPU), and
# what any build says about its CUDA path ([torch]). Needs the CUDA cores
# (MPZERO_TORCH_CUDA) and NCCL; g++ compiles it with the CUDA headers (c10d's NCCL group).
if(TARGET mpzero_torch AND MPZERO_TORCH_CUDA AND MPZERO_NCCL_FOUND)
  mpzero_add_test(test_torch_gpu SOURCES test_torch_gpu.cpp TAGS gpu torch LIBS mpzero::torch mpzero_nccl CUDA::cudart)
  target_compile_definitions(test_torch_gpu PRIVATE USE_C10D_NCCL USE_CUDA)
  set_tests_properties(test_torch_gpu.torch PROPERTIES ENVIRONMENT OMP_NUM_THREADS=1)
endif()
# engine.save_checkpoint / load_checkpoint: resume bit for bit, other stages and world
# sizes, module-only, refusals; the fp32 export (zero_to_fp32.hpp and its tool).
if(TARGET mpzero_torch AND MPI_CXX_FOUND)
  mpzero_add_test(test_torch_checkpoint SOURCES test_torch_checkpoint.cpp TAGS checkpoint MPI 1 2 LIBS mpzero::torch)
  # The fp32 export's command-line tool, run by the test as a user would.
  add_dependencies(test_torch_checkpoint mpzero_zero_to_fp32)
  target_compile_definitions(test_torch_checkpoint PRIVATE MPZERO_ZERO_TO_FP32="$<TARGET_FILE:mpzero_zero_to_fp32>")
  if(MPZERO_TORCH_PYTHON)  # adapters/torch/torch.cmake: the interpreter LibTorch came from
    target_compile_definitions(test_torch_checkpoint PRIVATE MPZERO_TEST_PYTHON="${MPZERO_TORCH_PYTHON}")
    # The fp32 export's .safetensors files are read back with the safetensors package
    # (scripts/setup.sh installs it); without it the test says so and reads the .pt only.
    execute_process(COMMAND "${MPZERO_TORCH_PYTHON}" -c "import safetensors" RESULT_VARIABLE _mpzero_st_rc
                    OUTPUT_QUIET ERROR_QUIET)
    if(_mpzero_st_rc EQUAL 0)
      target_compile_definitions(test_torch_checkpoint PRIVATE MPZERO_TEST_SAFETENSORS)
    else()
      message(STATUS "mpzero: ${MPZERO_TORCH_PYTHON} has no safetensors package: the export test reads .pt files only")
    endif()
  endif()
endif()

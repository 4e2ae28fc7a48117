mpzero_add_test(test_loss_scaler SOURCES test_loss_scaler.cpp TAGS zero)
mpzero_add_test(test_zero SOURCES test_zero.cpp TAGS zero offload MPI 1 2 3 4)
# The memory contract: held and peak bytes, counted by the backend, against the bound.
mpzero_add_test(test_zero_memory SOURCES test_zero_memory.cpp TAGS memory MPI 1 2 3 4)
# Per-parameter wire dtypes (zero_options::wire_dtypes), every stage and offload.
mpzero_add_test(test_zero_wire SOURCES test_zero_wire.cpp TAGS zero MPI 1 2 3 4)
# ZeroOptimizer on the CUDA backend with NCCL at world size 1, against the host backend
# ([gpu]); its [zero] case (a communicator in the wrong memory space) runs without a device.
if(MPZERO_HAS_CUDA AND MPZERO_NCCL_FOUND)
  mpzero_add_test(test_zero_gpu SOURCES test_zero_gpu.cu TAGS gpu zero LIBS mpzero_nccl)
  mpzero_cuda_target(test_zero_gpu)
endif()
# save_checkpoint / load_checkpoint: resume bit for bit, resharding, refusals.
mpzero_add_test(test_checkpoint SOURCES test_checkpoint.cpp TAGS checkpoint MPI 1 2 3 4)

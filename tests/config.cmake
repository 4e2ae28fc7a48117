# The DeepSpeed-style JSON config, the LR schedules and the AutoTP plan (torch-free).
if(TARGET mpzero_torch_config)
  mpzero_add_test(test_config SOURCES test_config.cpp test_lr_schedule.cpp test_autotp.cpp TAGS config LIBS mpzero::torch_config)
endif()

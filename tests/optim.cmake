# Planner, optimizers and the fused step, host side.
mpzero_add_test(test_plan SOURCES test_plan.cpp test_simd.cpp TAGS multi_tensor)
mpzero_add_test(test_optim SOURCES test_optim_a.cpp test_optim_b.cpp test_fused_step.cpp TAGS optim multi_tensor)

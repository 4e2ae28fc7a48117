mpzero_add_test(test_loss_scaler SOURCES test_loss_scaler.cpp TAGS zero)
mpzero_add_test(test_zero SOURCES test_zero.cpp TAGS zero MPI 1 2 3 4)

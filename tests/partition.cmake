# [partition]: flat layouts and bucket plans (pure host logic).
mpzero_add_test(test_partition SOURCES test_partition.cpp TAGS partition)

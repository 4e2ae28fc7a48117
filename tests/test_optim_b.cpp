// The fused host step against the long-double reference: policies with bf16
// parameters (test_optim_a.cpp holds the fp32 and fp16 ones).
#include "test_optim_reference.hpp"

TEMPLATE_LIST_TEST_CASE("Adam and AdamW match the reference (bf16 params)", "[optim]", optim_test::policies_b) {
  INFO(optim_test::policy_name<TestType>());
  optim_test::check_adam_family<TestType>();
}

TEMPLATE_LIST_TEST_CASE("SGD and Lion match the reference (bf16 params)", "[optim]", optim_test::policies_b) {
  INFO(optim_test::policy_name<TestType>());
  optim_test::check_sgd_and_lion<TestType>();
}

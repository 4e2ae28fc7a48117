// The fused host step against the long-double reference: policies with fp32 or fp16
// parameters (test_optim_b.cpp holds the bf16 ones; two files compile in parallel).
#include "test_optim_reference.hpp"

TEMPLATE_LIST_TEST_CASE("Adam and AdamW match the reference (fp32 / fp16 params)", "[optim]", optim_test::policies_a) {
  INFO(optim_test::policy_name<TestType>());
  optim_test::check_adam_family<TestType>();
}

TEMPLATE_LIST_TEST_CASE("SGD and Lion match the reference (fp32 / fp16 params)", "[optim]", optim_test::policies_a) {
  INFO(optim_test::policy_name<TestType>());
  optim_test::check_sgd_and_lion<TestType>();
}

// mpzero: the host-side public API in one include (no CUDA needed).
// CUDA users add <mpzero/cuda/fused_step.cuh> in their .cu files.
#pragma once

#include "backend/host.hpp"
#include "config.hpp"
#include "error.hpp"
#include "multi_tensor/plan.hpp"
#include "numeric/bf16.hpp"
#include "numeric/convert.hpp"
#include "numeric/dtype.hpp"
#include "numeric/fp16.hpp"
#include "numeric/philox.hpp"
#include "numeric/rounding_bits.hpp"
#include "optim/optimizer.hpp"
#include "policy/memory_model.hpp"
#include "policy/precision.hpp"
#include "policy/stage.hpp"
#include "step/fused_step.hpp"

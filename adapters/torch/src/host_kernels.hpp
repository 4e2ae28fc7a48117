// The host backend's vectorized loops, declared `extern` for the table units: they are
// compiled once, at full optimization, in host_kernels.cpp. torch.cmake compiles the table
// units themselves at -O1: they instantiate ZeroOptimizer once per row (bookkeeping, not
// loops), which is most of the adapter's build time, and their optimization bought
// nothing measurable (docs/perf.md, "Session 23 ... the engine's build").
//
// Included by host_row.hpp, and by cuda_row.cuh where nvcc's host pass compiles the same
// variant of the host loops as g++ (MPZERO_RUNTIME_SIMD, backend/host.hpp): CPU offload's
// step on CUDA parameters runs them.
#pragma once

#include <cstdint>
#include <span>

#include <mpzero/backend/host.hpp>
#include <mpzero/optim/adam.hpp>
#include <mpzero/policy/precision.hpp>

#define MPZERO_TORCH_HOST_KW extern
#include "host_kernels.inc"
#undef MPZERO_TORCH_HOST_KW

// tests/test_simd.cpp compiled by nvcc: the host step's SIMD variants in nvcc's host
// pass (CPU offload on the CUDA backend runs them) must give the scalar reference's bits
// as they do under g++. Runs on the CPU; no GPU needed.
#include "test_simd.cpp"

#if !defined(MPZERO_RUNTIME_SIMD) && defined(__x86_64__) && __CUDACC_VER_MAJOR__ >= 13
#error "nvcc's host pass should take the run-time SIMD dispatch (backend/host.hpp)"
#endif

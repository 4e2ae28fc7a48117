// Shared by the LibTorch engine tests that run under mpirun: LibTorch's headers in the
// order they need, Catch, and the MPI world as the engine's communicator.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <torch/torch.h>
// LibTorch's logging defines CHECK (glog style); the tests mean Catch's.
#undef CHECK
#include <catch2/catch.hpp>

#include <mpzero/torch/engine.hpp>

#include "mpi_world.hpp"

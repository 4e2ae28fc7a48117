// Catch2 v2's implementation (a single header of some 17,000 lines), compiled once for
// every test program; catch_main.cpp and mpi_main.cpp supply main() and call
// mpzero_catch_run (Catch::Session is declared only where the implementation is).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

int mpzero_catch_run(int argc, char** argv) { return Catch::Session().run(argc, argv); }

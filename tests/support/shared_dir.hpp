// A temporary directory every rank of MPI_COMM_WORLD agrees on: rank 0 makes it and
// broadcasts its name; it is removed, after a barrier, at the end of the scope. For the
// checkpoint tests, whose ranks write and read one directory.
#pragma once

#include <mpi.h>
#include <stdlib.h>  // mkdtemp

#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>

namespace mpzero::testing {

struct shared_dir {
  std::filesystem::path path;
  shared_dir() {
    char buf[256] = {};
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank == 0) {
      std::string t = (std::filesystem::temp_directory_path() / "mpzero_test_XXXXXX").string();
      if (mkdtemp(t.data()) != nullptr) std::strncpy(buf, t.c_str(), sizeof buf - 1);
    }
    MPI_Bcast(buf, sizeof buf, MPI_CHAR, 0, MPI_COMM_WORLD);
    if (buf[0] == '\0') throw std::runtime_error("shared_dir: mkdtemp failed on rank 0");
    path = buf;
  }
  ~shared_dir() {
    MPI_Barrier(MPI_COMM_WORLD);
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank == 0) {
      std::error_code ignored;
      std::filesystem::remove_all(path, ignored);
    }
  }
  shared_dir(const shared_dir&) = delete;
  shared_dir& operator=(const shared_dir&) = delete;
};

}  // namespace mpzero::testing

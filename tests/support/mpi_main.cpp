// Catch2 main for tests that run under mpirun: MPI is initialised around the whole
// session, and every rank runs the same test cases. A failure on any rank fails the
// job (mpirun reports the first non-zero exit). Catch2's implementation: catch_impl.cpp.
#include <mpi.h>

int mpzero_catch_run(int argc, char** argv);

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const int rc = mpzero_catch_run(argc, argv);
  // Agree on the outcome so that no rank leaves while another still waits in a collective.
  int worst = rc;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst == 0 ? 0 : 1;
}

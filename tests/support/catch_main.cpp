// main() of the single-process test programs (Catch2's implementation: catch_impl.cpp).
int mpzero_catch_run(int argc, char** argv);

int main(int argc, char** argv) { return mpzero_catch_run(argc, argv); }

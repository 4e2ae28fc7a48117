// A main() for the fuzz targets where libFuzzer is not linked (g++, or a plain build):
// it runs the target on every file it is given (a file, or every file of a directory),
// then on `--mutations N` inputs made from them by a seeded random mutator. CTest runs it
// that way in every build, so the targets' checks run in CI without clang; a clang build
// with -DMPZERO_FUZZ=ON links libFuzzer instead, for coverage-guided runs
// (scripts/fuzz.sh, docs/testing.md).
//
//   fuzz_<target>_replay [--mutations N] [--seed S] [--max-len BYTES] FILE_OR_DIR...
//
// A finding ends the run with the target's own report (an abort, a sanitizer's report, an
// uncaught exception); before each mutated input runs, the driver writes it to
// `fuzz-<target>-last-input` in the working directory, so that the input that failed
// is on disk to replay and minimize.
#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);
extern const char* const mpzero_fuzz_target_name;

namespace {

using bytes = std::vector<std::uint8_t>;
namespace fs = std::filesystem;

bytes read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) {
    std::cerr << "fuzz driver: cannot read '" << p.string() << "'\n";
    std::exit(2);
  }
  return bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void run(const bytes& in) { LLVMFuzzerTestOneInput(in.data(), in.size()); }

// Values that sit on the edges of the formats' fields: sizes, counts, offsets, dtype codes.
constexpr std::uint64_t interesting[] = {0, 1, 2, 3, 7, 8, 16, 31, 32, 64, 127, 128, 255, 256, 0x7fff, 0xffff,
                                         0x10000, 0x7fffffff, 0x80000000, 0xffffffff, 0x100000000,
                                         0x7fffffffffffffff, 0x8000000000000000, 0xffffffffffffffff};
constexpr const char* tokens[] = {"{", "}", "[", "]", ",", ":", "\"", "true", "false", "null", "0", "-1", "1e400",
                                  "1.5", "\"auto\"", "\"fp16\"", "\"bf16\"", "\"stochastic\"", "{}", "[]", "//", "/*"};

// One random edit of `b`: flip a bit, set a byte, write an interesting value (1, 2, 4 or
// 8 bytes), remove, duplicate or insert a run of bytes, truncate, or splice in a token
// (for the text formats).
void mutate_once(bytes& b, std::mt19937_64& rng, std::size_t max_len) {
  auto pick = [&](std::size_t n) { return n == 0 ? std::size_t{0} : static_cast<std::size_t>(rng() % n); };
  switch (rng() % 8) {
    case 0:
      if (!b.empty()) b[pick(b.size())] ^= static_cast<std::uint8_t>(1u << (rng() % 8));
      break;
    case 1:
      if (!b.empty()) b[pick(b.size())] = static_cast<std::uint8_t>(rng());
      break;
    case 2: {
      const std::size_t width = std::size_t{1} << (rng() % 4);
      if (b.size() < width) break;
      const std::uint64_t v = interesting[pick(std::size(interesting))] + (rng() % 3) - 1;
      std::memcpy(b.data() + pick(b.size() - width + 1), &v, width);  // little-endian: the low bytes
      break;
    }
    case 3:
      if (!b.empty()) {
        const std::size_t at = pick(b.size()), n = std::min(b.size() - at, 1 + pick(16));
        b.erase(b.begin() + static_cast<std::ptrdiff_t>(at), b.begin() + static_cast<std::ptrdiff_t>(at + n));
      }
      break;
    case 4:
      if (!b.empty()) {
        const std::size_t at = pick(b.size()), n = std::min(b.size() - at, 1 + pick(32));
        const bytes run(b.begin() + static_cast<std::ptrdiff_t>(at), b.begin() + static_cast<std::ptrdiff_t>(at + n));
        b.insert(b.begin() + static_cast<std::ptrdiff_t>(pick(b.size() + 1)), run.begin(), run.end());
      }
      break;
    case 5:
      b.resize(pick(b.size() + 1));
      break;
    case 6: {
      const char* t = tokens[pick(std::size(tokens))];
      b.insert(b.begin() + static_cast<std::ptrdiff_t>(pick(b.size() + 1)), t, t + std::strlen(t));
      break;
    }
    default: {
      const std::size_t n = 1 + pick(8);
      bytes r(n);
      for (auto& x : r) x = static_cast<std::uint8_t>(rng());
      b.insert(b.begin() + static_cast<std::ptrdiff_t>(pick(b.size() + 1)), r.begin(), r.end());
    }
  }
  if (b.size() > max_len) b.resize(max_len);
}

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "fuzz driver (" << mpzero_fuzz_target_name << "): " << why
            << "\nusage: fuzz_" << mpzero_fuzz_target_name
            << "_replay [--mutations N] [--seed S] [--max-len BYTES] FILE_OR_DIR...\n";
  std::exit(2);
}

std::uint64_t number(const char* flag, const char* text) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || text[0] == '-') {
    usage(std::string(flag) + " wants a non-negative integer, not '" + text + "'");
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  std::uint64_t mutations = 0, seed = 1;
  std::size_t max_len = 1 << 20;
  std::vector<fs::path> paths;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--mutations" || a == "--seed" || a == "--max-len") {
      if (!has_value) usage(a + " needs a value");
      const std::uint64_t v = number(argv[i], argv[i + 1]);
      ++i;
      if (a == "--mutations") mutations = v;
      if (a == "--seed") seed = v;
      if (a == "--max-len") max_len = static_cast<std::size_t>(v);
    } else if (a.rfind("--", 0) == 0) {
      usage("unknown flag '" + a + "'");
    } else {
      paths.emplace_back(a);
    }
  }
  std::vector<bytes> inputs;
  for (const fs::path& p : paths) {
    std::error_code ec;
    if (fs::is_directory(p, ec)) {
      std::vector<fs::path> files;
      for (const auto& e : fs::directory_iterator(p)) {
        if (e.is_regular_file()) files.push_back(e.path());
      }
      std::sort(files.begin(), files.end());  // the same order, and so the same mutations, everywhere
      for (const fs::path& f : files) inputs.push_back(read_file(f));
    } else if (fs::exists(p, ec)) {
      inputs.push_back(read_file(p));
    } else {
      usage("'" + p.string() + "' does not exist");
    }
  }
  if (inputs.empty()) usage("no inputs: pass seed files or a directory of them");
  for (const bytes& in : inputs) run(in);
  std::cout << "fuzz " << mpzero_fuzz_target_name << ": " << inputs.size() << " seed inputs passed\n" << std::flush;

  std::mt19937_64 rng(seed);
  const std::string last = std::string("fuzz-") + mpzero_fuzz_target_name + "-last-input";
  for (std::uint64_t k = 0; k < mutations; ++k) {
    bytes b = inputs[rng() % inputs.size()];
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) mutate_once(b, rng, max_len);
    {
      std::ofstream out(last, std::ios::binary | std::ios::trunc);
      out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
    }
    run(b);
    if ((k + 1) % 5000 == 0 || k + 1 == mutations) {
      std::cout << "fuzz " << mpzero_fuzz_target_name << ": " << (k + 1) << " of " << mutations
                << " mutated inputs passed\n"
                << std::flush;
    }
  }
  std::error_code ec;
  fs::remove(last, ec);  // nothing failed: no input to keep
  return 0;
}

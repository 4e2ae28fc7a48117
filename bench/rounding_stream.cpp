// Writes mpzero's stochastic-rounding bits (numeric/rounding_bits.hpp) to stdout as raw
// native-endian 32-bit words, for statistical test batteries that read a stream
// (dieharder -g 200). Runs until stdout closes.
//
//   mpzero_rounding_stream elements [seed] [step]   words 0-3 of pairs 0, 1, 2, ... (every bit a step
//                                                   can draw, in the order of the elements)
//   mpzero_rounding_stream steps [seed] [element]   word 0 of elements e .. e + 7 at steps 1, 2, ...
//                                                   (the bits one parameter sees over training)
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <mpzero/numeric/rounding_bits.hpp>

int main(int argc, char** argv) {
  const bool elements = argc >= 2 && std::strcmp(argv[1], "elements") == 0;
  if (argc < 2 || (!elements && std::strcmp(argv[1], "steps") != 0)) {
    std::fprintf(stderr, "usage: %s elements [seed] [step] | steps [seed] [element]\n", argv[0]);
    return 2;
  }
  const std::uint64_t seed = argc > 2 ? std::strtoull(argv[2], nullptr, 0) : 1234;
  const std::uint64_t fixed = argc > 3 ? std::strtoull(argv[3], nullptr, 0) : (elements ? 1 : 1000);
  std::vector<std::uint32_t> buf(1 << 16);
  const mpzero::rounding_key key = mpzero::rounding_key_of(seed, fixed);  // elements: the one step's
  for (std::uint64_t n = 0;; n += buf.size()) {
    if (elements) {
      // Pair p = elements 2 p, 2 p + 1: its words 0-3 (word t is element t's w0; words 2
      // and 3 are split in halves between the two elements' w1).
      for (std::size_t i = 0; i < buf.size(); i += 4) {
        const std::uint64_t p = (n + i) / 4;
        const std::uint32_t inner = mpzero::rounding_inner_key(key, static_cast<std::uint32_t>(p >> 32));
        const std::uint32_t x = mpzero::rounding_pair_state(key, static_cast<std::uint32_t>(p));
        for (unsigned u = 0; u < 4; ++u) buf[i + u] = mpzero::rounding_word(key, inner, x, mpzero::rounding_salt(u));
      }
    } else {
      for (std::size_t i = 0; i < buf.size(); i += 8) {
        const mpzero::rounding_key at_step = mpzero::rounding_key_of(seed, 1 + (n + i) / 8);
        for (std::size_t e = 0; e < 8; ++e) buf[i + e] = mpzero::element_rounding_bits<1>(at_step, fixed + e).w[0];
      }
    }
    if (std::fwrite(buf.data(), sizeof buf[0], buf.size(), stdout) != buf.size()) return 0;
  }
}

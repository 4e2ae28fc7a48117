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
      // Pair p = elements 2 p, 2 p + 1: word 0 and word 1 (each element's w0), then
      // words 2 and 3 (each split in halves between the two elements' w1).
      for (std::size_t i = 0; i < buf.size(); i += 4) {
        const std::uint64_t p = (n + i) / 4;
        const mpzero::element_bits even = mpzero::element_rounding_bits<4>(key, 2 * p);
        const mpzero::element_bits odd = mpzero::element_rounding_bits<4>(key, 2 * p + 1);
        buf[i] = even.w[0];
        buf[i + 1] = odd.w[0];
        buf[i + 2] = (even.w[1] & 0xffffu) | (odd.w[1] << 16);
        buf[i + 3] = (even.w[1] >> 16) | (odd.w[1] & 0xffff0000u);
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

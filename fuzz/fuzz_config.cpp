// Fuzz target: the LibTorch adapter's DeepSpeed-style JSON config parser
// (adapters/torch/src/config.cpp, torch-free).
//
// The input is the config's text. At world sizes 1 and 3 (the batch-size triangle
// depends on it), parse_config_text must either return a config or throw
// mpzero::torch::config_error; anything else it throws (a JSON library's type_error, a
// std::out_of_range, a bare mpzero::error) is a finding: a user would see a message
// the parser did not write. A config it accepts must survive its own round trip:
// to_json(c) parses again, at the same world size, and prints the same JSON.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <typeinfo>

#include <mpzero/torch/config.hpp>
#include <nlohmann/json.hpp>

extern const char* const mpzero_fuzz_target_name = "config";

namespace {

[[noreturn]] void finding(const std::string& what, const std::string& input) {
  std::fprintf(stderr, "fuzz config: %s\n--- input (%zu bytes) ---\n%s\n---\n", what.c_str(), input.size(),
               input.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  for (const int world : {1, 3}) {
    mpzero::torch::config c;
    try {
      c = mpzero::torch::parse_config_text(text, world);
    } catch (const mpzero::torch::config_error& e) {
      if (std::string(e.what()).empty()) finding("a config_error with an empty message", text);
      continue;
    } catch (const std::exception& e) {
      finding(std::string("parse_config_text threw ") + typeid(e).name() + ", not config_error: " + e.what(), text);
    }
    std::string printed, reprinted;
    try {
      printed = mpzero::torch::to_json(c).dump();
      reprinted = mpzero::torch::to_json(mpzero::torch::parse_config_text(printed, world)).dump();
    } catch (const std::exception& e) {
      finding(std::string("the accepted config's to_json does not parse again (world size ") + std::to_string(world) +
                  "): " + e.what() + "\nto_json: " + printed,
              text);
    }
    if (printed != reprinted) {
      finding("the round trip changed the config (world size " + std::to_string(world) + ")\nfirst:  " + printed +
                  "\nsecond: " + reprinted,
              text);
    }
  }
  return 0;
}

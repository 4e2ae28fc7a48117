// The engine checkpoint's files, for the engine (engine.cpp) and the fp32 export
// (zero_to_fp32.cpp): <save_dir>/latest, <save_dir>/<tag>/{mpzero_engine.json,
// model_states.pt, zero_shard_*.mpz}.
#pragma once

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <mpzero/error.hpp>
#include <mpzero/zero/checkpoint.hpp>

namespace mpzero::torch::detail {

namespace fs = std::filesystem;

[[noreturn]] inline void fail_checkpoint(const std::string& what) {
  throw mpzero::invalid_argument("mpzero::torch: " + what);
}

inline std::string quoted(const fs::path& p) { return "'" + p.string() + "'"; }

// The whole of `bytes` in a new file at `path` (checkpoint::write_atomically).
inline void write_atomically(const fs::path& path, std::string_view bytes) {
  checkpoint::write_atomically(path, [&](std::ofstream& out) {
    return static_cast<bool>(out.write(bytes.data(), static_cast<std::streamsize>(bytes.size())));
  });
}

// The bytes of a checkpoint file; `who` (e.g. "load_checkpoint") and `what` ("the engine
// state") name it in the error.
inline std::vector<char> read_file(const std::string& who, const fs::path& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::error_code ec;
    fail_checkpoint(who + ": cannot read " + what + " " + quoted(path) + " (" +
                    (fs::exists(path, ec) ? std::error_code(errno, std::generic_category()).message()
                                          : std::string("no such file")) +
                    "); pass the directory save_checkpoint wrote and its tag");
  }
  return std::vector<char>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}
inline std::string read_text(const std::string& who, const fs::path& path, const std::string& what) {
  const std::vector<char> b = read_file(who, path, what);
  return std::string(b.begin(), b.end());
}

inline void check_tag(const std::string& who, const std::string& tag) {
  if (tag.empty() || tag == "." || tag == ".." || tag.find_first_of("/\\") != std::string::npos) {
    fail_checkpoint(who + ": the checkpoint tag '" + tag +
                    "' is not a directory name; use a name without '/', such as global_step100");
  }
}

// The tag <save_dir>/latest names, without trailing white space; nullopt when there is
// no such file (nothing saved there yet).
inline std::optional<std::string> read_latest(const std::string& who, const fs::path& save_dir) {
  std::error_code ec;
  if (!fs::exists(save_dir / "latest", ec)) return std::nullopt;
  std::string tag = read_text(who, save_dir / "latest", "the latest tag");
  while (!tag.empty() && std::isspace(static_cast<unsigned char>(tag.back()))) tag.pop_back();
  return tag;
}

}  // namespace mpzero::torch::detail

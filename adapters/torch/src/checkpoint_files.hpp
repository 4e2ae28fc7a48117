// The engine checkpoint's files, for the engine (engine.cpp) and the fp32 export
// (zero_to_fp32.cpp): <save_dir>/latest, <save_dir>/<tag>/{mpzero_engine.json,
// model_states.pt, zero_shard_*.mpz}.
#pragma once

#include <algorithm>
#include <bit>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <sstream>
#include <system_error>
#include <utility>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <c10/util/ArrayRef.h>
#include <caffe2/serialize/inline_container.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/jit/serialization/import_read.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/csrc/jit/serialization/pickler_helper.h>

#include <mpzero/error.hpp>
#include <mpzero/zero/checkpoint.hpp>

namespace mpzero::torch::detail {

namespace fs = std::filesystem;

// The adapter's refusals: mpzero::invalid_argument, prefixed "mpzero::torch: ".
[[noreturn]] inline void fail(const std::string& what) { throw mpzero::invalid_argument("mpzero::torch: " + what); }

using mpzero::checkpoint::detail::quoted;  // 'path', as the core's messages write it

// "[4, 4]", as torch prints a shape.
inline std::string shape_of(c10::IntArrayRef shape) {
  std::ostringstream s;
  s << shape;
  return s.str();
}

// The whole of `bytes` in a new file at `path` (checkpoint::write_atomically).
inline void write_atomically(const fs::path& path, std::string_view bytes) {
  checkpoint::write_atomically(path, [&](std::ofstream& out) {
    return static_cast<bool>(out.write(bytes.data(), static_cast<std::streamsize>(bytes.size())));
  });
}

// A checkpoint file opened for reading; `who` (e.g. "load_checkpoint") and `what` ("the
// engine state") name it in the error.
inline std::ifstream open_file(const std::string& who, const fs::path& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::error_code ec;
    fail(who + ": cannot read " + what + " " + quoted(path) + " (" +
         (fs::exists(path, ec) ? std::error_code(errno, std::generic_category()).message() : std::string("no such file")) +
         "); pass the directory save_checkpoint wrote and its tag");
  }
  return in;
}

// A small checkpoint file's contents (open_file's refusal when it cannot be read).
inline std::string read_text(const std::string& who, const fs::path& path, const std::string& what) {
  std::ifstream in = open_file(who, path, what);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// `value` in the format torch.save writes (a zip of data.pkl and one record per tensor
// storage), as a new file at `path` (checkpoint::write_atomically). The tensors' bytes go
// from their storages straight to the file (a CUDA tensor through one host copy at a
// time), so no serialized copy of them is held in memory. Dictionaries are plain, without
// TorchScript's type tags (torch.jit._pickle.restore_type_tag), so Python's
// torch.load(path, weights_only=True) reads the file as is; torch::pickle_load and
// read_torch_file read it in C++.
inline void write_torch_file(const fs::path& path, const c10::IValue& value) {
  std::string pickle;
  ::torch::jit::Pickler pickler([&](const char* bytes, std::size_t n) { pickle.append(bytes, n); },
                                /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
                                /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  checkpoint::write_atomically(path, [&](std::ofstream& out) {
    try {
      caffe2::serialize::PyTorchStreamWriter zip([&](const void* bytes, std::size_t n) -> std::size_t {
        return out.write(static_cast<const char*>(bytes), static_cast<std::streamsize>(n)) ? n : 0;
      });
      zip.writeRecord("data.pkl", pickle.data(), pickle.size());
      const std::string order = std::endian::native == std::endian::little ? "little" : "big";
      zip.writeRecord("byteorder", order.data(), order.size());  // as torch.save: the storages' byte order
      // The pickler names the i-th storage it met "i"; torch.load finds it at data/i.
      const std::vector<at::Tensor>& storages = pickler.tensorData();
      for (std::size_t i = 0; i < storages.size(); ++i) {
        const auto w = ::torch::jit::getWriteableTensorData(storages[i]);
        zip.writeRecord("data/" + std::to_string(i), w.data(), w.sizeInBytes());
      }
      zip.writeEndOfFile();
    } catch (const c10::Error&) {
      if (!out) return false;  // the file system's refusal: write_atomically names it
      throw;
    }
    return static_cast<bool>(out);
  });
}

// What write_torch_file (or torch::pickle_save, or torch.save of plain containers) wrote
// at `path`, read record by record: the storages go from the file into their tensors
// without a copy of the file in memory. Throws c10::Error when the file is not such a zip;
// open_file's refusal when it cannot be read.
inline c10::IValue read_torch_file(const std::string& who, const fs::path& path, const std::string& what) {
  std::ifstream in = open_file(who, path, what);
  caffe2::serialize::PyTorchStreamReader zip(&in);
  return ::torch::jit::readArchiveAndTensors("data", /*pickle_prefix=*/"", /*tensor_prefix=*/"",
                                             /*type_resolver=*/std::nullopt, /*obj_loader=*/std::nullopt,
                                             /*device=*/std::nullopt, zip);
}

inline void check_tag(const std::string& who, const std::string& tag) {
  if (tag.empty() || tag == "." || tag == ".." || tag.find_first_of("/\\") != std::string::npos) {
    fail(who + ": the checkpoint tag '" + tag +
                    "' is not a directory name; use a name without '/', such as global_step100");
  }
  // What a load could not find again: the file 'latest' stores the tag without its
  // trailing white space, and a directory named 'latest' would take that file's place.
  const bool odd_char = std::any_of(tag.begin(), tag.end(), [](char ch) {
    return std::iscntrl(static_cast<unsigned char>(ch)) != 0;
  });
  if (odd_char || std::isspace(static_cast<unsigned char>(tag.front())) ||
      std::isspace(static_cast<unsigned char>(tag.back())) || tag == "latest") {
    fail(who + ": the checkpoint tag '" + tag +
         "' cannot be found again by a load (control characters, white space at either end, or the name 'latest', "
         "which is the file naming the newest tag); use a plain name such as global_step100");
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

[[noreturn]] inline void different_saves(const std::string& who, const fs::path& a, const fs::path& b) {
  fail(who + ": " + quoted(a) + " and " + quoted(b) +
       " come from different saves (a save that failed midway); use a checkpoint whose save completed");
}

// mpzero_engine.json, as engine_state::engine_json writes it.
struct engine_meta {
  struct param {
    std::string name;
    std::vector<std::string> aliases;  // a tied weight's other names
    std::vector<std::int64_t> shape;
  };
  std::uint64_t save_id = 0;
  std::vector<param> params;  // the trainable parameters, in the core's order
  std::uint64_t global_steps = 0, micro_steps = 0, skipped_steps = 0, scheduler_steps = 0;
  nlohmann::json client_state = nlohmann::json::object();
};

inline engine_meta read_engine_meta(const std::string& who, const fs::path& path) {
  engine_meta m;
  try {
    const auto j = nlohmann::json::parse(read_text(who, path, "the engine state"));
    m.save_id = j.at("save_id").get<std::uint64_t>();
    for (const auto& p : j.at("parameters")) {
      m.params.push_back({p.at("name").get<std::string>(), p.value("aliases", std::vector<std::string>{}),
                          p.at("shape").get<std::vector<std::int64_t>>()});
    }
    m.global_steps = j.at("global_steps").get<std::uint64_t>();
    m.micro_steps = j.at("micro_steps").get<std::uint64_t>();
    m.skipped_steps = j.at("skipped_steps").get<std::uint64_t>();
    m.scheduler_steps = j.at("scheduler_steps").get<std::uint64_t>();
    m.client_state = j.value("client_state", nlohmann::json::object());
  } catch (const nlohmann::json::exception& e) {
    fail(who + ": " + quoted(path) + " is not an engine state save_checkpoint wrote (" + e.what() + ")");
  }
  return m;
}

// model_states.pt's "module" entries, in the file's order (the module's), after checking
// that the file belongs to the save `save_id` (`meta_path` names the file it came from).
inline std::vector<std::pair<std::string, at::Tensor>> read_module_states(const std::string& who, const fs::path& path,
                                                                          std::uint64_t save_id,
                                                                          const fs::path& meta_path) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  try {
    const c10::IValue top = read_torch_file(who, path, "the module state");
    const auto dict = top.toGenericDict();
    if (static_cast<std::uint64_t>(dict.at("mpzero_save_id").toInt()) != save_id) different_saves(who, meta_path, path);
    for (const auto& e : dict.at("module").toGenericDict()) out.emplace_back(e.key().toStringRef(), e.value().toTensor());
  } catch (const c10::Error& e) {
    fail(who + ": " + quoted(path) + " is not a module state save_checkpoint wrote (" + e.what_without_backtrace() + ")");
  } catch (const std::out_of_range& e) {  // no "module" or "mpzero_save_id" entry
    fail(who + ": " + quoted(path) + " is not a module state save_checkpoint wrote (" + e.what() + ")");
  }
  return out;
}

}  // namespace mpzero::torch::detail

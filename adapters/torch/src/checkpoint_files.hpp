// The engine checkpoint's files, for the engine (engine.cpp) and the fp32 export
// (zero_to_fp32.cpp): <save_dir>/latest, <save_dir>/<tag>/{mpzero_engine.json,
// model_states.pt, zero_shard_*.mpz}.
#pragma once

#include <algorithm>
#include <bit>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <cstddef>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <sstream>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Dict.h>
#include <mpzero/torch/autotp.hpp>
#include <mpzero/torch/config.hpp>
#include <ATen/core/ivalue.h>
#include <c10/util/ArrayRef.h>
#include <caffe2/serialize/inline_container.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/jit/serialization/import_read.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/csrc/jit/serialization/pickler_helper.h>
#include <torch/csrc/jit/serialization/unpickler.h>

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

// A tensor of `shape` and `type` without data: it stands for a tensor in what the
// streamed writers below describe, and their `fetch` supplies its values when they are
// written. Its storage points at nothing that is ever read.
inline at::Tensor placeholder(c10::IntArrayRef shape, at::ScalarType type) {
  static std::max_align_t nothing{};
  return at::from_blob(&nothing, shape, [](void*) {}, at::TensorOptions().dtype(type));
}

// Given a tensor of what is written (a placeholder or a real tensor), the tensor whose
// values go to the file; called once per tensor, in file order, on every rank.
using fetch_fn = std::function<at::Tensor(const at::Tensor&)>;
inline at::Tensor as_is(const at::Tensor& t) { return t; }

// A collective write: every rank calls it alike; `fetch` (which may gather, collectively)
// runs on every rank for every tensor in the same order, and only where `writer` is
// true do the bytes go to a new file at `path` (whole or absent, as write_atomically).
// emit(put) writes the file through put(bytes, n); a file that cannot be written does
// not stop the fetches (the other ranks' gathers still need this one's): the error is
// thrown after them.
template <class Emit, class FetchAll>
void write_collectively(const fs::path& path, bool writer, Emit&& emit, FetchAll&& fetch_all) {
  if (!writer) {
    fetch_all();
    return;
  }
  bool ran = false;
  try {
    checkpoint::write_atomically(path, [&](std::ofstream& out) {
      ran = true;
      // A failed stream ignores further writes; write_atomically reports it at the end.
      emit([&](const void* bytes, std::size_t n) { out.write(static_cast<const char*>(bytes), static_cast<std::streamsize>(n)); });
      return static_cast<bool>(out);
    });
  } catch (...) {
    if (!ran) fetch_all();  // the file could not be opened
    throw;
  }
}

// `value` in the format torch.save writes (a zip of data.pkl and one record per tensor
// storage), collectively (write_collectively). The tensors' bytes go from their storages
// straight to the file (a CUDA tensor through one host copy at a time), so no serialized
// copy of them is held in memory; with placeholders and a gathering fetch, not even the
// tensors. Dictionaries are plain, without TorchScript's type tags
// (torch.jit._pickle.restore_type_tag), so Python's torch.load(path, weights_only=True)
// reads the file as is; torch::pickle_load and read_torch_file read it in C++.
inline void write_torch_file(const fs::path& path, const c10::IValue& value, bool writer = true,
                             const fetch_fn& fetch = as_is) {
  std::string pickle;
  ::torch::jit::Pickler pickler([&](const char* bytes, std::size_t n) { pickle.append(bytes, n); },
                                /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
                                /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  // The pickler names the i-th storage it met "i"; torch.load finds it at data/i.
  const std::vector<at::Tensor>& storages = pickler.tensorData();
  const auto record = [&](std::size_t i, const auto& write) {
    const at::Tensor& described = storages[i];
    at::Tensor t = fetch(described);
    if (t.is_same(described)) {
      const auto w = ::torch::jit::getWriteableTensorData(t);
      write(w.data(), w.sizeInBytes());
      return;
    }
    t = t.to(at::kCPU).contiguous();
    if (t.nbytes() != described.storage().nbytes()) {
      fail("write_torch_file: tensor " + std::to_string(i) + " has " + std::to_string(t.nbytes()) +
           " bytes where the file describes " + std::to_string(described.storage().nbytes()));
    }
    write(t.data_ptr(), t.nbytes());
  };
  write_collectively(
      path, writer,
      [&](const auto& put) {
        caffe2::serialize::PyTorchStreamWriter zip([&](const void* bytes, std::size_t n) -> std::size_t {
          put(bytes, n);
          return n;
        });
        zip.writeRecord("data.pkl", pickle.data(), pickle.size());
        const std::string order = std::endian::native == std::endian::little ? "little" : "big";
        zip.writeRecord("byteorder", order.data(), order.size());  // as torch.save: the storages' byte order
        for (std::size_t i = 0; i < storages.size(); ++i) {
          record(i, [&](const void* data, std::size_t n) { zip.writeRecord("data/" + std::to_string(i), data, n); });
        }
        zip.writeEndOfFile();
      },
      [&] {
        for (const at::Tensor& t : storages) (void)fetch(t);
      });
}

// safetensors' name of a dtype; nullptr for one it has no name for.
inline const char* safetensors_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "F32";
    case at::kDouble: return "F64";
    case at::kBFloat16: return "BF16";
    case at::kHalf: return "F16";
    case at::kLong: return "I64";
    case at::kInt: return "I32";
    case at::kShort: return "I16";
    case at::kChar: return "I8";
    case at::kByte: return "U8";
    case at::kBool: return "BOOL";
    case at::kUInt16: return "U16";
    case at::kUInt32: return "U32";
    case at::kUInt64: return "U64";
    default: return nullptr;
  }
}

// The safetensors format (huggingface/safetensors), collectively (write_collectively): an
// 8-byte little-endian header size, a JSON header {name: {dtype, shape, data_offsets:
// [begin, end)}, "__metadata__": {...}} padded with spaces to a multiple of 8 bytes, then
// the tensors' bytes, in order, little-endian, with no gaps. The tensors of `described`
// may be placeholders: only their names, shapes and dtypes are read before fetch.
inline void write_safetensors(const fs::path& path, const std::vector<std::pair<std::string, at::Tensor>>& described,
                              const nlohmann::ordered_json& metadata, bool writer = true,
                              const fetch_fn& fetch = as_is) {
  if constexpr (std::endian::native != std::endian::little) {
    fail("safetensors files are little-endian and this machine is not; write a .pt file instead");
  }
  nlohmann::ordered_json header;
  header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (const auto& [name, t] : described) {
    const char* dt = safetensors_dtype(t.scalar_type());
    if (dt == nullptr) {
      fail("'" + name + "' has dtype " + std::string(c10::toString(t.scalar_type())) +
           ", which this safetensors writer does not support; write a .pt file instead");
    }
    const std::uint64_t bytes = static_cast<std::uint64_t>(t.numel()) * t.element_size();
    header[name] = {{"dtype", dt}, {"shape", t.sizes().vec()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const std::uint64_t n = text.size();
  // Any device and layout: one tensor at a time goes through a contiguous host copy
  // when it is not one already.
  const auto values = [&](const auto& put) {
    for (const auto& [name, t] : described) {
      const at::Tensor host = fetch(t).to(at::kCPU).contiguous();
      if (host.nbytes() != t.nbytes()) {
        fail("write_safetensors: '" + name + "' has " + std::to_string(host.nbytes()) + " bytes where the header says " +
             std::to_string(t.nbytes()));
      }
      put(host.data_ptr(), host.nbytes());
    }
  };
  write_collectively(
      path, writer,
      [&](const auto& put) {
        put(&n, sizeof n);
        put(text.data(), text.size());
        values(put);
      },
      [&] {
        for (const auto& item : described) (void)fetch(item.second);
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
  nlohmann::json param_groups;  // the engine's param_group_record() at the save; null without groups
};

// AutoTP: the partition plan and the whole parameters' shapes of the save in `tag_dir`
// made at tensor-parallel size `saved_tp`, for its trainable parameters (its engine
// file's, read from tp_rank_0/); at size 1, every parameter whole.
struct saved_tp_layout {
  std::vector<std::string> names;  // the trainable parameters'
  std::vector<std::vector<std::int64_t>> shapes;
  std::vector<tp_param_plan> plan;
  // The frozen floating parameters' (after the trainable ones in plan_all), by name.
  std::vector<std::string> frozen_names;
  std::vector<tp_param_plan> plan_all;  // names, then frozen_names
};
inline engine_meta read_engine_meta(const std::string& who, const fs::path& path);
inline saved_tp_layout read_saved_tp_layout(const std::string& who, const fs::path& tag_dir, std::uint64_t saved_tp) {
  saved_tp_layout out;
  const fs::path meta_path = (saved_tp > 1 ? tag_dir / tp_checkpoint_directory(0) : tag_dir) / "mpzero_engine.json";
  const engine_meta meta = read_engine_meta(who, meta_path);
  for (const auto& p : meta.params) out.names.push_back(p.name);
  tensor_parallel_config whole;  // autotp_size 1: every parameter replicated
  if (saved_tp == 1) {
    for (const auto& p : meta.params) out.shapes.push_back(p.shape);
    out.plan = plan_tensor_parallel(whole, out.names, out.shapes);
    out.plan_all = out.plan;
    return out;
  }
  try {
    const nlohmann::json record = nlohmann::json::parse(read_text(who, meta_path, "the engine state")).at("tensor_parallel");
    out.shapes = record.at("shapes").get<std::vector<std::vector<std::int64_t>>>();
    const config c = parse_config(nlohmann::json{{"train_micro_batch_size_per_gpu", 1}, {"tensor_parallel", record.at("config")}},
                                  static_cast<int>(saved_tp));
    std::vector<std::string> names = out.names;
    std::vector<std::vector<std::int64_t>> shapes = out.shapes;
    for (const auto& f : record.value("frozen", nlohmann::json::array())) {
      out.frozen_names.push_back(f.at(0).get<std::string>());
      names.push_back(out.frozen_names.back());
      shapes.push_back(f.at(1).get<std::vector<std::int64_t>>());
    }
    out.plan_all = plan_tensor_parallel(c.tensor_parallel, names, shapes);
    out.plan.assign(out.plan_all.begin(), out.plan_all.begin() + static_cast<std::ptrdiff_t>(out.names.size()));
    return out;
  } catch (const nlohmann::json::exception& e) {
    fail(who + ": " + quoted(meta_path) + " has no readable \"tensor_parallel\" record (" + e.what() +
         "); the checkpoint is corrupt");
  }
  return out;
}

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
    m.param_groups = j.value("param_groups", nlohmann::json());
  } catch (const nlohmann::json::exception& e) {
    fail(who + ": " + quoted(path) + " is not an engine state save_checkpoint wrote (" + e.what() + ")");
  }
  return m;
}

// model_states.pt's "module" entries, in the file's order (the module's), after checking
// that the file belongs to the save `save_id` (`meta_path` names the file it came from).
// The "module" entries of model_states.pt with the values of those `wanted` selects (all
// when it is empty). The others keep their name, shape and dtype on the meta device, with
// no data: their records are never read, so a ZeRO-3 load, which takes the managed
// parameters from the shard files, holds no whole copy of them.
inline std::vector<std::pair<std::string, at::Tensor>> read_module_states(
    const std::string& who, const fs::path& path, std::uint64_t save_id, const fs::path& meta_path,
    const std::function<bool(const std::string&)>& wanted = {}) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  try {
    std::ifstream in = open_file(who, path, "the module state");
    caffe2::serialize::PyTorchStreamReader zip(&in);
    const auto [pickle, pickle_bytes] = zip.getRecord("data.pkl");
    std::size_t at_byte = 0;
    const auto reader = [&, p = static_cast<const char*>(pickle.get()), n = pickle_bytes](char* buf, std::size_t len) {
      len = std::min(len, n - at_byte);
      std::memcpy(buf, p + at_byte, len);
      at_byte += len;
      return len;
    };
    // Each storage first gets a one-byte stand-in, by which its record is found again; the
    // wanted ones then read their record.
    std::unordered_map<const void*, std::string> record_of;
    const auto stand_in = [&](const std::string& record) -> at::DataPtr {
      char* p = new char[1];
      record_of[p] = record;
      return at::DataPtr(p, p, [](void* q) { delete[] static_cast<char*>(q); }, at::Device(at::kCPU));
    };
    ::torch::jit::Unpickler unpickler(reader, /*type_resolver=*/nullptr, /*obj_loader=*/nullptr, stand_in,
                                      /*device=*/std::nullopt);
    const c10::IValue top = unpickler.parse_ivalue();
    const auto dict = top.toGenericDict();
    if (static_cast<std::uint64_t>(dict.at("mpzero_save_id").toInt()) != save_id) different_saves(who, meta_path, path);
    for (const auto& e : dict.at("module").toGenericDict()) {
      const std::string& name = e.key().toStringRef();
      const at::Tensor& t = e.value().toTensor();
      if (wanted && !wanted(name)) {
        out.emplace_back(name, at::empty(t.sizes(), t.options().device(at::kMeta)));
        continue;
      }
      auto [data, bytes] = zip.getRecord("data/" + record_of.at(t.storage().data()));
      at::Storage storage(at::Storage::use_byte_size_t(), bytes, std::move(data), /*allocator=*/nullptr,
                          /*resizable=*/false);
      out.emplace_back(name, at::empty({0}, t.options()).set_(storage, t.storage_offset(), t.sizes(), t.strides()));
    }
  } catch (const c10::Error& e) {
    fail(who + ": " + quoted(path) + " is not a module state save_checkpoint wrote (" + e.what_without_backtrace() + ")");
  } catch (const std::out_of_range& e) {  // no "module" or "mpzero_save_id" entry, or an unknown record
    fail(who + ": " + quoted(path) + " is not a module state save_checkpoint wrote (" + e.what() + ")");
  }
  return out;
}

}  // namespace mpzero::torch::detail

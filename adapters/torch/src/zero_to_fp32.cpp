// mpzero::torch: an engine checkpoint as one fp32 state dict (zero_to_fp32.hpp).
#include <mpzero/torch/zero_to_fp32.hpp>

#include <torch/csrc/jit/serialization/pickle.h>

#include <bit>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <sstream>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <mpzero/zero/checkpoint.hpp>

#include "checkpoint_files.hpp"

namespace mpzero::torch {

namespace {

namespace fs = std::filesystem;
using detail::fail_checkpoint;
using detail::quoted;

const char* const who = "fp32_state_dict_from_checkpoint";

std::string shape_text(c10::IntArrayRef shape) {
  std::ostringstream s;
  s << shape;
  return s.str();
}

// <checkpoint_dir>/<tag>, the tag from 'latest' when none is given.
fs::path checkpoint_path(const std::string& checkpoint_dir, const std::string& tag_arg) {
  std::string tag = tag_arg;
  if (tag.empty()) {
    const auto latest = detail::read_latest(who, checkpoint_dir);
    if (!latest) {
      fail_checkpoint(std::string(who) + ": " + quoted(fs::path(checkpoint_dir) / "latest") +
                      " does not exist, so no tag was given or found; pass the tag (a directory of " +
                      quoted(fs::path(checkpoint_dir)) + ") or the save_dir that engine.save_checkpoint wrote");
    }
    tag = *latest;
  }
  detail::check_tag(who, tag);
  return fs::path(checkpoint_dir) / tag;
}

// safetensors' name of a dtype; nullptr for one it has no name for.
const char* safetensors_dtype(at::ScalarType t) {
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

// The safetensors format (huggingface/safetensors): an 8-byte little-endian header size,
// a JSON header {name: {dtype, shape, data_offsets: [begin, end)}, "__metadata__": {...}}
// padded with spaces to a multiple of 8 bytes, then the tensors' bytes, in order,
// little-endian, with no gaps.
void write_safetensors(const fs::path& path, const ::torch::OrderedDict<std::string, ::torch::Tensor>& sd,
                       const nlohmann::ordered_json& metadata) {
  if constexpr (std::endian::native != std::endian::little) {
    fail_checkpoint("convert_checkpoint_to_fp32_state_dict: safetensors files are little-endian and this machine "
                    "is not; write a .pt file instead");
  }
  nlohmann::ordered_json header;
  header["__metadata__"] = metadata;
  std::vector<::torch::Tensor> data;
  std::uint64_t offset = 0;
  for (const auto& item : sd) {
    const ::torch::Tensor t = item.value().contiguous();
    const char* dt = safetensors_dtype(t.scalar_type());
    if (dt == nullptr) {
      fail_checkpoint("convert_checkpoint_to_fp32_state_dict: '" + item.key() + "' has dtype " +
                      std::string(c10::toString(t.scalar_type())) +
                      ", which this safetensors writer does not support; write a .pt file instead");
    }
    const std::uint64_t bytes = t.nbytes();
    header[item.key()] = {{"dtype", dt}, {"shape", t.sizes().vec()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(t);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const std::uint64_t n = text.size();
  checkpoint::write_atomically(path, [&](std::ofstream& out) {
    out.write(reinterpret_cast<const char*>(&n), sizeof n);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const ::torch::Tensor& t : data) out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
    return static_cast<bool>(out);
  });
}

}  // namespace

::torch::OrderedDict<std::string, ::torch::Tensor> fp32_state_dict_from_checkpoint(const std::string& checkpoint_dir,
                                                                                   const std::string& tag) {
  const fs::path dir = checkpoint_path(checkpoint_dir, tag);
  const fs::path meta_path = dir / "mpzero_engine.json", module_path = dir / "model_states.pt";

  // The trainable parameters' names (and those of their tied copies) and shapes, in the
  // core's order, and the save id.
  struct trainable_param {
    std::string name;
    std::vector<std::string> aliases;
    std::vector<std::int64_t> shape;
  };
  std::vector<trainable_param> trainable;
  std::uint64_t save_id = 0;
  try {
    const auto meta = nlohmann::json::parse(detail::read_text(who, meta_path, "the engine state"));
    save_id = meta.at("save_id").get<std::uint64_t>();
    for (const auto& p : meta.at("parameters")) {
      trainable.push_back({p.at("name").get<std::string>(),
                           p.value("aliases", std::vector<std::string>{}),
                           p.at("shape").get<std::vector<std::int64_t>>()});
    }
  } catch (const nlohmann::json::exception& e) {
    fail_checkpoint(std::string(who) + ": " + quoted(meta_path) + " is not an engine state save_checkpoint wrote (" +
                    e.what() + ")");
  }
  const auto different_saves = [&](const fs::path& other) {
    fail_checkpoint(std::string(who) + ": " + quoted(meta_path) + " and " + quoted(other) +
                    " come from different saves (a save that failed midway); use a checkpoint whose save completed");
  };

  // The master weights, whole. Wrapped in tensors without a copy: each tensor owns its
  // vector. A tied weight's names all get the one tensor.
  checkpoint::fp32_weights weights = checkpoint::read_fp32_weights(dir);
  if (weights.header.save_id != save_id) different_saves(checkpoint::shard_path(dir, 0));
  if (weights.params.size() != trainable.size()) {
    fail_checkpoint(std::string(who) + ": " + quoted(meta_path) + " lists " + std::to_string(trainable.size()) +
                    " trainable parameters and the shard files hold " + std::to_string(weights.params.size()) +
                    "; the checkpoint is corrupt");
  }
  std::unordered_map<std::string, ::torch::Tensor> master;
  for (std::size_t i = 0; i < trainable.size(); ++i) {
    const trainable_param& tp = trainable[i];
    auto values = std::make_shared<std::vector<float>>(std::move(weights.params[i]));
    if (static_cast<std::int64_t>(values->size()) != c10::multiply_integers(tp.shape)) {
      fail_checkpoint(std::string(who) + ": '" + tp.name + "' has shape " + shape_text(tp.shape) + " in " +
                      quoted(meta_path) + " and " + std::to_string(values->size()) +
                      " elements in the shard files; the checkpoint is corrupt");
    }
    float* p = values->data();
    const ::torch::Tensor t = ::torch::from_blob(p, tp.shape, [values](void*) mutable { values.reset(); },
                                                 ::torch::TensorOptions().dtype(::torch::kFloat));
    master.emplace(tp.name, t);
    for (const std::string& alias : tp.aliases) master.emplace(alias, t);
  }

  // The module's entries, in its order: trainable ones (and their tied copies) from the
  // master weights; 16-bit floating ones converted to fp32 (exactly); others as saved.
  ::torch::OrderedDict<std::string, ::torch::Tensor> out;
  std::unordered_set<std::string> unused;
  for (const auto& [name, t] : master) unused.insert(name);
  try {
    const c10::IValue top = ::torch::jit::pickle_load(detail::read_file(who, module_path, "the module state"));
    const auto dict = top.toGenericDict();
    if (static_cast<std::uint64_t>(dict.at("mpzero_save_id").toInt()) != save_id) different_saves(module_path);
    for (const auto& entry : dict.at("module").toGenericDict()) {
      const std::string& name = entry.key().toStringRef();
      const ::torch::Tensor saved = entry.value().toTensor();
      const auto it = master.find(name);
      if (it != master.end()) {
        if (saved.sizes() != it->second.sizes()) {
          fail_checkpoint(std::string(who) + ": '" + name + "' has shape " + shape_text(saved.sizes()) + " in " +
                          quoted(module_path) + " and " + shape_text(it->second.sizes()) + " in " + quoted(meta_path) +
                          "; the checkpoint is corrupt");
        }
        out.insert(name, it->second);
        unused.erase(name);
      } else {
        const auto st = saved.scalar_type();
        out.insert(name, st == at::kHalf || st == at::kBFloat16 ? saved.to(::torch::kFloat) : saved);
      }
    }
  } catch (const c10::Error& e) {
    fail_checkpoint(std::string(who) + ": " + quoted(module_path) + " is not a module state save_checkpoint wrote (" +
                    e.what_without_backtrace() + ")");
  } catch (const std::out_of_range& e) {
    fail_checkpoint(std::string(who) + ": " + quoted(module_path) + " is not a module state save_checkpoint wrote (" +
                    e.what() + ")");
  }
  if (!unused.empty()) {
    fail_checkpoint(std::string(who) + ": " + quoted(module_path) + " has no '" + *unused.begin() + "', which " +
                    quoted(meta_path) + " lists as trainable; the checkpoint is corrupt");
  }
  return out;
}

std::size_t convert_checkpoint_to_fp32_state_dict(const std::string& checkpoint_dir, const std::string& output_file,
                                                  const std::string& tag) {
  const auto sd = fp32_state_dict_from_checkpoint(checkpoint_dir, tag);
  const fs::path out(output_file);
  if (out.extension() == ".safetensors") {
    nlohmann::ordered_json metadata = {{"format", "pt"}, {"source", "mpzero checkpoint"}};
    write_safetensors(out, sd, metadata);
  } else {
    c10::Dict<std::string, at::Tensor> dict;
    for (const auto& item : sd) dict.insert(item.key(), item.value());
    const std::vector<char> bytes = ::torch::jit::pickle_save(dict);
    detail::write_atomically(out, std::string_view(bytes.data(), bytes.size()));
  }
  return sd.size();
}

}  // namespace mpzero::torch

// mpzero::torch: an engine checkpoint as one fp32 state dict (zero_to_fp32.hpp).
#include <mpzero/torch/zero_to_fp32.hpp>

#include <bit>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <mpzero/torch/config.hpp>
#include <mpzero/zero/checkpoint.hpp>

#include "checkpoint_files.hpp"

namespace mpzero::torch {

namespace {

namespace fs = std::filesystem;
using detail::fail;
using detail::quoted;
using detail::shape_of;

const std::string who = "fp32_state_dict_from_checkpoint";

// <checkpoint_dir>/<tag>, the tag from 'latest' when none is given.
fs::path checkpoint_path(const std::string& checkpoint_dir, const std::string& tag_arg) {
  std::string tag = tag_arg;
  if (tag.empty()) {
    const auto latest = detail::read_latest(who, checkpoint_dir);
    if (!latest) {
      fail(who + ": " + quoted(fs::path(checkpoint_dir) / "latest") +
           " does not exist, so no tag was given or found; pass the tag (a directory of " +
           quoted(fs::path(checkpoint_dir)) + ") or the save_dir that engine.save_checkpoint wrote");
    }
    tag = *latest;
  }
  detail::check_tag(who, tag);
  return fs::path(checkpoint_dir) / tag;
}

}  // namespace

namespace {

// AutoTP: the tensor-parallel ranks' state dicts (their slices) joined into whole tensors
// by the partition plan the engine file records; replicated entries are rank 0's.
::torch::OrderedDict<std::string, ::torch::Tensor> join_tensor_parallel(const fs::path& dir, std::uint64_t tp) {
  std::vector<::torch::OrderedDict<std::string, ::torch::Tensor>> parts;
  for (std::uint64_t r = 0; r < tp; ++r)
    parts.push_back(fp32_state_dict_from_checkpoint(dir.string(), tp_checkpoint_directory(r)));
  const detail::saved_tp_layout layout = detail::read_saved_tp_layout(who, dir, tp);
  const detail::engine_meta meta = detail::read_engine_meta(who, dir / tp_checkpoint_directory(0) / "mpzero_engine.json");
  const auto& plan = layout.plan;
  const auto& shapes = layout.shapes;
  std::unordered_map<std::string, std::size_t> index;
  for (std::size_t i = 0; i < meta.params.size(); ++i) {
    index.emplace(meta.params[i].name, i);
    for (const std::string& a : meta.params[i].aliases) index.emplace(a, i);
  }
  ::torch::OrderedDict<std::string, ::torch::Tensor> out;
  for (const auto& item : parts[0]) {
    const auto it = index.find(item.key());
    if (it == index.end() || plan[it->second].type == tp_partition::skip) {
      out.insert(item.key(), item.value());
      continue;
    }
    const std::size_t i = it->second;
    ::torch::Tensor whole = ::torch::empty({c10::multiply_integers(shapes[i])}, ::torch::kFloat);
    for (std::uint64_t r = 0; r < tp; ++r) {
      const ::torch::Tensor slice = parts[r][item.key()].reshape({-1});
      std::int64_t at = 0;
      for (const auto& [first, n] : tp_shard_runs(plan[i], tp, r)) {
        whole.narrow(0, first, n).copy_(slice.narrow(0, at, n));
        at += n;
      }
    }
    out.insert(item.key(), whole.reshape(shapes[i]));
  }
  return out;
}

}  // namespace

::torch::OrderedDict<std::string, ::torch::Tensor> fp32_state_dict_from_checkpoint(const std::string& checkpoint_dir,
                                                                                   const std::string& tag) {
  const fs::path dir = checkpoint_path(checkpoint_dir, tag);
  if (const std::uint64_t tp = saved_tensor_parallel_size(dir); tp > 1) return join_tensor_parallel(dir, tp);
  const fs::path meta_path = dir / "mpzero_engine.json", module_path = dir / "model_states.pt";
  const detail::engine_meta meta = detail::read_engine_meta(who, meta_path);

  // The master weights, whole. Wrapped in tensors without a copy: each tensor owns its
  // vector. A tied weight's names all get the one tensor.
  checkpoint::fp32_weights weights = checkpoint::read_fp32_weights(dir);
  if (weights.header.save_id != meta.save_id) detail::different_saves(who, meta_path, checkpoint::shard_path(dir, 0));
  if (weights.params.size() != meta.params.size()) {
    fail(who + ": " + quoted(meta_path) + " lists " + std::to_string(meta.params.size()) +
         " trainable parameters and the shard files hold " + std::to_string(weights.params.size()) +
         "; the checkpoint is corrupt");
  }
  std::unordered_map<std::string, ::torch::Tensor> master;
  for (std::size_t i = 0; i < meta.params.size(); ++i) {
    const detail::engine_meta::param& tp = meta.params[i];
    auto values = std::make_shared<std::vector<float>>(std::move(weights.params[i]));
    if (static_cast<std::int64_t>(values->size()) != c10::multiply_integers(tp.shape)) {
      fail(who + ": '" + tp.name + "' has shape " + shape_of(tp.shape) + " in " + quoted(meta_path) + " and " +
           std::to_string(values->size()) + " elements in the shard files; the checkpoint is corrupt");
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
  for (const auto& [name, saved] : detail::read_module_states(who, module_path, meta.save_id, meta_path)) {
    const auto it = master.find(name);
    if (it != master.end()) {
      if (saved.sizes() != it->second.sizes()) {
        fail(who + ": '" + name + "' has shape " + shape_of(saved.sizes()) + " in " + quoted(module_path) + " and " +
             shape_of(it->second.sizes()) + " in " + quoted(meta_path) + "; the checkpoint is corrupt");
      }
      out.insert(name, it->second);
      unused.erase(name);
    } else {
      const auto st = saved.scalar_type();
      out.insert(name, st == at::kHalf || st == at::kBFloat16 ? saved.to(::torch::kFloat) : saved);
    }
  }
  if (!unused.empty()) {
    fail(who + ": " + quoted(module_path) + " has no '" + *unused.begin() + "', which " + quoted(meta_path) +
         " lists as trainable; the checkpoint is corrupt");
  }
  return out;
}

std::size_t save_state_dict(const ::torch::OrderedDict<std::string, ::torch::Tensor>& state_dict,
                            const std::string& output_file) {
  const fs::path out(output_file);
  if (out.extension() == ".safetensors") {
    std::vector<std::pair<std::string, at::Tensor>> items;
    for (const auto& item : state_dict) items.emplace_back(item.key(), item.value());
    detail::write_safetensors(out, items, {{"format", "pt"}, {"source", "mpzero checkpoint"}});
  } else {
    c10::Dict<std::string, at::Tensor> dict;
    for (const auto& item : state_dict) dict.insert(item.key(), item.value());
    detail::write_torch_file(out, dict);
  }
  return state_dict.size();
}

std::size_t convert_checkpoint_to_fp32_state_dict(const std::string& checkpoint_dir, const std::string& output_file,
                                                  const std::string& tag) {
  return save_state_dict(fp32_state_dict_from_checkpoint(checkpoint_dir, tag), output_file);
}

}  // namespace mpzero::torch

// mpzero::torch: DeepSpeed's AutoTP training configuration (the "tensor_parallel"
// section) and the partition plan it gives a model: which parameters are split across
// the tensor-parallel ranks, along which dimension, in which sub-parameter segments, and
// the slice of each that a tensor-parallel rank holds.
//
//   "tensor_parallel": {"autotp_size": 2, "preset_model": "llama",
//                       "partition_config": {"use_default_specs": true, "layer_specs": [
//                         {"patterns": [".*\\.gate_up_proj\\.weight$"], "partition_type": "column",
//                          "shape": [2, -1], "partition_dim": 0}]}}
//
// A layer spec names weights by regular expressions matched from the start of the
// parameter's name (Python's re.match, as DeepSpeed). A column-parallel weight ([out,
// in]) is split on dimension 0, its bias with it; a row-parallel weight on dimension 1,
// its bias kept whole (added once, after the reduction). "shape" views the weight as
// another shape first (-1: inferred) and splits each sub-parameter along partition_dim:
// [2, -1] is two stacked matrices (a fused gate_up), [[q, kv, kv], -1] three of unequal
// sizes (a GQA fused qkv); every sub-parameter is split evenly, and a rank's shard is its
// piece of each, in order.
//
// Torch-free (plain g++): the plan is a function of names and shapes.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mpzero::torch {

enum class tp_partition : std::uint8_t { column, row, skip };

struct tp_layer_spec {
  std::vector<std::string> patterns;  // regular expressions (ECMAScript), matched from the name's start
  tp_partition partition_type = tp_partition::column;
  // The logical shape: each entry > 0 or -1 (inferred, at most one); empty: the weight's
  // own shape. sub_sizes: the unequal sub-parameter sizes at partition_dim (DeepSpeed's
  // nested list, [[q, kv, kv], -1]); the entry of shape there is then their sum.
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> sub_sizes;
  int partition_dim = -1;  // -1: 0 for column, 1 for row
  std::vector<std::string> model_types;  // applies only when preset_model is one of them (any case)
  friend bool operator==(const tp_layer_spec&, const tp_layer_spec&) = default;
  // The dimension split: partition_dim, or the partition type's default.
  int dim() const { return partition_dim >= 0 ? partition_dim : partition_type == tp_partition::row ? 1 : 0; }
};

struct tensor_parallel_config {
  std::uint64_t autotp_size = 1;  // ranks per tensor-parallel group (consecutive ranks)
  std::string preset_model;       // "llama", "qwen2" (DeepSpeed's names; lower case), or ""
  bool use_default_specs = true;  // with a preset: the preset's specs after layer_specs
  std::vector<tp_layer_spec> layer_specs;
  bool enabled() const { return autotp_size > 1; }
  friend bool operator==(const tensor_parallel_config&, const tensor_parallel_config&) = default;
};

// The preset names DeepSpeed lists, and whether mpzero has each one's specs.
std::span<const std::string_view> tp_preset_names();
bool tp_preset_available(std::string_view name);
// A preset's layer specs (LLaMA's and Qwen2's attention and MLP projections); config_error
// for a name without one.
std::vector<tp_layer_spec> tp_preset_specs(std::string_view name);
// The specs a config applies, in order of precedence: layer_specs, then the preset's
// (with use_default_specs, or when no layer_specs are given).
std::vector<tp_layer_spec> tp_effective_specs(const tensor_parallel_config& c);

// How one parameter is split: type skip (replicated) for a parameter no spec takes.
struct tp_param_plan {
  tp_partition type = tp_partition::skip;
  int spec = -1;                      // index into tp_effective_specs, -1: none (or a row bias)
  std::vector<std::int64_t> view;     // the logical shape (the parameter's own when no "shape")
  int dim = 0;                        // the dimension of `view` that is split
  std::vector<std::int64_t> segments; // the sub-parameter sizes along dim (one: the whole dim)
  std::vector<std::int64_t> shard_shape;  // the parameter's shape on one tensor-parallel rank
};

// The plan for a model: one entry per parameter (names as named_parameters() gives them,
// shapes whole). A weight's bias ("<layer>.bias" for "<layer>.weight") follows it: split
// with a column weight, whole beside a row one. Throws config_error naming the spec and
// the parameter for a pattern that matches no parameter, a shape that does not multiply
// out to the parameter's, a partition_dim out of range, or a segment the tensor-parallel
// size does not divide.
std::vector<tp_param_plan> plan_tensor_parallel(const tensor_parallel_config& c, std::span<const std::string> names,
                                                std::span<const std::vector<std::int64_t>> shapes);

// The elements of a split parameter that tensor-parallel rank `rank` holds, as runs
// {first, count} of the parameter's row-major flat index, in the order of the shard's
// own row-major layout. One run {0, numel} for a replicated parameter.
std::vector<std::pair<std::int64_t, std::int64_t>> tp_shard_runs(const tp_param_plan& p, std::uint64_t tp_size,
                                                                  std::uint64_t rank);

// ---- checkpoints ----------------------------------------------------------------------
// An AutoTP checkpoint keeps tensor-parallel rank r's files (its data-parallel group's
// shard files, its engine file and module states) in <tag>/tp_rank_<r>/.
std::string tp_checkpoint_directory(std::uint64_t rank);
// The tensor-parallel size the save in `tag_dir` was made at: 1 without such directories.
std::uint64_t saved_tensor_parallel_size(const std::filesystem::path& tag_dir);

// The shard files of the save in `tag_dir`, at another tensor-parallel size: joins the
// `saved_tp` ranks' slices (cut by the `saved` plans) and writes into `out_dir` one shard
// file (world size 1) with rank `rank` of `new_tp`'s slices (cut by the `now` plans):
// parameters, master weights and optimizer states in their stored dtypes, the step count
// and the loss scaler, under the save's id. A ZeRO core of any data-parallel size then
// loads it. Needs host memory for one whole parameter's arrays at a time. Throws
// mpzero::invalid_argument naming the file for a corrupt or mixed set.
void reshard_tensor_parallel(const std::filesystem::path& tag_dir, std::uint64_t saved_tp,
                             std::span<const tp_param_plan> saved, std::uint64_t new_tp, std::uint64_t rank,
                             std::span<const tp_param_plan> now, const std::filesystem::path& out_dir);

}  // namespace mpzero::torch

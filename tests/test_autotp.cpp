// DeepSpeed's AutoTP training config ("tensor_parallel") and the partition plan
// (mpzero/torch/autotp.hpp): parsing, the refusals, the presets, and the slice of each
// weight a tensor-parallel rank holds, checked against indices worked out by hand from
// the definitions (column: the output rows of each sub-parameter; row: the input columns).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <mpzero/torch/autotp.hpp>
#include <mpzero/torch/config.hpp>

using namespace mpzero::torch;
using json = nlohmann::json;
using runs = std::vector<std::pair<std::int64_t, std::int64_t>>;

namespace {

config parse_tp(const json& tp, int world = 4, int stage = 2) {
  return parse_config(json{{"train_micro_batch_size_per_gpu", 1},
                           {"zero_optimization", {{"stage", stage}}},
                           {"tensor_parallel", tp}},
                      world);
}

// A transformer block with a GQA fused qkv (q 8 rows, k and v 4 each, 8 inputs), a fused
// gate_up (2 x 12 rows), and the two row-parallel projections.
const std::vector<std::string> names = {"layers.0.input_layernorm.weight", "layers.0.self_attn.qkv_proj.weight",
                                        "layers.0.self_attn.qkv_proj.bias",  "layers.0.self_attn.o_proj.weight",
                                        "layers.0.self_attn.o_proj.bias",    "layers.0.mlp.gate_up_proj.weight",
                                        "layers.0.mlp.down_proj.weight"};
const std::vector<std::vector<std::int64_t>> shapes = {{8}, {16, 8}, {16}, {8, 8}, {8}, {24, 8}, {8, 12}};

const json block_specs = json::array(
    {{{"patterns", {R"(.*\.qkv_proj\.weight$)"}}, {"partition_type", "column"}, {"shape", {{8, 4, 4}, -1}},
      {"partition_dim", 0}},
     {{"patterns", {R"(.*\.gate_up_proj\.weight$)"}}, {"partition_type", "column"}, {"shape", {2, -1}},
      {"partition_dim", 0}},
     {{"patterns", {R"(.*\.(o_proj|down_proj)\.weight$)"}}, {"partition_type", "row"}}});

}  // namespace

TEST_CASE("autotp: the tensor_parallel section is read with DeepSpeed's keys and round-trips", "[config]") {
  const config c = parse_tp({{"autotp_size", 2}, {"preset_model", "LLaMA"},
                             {"partition_config", {{"use_default_specs", true}, {"layer_specs", block_specs}}}});
  const tensor_parallel_config& t = c.tensor_parallel;
  CHECK(t.autotp_size == 2);
  CHECK(t.enabled());
  CHECK(t.preset_model == "llama");
  REQUIRE(t.layer_specs.size() == 3);
  CHECK(t.layer_specs[0].sub_sizes == std::vector<std::int64_t>{8, 4, 4});
  CHECK(t.layer_specs[1].shape == std::vector<std::int64_t>{2, -1});
  CHECK(t.layer_specs[2].partition_type == tp_partition::row);
  CHECK(t.layer_specs[2].dim() == 1);
  // The custom specs first, then the preset's four.
  CHECK(tp_effective_specs(t).size() == 7);
  const config back = parse_config(to_json(c), 4);
  CHECK(back.tensor_parallel == t);
  CHECK_FALSE(parse_tp({{"autotp_size", 1}}).tensor_parallel.enabled());
}

TEST_CASE("autotp: a config AutoTP cannot run is refused, naming the key and the fix", "[config]") {
  CHECK_THROWS_WITH(parse_tp({{"autotp_size", 2}, {"preset_model", "llama"}}, 4, 3),
                    Catch::Contains("with ZeRO stage 3: AutoTP trains with stages 0-2"));
  CHECK_THROWS_WITH(parse_tp({{"autotp_size", 3}, {"preset_model", "llama"}}, 4),
                    Catch::Contains("'tensor_parallel.autotp_size' = 3 does not divide the 4 ranks"));
  CHECK_THROWS_WITH(parse_tp({{"autotp_size", 2}}),
                    Catch::Contains("without 'preset_model' or 'partition_config.layer_specs'"));
  CHECK_THROWS_WITH(parse_tp({{"autotp_size", 2}, {"preset_model", "gpt2"}}),
                    Catch::Contains("\"gpt2\" is not a preset; the presets are llama, bloom, chatglm, mixtral, "
                                    "deepseek_v2, qwen2, phi3"));
  CHECK_THROWS_WITH(parse_tp({{"autotp_size", 2}, {"tp_size", 2}}), Catch::Contains("unknown key 'tensor_parallel.tp_size'"));
  const auto spec = [](const json& s) {
    return parse_tp({{"autotp_size", 2}, {"partition_config", {{"layer_specs", json::array({s})}}}});
  };
  CHECK_THROWS_WITH(spec({{"patterns", {"x"}}, {"partition_type", "diagonal"}}),
                    Catch::Contains("partition_type' = \"diagonal\" is invalid; use \"column\", \"row\" or \"skip\""));
  CHECK_THROWS_WITH(spec({{"patterns", {"x("}}}), Catch::Contains("\"x(\" is not a regular expression"));
  CHECK_THROWS_WITH(spec({{"partition_type", "row"}}), Catch::Contains("patterns' is missing or empty"));
  CHECK_THROWS_WITH(spec({{"patterns", {"x"}}, {"shape", {2, {1, 2}}}, {"partition_dim", 0}}),
                    Catch::Contains("a list of sizes is allowed only at partition_dim (0), not at 1"));
  CHECK_THROWS_WITH(spec({{"patterns", {"x"}}, {"shape", {0, -1}}}),
                    Catch::Contains("entries must be positive integers or -1"));
  CHECK_THROWS_WITH(spec({{"patterns", {"x"}}, {"shape", {2, -1}}, {"partition_dim", 2}}),
                    Catch::Contains("partition_dim' = 2 is out of range for the shape of 2 dimensions"));
}

TEST_CASE("autotp: the plan splits fused and GQA weights by sub-parameter; biases follow their weights", "[config]") {
  tensor_parallel_config t = parse_tp({{"autotp_size", 2}, {"partition_config", {{"layer_specs", block_specs}}}})
                                 .tensor_parallel;
  const auto plan = plan_tensor_parallel(t, names, shapes);
  REQUIRE(plan.size() == names.size());
  CHECK(plan[0].type == tp_partition::skip);  // the norm: replicated
  CHECK(plan[0].shard_shape == std::vector<std::int64_t>{8});
  CHECK(plan[1].type == tp_partition::column);
  CHECK(plan[1].segments == std::vector<std::int64_t>{8, 4, 4});
  CHECK(plan[1].shard_shape == std::vector<std::int64_t>{8, 8});
  CHECK(plan[2].type == tp_partition::column);  // qkv's bias: split with its rows
  CHECK(plan[2].shard_shape == std::vector<std::int64_t>{8});
  CHECK(plan[3].type == tp_partition::row);
  CHECK(plan[3].shard_shape == std::vector<std::int64_t>{8, 4});
  CHECK(plan[4].type == tp_partition::skip);  // o_proj's bias: whole, added after the reduction
  CHECK(plan[5].segments == std::vector<std::int64_t>{12, 12});
  CHECK(plan[5].shard_shape == std::vector<std::int64_t>{12, 8});
  CHECK(plan[6].shard_shape == std::vector<std::int64_t>{8, 6});

  // qkv, rank 1: q rows 4-7, k rows 10-11, v rows 14-15 (8 elements per row).
  CHECK(tp_shard_runs(plan[1], 2, 1) == runs{{4 * 8, 4 * 8}, {10 * 8, 2 * 8}, {14 * 8, 2 * 8}});
  CHECK(tp_shard_runs(plan[2], 2, 1) == runs{{4, 4}, {10, 2}, {14, 2}});
  // gate_up, rank 0: gate rows 0-5 and up rows 12-17.
  CHECK(tp_shard_runs(plan[5], 2, 0) == runs{{0, 6 * 8}, {12 * 8, 6 * 8}});
  // o_proj, rank 1: input columns 4-7 of each of its 8 rows.
  runs o;
  for (std::int64_t r = 0; r < 8; ++r) o.emplace_back(r * 8 + 4, 4);
  CHECK(tp_shard_runs(plan[3], 2, 1) == o);
  CHECK(tp_shard_runs(plan[0], 2, 1) == runs{{0, 8}});

  // Every element is held by exactly one rank, at every split size that divides the segments.
  for (std::uint64_t tp : {1u, 2u, 4u}) {
    t.autotp_size = tp;
    const auto p = plan_tensor_parallel(t, names, shapes);
    for (std::size_t i = 0; i < names.size(); ++i) {
      if (p[i].type == tp_partition::skip) continue;
      std::int64_t numel = 1;
      for (auto d : shapes[i]) numel *= d;
      std::vector<int> owners(static_cast<std::size_t>(numel), 0);
      std::int64_t shard = 1;
      for (auto d : p[i].shard_shape) shard *= d;
      for (std::uint64_t r = 0; r < tp; ++r) {
        std::int64_t held = 0;
        for (const auto& [first, n] : tp_shard_runs(p[i], tp, r)) {
          for (std::int64_t e = first; e < first + n; ++e) ++owners[static_cast<std::size_t>(e)];
          held += n;
        }
        CHECK(held == shard);
      }
      INFO(names[i] << " at tp " << tp);
      CHECK(std::all_of(owners.begin(), owners.end(), [](int k) { return k == 1; }));
    }
  }
}

TEST_CASE("autotp: a spec that matches nothing, a shape that does not multiply out, an indivisible split", "[config]") {
  tensor_parallel_config t;
  t.autotp_size = 2;
  t.layer_specs = parse_tp({{"autotp_size", 2}, {"partition_config", {{"layer_specs", block_specs}}}})
                      .tensor_parallel.layer_specs;
  t.layer_specs[2].patterns = {R"(\.o_proj\.weight$)"};  // anchored at the start, as re.match: matches nothing
  CHECK_THROWS_WITH(plan_tensor_parallel(t, names, shapes),
                    Catch::Contains("layer spec 2 (patterns \"\\.o_proj\\.weight$\") matches no parameter"));
  t.layer_specs[2].patterns = {R"(.*\.(o_proj|down_proj)\.weight$)"};
  t.layer_specs[0].sub_sizes = {8, 4, 5};
  CHECK_THROWS_WITH(plan_tensor_parallel(t, names, shapes),
                    Catch::Contains("on 'layers.0.self_attn.qkv_proj.weight' of shape [16, 8]: shape [[8, 4, 5], -1] does "
                                    "not multiply out to its 128 elements"));
  t.layer_specs[0].sub_sizes = {8, 4, 4};
  t.autotp_size = 8;  // q's 8 rows split, but not k's 4
  CHECK_THROWS_WITH(plan_tensor_parallel(t, names, shapes),
                    Catch::Contains("its sub-parameter of 4 along partition dimension 0 is not divisible by "
                                    "autotp_size 8"));
  t.autotp_size = 2;
  t.layer_specs[1].shape = {5, -1};
  CHECK_THROWS_WITH(plan_tensor_parallel(t, names, shapes),
                    Catch::Contains("its dimension 0 (24) does not hold 5 equal sub-parameters"));
}

TEST_CASE("autotp: presets name Hugging Face's layers; model_types limits a spec to its family", "[config]") {
  tensor_parallel_config t = parse_tp({{"autotp_size", 2}, {"preset_model", "qwen2"}}).tensor_parallel;
  const std::vector<std::string> hf = {"model.embed_tokens.weight",         "model.layers.0.self_attn.q_proj.weight",
                                       "model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.o_proj.weight",
                                       "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight"};
  const std::vector<std::vector<std::int64_t>> hs = {{32, 8}, {8, 8}, {8}, {8, 8}, {16, 8}, {8, 16}};
  auto p = plan_tensor_parallel(t, hf, hs);
  CHECK(p[0].type == tp_partition::skip);
  CHECK(p[1].type == tp_partition::column);
  CHECK(p[2].type == tp_partition::column);
  CHECK(p[3].type == tp_partition::row);
  CHECK(p[4].type == tp_partition::column);
  CHECK(p[5].type == tp_partition::row);
  for (std::string_view name : tp_preset_names()) CHECK(tp_preset_available(name));
  tensor_parallel_config phi3;
  phi3.autotp_size = 2;
  phi3.preset_model = "phi3";
  CHECK(tp_effective_specs(phi3).size() == 4);
  // A custom spec for another family does not apply (and is not "unmatched"); one for this
  // family comes before the preset's.
  tp_layer_spec other;
  other.patterns = {R"(.*embed_tokens\.weight$)"};
  other.model_types = {"llama"};
  t.layer_specs = {other};
  CHECK(plan_tensor_parallel(t, hf, hs)[0].type == tp_partition::skip);
  t.layer_specs[0].model_types = {"Qwen2"};
  p = plan_tensor_parallel(t, hf, hs);
  CHECK(p[0].type == tp_partition::column);
  CHECK(p[0].shard_shape == std::vector<std::int64_t>{16, 8});
}

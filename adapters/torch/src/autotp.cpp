// The AutoTP partition plan (autotp.hpp): presets, spec matching, shapes and shards.
#include <mpzero/torch/autotp.hpp>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <array>
#include <cctype>
#include <cstdint>
#include <numeric>
#include <regex>
#include <string>
#include <type_traits>

#include <mpzero/torch/config.hpp>
#include <mpzero/zero/checkpoint.hpp>

namespace mpzero::torch {

namespace {

[[noreturn]] void fail(const std::string& what) { throw config_error("mpzero: config: " + what); }

std::string lower(std::string_view s) {
  std::string r(s);
  for (char& c : r) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return r;
}

std::string shape_text(const std::vector<std::int64_t>& s) {
  std::string r = "[";
  for (std::size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

// A spec's shape as the config writes it: [[8, 4, 4], -1].
std::string spec_shape_text(const tp_layer_spec& s) {
  std::string r = "[";
  for (std::size_t k = 0; k < s.shape.size(); ++k) {
    r += k ? ", " : "";
    r += !s.sub_sizes.empty() && static_cast<int>(k) == s.dim() ? shape_text(s.sub_sizes) : std::to_string(s.shape[k]);
  }
  return r + "]";
}

std::string spec_text(const tp_layer_spec& s, std::size_t index) {
  std::string r = "tensor_parallel layer spec " + std::to_string(index) + " (patterns";
  for (const std::string& p : s.patterns) r += " \"" + p + "\"";
  return r + ")";
}

tp_layer_spec spec(std::string pattern, tp_partition type, std::vector<std::int64_t> shape = {}, int dim = -1) {
  tp_layer_spec s;
  s.patterns = {std::move(pattern)};
  s.partition_type = type;
  s.shape = std::move(shape);
  s.partition_dim = dim;
  return s;
}

constexpr auto col = tp_partition::column;
constexpr auto row = tp_partition::row;
constexpr auto skip = tp_partition::skip;

// Hugging Face's parameter names of each family: attention output and MLP down
// projections row-parallel, the projections into them column-parallel; fused weights
// viewed as their stacked parts.
std::vector<tp_layer_spec> llama_like() {
  return {spec(R"(.*\.self_attn\.o_proj\.weight$)", row), spec(R"(.*\.self_attn\.[qkv]_proj\.weight$)", col),
          spec(R"(.*\.mlp\.down_proj\.weight$)", row), spec(R"(.*\.mlp\.(up|gate)_proj\.weight$)", col)};
}

constexpr std::array<std::string_view, 7> preset_list = {"llama",  "bloom", "chatglm", "mixtral",
                                                         "deepseek_v2", "qwen2", "phi3"};

}  // namespace

std::span<const std::string_view> tp_preset_names() { return preset_list; }

bool tp_preset_available(std::string_view name) {
  const std::string n = lower(name);
  return std::find(preset_list.begin(), preset_list.end(), n) != preset_list.end();
}

std::vector<tp_layer_spec> tp_preset_specs(std::string_view name) {
  const std::string n = lower(name);
  if (n == "llama" || n == "qwen2") return llama_like();
  if (n == "bloom") {
    // Bloom interleaves heads in its fused query_key_value ([q1, k1, v1, q2, ...]): a plain split.
    return {spec(R"(.*\.self_attention\.dense\.weight$)", row),
            spec(R"(.*\.self_attention\.query_key_value\.weight$)", col),
            spec(R"(.*\.mlp\.dense_4h_to_h\.weight$)", row), spec(R"(.*\.mlp\.dense_h_to_4h\.weight$)", col)};
  }
  if (n == "chatglm") {
    return {spec(R"(.*\.self_attention\.dense\.weight$)", row),
            spec(R"(.*\.self_attention\.query_key_value\.weight$)", col, {3, -1}, 0),
            spec(R"(.*\.mlp\.dense_4h_to_h\.weight$)", row),
            spec(R"(.*\.mlp\.dense_h_to_4h\.weight$)", col, {2, -1}, 0)};
  }
  if (n == "mixtral") {
    return {spec(R"(.*\.self_attn\.o_proj\.weight$)", row), spec(R"(.*\.self_attn\.[qkv]_proj\.weight$)", col),
            spec(R"(.*\.block_sparse_moe\.experts\.\d+\.w2\.weight$)", row),
            spec(R"(.*\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$)", col),
            spec(R"(.*\.block_sparse_moe\.gate\.weight$)", skip)};
  }
  if (n == "deepseek_v2") {
    return {spec(R"(.*\.self_attn\.o_proj\.weight$)", row),
            spec(R"(.*\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$)", skip),
            spec(R"(.*\.self_attn\.(q_b_proj|kv_b_proj)\.weight$)", col),
            spec(R"(.*\.mlp\.experts\.\d+\.down_proj\.weight$)", row),
            spec(R"(.*\.mlp\.experts\.\d+\.(up|gate)_proj\.weight$)", col), spec(R"(.*\.mlp\.gate\.weight$)", skip),
            spec(R"(.*\.mlp\.shared_experts\.down_proj\.weight$)", row),
            spec(R"(.*\.mlp\.shared_experts\.(up|gate)_proj\.weight$)", col)};
  }
  if (n == "phi3") {
    return {spec(R"(.*\.self_attn\.o_proj\.weight$)", row),
            spec(R"(.*\.self_attn\.qkv_proj\.weight$)", col, {3, -1}, 0), spec(R"(.*\.mlp\.down_proj\.weight$)", row),
            spec(R"(.*\.mlp\.gate_up_proj\.weight$)", col, {2, -1}, 0)};
  }
  std::string names;
  for (auto p : preset_list) names += (names.empty() ? "" : ", ") + std::string(p);
  fail("'tensor_parallel.preset_model' = \"" + std::string(name) + "\" is not a preset; the presets are " + names +
       " (or give partition_config.layer_specs)");
}

std::vector<tp_layer_spec> tp_effective_specs(const tensor_parallel_config& c) {
  std::vector<tp_layer_spec> out = c.layer_specs;
  if (!c.preset_model.empty() && (c.use_default_specs || c.layer_specs.empty())) {
    for (tp_layer_spec& s : tp_preset_specs(c.preset_model)) out.push_back(std::move(s));
  }
  return out;
}

namespace {

// The product of v's entries [from, to).
std::int64_t product(const std::vector<std::int64_t>& v, std::size_t from = 0, std::size_t to = SIZE_MAX) {
  const auto end = static_cast<std::ptrdiff_t>(std::min(to, v.size()));
  const auto begin = std::min(static_cast<std::ptrdiff_t>(from), end);
  return std::accumulate(v.begin() + begin, v.begin() + end, std::int64_t{1}, std::multiplies<>());
}

// The view, split dimension and segments of a weight that spec `s` takes.
void plan_weight(tp_param_plan& p, const tp_layer_spec& s, const std::vector<std::int64_t>& own,
                 const std::string& who, std::uint64_t tp) {
  const int d = s.dim();
  const std::int64_t numel = product(own);
  const std::size_t rank = s.shape.empty() ? own.size() : s.shape.size();
  if (d >= static_cast<int>(rank)) {
    fail(who + ": partition_dim " + std::to_string(d) + " is out of range for " +
         (s.shape.empty() ? "its shape" : "the spec's shape " + spec_shape_text(s)) + "; use a dimension below " +
         std::to_string(rank));
  }
  const auto ud = static_cast<std::size_t>(d);
  if (s.shape.empty()) {
    p.view = own;
    p.segments = {own[ud]};
  } else if (s.shape.size() == own.size() && s.sub_sizes.empty() && s.shape[ud] > 0 && s.shape[ud] != own[ud]) {
    // n equal sub-parameters stacked along the weight's own dimension d ([2, -1] on a
    // fused gate_up): the view is the weight's shape; the other entries must agree with it.
    for (std::size_t k = 0; k < own.size(); ++k) {
      if (k != ud && s.shape[k] != -1 && s.shape[k] != own[k]) {
        fail(who + ": shape " + spec_shape_text(s) + " does not match it in dimension " + std::to_string(k) +
             "; write -1 or " + std::to_string(own[k]) + " there");
      }
    }
    const std::int64_t n = s.shape[ud];
    if (own[ud] % n != 0) {
      fail(who + ": its dimension " + std::to_string(d) + " (" + std::to_string(own[ud]) + ") does not hold " +
           std::to_string(n) + " equal sub-parameters; fix the shape's entry " + std::to_string(d));
    }
    p.view = own;
    p.segments.assign(static_cast<std::size_t>(n), own[ud] / n);
  } else {
    // A logical view: -1 is what the other entries leave; sub_sizes give dimension d.
    std::vector<std::int64_t> v = s.shape;
    if (!s.sub_sizes.empty()) v[ud] = std::accumulate(s.sub_sizes.begin(), s.sub_sizes.end(), std::int64_t{0});
    const auto inferred = std::count(v.begin(), v.end(), std::int64_t{-1});
    std::int64_t known = 1;
    for (const std::int64_t x : v)
      if (x != -1) known *= x;
    if (inferred > 1 || known <= 0 || numel % known != 0 || (inferred == 0 && known != numel)) {
      fail(who + ": shape " + spec_shape_text(s) + " does not multiply out to its " + std::to_string(numel) +
           " elements; give sizes whose product is " + std::to_string(numel) + " (at most one -1)");
    }
    for (std::int64_t& x : v)
      if (x == -1) x = numel / known;
    p.view = std::move(v);
    p.segments = s.sub_sizes.empty() ? std::vector<std::int64_t>{p.view[ud]} : s.sub_sizes;
  }
  p.dim = d;
  for (const std::int64_t seg : p.segments) {
    if (seg % static_cast<std::int64_t>(tp) != 0) {
      fail(who + ": " + (p.segments.size() > 1 ? "its sub-parameter of " : "its ") + std::to_string(seg) +
           " along partition dimension " + std::to_string(d) + " is not divisible by autotp_size " +
           std::to_string(tp) + "; choose a tensor-parallel size that divides it");
    }
  }
  // The shard keeps every dimension after the split whole: the weight's own dimension
  // whose trailing elements are exactly those is the one that shrinks.
  const std::int64_t inner = product(p.view, ud + 1);
  std::size_t j = own.size();
  for (std::size_t k = 0; k < own.size(); ++k)
    if (product(own, k + 1) == inner && product(own, k) >= inner * p.view[ud]) j = k;
  if (j == own.size()) {
    fail(who + ": shape " + shape_text(p.view) + " splits dimension " + std::to_string(d) +
         " across the weight's own dimensions; use a shape whose dimensions after partition_dim are the weight's last "
         "ones");
  }
  p.shard_shape = own;
  p.shard_shape[j] /= static_cast<std::int64_t>(tp);
}

}  // namespace

std::vector<tp_param_plan> plan_tensor_parallel(const tensor_parallel_config& c, std::span<const std::string> names,
                                                std::span<const std::vector<std::int64_t>> shapes) {
  const std::vector<tp_layer_spec> specs = tp_effective_specs(c);
  const std::uint64_t tp = c.autotp_size;
  const std::string model_type = lower(c.preset_model);
  std::vector<tp_param_plan> out(names.size());
  std::vector<std::vector<std::regex>> res(specs.size());
  std::vector<bool> applies(specs.size(), true), used(specs.size(), false);
  for (std::size_t k = 0; k < specs.size(); ++k) {
    for (const std::string& p : specs[k].patterns) res[k].emplace_back(p, std::regex::ECMAScript);
    if (!specs[k].model_types.empty()) {
      applies[k] = std::any_of(specs[k].model_types.begin(), specs[k].model_types.end(),
                               [&](const std::string& m) { return lower(m) == model_type; });
    }
  }
  // Python's re.match: anchored at the start of the name, not at its end.
  const auto matches = [&](std::size_t k, const std::string& name) {
    return std::any_of(res[k].begin(), res[k].end(), [&](const std::regex& re) {
      return std::regex_search(name, re, std::regex_constants::match_continuous);
    });
  };
  for (std::size_t i = 0; i < names.size(); ++i) {
    tp_param_plan& p = out[i];
    p.view = p.shard_shape = shapes[i];
    p.segments = {};
    for (std::size_t k = 0; k < specs.size(); ++k) {
      if (!applies[k] || !matches(k, names[i])) continue;
      used[k] = true;
      p.spec = static_cast<int>(k);
      p.type = specs[k].partition_type;
      break;
    }
    if (p.type == tp_partition::skip) continue;
    const auto k = static_cast<std::size_t>(p.spec);
    plan_weight(p, specs[k], shapes[i], spec_text(specs[k], k) + " on '" + names[i] + "' of shape " + shape_text(shapes[i]),
                tp);
  }
  // A bias follows its weight: split as the weight's rows with a column weight split on
  // its first dimension, whole beside a row one (added once, after the reduction).
  for (std::size_t i = 0; i < names.size(); ++i) {
    const std::string& n = names[i];
    if (out[i].spec >= 0 || shapes[i].size() != 1 || n.size() < 5 || n.compare(n.size() - 5, 5, ".bias") != 0) continue;
    const auto w = std::find(names.begin(), names.end(), n.substr(0, n.size() - 5) + ".weight");
    if (w == names.end()) continue;
    const auto wi = static_cast<std::size_t>(w - names.begin());
    const tp_param_plan& wp = out[wi];
    if (wp.type != tp_partition::column) continue;
    if (wp.dim != 0 || wp.view.size() != shapes[wi].size() || wp.view[0] != shapes[i][0]) {
      fail("'" + n + "': the bias of a column-parallel weight split other than on its rows ('" + *w + "' viewed as " +
           shape_text(wp.view) + ", partition_dim " + std::to_string(wp.dim) +
           "); give the bias a layer spec of its own");
    }
    tp_param_plan& b = out[i];
    b.type = tp_partition::column;
    b.spec = wp.spec;
    b.view = shapes[i];
    b.dim = 0;
    b.segments = wp.segments;
    b.shard_shape = {shapes[i][0] / static_cast<std::int64_t>(tp)};
  }
  for (std::size_t k = 0; k < c.layer_specs.size(); ++k) {
    if (used[k] || !applies[k]) continue;
    std::string some;
    for (std::size_t i = 0; i < std::min<std::size_t>(names.size(), 6); ++i) some += (i ? ", " : "") + names[i];
    if (names.size() > 6) some += ", ...";
    fail(spec_text(specs[k], k) + " matches no parameter (the model's: " + some +
         "); patterns match from the start of the name, as \".*\\\\.o_proj\\\\.weight$\": fix them or remove the spec");
  }
  return out;
}

std::vector<std::pair<std::int64_t, std::int64_t>> tp_shard_runs(const tp_param_plan& p, std::uint64_t tp_size,
                                                                  std::uint64_t rank) {
  if (p.type == tp_partition::skip) return {{0, product(p.view)}};
  // Row-major over the view: for each index before the split dimension, rank r's piece
  // of every segment, each piece whole in the dimensions after it.
  const auto d = static_cast<std::size_t>(p.dim);
  const std::int64_t outer = product(p.view, 0, d), inner = product(p.view, d + 1), extent = p.view[d];
  const auto tp = static_cast<std::int64_t>(tp_size), r = static_cast<std::int64_t>(rank);
  std::vector<std::pair<std::int64_t, std::int64_t>> runs;
  for (std::int64_t o = 0; o < outer; ++o) {
    std::int64_t seg_begin = 0;
    for (const std::int64_t seg : p.segments) {
      const std::int64_t piece = seg / tp;
      const std::int64_t at = (o * extent + seg_begin + r * piece) * inner, n = piece * inner;
      if (!runs.empty() && runs.back().first + runs.back().second == at) {
        runs.back().second += n;
      } else {
        runs.emplace_back(at, n);
      }
      seg_begin += seg;
    }
  }
  return runs;
}

std::string tp_checkpoint_directory(std::uint64_t rank) { return "tp_rank_" + std::to_string(rank); }

std::uint64_t saved_tensor_parallel_size(const std::filesystem::path& tag_dir) {
  std::uint64_t n = 0;
  std::error_code ec;
  while (std::filesystem::exists(tag_dir / tp_checkpoint_directory(n), ec)) ++n;
  return n == 0 ? 1 : n;
}

void reshard_tensor_parallel(const std::filesystem::path& tag_dir, std::uint64_t saved_tp,
                             std::span<const tp_param_plan> saved, std::uint64_t new_tp, std::uint64_t rank,
                             std::span<const tp_param_plan> now, const std::filesystem::path& out_dir) {
  const std::string who = "load_checkpoint (at tensor-parallel size " + std::to_string(new_tp) + ")";
  std::vector<std::unique_ptr<checkpoint::shard_set>> sets;
  for (std::uint64_t r = 0; r < saved_tp; ++r) {
    sets.push_back(std::make_unique<checkpoint::shard_set>(
        saved_tp == 1 ? tag_dir : tag_dir / tp_checkpoint_directory(r), who));
  }
  const checkpoint::shard_header& h0 = sets[0]->first();
  for (const auto& set : sets) {
    const checkpoint::shard_header& h = set->first();
    if (h.steps != h0.steps || h.n_states != h0.n_states || h.param != h0.param ||
        h.master != h0.master || h.state != h0.state || h.has_master != h0.has_master ||
        h.numels.size() != saved.size()) {
      mpzero::detail::throw_invalid(who + ": the tensor-parallel ranks' files in " + checkpoint::detail::quoted(tag_dir) +
                                    " are not of one save (steps, dtypes or parameters differ); load a "
                                    "checkpoint whose save completed");
    }
  }
  const int arrays = 1 + (h0.has_master ? 1 : 0) + static_cast<int>(h0.n_states);
  // Per parameter and array: this rank's new slice, as bytes of the stored dtype.
  std::vector<std::vector<std::vector<unsigned char>>> slices(now.size());
  checkpoint::shard_header out = h0;
  out.rank = 0;
  out.world = 1;
  out.files = 1;
  out.numels.clear();
  out.records.clear();
  for (std::size_t i = 0; i < now.size(); ++i) {
    const std::int64_t whole_n = product(now[i].view);
    std::int64_t mine = 0;
    for (const auto& [first, n] : tp_shard_runs(now[i], new_tp, rank)) mine += n;
    if (now[i].type == tp_partition::skip) mine = whole_n;
    out.numels.push_back(static_cast<std::uint64_t>(mine));
    slices[i].resize(static_cast<std::size_t>(arrays));
    for (int a = 0; a < arrays; ++a) {
      visit_dtype(h0.array_dtype(a), [&]<class S>(S*) {
        std::vector<S> whole(static_cast<std::size_t>(whole_n));
        for (std::uint64_t r = 0; r < saved_tp; ++r) {
          if (saved[i].type == tp_partition::skip && r > 0) break;  // replicated: rank 0's
          checkpoint::shard_set& set = *sets[r];
          const std::uint64_t n = set.first().numels[i];
          std::vector<S> part(static_cast<std::size_t>(n));
          set.for_each_run(i, 0, n, [&](const checkpoint::shard_set::run& run) {
            set.read(run, a, [&](const auto* src, std::uint64_t k) {
              // The array's stored dtype: every file of the save has the same (checked above).
              if constexpr (std::is_same_v<std::remove_cvref_t<decltype(*src)>, S>) {
                std::copy_n(src, k, part.begin() + static_cast<std::ptrdiff_t>(run.at));
              }
            });
          });
          std::int64_t at = 0;
          for (const auto& [first, len] : tp_shard_runs(saved[i], saved_tp, r)) {
            std::copy_n(part.begin() + at, len, whole.begin() + first);
            at += len;
          }
        }
        std::vector<unsigned char>& bytes = slices[i][static_cast<std::size_t>(a)];
        bytes.resize(static_cast<std::size_t>(mine) * sizeof(S));
        auto* dst = reinterpret_cast<S*>(bytes.data());
        for (const auto& [first, len] : tp_shard_runs(now[i], new_tp, rank)) dst = std::copy_n(whole.begin() + first, len, dst);
      });
    }
    if (mine > 0) out.records.push_back({i, 0, static_cast<std::uint64_t>(mine), 0});
  }
  std::filesystem::create_directories(out_dir);
  checkpoint::write_shard(checkpoint::shard_path(out_dir, 0), out, [&](std::size_t k, auto&& put) {
    for (const auto& bytes : slices[out.records[k].param]) put(bytes.data(), bytes.size());
  });
}

}  // namespace mpzero::torch

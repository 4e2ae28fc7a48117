// The DeepSpeed-style JSON configuration: parsing, defaults and validation.
//
// Key names, defaults and rules follow DeepSpeed v0.19 (deepspeed/runtime/config.py,
// precision_config.py, zero/config.py, zero/offload_config.py, lr_schedules.py, and the
// engine's optimizer construction). docs/config.md is the reference; every deliberate
// difference is listed there. Errors are config_error with the full key path.
#include <mpzero/torch/config.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <regex>
#include <set>
#include <sstream>

#include <mpzero/optim/optimizer.hpp>
#include <mpzero/policy/precision.hpp>

namespace mpzero::torch {

using nlohmann::json;

namespace {

// ---- messages ---------------------------------------------------------------

[[noreturn]] void fail(const std::string& what) { throw config_error("mpzero: config: " + what); }

std::string join_path(const std::string& path, std::string_view key) {
  return path.empty() ? std::string(key) : path + "." + std::string(key);
}

std::string squote(std::string_view s) {
  std::string r;
  r.reserve(s.size() + 2);
  r.push_back('\'');
  r.append(s);
  r.push_back('\'');
  return r;
}

std::string lower(std::string_view s) {
  std::string r(s);
  for (auto& c : r) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return r;
}

// "string \"2\"", "array [1,2]", ...: what the user wrote, shortened.
std::string describe(const json& v) {
  std::string text = v.dump();
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "boolean " + text;
    case json::value_t::string: return "string " + text;
    case json::value_t::array: return "array " + text;
    case json::value_t::object: return "object " + text;
    case json::value_t::number_float: return "number " + text;
    default: return "integer " + text;
  }
}

std::string format_number(double v) {
  // Whole numbers as written in JSON, without an exponent: 1000000, not 1e+06.
  if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 1e15) return std::to_string(static_cast<long long>(v));
  std::ostringstream os;
  os.precision(17);
  os << v;
  // Prefer the shortest text that reads back exactly.
  for (int p = 1; p <= 17; ++p) {
    std::ostringstream t;
    t.precision(p);
    t << v;
    if (std::stod(t.str()) == v) return t.str();
  }
  return os.str();
}

// Damerau (optimal string alignment) distance, case-insensitive: "satge" is one edit
// from "stage", "Stage" none.
std::size_t edit_distance(std::string_view a0, std::string_view b0) {
  const std::string a = lower(a0), b = lower(b0);
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[a.size()][b.size()];
}

std::vector<std::string> tokens(std::string_view s) {
  std::vector<std::string> r;
  std::string cur;
  for (char ch : lower(s)) {
    if (ch == '_' || ch == '.') {
      if (!cur.empty()) r.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(ch);
    }
  }
  if (!cur.empty()) r.push_back(cur);
  return r;
}

// Two words of a key name are the same word when they are equal, or when, without a
// plural "s", one begins the other and the shorter has at least 4 letters: "gradients"
// and "grads" (both "grad..."), "weight" and "weights".
bool same_word(std::string_view a, std::string_view b) {
  if (a == b) return true;
  auto stem = [](std::string_view w) { return w.size() > 4 && w.back() == 's' ? w.substr(0, w.size() - 1) : w; };
  a = stem(a), b = stem(b);
  if (a.size() > b.size()) std::swap(a, b);
  return a.size() >= 4 && b.substr(0, a.size()) == a;
}

// The closest candidate: one edit away; failing that, the shortest candidate holding
// every word of a multi-word key ("warmup_steps" -> "warmup_num_steps",
// "fp16_master_weights_and_gradients" -> "fp16_master_weights_and_grads"); failing that,
// within a few edits (scaled with the length); or "".
std::string closest(std::string_view word, const std::vector<std::string_view>& candidates) {
  auto nearest = [&](std::size_t limit) {
    std::string best;
    std::size_t best_d = limit + 1;
    for (auto c : candidates) {
      const std::size_t d = edit_distance(word, c);
      if (d < best_d) best_d = d, best = std::string(c);
    }
    return best;
  };
  if (auto one = nearest(1); !one.empty()) return one;
  const auto words = tokens(word);
  if (words.size() >= 2) {
    std::string best;
    for (auto c : candidates) {
      const auto have = tokens(c);
      const bool all = std::all_of(words.begin(), words.end(), [&](const std::string& w) {
        return std::any_of(have.begin(), have.end(), [&](const std::string& h) { return same_word(w, h); });
      });
      if (all && (best.empty() || c.size() < best.size())) best = std::string(c);
    }
    if (!best.empty()) return best;
  }
  return nearest(word.size() <= 4 ? 1 : word.size() <= 10 ? 2 : 3);
}

std::string list(const std::vector<std::string_view>& names) {
  std::string r;
  for (auto n : names) r += (r.empty() ? "" : ", ") + std::string(n);
  return r;
}

// What a Hugging Face "auto" placeholder gets: the Trainer fills these in from its own
// arguments before DeepSpeed sees the config; mpzero reads the config as written.
std::string auto_hint() {
  return "\"auto\" is a placeholder that Hugging Face's Trainer fills in from its own arguments; mpzero reads "
         "the config as written: write the value itself, or remove the key to get the default";
}

// ---- keys -----------------------------------------------------------------

// A DeepSpeed key mpzero does not implement. `accepted` is the JSON text of the one
// value that matches what mpzero does anyway ("*": any value, the key cannot change
// results; nullptr: no value, the key must go). A section that DeepSpeed switches off
// with one of its keys names it in `off_key`: the section is accepted whole when that
// key is absent (DeepSpeed's default is off) or equals `off_value` (JSON text), as in
// "tensorboard": {"enabled": false, ...} or "offload_param": {"device": "none"}. A
// deprecated key names the key that replaced it in `replaced_by`: DeepSpeed refuses the
// two together, whatever the deprecated one's value.
struct foreign_key {
  std::string_view name;
  const char* accepted;
  std::string_view why;
  std::string_view off_key = {};
  const char* off_value = nullptr;
  std::string_view replaced_by = {};

  bool switched_off(const json& v) const {
    if (off_key.empty() || !v.is_object()) return false;
    const auto it = v.find(std::string(off_key));
    const bool off = it == v.end() || it->is_null() || *it == json::parse(off_value);
    // A nested "enabled" switches a part on by itself: DeepSpeed's data_efficiency runs
    // data_routing.random_ltd when that says true, whatever the section's own flag says.
    return off && !nested_enabled(v);
  }

 private:
  static bool nested_enabled(const json& obj) {
    for (auto it = obj.begin(); it != obj.end(); ++it) {
      if (!it->is_object()) continue;
      if (const auto e = it->find("enabled"); e != it->end() && !e->is_null() && *e != json(false)) return true;
      if (nested_enabled(*it)) return true;
    }
    return false;
  }
};

// Checks every key of `obj` against the supported ones (and DeepSpeed's keys that mpzero
// accepts or explains). Unknown keys name the path, the closest valid key and the list.
void check_keys(const json& obj, const std::string& path, const std::vector<std::string_view>& supported,
                const std::vector<foreign_key>& foreign = {}) {
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    const std::string& key = it.key();
    if (std::find(supported.begin(), supported.end(), key) != supported.end()) continue;
    const std::string full = join_path(path, key);
    const auto f = std::find_if(foreign.begin(), foreign.end(), [&](const foreign_key& k) { return k.name == key; });
    if (f != foreign.end()) {
      if (it.value().is_null()) continue;  // null means absent, as everywhere
      if (!f->replaced_by.empty()) {
        const auto n = obj.find(std::string(f->replaced_by));
        if (n != obj.end() && !n->is_null()) {
          fail(squote(full) + " is DeepSpeed's deprecated form of " + squote(join_path(path, f->replaced_by)) +
               ", and both are given (DeepSpeed refuses this too); remove " + key);
        }
      }
      if (f->accepted != nullptr && std::string_view(f->accepted) == "*") continue;
      if (f->switched_off(it.value())) continue;
      if (f->accepted != nullptr) {
        if (it.value() == json::parse(f->accepted)) continue;
        const bool is_auto = it.value().is_string() && it.value().get<std::string>() == "auto";
        fail(squote(full) + " = " + it.value().dump() + " is not supported by mpzero: " + std::string(f->why) +
             " (only " + std::string(f->accepted) + " is accepted; remove the key or set it to " +
             std::string(f->accepted) + ")" + (is_auto ? "; " + auto_hint() : std::string()));
      }
      std::string msg = squote(full) + " is a DeepSpeed setting that mpzero does not implement: " +
                        std::string(f->why) + "; remove it";
      if (!f->off_key.empty()) {
        msg += " (or set " + squote(join_path(full, f->off_key)) + " to " + f->off_value + ")";
      }
      fail(msg);
    }
    std::vector<std::string_view> candidates = supported;
    for (const auto& k : foreign) candidates.push_back(k.name);
    std::string msg = "unknown key " + squote(full);
    const std::string guess = closest(key, candidates);
    if (!guess.empty()) msg += "; did you mean " + squote(guess) + "?";
    msg += path.empty() ? " Valid top-level keys: " : " Valid keys in " + squote(path) + ": ";
    msg += list(supported);
    fail(msg);
  }
}

// Typed reads of one object's values. A JSON null reads as absent (the default applies),
// as DeepSpeed's optional keys do.
class reader {
 public:
  reader(const json& obj, std::string path) : obj_(obj), path_(std::move(path)) {}

  // Every typed read starts here, so "auto" is refused once, before any key's own
  // validation could call it merely invalid.
  const json* find(std::string_view key) const {
    const auto it = obj_.find(std::string(key));
    if (it == obj_.end() || it->is_null()) return nullptr;
    if (it->is_string() && it->get<std::string>() == "auto") fail(squote(path(key)) + " = \"auto\": " + auto_hint());
    return &*it;
  }
  bool has(std::string_view key) const { return find(key) != nullptr; }
  std::string path(std::string_view key) const { return join_path(path_, key); }

  [[noreturn]] void type_error(std::string_view key, const json& v, std::string_view expected) const {
    std::string msg = squote(path(key)) + " must be " + std::string(expected) + ", got " + describe(v);
    if (v.is_string()) {
      const std::string s = v.get<std::string>();
      if (!s.empty() && (expected.find("number") != std::string_view::npos ||
                         expected.find("integer") != std::string_view::npos)) {
        char* end = nullptr;
        std::strtod(s.c_str(), &end);
        if (end && *end == '\0') msg += " (write the number without quotes)";
      } else if ((s == "true" || s == "false") && expected.find("boolean") != std::string_view::npos) {
        msg += " (write " + s + " without quotes)";
      }
    }
    fail(msg);
  }

  bool boolean(std::string_view key, bool dflt) const {
    const json* v = find(key);
    if (!v) return dflt;
    if (!v->is_boolean()) type_error(key, *v, "a boolean (true or false)");
    return v->get<bool>();
  }

  double number(std::string_view key, double dflt) const {
    const json* v = find(key);
    if (!v) return dflt;
    if (!v->is_number()) type_error(key, *v, "a number");
    return v->get<double>();
  }

  // An integer in [lo, hi]; integral floats such as 5e8 count (JSON has no integer type).
  std::int64_t integer(std::string_view key, std::int64_t dflt, std::int64_t lo, std::int64_t hi) const {
    const json* v = find(key);
    if (!v) return dflt;
    std::int64_t r = 0;
    if (v->is_number_unsigned()) {
      const auto u = v->get<std::uint64_t>();
      if (u > static_cast<std::uint64_t>(hi)) range_error(key, *v, lo, hi);
      r = static_cast<std::int64_t>(u);
    } else if (v->is_number_integer()) {
      r = v->get<std::int64_t>();
    } else if (v->is_number_float()) {
      const double d = v->get<double>();
      if (d != std::floor(d)) type_error(key, *v, "an integer");
      if (!(d >= static_cast<double>(lo) && d <= static_cast<double>(hi))) range_error(key, *v, lo, hi);
      r = static_cast<std::int64_t>(d);
    } else {
      type_error(key, *v, "an integer");
    }
    if (r < lo || r > hi) range_error(key, *v, lo, hi);
    return r;
  }

  // A non-negative integer up to 2^64 - 1, at least `lo`.
  std::uint64_t unsigned_integer(std::string_view key, std::uint64_t dflt, std::uint64_t lo) const {
    const json* v = find(key);
    if (!v) return dflt;
    std::uint64_t r = 0;
    if (v->is_number_unsigned()) {
      r = v->get<std::uint64_t>();
    } else if (v->is_number_integer()) {
      const auto i = v->get<std::int64_t>();
      if (i < 0) unsigned_error(key, *v, lo);
      r = static_cast<std::uint64_t>(i);
    } else if (v->is_number_float()) {
      const double d = v->get<double>();
      if (d != std::floor(d)) type_error(key, *v, "an integer");
      if (!(d >= 0 && d < 18446744073709551616.0)) unsigned_error(key, *v, lo);
      r = static_cast<std::uint64_t>(d);
    } else {
      type_error(key, *v, "an integer");
    }
    if (r < lo) unsigned_error(key, *v, lo);
    return r;
  }

  std::string string(std::string_view key, const std::string& dflt) const {
    const json* v = find(key);
    if (!v) return dflt;
    if (!v->is_string()) type_error(key, *v, "a string");
    return v->get<std::string>();
  }

  // A list of strings; a single string counts as a list of one when `allow_single`.
  std::vector<std::string> strings(std::string_view key, const std::vector<std::string>& dflt, bool allow_single) const {
    const json* v = find(key);
    if (!v) return dflt;
    if (allow_single && v->is_string()) return {v->get<std::string>()};
    const char* expected = allow_single ? "a list of strings (or one string)" : "a list of strings";
    if (!v->is_array()) type_error(key, *v, expected);
    std::vector<std::string> r;
    for (const auto& e : *v) {
      if (!e.is_string()) {
        fail(squote(path(key)) + " must be " + expected + ", but an element is " + describe(e));
      }
      r.push_back(e.get<std::string>());
    }
    return r;
  }

  // A nested object, or nullptr when absent.
  const json* object(std::string_view key) const {
    const json* v = find(key);
    if (v && !v->is_object()) type_error(key, *v, "an object {...}");
    return v;
  }

 private:
  [[noreturn]] void range_error(std::string_view key, const json& v, std::int64_t lo, std::int64_t hi) const {
    fail(squote(path(key)) + " = " + v.dump() + " is out of range; it must be an integer in [" + std::to_string(lo) +
         ", " + std::to_string(hi) + "]");
  }
  // Below `lo` says ">= lo"; above 2^64 - 1 (only a float can be) names that bound too.
  [[noreturn]] void unsigned_error(std::string_view key, const json& v, std::uint64_t lo) const {
    const bool too_big = v.is_number_float() && v.get<double>() >= 18446744073709551616.0;
    fail(squote(path(key)) + " = " + v.dump() + " is out of range; it must be an integer " +
         (too_big ? "in [" + std::to_string(lo) + ", 18446744073709551615] (at most 2^64 - 1)"
                  : ">= " + std::to_string(lo)));
  }

  const json& obj_;
  std::string path_;
};

void require_finite_range(const std::string& path, double v, double lo, double hi, const std::string& why) {
  if (!(std::isfinite(v) && v >= lo && v <= hi)) {
    fail(squote(path) + " = " + format_number(v) + " is out of range; it must lie in [" + format_number(lo) + ", " +
         format_number(hi) + "]" + (why.empty() ? "" : " (" + why + ")"));
  }
}

// Rethrows a core library's invalid_argument as a config_error under `where`.
template <class F>
void with_context(const std::string& where, F&& f) {
  try {
    f();
  } catch (const config_error&) {
    throw;
  } catch (const mpzero::invalid_argument& e) {
    std::string m = e.what();
    if (m.rfind("mpzero: ", 0) == 0) m = m.substr(8);
    fail(where + m);
  }
}

// ---- dtypes -----------------------------------------------------------------

// DeepSpeed's DtypeEnum spellings (runtime/config.py), without int8.
std::optional<dtype> dtype_from_deepspeed_name(const std::string& s) {
  static const std::vector<std::pair<std::string_view, dtype>> names = {
      {"torch.float16", dtype::fp16}, {"fp16", dtype::fp16},         {"float16", dtype::fp16},
      {"half", dtype::fp16},          {"torch.bfloat16", dtype::bf16}, {"bf16", dtype::bf16},
      {"bfloat16", dtype::bf16},      {"torch.float32", dtype::fp32},  {"fp32", dtype::fp32},
      {"float32", dtype::fp32},       {"float", dtype::fp32}};
  for (const auto& [n, d] : names)
    if (n == s) return d;
  return std::nullopt;
}

std::string_view dtype_json_name(dtype d) { return name_of(d); }

// ---- sections -----------------------------------------------------------------

const std::vector<std::string_view> top_level_keys = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "bf16", "fp16",
    "torch_autocast", "zero_optimization", "gradient_clipping", "optimizer", "scheduler", "communication_data_type",
    "data_types", "seed", "rounding", "bfloat16", "managed_gradient_accumulation", "param_groups",
    "tensor_parallel"};

const std::vector<foreign_key> top_level_foreign = {
    {"steps_per_print", "*", "logging only"},
    {"wall_clock_breakdown", "*", "logging only"},
    {"memory_breakdown", "*", "logging only"},
    {"log_level", "*", "logging only"},
    {"dump_state", "*", "logging only"},
    {"timers", "*", "logging only"},
    {"comms_logger", "*", "logging only"},
    {"dataloader_drop_last", "*", "it configures DeepSpeed's data loader; the caller feeds mpzero's engine"},
    {"disable_allgather", "*", "DeepSpeed's engine does not read it"},
    {"graph_harvesting", "*", "CUDA-graph capture of DeepSpeed's bf16 optimizer kernels; the results are the same"},
    {"use_data_before_expert_parallelism", "*", "no expert parallelism"},
    {"zero_allow_untested_optimizer", "*", "mpzero runs only its own optimizers"},
    {"zero_force_ds_cpu_optimizer", "*", "the CPU optimizer is mpzero's own"},
    {"aio", "*", "asynchronous I/O for NVMe offload, which mpzero does not have"},
    // Each leaves the averaged gradient DeepSpeed's average (they move where DeepSpeed
    // divides, against fp16 overflow); parse_config checks their types and ranges.
    {"prescale_gradients", "*", "gradients are averaged after the reduction"},
    {"gradient_predivide_factor", "*", "gradients are averaged after the reduction"},
    {"gradient_allreduce_op", "\"mean\"", "data-parallel gradients are averaged"},
    {"sparse_gradients", "false", "gradients are dense"},
    // Sections DeepSpeed switches off with "enabled" (off by default).
    {"amp", nullptr, "use \"bf16\", \"fp16\" or \"torch_autocast\"", "enabled", "false"},
    {"flops_profiler", nullptr, "no profiler", "enabled", "false"},
    {"tensorboard", nullptr, "no monitors", "enabled", "false"},
    {"wandb", nullptr, "no monitors", "enabled", "false"},
    {"csv_monitor", nullptr, "no monitors", "enabled", "false"},
    {"comet", nullptr, "no monitors", "enabled", "false"},
    {"elasticity", nullptr, "no elastic training", "enabled", "false"},
    {"autotuning", nullptr, "no autotuner", "enabled", "false"},
    {"eigenvalue", nullptr, "no eigenvalue computation", "enabled", "false"},
    {"progressive_layer_drop", nullptr, "no progressive layer drop", "enabled", "false"},
    {"curriculum_learning", nullptr, "no curriculum learning", "enabled", "false"},
    {"data_efficiency", nullptr, "no data-efficiency pipeline", "enabled", "false"},
    {"hybrid_engine", nullptr, "no hybrid (RLHF) engine", "enabled", "false"},
    {"nebula", nullptr, "no Nebula checkpointing", "enabled", "false"},
    {"compile", nullptr, "no DeepCompile", "deepcompile", "false"},
    {"activation_checkpointing", nullptr, "checkpoint activations in the model"},
    {"pipeline", nullptr, "no pipeline parallelism"},
    {"expert_parallel", nullptr, "no expert parallelism"},
    {"weight_quantization", nullptr, "no weight quantization"},
    {"checkpoint", nullptr, "checkpointing is configured in code"},
    {"compression_training", nullptr, "no compression"},
    {"sparse_attention", nullptr, "no sparse attention kernels"},
    {"seq_parallel_communication_data_type", nullptr, "no sequence parallelism"},
};

void parse_bf16(const json& j, config& c, const std::string& p = "bf16") {
  check_keys(j, p, {"enabled", "bf16_master_weights_and_grads", "bf16_optimizer_states", "check_grad_overflow"},
             {{"immediate_grad_update", "false", "gradients are applied at the optimizer step"}});
  reader r(j, p);
  c.bf16 = r.boolean("enabled", false);
  c.bf16_master_weights_and_grads = r.boolean("bf16_master_weights_and_grads", false);
  c.bf16_optimizer_states = r.boolean("bf16_optimizer_states", false);
  c.check_grad_overflow = r.boolean("check_grad_overflow", true);
}

void parse_fp16(const json& j, config& c) {
  const std::string p = "fp16";
  check_keys(j, p,
             {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
              "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads"},
             {{"auto_cast", "false", "inputs are not cast; use \"torch_autocast\" for autocast"},
              {"fp16_optimizer_states", "false",
               "fp16 optimizer states are refused: Adam's second moment under- and overflows fp16's range "
               "(use \"bf16\" with bf16_optimizer_states, or fp32 states)"}});
  reader r(j, p);
  c.fp16 = r.boolean("enabled", false);
  c.fp16_master_weights_and_grads = r.boolean("fp16_master_weights_and_grads", false);
  c.loss_scale = r.number("loss_scale", 0.0);
  if (!(c.loss_scale >= 0)) {
    fail("'fp16.loss_scale' = " + format_number(c.loss_scale) +
         " is invalid; it must be >= 0 (0 enables dynamic loss scaling, a positive value is a static scale)");
  }
  loss_scale_options o;
  o.dynamic = c.loss_scale == 0.0;
  o.static_scale = o.dynamic ? 1.0 : c.loss_scale;
  // The dynamic options are typed always but range-checked only when dynamic scaling uses
  // them (as DeepSpeed, whose ints have no range otherwise): an unused value is stored
  // clamped to the scaler's int. The ranges below are the scaler's (loss_scaler.hpp).
  // torch_autocast in fp16 uses them too; its section may come later, so a value it
  // would use out of range is refused by the scaler at initialize.
  const bool used = c.fp16 && o.dynamic;
  constexpr double int_max = std::numeric_limits<int>::max();
  auto option = [&](std::string_view key, int dflt, double lo, double hi, const std::string& meaning,
                    const char* unit) -> int {
    const json* v = r.find(key);
    if (!v) return dflt;
    if (!v->is_number()) r.type_error(key, *v, "an integer");
    const double d = v->get<double>();
    if (d != std::floor(d)) r.type_error(key, *v, "an integer");
    if (used && d > int_max && hi == int_max) {
      // A window or hysteresis this long never runs out within any run: the scaler's
      // 32-bit counter's largest value behaves the same.
      fail(squote(r.path(key)) + " = " + v->dump() + " is more " + unit +
           " than mpzero's loss scaler counts (at most 2147483647, a 32-bit int); write 2147483647, which behaves "
           "the same in any run with fewer " + unit + " than that");
    }
    if (used && !(d >= lo && d <= hi)) {
      fail(squote(r.path(key)) + " = " + v->dump() + " is out of range; it must be an integer " +
           (hi == int_max ? ">= " + format_number(lo) : "in [" + format_number(lo) + ", " + format_number(hi) + "]") +
           " (" + meaning + ")");
    }
    return static_cast<int>(std::clamp(d, static_cast<double>(std::numeric_limits<int>::min()), int_max));
  };
  o.initial_scale_power = option("initial_scale_power", 16, loss_scaler::min_scale_power, loss_scaler::max_scale_power,
                                 "the initial dynamic scale is 2^initial_scale_power; DeepSpeed's default is 16", "");
  o.loss_scale_window = option("loss_scale_window", 1000, 1, int_max,
                               "clean steps before the scale doubles; DeepSpeed's default is 1000", "steps");
  o.hysteresis = option("hysteresis", 2, 1, int_max,
                        "overflows before the scale halves, 1 halves it on every overflow; DeepSpeed's default is 2",
                        "overflows");
  o.consecutive_hysteresis = r.boolean("consecutive_hysteresis", false);
  // DeepSpeed types min_loss_scale as an integer; any positive number works here.
  o.min_loss_scale = r.number("min_loss_scale", 1.0);
  c.loss_scaler = o;
}

// Returns whether "dtype" was given (validate() then says "(the default)" when it was not).
bool parse_autocast(const json& j, config& c) {
  const std::string p = "torch_autocast";
  check_keys(j, p, {"enabled", "dtype", "lower_precision_safe_modules"});
  reader r(j, p);
  c.torch_autocast.enabled = r.boolean("enabled", false);
  if (const json* v = r.find("dtype")) {
    if (!v->is_string()) r.type_error("dtype", *v, "a string (\"bfloat16\" or \"float16\")");
    const auto d = dtype_from_deepspeed_name(v->get<std::string>());
    if (!d || *d == dtype::fp32) {
      fail("'torch_autocast.dtype' = " + v->dump() +
           " is invalid; autocast runs in a 16-bit dtype: \"bfloat16\" (also \"bf16\", \"torch.bfloat16\") or "
           "\"float16\" (also \"fp16\", \"half\", \"torch.float16\")");
    }
    c.torch_autocast.dtype_ = *d;
  }
  if (r.has("lower_precision_safe_modules")) {
    auto names = r.strings("lower_precision_safe_modules", {}, false);
    // DeepSpeed names Python classes by module path ("torch.nn.Linear", or its documented
    // "torch.nn.modules.linear.Linear"); the engine matches LibTorch class names, so a
    // torch.nn class keeps only its name after the last dot, and "torch::nn::" is dropped.
    for (auto& n : names) {
      if (n.rfind("torch.nn.", 0) == 0) {
        n = n.substr(n.rfind('.') + 1);
      } else if (n.rfind("torch::nn::", 0) == 0) {
        n = n.substr(std::string_view("torch::nn::").size());
      }
      if (n.empty()) {
        fail("'torch_autocast.lower_precision_safe_modules' has an entry without a class name; write a module class "
             "such as \"Linear\" or \"torch.nn.Linear\"");
      }
    }
    c.torch_autocast.lower_precision_safe_modules = names;
    c.torch_autocast.lower_precision_safe_modules_given = true;
  }
  return r.has("dtype");
}

// A pattern over parameter names must be an ECMAScript regular expression.
void check_pattern(const std::string& where, const std::string& pat) {
  try {
    (void)std::regex(pat, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    fail(where + ": pattern \"" + pat + "\" is not a regular expression (" + e.what() +
         "); write an ECMAScript pattern, e.g. \"\\\\.bias$\" (escape dots)");
  }
}

tp_layer_spec parse_layer_spec(const json& v, const std::string& p) {
  if (!v.is_object()) fail(squote(p) + " must be an object with \"patterns\" and \"partition_type\", got " + describe(v));
  check_keys(v, p, {"patterns", "partition_type", "shape", "partition_dim", "model_types"});
  reader r(v, p);
  tp_layer_spec s;
  s.patterns = r.strings("patterns", {}, true);
  if (s.patterns.empty()) fail(squote(p + ".patterns") + " is missing or empty; give regular expressions over parameter names");
  for (const std::string& pat : s.patterns) check_pattern(squote(p + ".patterns"), pat);
  const std::string type = lower(r.string("partition_type", "column"));
  if (type == "column") {
    s.partition_type = tp_partition::column;
  } else if (type == "row") {
    s.partition_type = tp_partition::row;
  } else if (type == "skip") {
    s.partition_type = tp_partition::skip;
  } else {
    fail(squote(p + ".partition_type") + " = \"" + type + "\" is invalid; use \"column\", \"row\" or \"skip\"");
  }
  if (r.has("partition_dim")) s.partition_dim = static_cast<int>(r.integer("partition_dim", 0, 0, 7));
  s.model_types = r.strings("model_types", {}, true);
  if (const json* sh = r.find("shape")) {
    const std::string sp = p + ".shape";
    if (!sh->is_array() || sh->empty()) fail(squote(sp) + " must be a list such as [2, -1] or [[q, kv, kv], -1], got " + describe(*sh));
    const int d = s.dim();
    for (std::size_t k = 0; k < sh->size(); ++k) {
      const json& e = (*sh)[k];
      if (e.is_array()) {
        if (static_cast<int>(k) != d) {
          fail(squote(sp) + ": a list of sizes is allowed only at partition_dim (" + std::to_string(d) + "), not at " +
               std::to_string(k));
        }
        for (const json& x : e) {
          if (!x.is_number_integer() || x.get<std::int64_t>() <= 0) {
            fail(squote(sp) + ": sub-parameter sizes must be positive integers, got " + describe(x));
          }
          s.sub_sizes.push_back(x.get<std::int64_t>());
        }
        if (s.sub_sizes.empty()) fail(squote(sp) + ": the list of sub-parameter sizes is empty");
        s.shape.push_back(0);  // their sum, once known
      } else if (e.is_number_integer() && (e.get<std::int64_t>() > 0 || e.get<std::int64_t>() == -1)) {
        s.shape.push_back(e.get<std::int64_t>());
      } else {
        fail(squote(sp) + ": entries must be positive integers or -1 (and a list of sizes at partition_dim), got " +
             describe(e));
      }
    }
    if (d >= static_cast<int>(s.shape.size())) {
      fail(squote(p + ".partition_dim") + " = " + std::to_string(d) + " is out of range for the shape of " +
           std::to_string(s.shape.size()) + " dimensions");
    }
  }
  return s;
}

void parse_tensor_parallel(const json& j, config& c) {
  const std::string p = "tensor_parallel";
  check_keys(j, p, {"autotp_size", "preset_model", "partition_config"});
  reader r(j, p);
  tensor_parallel_config& t = c.tensor_parallel;
  t.autotp_size = r.unsigned_integer("autotp_size", 1, 1);
  if (r.has("preset_model")) {
    t.preset_model = lower(r.string("preset_model", ""));
    if (!tp_preset_available(t.preset_model)) (void)tp_preset_specs(t.preset_model);  // names the presets
  }
  if (const json* pc = r.object("partition_config")) {
    const std::string pp = p + ".partition_config";
    check_keys(*pc, pp, {"use_default_specs", "layer_specs"});
    reader pr(*pc, pp);
    t.use_default_specs = pr.boolean("use_default_specs", true);
    if (const json* specs = pr.find("layer_specs")) {
      if (!specs->is_array()) pr.type_error("layer_specs", *specs, "a list of layer specs");
      for (std::size_t k = 0; k < specs->size(); ++k)
        t.layer_specs.push_back(parse_layer_spec((*specs)[k], pp + ".layer_specs[" + std::to_string(k) + "]"));
    }
  }
}

void parse_param_groups(const json& v, config& c) {
  if (!v.is_array()) {
    fail("'param_groups' must be an array of groups such as {\"name\": \"no_decay\", \"patterns\": [\"bias$\", "
         "\"norm\"], \"weight_decay\": 0.0}, got " + describe(v));
  }
  for (std::size_t i = 0; i < v.size(); ++i) {
    const std::string p = "param_groups[" + std::to_string(i) + "]";
    if (!v[i].is_object()) fail(squote(p) + " must be an object with \"name\" and \"patterns\", got " + describe(v[i]));
    check_keys(v[i], p, {"name", "patterns", "lr", "weight_decay"});
    reader r(v[i], p);
    param_group g;
    g.name = r.string("name", "");
    g.patterns = r.strings("patterns", {}, true);
    if (r.has("lr")) g.lr = r.number("lr", 0.0);
    if (r.has("weight_decay")) g.weight_decay = r.number("weight_decay", 0.0);
    c.param_groups.push_back(std::move(g));
  }
  check_param_groups(c.param_groups);
}

std::vector<std::string> dedup(std::vector<std::string> v) {
  std::vector<std::string> r;
  for (auto& s : v)
    if (std::find(r.begin(), r.end(), s) == r.end()) r.push_back(std::move(s));
  return r;
}

void parse_offload_optimizer(const json& j, config& c) {
  const std::string p = "zero_optimization.offload_optimizer";
  check_keys(j, p, {"device", "pin_memory"},
             {{"nvme_path", nullptr, "no NVMe offload (device \"cpu\" or \"none\")"},
              {"buffer_count", "*", "NVMe only"},
              {"pipeline_read", "false", "NVMe only"},
              {"pipeline_write", "false", "NVMe only"},
              {"fast_init", "false", "NVMe only"},
              {"ratio", "1.0", "the whole optimizer is offloaded"},
              {"super_offload", "false", "no Superchip offload"},
              {"cpuadam_cores_perc", "*", "the host step uses OpenMP's threads"}});
  reader r(j, p);
  const std::string dev = r.string("device", "none");
  if (dev == "none") {
    c.zero.offload_optimizer = offload_device::none;
  } else if (dev == "cpu") {
    c.zero.offload_optimizer = offload_device::cpu;
  } else if (dev == "nvme") {
    fail("'" + p + ".device' = \"nvme\" is not supported by mpzero; use \"cpu\" or \"none\"");
  } else {
    fail("'" + p + ".device' = \"" + dev + "\" is invalid; use \"cpu\" or \"none\"");
  }
  c.zero.offload_pin_memory = r.boolean("pin_memory", true);
}

void parse_leaf_module(const json& j, config& c) {
  const std::string p = "zero_optimization.leaf_module";
  check_keys(j, p, {"classes", "names", "name_suffixes"});
  reader r(j, p);
  c.zero.leaf_module_classes = dedup(r.strings("classes", {}, true));
  c.zero.leaf_module_names = dedup(r.strings("names", {}, true));
  c.zero.leaf_module_name_suffixes = dedup(r.strings("name_suffixes", {}, true));
}

void parse_zero(const json& j, config& c) {
  const std::string p = "zero_optimization";
  check_keys(j, p,
             {"stage", "offload_optimizer", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "sub_group_size",
              "contiguous_gradients", "reduce_scatter", "stage3_param_persistence_threshold",
              "stage3_prefetch_bucket_size", "leaf_module", "param_persistence_threshold", "prefetch_bucket_size",
              "stage3_max_live_parameters", "max_live_parameters",
              "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
              "stage3_gather_fp16_weights_on_model_save"},
             {{"offload_param", nullptr, "parameters stay on the device (offload_optimizer offloads the optimizer)",
               "device", "\"none\""},
              {.name = "cpu_offload",
               .accepted = "*",
               .why = "deprecated in DeepSpeed; write \"offload_optimizer\": {\"device\": \"cpu\"}",
               .replaced_by = "offload_optimizer"},
              {.name = "cpu_offload_param",
               .accepted = "false",
               .why = "parameters stay on the device",
               .replaced_by = "offload_param"},
              {"cpu_offload_use_pin_memory", "*", "deprecated; DeepSpeed does not read it"},
              {"allgather_partitions", "true", "parameters are gathered with allgather"},
              {"use_multi_rank_bucket_allreduce", "*", "a communication detail"},
              {"load_from_fp32_weights", "*", "checkpoints are loaded in code"},
              {"elastic_checkpoint", "false", "no elastic checkpoints"},
              // DeepSpeed's stage-3 keys, each also under its pydantic field name.
              {"stage3_max_reuse_distance", "*", "a DeepSpeed prefetch knob"},
              {"max_reuse_distance", "*", "a DeepSpeed prefetch knob"},
              {"stage3_model_persistence_threshold", "*", "a DeepSpeed prefetch knob"},
              {"model_persistence_threshold", "*", "a DeepSpeed prefetch knob"},
              {"stage3_module_granularity_threshold", "*", "a DeepSpeed stage-3 fetch-grouping knob"},
              {"module_granularity_threshold", "*", "a DeepSpeed stage-3 fetch-grouping knob"},
              {"stage3_use_all_reduce_for_fetch_params", "*", "how DeepSpeed's stage 3 fetches parameters"},
              {"use_all_reduce_for_fetch_params", "*", "how DeepSpeed's stage 3 fetches parameters"},
              {"stage3_allgather_sequential", "*", "how DeepSpeed's stage 3 gathers parameters"},
              {"allgather_sequential", "*", "how DeepSpeed's stage 3 gathers parameters"},
              {"legacy_stage1", "false", "DeepSpeed >= 0.5.9 refuses true too: its old stage-1 code is gone"},
              {"mics_hierarchical_params_gather", "*", "MiCS only, and mics_shard_size must be -1"},
              {"zeropp_loco_param", "*", "LoCo acts only with zero_quantized_gradients, which must be false"},
              {"override_module_apply", "*", "a DeepSpeed stage-3 implementation detail"},
              {"pipeline_loading_checkpoint", "*", "checkpoints are loaded in code"},
              {"log_trace_cache_warnings", "*", "logging only"},
              {"enable_sanity_checks", "*", "DeepSpeed's internal debugging checks"},
              {"save_muon_momentum_buffer_in_memory", "*", "Muon with NVMe offload only"},
              {"ignore_unused_parameters", "true", "parameters without gradients are always allowed"},
              {"round_robin_gradients", "*", "a DeepSpeed offload copy schedule"},
              {"zero_hpz_partition_size", "1", "no ZeRO++ hierarchical partitioning"},
              {"zero_quantized_weights", "false", "no ZeRO++ quantization"},
              {"zero_quantized_nontrainable_weights", "false", "no ZeRO++ quantization"},
              {"zero_quantized_gradients", "false", "no ZeRO++ quantization"},
              {"mics_shard_size", "-1", "no MiCS"},
              {"memory_efficient_linear", "*", "a DeepSpeed stage-3 implementation detail"},
              {"zenflow", nullptr, "no ZenFlow"}});
  reader r(j, p);
  if (const json* v = r.find("stage")) {
    if (!v->is_number()) r.type_error("stage", *v, "an integer 0, 1, 2 or 3");
  }
  c.zero.stage = static_cast<int>(r.integer("stage", 0, 0, 3));
  if (const json* o = r.object("offload_optimizer")) parse_offload_optimizer(*o, c);
  // DeepSpeed's deprecated form: true means "offload_optimizer": {"device": "cpu"} (check_keys
  // has refused the two together).
  if (r.has("cpu_offload") && r.boolean("cpu_offload", false)) {
    parse_offload_optimizer(json{{"device", "cpu"}}, c);
    c.notices.push_back(
        "'zero_optimization.cpu_offload' is deprecated in DeepSpeed; read as \"offload_optimizer\": {\"device\": "
        "\"cpu\"} (write that instead)");
  }
  c.zero.reduce_bucket_size = r.unsigned_integer("reduce_bucket_size", 500'000'000, 1);
  if (r.has("sub_group_size")) c.zero.sub_group_size = r.unsigned_integer("sub_group_size", 0, 1);
  // Read and kept for DeepSpeed configs, but no engine uses them (docs/config.md says what
  // mpzero does instead), so only DeepSpeed's own limits apply (allgather_bucket_size >= 0).
  c.zero.allgather_bucket_size = r.unsigned_integer("allgather_bucket_size", 500'000'000, 0);
  // DeepSpeed's default overlaps communication in stage 3 only.
  c.zero.overlap_comm = r.boolean("overlap_comm", c.zero.stage == 3);
  c.zero.contiguous_gradients = r.boolean("contiguous_gradients", true);
  c.zero.reduce_scatter = r.boolean("reduce_scatter", true);
  // DeepSpeed accepts each stage-3 key under its field name too (pydantic aliases).
  for (auto [name, alias] : {std::pair<std::string_view, std::string_view>{"stage3_param_persistence_threshold",
                                                                            "param_persistence_threshold"},
                             {"stage3_prefetch_bucket_size", "prefetch_bucket_size"},
                             {"stage3_max_live_parameters", "max_live_parameters"},
                             {"stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save"},
                             {"stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"},
                             {"gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"}}) {
    if (r.has(name) && r.has(alias)) {
      fail("'zero_optimization." + std::string(name) + "' and its alias 'zero_optimization." + std::string(alias) +
           "' are both given; keep one");
    }
  }
  const bool alias1 = r.has("param_persistence_threshold");
  c.zero.stage3_param_persistence_threshold = r.unsigned_integer(
      alias1 ? "param_persistence_threshold" : "stage3_param_persistence_threshold", 100'000, 0);
  const bool alias2 = r.has("prefetch_bucket_size");
  c.zero.stage3_prefetch_bucket_size =
      r.unsigned_integer(alias2 ? "prefetch_bucket_size" : "stage3_prefetch_bucket_size", 50'000'000, 0);
  const bool alias3 = r.has("max_live_parameters");
  c.zero.stage3_max_live_parameters =
      r.unsigned_integer(alias3 ? "max_live_parameters" : "stage3_max_live_parameters", 1'000'000'000, 0);
  // DeepSpeed's older spelling (stage3_gather_fp16_weights_on_model_save) means the same.
  const char* gather16 = "stage3_gather_16bit_weights_on_model_save";
  if (r.has("gather_16bit_weights_on_model_save")) gather16 = "gather_16bit_weights_on_model_save";
  if (r.has("stage3_gather_fp16_weights_on_model_save")) gather16 = "stage3_gather_fp16_weights_on_model_save";
  c.zero.stage3_gather_16bit_weights_on_model_save = r.boolean(gather16, false);
  if (const json* o = r.object("leaf_module")) parse_leaf_module(*o, c);
}

const std::vector<std::string_view> optimizer_types = {"Adam", "AdamW", "SGD", "Lion"};

void parse_betas(const reader& r, optimizer_config& o) {
  const json* v = r.find("betas");
  if (!v) return;
  if (!v->is_array() || v->size() != 2 || !(*v)[0].is_number() || !(*v)[1].is_number()) {
    r.type_error("betas", *v, "a list of two numbers [beta1, beta2]");
  }
  o.beta1 = (*v)[0].get<double>();
  o.beta2 = (*v)[1].get<double>();
}

void parse_optimizer(const json& j, config& c) {
  const std::string p = "optimizer";
  check_keys(j, p, {"type", "params"}, {{"legacy_fusion", "false", "mpzero has one fused step"}});
  reader r(j, p);
  if (!r.has("type")) {
    fail("'optimizer.type' is missing; set it to one of " + list(optimizer_types) +
         " (or remove the \"optimizer\" section for the default, AdamW)");
  }
  const std::string type = r.string("type", "");
  // DeepSpeed lower-cases its own optimizer names; SGD (torch.optim.SGD there) is matched
  // case-insensitively here too.
  const std::string t = lower(type);
  optimizer_config& o = c.optimizer;
  o = optimizer_config{};
  if (t == "adam" || t == "adamw") {
    o.type = optimizer_type::adamw;
  } else if (t == "sgd") {
    o.type = optimizer_type::sgd;
  } else if (t == "lion") {
    o.type = optimizer_type::lion;
  } else {
    std::string msg = "'optimizer.type' = \"" + type + "\" is not supported by mpzero; supported: " +
                      list(optimizer_types) + " (case-insensitive)";
    const std::string guess = closest(type, optimizer_types);
    if (!guess.empty()) msg += "; did you mean " + squote(guess) + "?";
    fail(msg);
  }
  const json* params = r.object("params");
  const json empty = json::object();
  const json& pj = params ? *params : empty;
  const std::string pp = "optimizer.params";
  const foreign_key max_grad_norm{"max_grad_norm", nullptr,
                                  "DeepSpeed refuses it too; use the top-level \"gradient_clipping\""};
  if (o.type == optimizer_type::adamw) {
    check_keys(pj, pp, {"lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode", "torch_adam"},
               {max_grad_norm,
                {"amsgrad", "false", "AMSGrad is not implemented (DeepSpeed's fused Adam refuses it too)"},
                {"fp32_optimizer_states", nullptr, "the state dtype comes from \"bf16\".bf16_optimizer_states"}});
  } else if (o.type == optimizer_type::sgd) {
    check_keys(pj, pp, {"lr", "momentum", "dampening", "weight_decay", "nesterov"},
               {max_grad_norm,
                {"maximize", "false", "mpzero's SGD minimizes"},
                {"foreach", "*", "an implementation choice of torch"},
                {"fused", "*", "an implementation choice of torch"},
                {"differentiable", "false", "the step is not differentiable"}});
  } else {
    check_keys(pj, pp, {"lr", "betas", "weight_decay"}, {max_grad_norm});
  }
  reader pr(pj, pp);
  o.lr = pr.number("lr", 1e-3);
  o.weight_decay = pr.number("weight_decay", 0.0);
  // The optimizer's own checks (ranges of lr, betas, eps, ...), at parse time.
  if (o.type == optimizer_type::adamw) {
    parse_betas(pr, o);
    o.eps = pr.number("eps", 1e-8);
    o.bias_correction = pr.boolean("bias_correction", true);
    // DeepSpeed: "AdamW" is always decoupled; "Adam" is decoupled too unless adam_w_mode
    // is false (ADAM_W_MODE_DEFAULT = True).
    const bool adam_w_mode = pr.boolean("adam_w_mode", true);
    o.type = (t == "adamw" || adam_w_mode) ? optimizer_type::adamw : optimizer_type::adam;
    // torch_adam: DeepSpeed builds torch.optim.AdamW (decoupled) or torch.optim.Adam instead
    // of its fused Adam. Same update, but torch's AdamW defaults weight_decay to 0.01
    // (FusedAdam, CPUAdam and torch's Adam to 0), and torch's classes take no
    // bias_correction (they always correct; DeepSpeed fails on the keyword).
    if (pr.boolean("torch_adam", false)) {
      if (!pr.has("weight_decay") && o.type == optimizer_type::adamw) o.weight_decay = 0.01;
      if (!o.bias_correction) {
        fail("'optimizer.params.bias_correction' = false with 'optimizer.params.torch_adam' = true: DeepSpeed then "
             "builds torch.optim." + std::string(o.type == optimizer_type::adamw ? "AdamW" : "Adam") +
             ", which always corrects the bias (and refuses the keyword); remove torch_adam for DeepSpeed's fused "
             "Adam, or remove bias_correction");
      }
    }
    optim::adam_options a{o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.bias_correction};
    with_context("optimizer.params: ", [&] {
      if (o.type == optimizer_type::adamw) {
        optim::adamw::prepare(a, 1);
      } else {
        optim::adam::prepare(a, 1);
      }
    });
  } else if (o.type == optimizer_type::sgd) {
    o.momentum = pr.number("momentum", 0.0);
    o.dampening = pr.number("dampening", 0.0);
    o.nesterov = pr.boolean("nesterov", false);
    optim::sgd_options s{o.lr, o.momentum, o.dampening, o.weight_decay, o.nesterov};
    with_context("optimizer.params: ", [&] { optim::sgd::prepare(s, 1); });
  } else {
    parse_betas(pr, o);
    optim::lion_options l{o.lr, o.beta1, o.beta2, o.weight_decay};
    with_context("optimizer.params: ", [&] { optim::lion::prepare(l, 1); });
  }
}

const std::vector<std::string_view> scheduler_types = {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "LRRangeTest",
                                                       "OneCycle"};

// LRRangeTest's params, DeepSpeed's names and defaults.
void parse_lr_range_test(const json& pj, const std::string& pp, scheduler_config& s) {
  check_keys(pj, pp,
             {"lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate", "lr_range_test_staircase"},
             {{"last_batch_iteration", "-1", "the schedule starts at step 0; a checkpoint restores its position"}});
  reader pr(pj, pp);
  s.lr_range_test_min_lr = pr.number("lr_range_test_min_lr", 1e-3);
  require_finite_range(pr.path("lr_range_test_min_lr"), s.lr_range_test_min_lr, 0.0, 1e6, "");
  s.lr_range_test_step_size = pr.unsigned_integer("lr_range_test_step_size", 2000, 1);
  s.lr_range_test_step_rate = pr.number("lr_range_test_step_rate", 1.0);
  require_finite_range(pr.path("lr_range_test_step_rate"), s.lr_range_test_step_rate, 0.0, 1e6,
                       "the learning rate grows by min_lr x step_rate every step_size steps");
  s.lr_range_test_staircase = pr.boolean("lr_range_test_staircase", false);
}

// OneCycle's params, DeepSpeed's names and defaults; the optimizer is parsed already.
void parse_one_cycle(const json& pj, const std::string& pp, config& c) {
  scheduler_config& s = c.scheduler;
  check_keys(pj, pp,
             {"cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size",
              "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size", "cycle_momentum",
              "cycle_min_mom", "cycle_max_mom", "decay_mom_rate"},
             {{"last_batch_iteration", "-1", "the schedule starts at step 0; a checkpoint restores its position"}});
  reader pr(pj, pp);
  for (const char* k : {"cycle_min_lr", "cycle_max_lr"}) {
    if (!pr.has(k)) {
      fail("'" + pr.path(k) + "' is missing; OneCycle needs cycle_min_lr and cycle_max_lr (DeepSpeed requires "
           "them too)");
    }
  }
  s.cycle_min_lr = pr.number("cycle_min_lr", 0.0);
  s.cycle_max_lr = pr.number("cycle_max_lr", 0.0);
  require_finite_range(pr.path("cycle_min_lr"), s.cycle_min_lr, 0.0, 1e6, "");
  require_finite_range(pr.path("cycle_max_lr"), s.cycle_max_lr, 0.0, 1e6, "");
  s.decay_lr_rate = pr.number("decay_lr_rate", 0.0);
  require_finite_range(pr.path("decay_lr_rate"), s.decay_lr_rate, 0.0, 1e6,
                       "after the cycle, lr = cycle_min_lr / (1 + decay_lr_rate x intervals)");
  s.cycle_first_step_size = pr.unsigned_integer("cycle_first_step_size", 2000, 1);
  s.cycle_second_step_size = pr.unsigned_integer("cycle_second_step_size", s.cycle_first_step_size, 1);
  s.cycle_first_stair_count = pr.unsigned_integer("cycle_first_stair_count", 0, 0);
  s.cycle_second_stair_count = pr.unsigned_integer("cycle_second_stair_count", s.cycle_first_stair_count, 0);
  s.decay_step_size = pr.unsigned_integer("decay_step_size", 0, 0);
  s.cycle_momentum = pr.boolean("cycle_momentum", true);
  s.cycle_min_mom = pr.number("cycle_min_mom", 0.8);
  s.cycle_max_mom = pr.number("cycle_max_mom", 0.9);
  s.decay_mom_rate = pr.number("decay_mom_rate", 0.0);
  require_finite_range(pr.path("cycle_min_mom"), s.cycle_min_mom, 0.0, 1.0, "it becomes the optimizer's beta1");
  require_finite_range(pr.path("cycle_max_mom"), s.cycle_max_mom, 0.0, 1.0, "it becomes the optimizer's beta1");
  require_finite_range(pr.path("decay_mom_rate"), s.decay_mom_rate, 0.0, 1e6,
                       "after the cycle, beta1 = cycle_max_mom x (1 + decay_mom_rate x intervals)");
  if (s.cycle_momentum && (s.cycle_min_mom >= 1.0 || s.cycle_max_mom >= 1.0)) {
    fail("'" + pr.path(s.cycle_min_mom >= 1.0 ? "cycle_min_mom" : "cycle_max_mom") +
         "' must be below 1: it becomes the optimizer's beta1");
  }
  if (s.cycle_momentum && c.optimizer.type == optimizer_type::sgd) {
    // DeepSpeed warns and turns the cycling off for an optimizer without betas.
    s.cycle_momentum = false;
    c.notices.push_back("'scheduler.params.cycle_momentum' is off: SGD has no betas to cycle (as DeepSpeed; set it "
                        "to false to silence this)");
  }
}

void parse_scheduler(const json& j, config& c) {
  const std::string p = "scheduler";
  check_keys(j, p, {"type", "params"});
  reader r(j, p);
  if (!r.has("type")) {
    fail("'scheduler.type' is missing; set it to one of " + list(scheduler_types) +
         " (or remove the \"scheduler\" section for a constant learning rate)");
  }
  const std::string type = r.string("type", "");
  scheduler_config& s = c.scheduler;
  s = scheduler_config{};
  if (type == "WarmupLR") {
    s.type = scheduler_type::warmup_lr;
  } else if (type == "WarmupDecayLR") {
    s.type = scheduler_type::warmup_decay_lr;
  } else if (type == "WarmupCosineLR") {
    s.type = scheduler_type::warmup_cosine_lr;
  } else if (type == "LRRangeTest") {
    s.type = scheduler_type::lr_range_test;
  } else if (type == "OneCycle") {
    s.type = scheduler_type::one_cycle;
  } else {
    std::string msg = "'scheduler.type' = \"" + type + "\" is not supported by mpzero";
    msg += "; supported: " + list(scheduler_types);
    const std::string guess = closest(type, scheduler_types);
    if (!guess.empty() && guess != type) msg += "; did you mean " + squote(guess) + "?";
    fail(msg);
  }
  const json* params = r.object("params");
  const json empty = json::object();
  const json& pj = params ? *params : empty;
  const std::string pp = "scheduler.params";
  if (s.type == scheduler_type::lr_range_test) return parse_lr_range_test(pj, pp, s);
  if (s.type == scheduler_type::one_cycle) return parse_one_cycle(pj, pp, c);
  const foreign_key last_iter{"last_batch_iteration", "-1",
                              "the schedule starts at step 0; a checkpoint restores its position"};
  reader pr(pj, pp);
  if (s.type == scheduler_type::warmup_cosine_lr) {
    const std::string why = "WarmupCosineLR scales the optimizer's lr (optimizer.params.lr) by ratios: use "
                            "warmup_min_ratio and cos_min_ratio";
    check_keys(pj, pp, {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"},
               {last_iter, {"warmup_min_lr", nullptr, why}, {"warmup_max_lr", nullptr, why}});
  } else if (s.type == scheduler_type::warmup_decay_lr) {
    check_keys(pj, pp, {"total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"},
               {last_iter});
  } else {
    check_keys(pj, pp, {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"},
               {last_iter, {"total_num_steps", nullptr, "WarmupLR stays at warmup_max_lr; use WarmupDecayLR to decay"}});
  }
  s.warmup_num_steps = pr.unsigned_integer("warmup_num_steps", 1000, 1);
  s.warmup_type = pr.string("warmup_type", "log");
  if (s.warmup_type != "log" && s.warmup_type != "linear") {
    fail("'scheduler.params.warmup_type' = \"" + s.warmup_type +
         "\" is invalid; use \"log\" or \"linear\" (DeepSpeed would silently fall back to \"log\")");
  }
  if (s.type == scheduler_type::warmup_cosine_lr || s.type == scheduler_type::warmup_decay_lr) {
    if (!pr.has("total_num_steps")) {
      fail("'scheduler.params.total_num_steps' is missing; " + type +
           " needs the total number of optimizer steps (DeepSpeed requires it too)");
    }
    s.total_num_steps = pr.unsigned_integer("total_num_steps", 0, 1);
  }
  if (s.type == scheduler_type::warmup_cosine_lr) {
    s.warmup_min_ratio = pr.number("warmup_min_ratio", 0.0);
    s.cos_min_ratio = pr.number("cos_min_ratio", 1e-4);
    require_finite_range(pr.path("warmup_min_ratio"), s.warmup_min_ratio, 0.0, 1.0,
                         "the first learning rate is warmup_min_ratio x optimizer lr");
    require_finite_range(pr.path("cos_min_ratio"), s.cos_min_ratio, 0.0, 1.0,
                         "the final learning rate is cos_min_ratio x optimizer lr");
  } else {
    s.warmup_min_lr = pr.number("warmup_min_lr", 0.0);
    // DeepSpeed's WarmupLR warms up to the optimizer's lr when warmup_max_lr is absent;
    // WarmupDecayLR's default is 0.001.
    const double max_default = s.type == scheduler_type::warmup_lr ? c.optimizer.lr : 1e-3;
    s.warmup_max_lr = pr.number("warmup_max_lr", max_default);
    require_finite_range(pr.path("warmup_min_lr"), s.warmup_min_lr, 0.0, 1e6, "");
    require_finite_range(pr.path("warmup_max_lr"), s.warmup_max_lr, 0.0, 1e6, "");
  }
}

void parse_data_types(const json& j, config& c) {
  const std::string p = "data_types";
  check_keys(j, p, {"grad_accum_dtype"},
             {{"param_dtype", nullptr, "the parameter dtype comes from \"bf16\" / \"fp16\""},
              {"buffer_dtype", nullptr, "buffers are left as the model has them"}});
  reader r(j, p);
  if (const json* v = r.find("grad_accum_dtype")) {
    if (!v->is_string()) r.type_error("grad_accum_dtype", *v, "a string (\"fp32\", \"bf16\" or \"fp16\")");
    const auto d = dtype_from_deepspeed_name(v->get<std::string>());
    if (!d) {
      fail("'data_types.grad_accum_dtype' = " + v->dump() + " is invalid; use \"fp32\", \"bf16\" or \"fp16\"");
    }
    c.grad_accum_dtype = d;
  }
}

// ---- batch sizes ----------------------------------------------------------------

// DeepSpeed's rules (DeepSpeedConfig._set_batch_related_parameters, _batch_assertion):
// any two of the three derive the third; train_batch_size alone means GAS = 1; the micro
// batch alone means GAS = 1; neither of train/micro is an error; all three must satisfy
// train = micro x GAS x world.
void resolve_batch(const std::optional<std::uint64_t>& train, const std::optional<std::uint64_t>& micro,
                   const std::optional<std::uint64_t>& gas, std::uint64_t world, config& c) {
  const std::string formula = "train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x "
                              "world size";
  auto mul = [&](std::uint64_t a, std::uint64_t b) {
    std::uint64_t r;
    if (__builtin_mul_overflow(a, b, &r)) {
      fail("batch sizes overflow 64 bits (" + std::to_string(a) + " x " + std::to_string(b) + "); " + formula);
    }
    return r;
  };
  auto not_multiple = [&](std::uint64_t t, std::uint64_t divisor, const std::string& what) {
    fail("batch sizes disagree: " + formula + ", but train_batch_size (" + std::to_string(t) +
         ") is not a positive multiple of " + what + " = " + std::to_string(divisor) +
         "; change train_batch_size or give all three consistently");
  };
  const std::string ws = std::to_string(world);
  if (train && micro && gas) {
    const std::uint64_t prod = mul(mul(*micro, *gas), world);
    if (prod != *train) {
      fail("batch sizes disagree: train_batch_size (" + std::to_string(*train) +
           ") != train_micro_batch_size_per_gpu (" + std::to_string(*micro) + ") x gradient_accumulation_steps (" +
           std::to_string(*gas) + ") x world size (" + ws + ") = " + std::to_string(prod) + "; " + formula +
           ". Fix one of them, or give only two and mpzero derives the third");
    }
    c.train_batch_size = *train, c.train_micro_batch_size_per_gpu = *micro, c.gradient_accumulation_steps = *gas;
  } else if (train && micro) {
    const std::uint64_t d = mul(*micro, world);
    if (*train % d != 0 || *train < d) {
      not_multiple(*train, d,
                   "train_micro_batch_size_per_gpu (" + std::to_string(*micro) + ") x world size (" + ws + ")");
    }
    c.train_batch_size = *train, c.train_micro_batch_size_per_gpu = *micro, c.gradient_accumulation_steps = *train / d;
  } else if (train && gas) {
    const std::uint64_t d = mul(*gas, world);
    if (*train % d != 0 || *train < d) {
      not_multiple(*train, d, "gradient_accumulation_steps (" + std::to_string(*gas) + ") x world size (" + ws + ")");
    }
    c.train_batch_size = *train, c.gradient_accumulation_steps = *gas, c.train_micro_batch_size_per_gpu = *train / d;
  } else if (micro && gas) {
    c.train_micro_batch_size_per_gpu = *micro, c.gradient_accumulation_steps = *gas;
    c.train_batch_size = mul(mul(*micro, *gas), world);
  } else if (train) {
    if (*train % world != 0 || *train < world) not_multiple(*train, world, "world size (" + ws + ")");
    c.train_batch_size = *train, c.gradient_accumulation_steps = 1, c.train_micro_batch_size_per_gpu = *train / world;
  } else if (micro) {
    c.train_micro_batch_size_per_gpu = *micro, c.gradient_accumulation_steps = 1;
    c.train_batch_size = mul(*micro, world);
  } else {
    fail("no batch size: give train_batch_size or train_micro_batch_size_per_gpu (or both; " + formula +
         ", and gradient_accumulation_steps alone is not enough, as in DeepSpeed)");
  }
}

// ---- cross-section rules -----------------------------------------------------------

void validate(config& c, bool autocast_dtype_given) {
  const int stage = c.zero.stage;
  if (c.bf16 && c.fp16) fail("'bf16.enabled' and 'fp16.enabled' are both true; enable one of them");
  // Each flag lowers part of a 16-bit model's states, so it needs that model.
  auto need_enabled = [&](bool flag, bool enabled, const char* key, const char* section, const char* keeps) {
    if (flag && !enabled) {
      fail(std::string("'") + key + "' is true but '" + section + ".enabled' is not; set " + section +
           ".enabled = true (the flag keeps a " + section + " model's " + keeps + " in " + section +
           "; without a " + section + " model it has nothing to act on), or drop the flag");
    }
  };
  need_enabled(c.bf16_master_weights_and_grads, c.bf16, "bf16.bf16_master_weights_and_grads", "bf16",
               "master weights and gradients");
  need_enabled(c.bf16_optimizer_states, c.bf16, "bf16.bf16_optimizer_states", "bf16", "optimizer states");
  need_enabled(c.fp16_master_weights_and_grads, c.fp16, "fp16.fp16_master_weights_and_grads", "fp16",
               "master weights and gradients");
  auto need_zero = [&](bool flag, const char* key) {
    if (flag && stage < 1) {
      fail(std::string("'") + key + "' needs ZeRO stage 1, 2 or 3 (zero_optimization.stage is " +
           std::to_string(stage) + "); set zero_optimization.stage >= 1, as DeepSpeed requires");
    }
  };
  need_zero(c.bf16_master_weights_and_grads, "bf16.bf16_master_weights_and_grads");
  need_zero(c.bf16_optimizer_states, "bf16.bf16_optimizer_states");
  need_zero(c.fp16_master_weights_and_grads, "fp16.fp16_master_weights_and_grads");
  if (c.bf16_optimizer_states && !c.bf16_master_weights_and_grads) {
    fail("'bf16.bf16_optimizer_states' needs 'bf16.bf16_master_weights_and_grads' = true (as in DeepSpeed: 16-bit "
         "states come with a 16-bit master); set both, or drop bf16_optimizer_states");
  }
  if (c.zero.offload_optimizer == offload_device::cpu && stage < 1) {
    fail("'zero_optimization.offload_optimizer.device' = \"cpu\" needs ZeRO stage 1, 2 or 3 "
         "(zero_optimization.stage is 0); set the stage >= 1 or the device to \"none\"");
  }
  if (c.fp16) {
    with_context("", [&] { loss_scaler check(c.loss_scaler); });
  }
  const dtype model = c.param_dtype();
  constexpr auto mixes = mpzero::detail::mixes_16bit;
  if (c.communication_data_type && mixes(model, *c.communication_data_type)) {
    fail("'communication_data_type' = \"" + std::string(name_of(*c.communication_data_type)) +
         "\" mixes bf16 and fp16 with a " + std::string(name_of(model)) +
         " model; reduce in the model's dtype or \"fp32\"");
  }
  if (c.torch_autocast.enabled && mixes(model, c.torch_autocast.dtype_)) {
    const char* same = model == dtype::fp16 ? "\"float16\"" : "\"bfloat16\"";
    fail("'torch_autocast.dtype' = \"" + std::string(name_of(c.torch_autocast.dtype_)) + "\"" +
         (autocast_dtype_given ? "" : " (the default)") + " mixes bf16 and fp16 with a " +
         std::string(name_of(model)) + " model; set \"torch_autocast\": {\"dtype\": " + same +
         "}, the dtype of the enabled \"" + std::string(name_of(model)) + "\" section");
  }
  if (c.grad_accum_dtype) {
    const dtype g = *c.grad_accum_dtype;
    if (g != dtype::fp32 && g != model) {
      fail("'data_types.grad_accum_dtype' = \"" + std::string(name_of(g)) + "\" with a " +
           std::string(name_of(model)) + " model is not supported; accumulate gradients in \"fp32\" or in the "
           "model's dtype \"" + std::string(name_of(model)) + "\"");
    }
    if (g == dtype::fp32 && (c.bf16_master_weights_and_grads || c.fp16_master_weights_and_grads)) {
      fail("'data_types.grad_accum_dtype' = \"fp32\" contradicts " +
           std::string(c.bf16 ? "'bf16.bf16_master_weights_and_grads'" : "'fp16.fp16_master_weights_and_grads'") +
           ", which keeps gradients in 16 bits; drop one of them");
    }
  }
  if (c.rounding != "nearest" && c.rounding != "stochastic") {
    std::string msg = "'rounding' = \"" + c.rounding + "\" is invalid; use \"nearest\" or \"stochastic\"";
    const std::string guess = closest(c.rounding, {"nearest", "stochastic"});
    if (!guess.empty()) msg += "; did you mean " + squote(guess) + "?";
    fail(msg);
  }
  if (c.rounding == "stochastic" && c.master_dtype() == dtype::fp32 && c.state_dtype() == dtype::fp32) {
    fail("'rounding' = \"stochastic\" applies to 16-bit master weights or optimizer states, and this config keeps "
         "both in fp32; use \"nearest\", or enable bf16.bf16_master_weights_and_grads / "
         "fp16.fp16_master_weights_and_grads");
  }
  if (!(std::isfinite(c.gradient_clipping) && c.gradient_clipping >= 0)) {
    fail("'gradient_clipping' = " + format_number(c.gradient_clipping) +
         " is invalid; it must be a finite number >= 0 (0 disables clipping; DeepSpeed's default is 1.0)");
  }
}

// Duplicate keys are an error, as DeepSpeed's dict_raise_error_on_duplicate_keys makes them.
json parse_text(const std::string& text) {
  struct frame {
    bool object;
    std::set<std::string> keys;
    std::string key;
  };
  std::vector<frame> stack;
  auto path = [&] {
    std::string p;
    for (const auto& f : stack)
      if (f.object && !f.key.empty()) p = join_path(p, f.key);
    return p;
  };
  json::parser_callback_t cb = [&](int, json::parse_event_t ev, json& parsed) {
    switch (ev) {
      case json::parse_event_t::object_start: stack.push_back({true, {}, {}}); break;
      case json::parse_event_t::array_start: stack.push_back({false, {}, {}}); break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!stack.empty()) stack.pop_back();
        break;
      case json::parse_event_t::key: {
        frame& f = stack.back();
        f.key = parsed.get<std::string>();
        if (!f.keys.insert(f.key).second) fail("duplicate key " + squote(path()) + "; keep one of them");
        break;
      }
      default: break;
    }
    return true;
  };
  try {
    return json::parse(text, cb, /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const json::parse_error& e) {
    fail(std::string("JSON syntax error: ") + e.what());
  } catch (const json::out_of_range& e) {
    // A number past a double's range (1e400): the JSON library stops with out_of_range 406.
    fail(std::string("JSON number out of range: ") + e.what() +
         "; write a finite number (a double reaches about 1.8e308)");
  }
}

}  // namespace

// ---- public API ----------------------------------------------------------------------

dtype config::param_dtype() const { return bf16 ? dtype::bf16 : fp16 ? dtype::fp16 : dtype::fp32; }

dtype config::master_dtype() const {
  if (bf16 && bf16_master_weights_and_grads) return dtype::bf16;
  if (fp16 && fp16_master_weights_and_grads) return dtype::fp16;
  return dtype::fp32;
}

// DeepSpeed accumulates and reduces gradients in the model's dtype (grad_accum_dtype
// defaults to it) whether the master is fp32 or 16-bit; see docs/config.md.
dtype config::grad_dtype() const { return grad_accum_dtype ? *grad_accum_dtype : param_dtype(); }

dtype config::state_dtype() const { return bf16 && bf16_optimizer_states ? dtype::bf16 : dtype::fp32; }

dtype config::comm_dtype() const { return communication_data_type ? *communication_data_type : grad_dtype(); }

std::string_view optimizer_name(optimizer_type t) {
  switch (t) {
    case optimizer_type::adam: return "Adam";
    case optimizer_type::adamw: return "AdamW";
    case optimizer_type::sgd: return "SGD";
    case optimizer_type::lion: return "Lion";
  }
  return "?";
}

std::string_view scheduler_name(scheduler_type t) {
  switch (t) {
    case scheduler_type::none: return "";
    case scheduler_type::warmup_lr: return "WarmupLR";
    case scheduler_type::warmup_decay_lr: return "WarmupDecayLR";
    case scheduler_type::warmup_cosine_lr: return "WarmupCosineLR";
    case scheduler_type::lr_range_test: return "LRRangeTest";
    case scheduler_type::one_cycle: return "OneCycle";
  }
  return "?";
}

std::string_view offload_device_name(offload_device d) { return d == offload_device::cpu ? "cpu" : "none"; }

void validate_tensor_parallel(const config& c, std::uint64_t world) {
  const tensor_parallel_config& t = c.tensor_parallel;
  if (!t.enabled()) return;
  const std::string size = "'tensor_parallel.autotp_size' = " + std::to_string(t.autotp_size);
  if (c.zero.stage == 3) {
    fail(size + " with ZeRO stage 3: AutoTP trains with stages 0-2 (as in DeepSpeed); set zero_optimization.stage "
         "to 2 or less, or autotp_size to 1");
  }
  if (world % t.autotp_size != 0) {
    fail(size + " does not divide the " + std::to_string(world) +
         " ranks; the world is tensor-parallel groups of autotp_size consecutive ranks times data-parallel replicas");
  }
  if (t.preset_model.empty() && t.layer_specs.empty()) {
    fail(size + " without 'preset_model' or 'partition_config.layer_specs': mpzero has no heuristic sharding; name "
         "a preset (llama, qwen2, ...) or give layer specs");
  }
}

void check_param_groups(const std::vector<param_group>& groups) {
  std::set<std::string> names;
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const param_group& g = groups[i];
    const std::string who = "param_groups[" + std::to_string(i) + "]" + (g.name.empty() ? "" : " ('" + g.name + "')");
    if (g.name.empty()) fail(who + " has no name; name it (e.g. \"no_decay\"): messages, get_lr and checkpoints use it");
    if (g.name == "default") {
      fail(who + ": \"default\" names the parameters no group matches; choose another name");
    }
    if (!names.insert(g.name).second) fail(who + ": another group has this name; give each group its own");
    if (g.patterns.empty()) {
      fail(who + " has no patterns; give regular expressions over parameter names, e.g. [\"bias$\", \"norm\"]");
    }
    for (const std::string& pat : g.patterns) check_pattern(who, pat);
    const auto check = [&](const std::optional<double>& v, const char* key) {
      if (v && (!(*v >= 0) || !std::isfinite(*v))) {
        fail(who + ": " + key + " = " + format_number(*v) + " is invalid; use a finite value >= 0, or leave it out "
             "for the optimizer's");
      }
    };
    check(g.lr, "lr");
    check(g.weight_decay, "weight_decay");
  }
}

config parse_config(const json& j, int world_size) {
  if (world_size < 1) {
    fail("world_size = " + std::to_string(world_size) + " is invalid; pass the number of data-parallel ranks (>= 1)");
  }
  if (!j.is_object()) fail("the configuration must be a JSON object {...}, got " + describe(j));
  check_keys(j, "", top_level_keys, top_level_foreign);
  config c;
  reader r(j, "");
  if (const json* v = r.object("bf16")) parse_bf16(*v, c);
  // DeepSpeed's older name of the section: read when "bf16" is absent, as DeepSpeed does.
  if (const json* v = r.object("bfloat16")) {
    if (r.has("bf16")) {
      c.notices.push_back("'bfloat16' is ignored: \"bf16\" is given, and DeepSpeed reads \"bf16\" first (remove 'bfloat16')");
    } else {
      parse_bf16(*v, c, "bfloat16");
      c.notices.push_back("'bfloat16' is DeepSpeed's deprecated name of the \"bf16\" section; read as \"bf16\" (rename it)");
    }
  }
  if (r.has("prescale_gradients")) (void)r.boolean("prescale_gradients", false);
  if (r.has("gradient_predivide_factor")) {
    const double f = r.number("gradient_predivide_factor", 1.0);
    if (!(f > 0) || !std::isfinite(f)) {
      fail("'gradient_predivide_factor' = " + format_number(f) +
           " is invalid; it must be a finite number > 0 (DeepSpeed divides gradients by it before the reduction)");
    }
  }
  if (const json* v = r.object("fp16")) parse_fp16(*v, c);
  bool autocast_dtype_given = false;
  if (const json* v = r.object("torch_autocast")) autocast_dtype_given = parse_autocast(*v, c);
  if (const json* z = r.find("zero_optimization"); z && z->is_boolean()) {
    r.type_error("zero_optimization", *z,
                 "an object (DeepSpeed's deprecated boolean form is not accepted: write {\"stage\": 1})");
  }
  if (const json* v = r.object("zero_optimization")) parse_zero(*v, c);
  // The optimizer first: WarmupLR's default peak is the optimizer's lr.
  const json* optimizer = r.object("optimizer");
  if (optimizer) parse_optimizer(*optimizer, c);
  c.optimizer_given = optimizer != nullptr;
  if (!c.optimizer_given) {
    // DeepSpeed would train with the client's optimizer here; mpzero has a default, said aloud.
    c.notices.push_back("no \"optimizer\" section: training with mpzero's default, AdamW (lr " +
                        format_number(c.optimizer.lr) + ", betas [" + format_number(c.optimizer.beta1) + ", " +
                        format_number(c.optimizer.beta2) + "], eps " + format_number(c.optimizer.eps) +
                        ", weight_decay " + format_number(c.optimizer.weight_decay) +
                        "); name one in the config, or pass one to initialize");
  }
  if (const json* v = r.object("scheduler")) parse_scheduler(*v, c);
  if (const json* v = r.object("data_types")) parse_data_types(*v, c);
  c.gradient_clipping = r.number("gradient_clipping", 1.0);
  c.managed_gradient_accumulation = r.boolean("managed_gradient_accumulation", true);
  if (const json* v = r.find("communication_data_type")) {
    if (!v->is_string()) r.type_error("communication_data_type", *v, "a string (\"fp32\", \"bf16\" or \"fp16\")");
    // DeepSpeed lower-cases the value and accepts exactly these three names.
    const std::string s = lower(v->get<std::string>());
    if (s == "fp32") {
      c.communication_data_type = dtype::fp32;
    } else if (s == "bf16") {
      c.communication_data_type = dtype::bf16;
    } else if (s == "fp16") {
      c.communication_data_type = dtype::fp16;
    } else {
      fail("'communication_data_type' = " + v->dump() + " is invalid; supported: \"fp32\", \"bf16\", \"fp16\"");
    }
  }
  c.seed = r.unsigned_integer("seed", 0, 0);
  c.rounding = r.string("rounding", "nearest");
  if (const json* v = r.find("param_groups")) parse_param_groups(*v, c);
  if (const json* v = r.object("tensor_parallel")) parse_tensor_parallel(*v, c);

  auto batch = [&](const char* key) -> std::optional<std::uint64_t> {
    if (!r.has(key)) return std::nullopt;
    if (const json* v = r.find(key); !v->is_number()) r.type_error(key, *v, "a positive integer");
    return r.unsigned_integer(key, 0, 1);
  };
  // The batch is split over the data-parallel replicas: with tensor parallelism, world /
  // autotp_size of them (the ranks of a tensor-parallel group share their batch).
  const auto world = static_cast<std::uint64_t>(world_size);
  const std::uint64_t tp = c.tensor_parallel.autotp_size;
  validate_tensor_parallel(c, world);
  resolve_batch(batch("train_batch_size"), batch("train_micro_batch_size_per_gpu"),
                batch("gradient_accumulation_steps"), world % tp == 0 ? world / tp : world, c);
  validate(c, autocast_dtype_given);
  return c;
}

config parse_config_text(const std::string& json_text, int world_size) {
  return parse_config(parse_text(json_text), world_size);
}

namespace {

// A file's text, or a config_error naming the path.
std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw config_error("mpzero: config file '" + path + "' cannot be opened: " + std::strerror(errno) +
                       " (check the path; it is resolved from the working directory)");
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// f(), its config_error naming the file.
template <class F>
auto in_file(const std::string& path, F&& f) {
  try {
    return f();
  } catch (const config_error& e) {
    std::string m = e.what();
    const std::string prefix = "mpzero: config: ";
    if (m.rfind(prefix, 0) == 0) m = m.substr(prefix.size());
    throw config_error("mpzero: config file '" + path + "': " + m);
  }
}

}  // namespace

config load_config_file(const std::string& path, int world_size) {
  const std::string text = read_file(path);
  return in_file(path, [&] { return parse_config_text(text, world_size); });
}

bool is_config_text(std::string_view path_or_json) {
  const auto first = std::find_if(path_or_json.begin(), path_or_json.end(), [](unsigned char ch) { return !std::isspace(ch); });
  return first != path_or_json.end() && *first == '{';
}

json read_config_json(const std::string& path_or_json) {
  if (is_config_text(path_or_json)) return parse_text(path_or_json);
  const std::string text = read_file(path_or_json);
  return in_file(path_or_json, [&] { return parse_text(text); });
}

config parse_config_with_optimizer(const json& j, const optimizer_config& optimizer, int world_size) {
  if (!j.is_object()) return parse_config(j, world_size);  // its own error
  if (const auto it = j.find("optimizer"); it != j.end() && !it->is_null()) {
    fail("the config has an \"optimizer\" section and initialize was given an optimizer in code too; keep one "
         "(remove the section, or the argument)");
  }
  config named;
  named.optimizer = optimizer;
  json with = j;
  with["optimizer"] = to_json(named)["optimizer"];
  return parse_config(with, world_size);
}

json to_json(const config& c) {
  json j;
  j["train_batch_size"] = c.train_batch_size;
  j["train_micro_batch_size_per_gpu"] = c.train_micro_batch_size_per_gpu;
  j["gradient_accumulation_steps"] = c.gradient_accumulation_steps;
  j["managed_gradient_accumulation"] = c.managed_gradient_accumulation;
  j["bf16"] = {{"enabled", c.bf16},
               {"bf16_master_weights_and_grads", c.bf16_master_weights_and_grads},
               {"bf16_optimizer_states", c.bf16_optimizer_states},
               {"check_grad_overflow", c.check_grad_overflow}};
  const loss_scale_options& o = c.loss_scaler;
  j["fp16"] = {{"enabled", c.fp16},
               {"loss_scale", o.dynamic ? 0.0 : o.static_scale},
               {"initial_scale_power", o.initial_scale_power},
               {"loss_scale_window", o.loss_scale_window},
               {"hysteresis", o.hysteresis},
               {"consecutive_hysteresis", o.consecutive_hysteresis},
               {"min_loss_scale", o.min_loss_scale},
               {"fp16_master_weights_and_grads", c.fp16_master_weights_and_grads}};
  j["torch_autocast"] = {{"enabled", c.torch_autocast.enabled}, {"dtype", dtype_json_name(c.torch_autocast.dtype_)}};
  // Only a given list: parsing it back must keep lower_precision_safe_modules_given.
  if (c.torch_autocast.lower_precision_safe_modules_given) {
    j["torch_autocast"]["lower_precision_safe_modules"] = c.torch_autocast.lower_precision_safe_modules;
  }
  const zero_config& z = c.zero;
  j["zero_optimization"] = {
      {"stage", z.stage},
      {"offload_optimizer", {{"device", offload_device_name(z.offload_optimizer)}, {"pin_memory", z.offload_pin_memory}}},
      {"reduce_bucket_size", z.reduce_bucket_size},
      {"allgather_bucket_size", z.allgather_bucket_size},
      {"overlap_comm", z.overlap_comm},
      {"contiguous_gradients", z.contiguous_gradients},
      {"reduce_scatter", z.reduce_scatter},
      {"stage3_param_persistence_threshold", z.stage3_param_persistence_threshold},
      {"stage3_prefetch_bucket_size", z.stage3_prefetch_bucket_size},
      {"stage3_max_live_parameters", z.stage3_max_live_parameters},
      {"stage3_gather_16bit_weights_on_model_save", z.stage3_gather_16bit_weights_on_model_save},
      {"leaf_module",
       {{"classes", z.leaf_module_classes}, {"names", z.leaf_module_names}, {"name_suffixes", z.leaf_module_name_suffixes}}}};
  if (z.sub_group_size) j["zero_optimization"]["sub_group_size"] = *z.sub_group_size;
  j["gradient_clipping"] = c.gradient_clipping;
  const optimizer_config& op = c.optimizer;
  json params = {{"lr", op.lr}, {"weight_decay", op.weight_decay}};
  switch (op.type) {
    case optimizer_type::adam:
    case optimizer_type::adamw:
      params["betas"] = {op.beta1, op.beta2};
      params["eps"] = op.eps;
      params["bias_correction"] = op.bias_correction;
      params["adam_w_mode"] = op.type == optimizer_type::adamw;
      break;
    case optimizer_type::sgd:
      params["momentum"] = op.momentum;
      params["dampening"] = op.dampening;
      params["nesterov"] = op.nesterov;
      break;
    case optimizer_type::lion: params["betas"] = {op.beta1, op.beta2}; break;
  }
  j["optimizer"] = {{"type", optimizer_name(op.type)}, {"params", params}};
  const scheduler_config& s = c.scheduler;
  if (s.type == scheduler_type::lr_range_test) {
    j["scheduler"] = {{"type", scheduler_name(s.type)},
                      {"params",
                       {{"lr_range_test_min_lr", s.lr_range_test_min_lr},
                        {"lr_range_test_step_size", s.lr_range_test_step_size},
                        {"lr_range_test_step_rate", s.lr_range_test_step_rate},
                        {"lr_range_test_staircase", s.lr_range_test_staircase}}}};
  } else if (s.type == scheduler_type::one_cycle) {
    j["scheduler"] = {{"type", scheduler_name(s.type)},
                      {"params",
                       {{"cycle_min_lr", s.cycle_min_lr},
                        {"cycle_max_lr", s.cycle_max_lr},
                        {"decay_lr_rate", s.decay_lr_rate},
                        {"cycle_first_step_size", s.cycle_first_step_size},
                        {"cycle_second_step_size", s.cycle_second_step_size},
                        {"cycle_first_stair_count", s.cycle_first_stair_count},
                        {"cycle_second_stair_count", s.cycle_second_stair_count},
                        {"decay_step_size", s.decay_step_size},
                        {"cycle_momentum", s.cycle_momentum},
                        {"cycle_min_mom", s.cycle_min_mom},
                        {"cycle_max_mom", s.cycle_max_mom},
                        {"decay_mom_rate", s.decay_mom_rate}}}};
  } else if (s.type != scheduler_type::none) {
    json sp = {{"warmup_num_steps", s.warmup_num_steps}, {"warmup_type", s.warmup_type}};
    if (s.type == scheduler_type::warmup_cosine_lr) {
      sp["total_num_steps"] = s.total_num_steps;
      sp["warmup_min_ratio"] = s.warmup_min_ratio;
      sp["cos_min_ratio"] = s.cos_min_ratio;
    } else {
      sp["warmup_min_lr"] = s.warmup_min_lr;
      sp["warmup_max_lr"] = s.warmup_max_lr;
      if (s.type == scheduler_type::warmup_decay_lr) sp["total_num_steps"] = s.total_num_steps;
    }
    j["scheduler"] = {{"type", scheduler_name(s.type)}, {"params", sp}};
  }
  if (c.communication_data_type) j["communication_data_type"] = dtype_json_name(*c.communication_data_type);
  if (c.grad_accum_dtype) j["data_types"] = {{"grad_accum_dtype", dtype_json_name(*c.grad_accum_dtype)}};
  j["seed"] = c.seed;
  j["rounding"] = c.rounding;
  if (c.tensor_parallel != tensor_parallel_config{}) {
    const tensor_parallel_config& t = c.tensor_parallel;
    json tp = {{"autotp_size", t.autotp_size}};
    if (!t.preset_model.empty()) tp["preset_model"] = t.preset_model;
    json specs = json::array();
    for (const tp_layer_spec& s : t.layer_specs) {
      json e = {{"patterns", s.patterns},
                {"partition_type", s.partition_type == tp_partition::row    ? "row"
                                   : s.partition_type == tp_partition::skip ? "skip"
                                                                            : "column"}};
      if (s.partition_dim >= 0) e["partition_dim"] = s.partition_dim;
      if (!s.model_types.empty()) e["model_types"] = s.model_types;
      if (!s.shape.empty()) {
        json shape = json::array();
        for (std::size_t k = 0; k < s.shape.size(); ++k) {
          if (!s.sub_sizes.empty() && static_cast<int>(k) == s.dim()) {
            shape.push_back(s.sub_sizes);
          } else {
            shape.push_back(s.shape[k]);
          }
        }
        e["shape"] = std::move(shape);
      }
      specs.push_back(std::move(e));
    }
    tp["partition_config"] = {{"use_default_specs", t.use_default_specs}, {"layer_specs", std::move(specs)}};
    j["tensor_parallel"] = std::move(tp);
  }
  if (!c.param_groups.empty()) {
    json groups = json::array();
    for (const param_group& g : c.param_groups) {
      json e = {{"name", g.name}, {"patterns", g.patterns}};
      if (g.lr) e["lr"] = *g.lr;
      if (g.weight_decay) e["weight_decay"] = *g.weight_decay;
      groups.push_back(std::move(e));
    }
    j["param_groups"] = std::move(groups);
  }
  return j;
}

}  // namespace mpzero::torch

// mpzero::torch engine: parameters re-pointed at the ZeRO core's flat buffer, autograd
// hooks that feed the core, and the per-graph-task end-of-backward epilogue.
#include <mpzero/torch/engine.hpp>

#include <ATen/autocast_mode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/accumulate.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <charconv>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <deque>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <regex>
#include <set>
#include <stdexcept>
#include <system_error>
#include <sstream>
#include <unordered_map>
#include <unordered_set>
#include <unistd.h>
#include <utility>

#include <mpzero/torch/lr_schedule.hpp>
#include <mpzero/torch/zero_core.hpp>
#include "checkpoint_files.hpp"
#include "param_use.hpp"
#include <mpzero/numeric/rounding_bits.hpp>
#include <mpzero/zero/checkpoint.hpp>

namespace mpzero::torch {

namespace detail {
class engine_state;
}

namespace {

namespace ag = ::torch::autograd;

at::ScalarType scalar_type_of(dtype d) {
  switch (d) {
    case dtype::fp32: return at::kFloat;
    case dtype::bf16: return at::kBFloat16;
    case dtype::fp16: return at::kHalf;
  }
  return at::kFloat;
}

std::optional<dtype> dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return dtype::fp32;
    case at::kBFloat16: return dtype::bf16;
    case at::kHalf: return dtype::fp16;
    default: return std::nullopt;
  }
}

// fail, shape_of and the checkpoint files' helpers: checkpoint_files.hpp.
namespace fs = std::filesystem;
using detail::check_tag;
using detail::fail;
using detail::quoted;
using detail::shape_of;
using detail::write_atomically;

using mpzero::detail::format_double;

// True in a graph task that runs only part of the graph: torch::autograd::grad, or
// backward with `inputs` (autograd then lists the nodes to run in exec_info).
bool partial_graph_task() {
  const auto* info = ag::get_current_graph_task_exec_info();
  return info != nullptr && !info->empty();
}

// The graph task an fp16 engine last scaled (engine.scale's root, or engine.backward's),
// any engine of the process: an unscaled engine's refusal names a loss another engine
// scaled. Hooks run on autograd's device threads too, hence atomic.
std::atomic<int>& scaled_task() {
  static std::atomic<int> task{std::numeric_limits<int>::min()};
  return task;
}

// The reentrant depth of the graph task running on this thread: 0 for a backward
// called by user code, > 0 for a backward started inside another backward (reentrant
// checkpointing, a custom Function's backward). -1 when there is no graph task or the
// depth cannot be read. LibTorch exports no accessor for it, but exports a pointer to a
// member of the current GraphTask (its exec_info_), whose layout the installed headers
// describe; the result is trusted only if the task id read through it matches the
// exported id. Otherwise the engine falls back to "an outer backward of this engine is
// still open" (see backward_tracker::acquire).
int current_reentrant_depth() {
  const auto* info = ag::get_current_graph_task_exec_info();
  if (info == nullptr) return -1;
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winvalid-offsetof"
  const auto* task = reinterpret_cast<const ag::GraphTask*>(reinterpret_cast<const char*>(info) -
                                                            offsetof(ag::GraphTask, exec_info_));
#pragma GCC diagnostic pop
  if (static_cast<int>(task->id_) != ag::get_current_graph_task_id()) return -1;
  const int depth = task->reentrant_depth_;
  return depth >= 0 && depth < (1 << 20) ? depth : -1;
}

// DeepSpeed gives the parameters of torch_autocast.lower_precision_safe_modules the
// autocast dtype for their reduction, matching each module's exact class (not
// subclasses). A LibTorch module's name() is its demangled class ("torch::nn::LinearImpl");
// an entry matches that, or it without namespaces, each with or without TORCH_MODULE's
// "Impl": "Linear", "LinearImpl", "torch::nn::LinearImpl" (the config already turned
// "torch.nn.Linear" and DeepSpeed's "torch.nn.modules.linear.Linear" into "Linear").
bool is_lower_precision_safe(const std::string& cls, const std::vector<std::string>& entries) {
  auto without_impl = [](std::string s) {
    if (s.size() > 4 && s.compare(s.size() - 4, 4, "Impl") == 0) s.resize(s.size() - 4);
    return s;
  };
  const std::size_t colon = cls.rfind("::");
  const std::string bare = colon == std::string::npos ? cls : cls.substr(colon + 2);
  const std::string names[] = {cls, without_impl(cls), bare, without_impl(bare)};
  for (const auto& e : entries)
    for (const auto& n : names)
      if (e == n) return true;
  return false;
}

// ---- partitioned construction (zero_init) ------------------------------------------------

thread_local zero_init* current_zero_init = nullptr;

// ZeRO-3: the engine that partitions each frozen parameter (a gathered_forward unit of
// frozen parameters only finds its engine here; trainable ones carry it in their hook).
std::mutex frozen_owners_mutex;
std::unordered_map<const c10::TensorImpl*, std::weak_ptr<detail::engine_state>> frozen_owners;

std::shared_ptr<detail::engine_state> frozen_owner(const ::torch::Tensor& p) {
  std::lock_guard<std::mutex> lock(frozen_owners_mutex);
  const auto it = frozen_owners.find(p.unsafeGetTensorImpl());
  return it == frozen_owners.end() ? nullptr : it->second.lock();
}

// A parameter built under zero_init: this rank's slice of it, what it was whole.
struct built_slice {
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> owner{
      c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
  ::torch::Tensor slice;  // elements slice_range(numel, world, rank) of the flattened parameter, on the CPU
  std::vector<std::int64_t> shape;
  int world = 1, rank = 0;
  std::uint64_t hash = 0;  // of the whole parameter as built, in fp32 (whole_hash)
};

// Rank r's elements of a parameter of n elements split over `world` ranks: equal
// slices of ceil(n / world), the last ones shorter or empty.
std::pair<std::int64_t, std::int64_t> slice_range(std::int64_t n, int world, int r) {
  const std::int64_t chunk = (n + world - 1) / world;
  const std::int64_t begin = std::min(n, chunk * r);
  return {begin, std::min(n, begin + chunk)};
}

// Rank r's slice of a parameter of whole.size() elements into `whole`, in fp32.
void put_own_slice(std::vector<float>& whole, const ::torch::Tensor& slice, int world, int r) {
  const auto [begin, end] = slice_range(static_cast<std::int64_t>(whole.size()), world, r);
  const ::torch::Tensor own = slice.to(at::kCPU, at::kFloat).contiguous();
  std::copy_n(own.const_data_ptr<float>(), end - begin, whole.data() + begin);
}

// 64-bit FNV-1a of n floats' bytes.
std::uint64_t whole_hash(const float* v, std::size_t n) {
  std::uint64_t h = 1469598103934665603ull;
  const auto* b = reinterpret_cast<const unsigned char*>(v);
  for (std::size_t k = 0; k < n * sizeof(float); ++k) h = (h ^ b[k]) * 1099511628211ull;
  return h;
}

// The parameters built partitioned and not yet taken by an engine, by tensor. Entries of
// parameters that no longer exist are dropped as they are found.
std::mutex built_slices_mutex;
std::unordered_map<const c10::TensorImpl*, built_slice> built_slices;

void drop_dead_slices() {
  for (auto it = built_slices.begin(); it != built_slices.end();) {
    it = it->second.owner.expired() ? built_slices.erase(it) : std::next(it);
  }
}

// The record of parameter p if it was built partitioned (a copy: the engine removes the
// record only once it has started).
std::optional<built_slice> built_slice_of(const ::torch::Tensor& p) {
  std::lock_guard<std::mutex> lock(built_slices_mutex);
  const auto it = built_slices.find(p.unsafeGetTensorImpl());
  if (it == built_slices.end() || it->second.owner.expired()) return std::nullopt;
  return it->second;
}

}  // namespace

namespace detail {

// One backward pass as this engine sees it: the graph task(s) it spans and how its
// gradients are to be treated.
struct pass {
  std::vector<int> tasks;       // graph task ids mapped to this pass (nested ones included)
  bool scaled = false;          // fp16: the loss was scaled (engine.backward or engine.scale)
  bool scale_wrt_gas = true;    // divide gradients by gradient_accumulation_steps
  bool manual = false;          // engine.backward runs the epilogue itself
  bool has_callback = false;    // an end-of-backward callback is queued in tasks[0]
  bool done = false;
  std::weak_ptr<char> alive;    // expires when the graph task holding the callback is destroyed
};

struct forward_hold;
class engine_state;

// ZeRO-3: what a backward says when it reaches parameters a step() released.
[[noreturn]] void released_since_forward(const char* what) {
  throw mpzero::error(std::string("mpzero::torch: ZeRO-3: a backward reached ") + what +
                      " whose parameters were released since its forward (engine.step() or load_checkpoint came "
                      "between): the parameters it saved are gone. Run backward before step(), and forward again "
                      "after it");
}

// ZeRO-3: gathering partitioned parameters. Each managed parameter has a count of holds;
// a partitioned parameter is gathered (its tensor a view of the core's gathered copy)
// while its count is above zero. Holds are taken and dropped in the same order on every
// rank, so the gathers, which are collective, match. A core group (a contiguous run of
// parameters gathered together) is released when none of its parameters is held any
// more. One part of engine_state, which owns it: it reads the engine's core, parameters
// and streams.
class zero3_gatherer {
 public:
  explicit zero3_gatherer(engine_state& e) : e_(e) {}

  void hold(const std::vector<std::size_t>& idx);
  void unhold(const std::vector<std::size_t>& idx);
  // Releases every group, whatever holds it (before step() and loads, which rewrite the
  // partitions); holds taken before do nothing when dropped.
  void release_all();
  // The partitioned parameters; with unclaimed_only, those no gathered_forward call has
  // covered yet, which engine.forward gathers for the whole pass.
  std::vector<std::size_t> partitioned_params(bool unclaimed_only) const;
  void release_backward_units();
  // Starts the all-gather of those of idx (sorted) that no group holds or fetches yet, if
  // stage3_prefetch_bucket_size allows their size; hold() then waits for it.
  void prefetch(const std::vector<std::size_t>& idx);
  // Releases the groups prefetched and not gathered since (the end of a forward or of a
  // backward: the unit they were for did not come).
  void drop_prefetches();
  // core_->release(group), its error kept in `first` unless one is there already (the
  // rest of a release loop still runs).
  void release_keeping_first_error(std::pair<std::size_t, std::size_t> group, std::exception_ptr& first);
  // An error where nothing can throw (forward_scope's destructor), kept for the engine's
  // next call: defer_error (in a catch block) keeps the first, prefixed with `where`;
  // rethrow_deferred throws it once.
  void defer_error(const std::string& where);
  void rethrow_deferred();
  // `sorted` in ranges of one all-gather each: neighbours join when only parameters that
  // are never gathered (persistent, empty) lie between them, as a block's biases between
  // its weights.
  std::vector<std::pair<std::size_t, std::size_t>> runs_of(const std::vector<std::size_t>& sorted) const;
  // Whether parameter i is in a group gathered now (live) or being fetched (prefetched).
  // group_of_[i] is the last group it was in, which may be gone.
  bool member(std::size_t i) const {
    const auto& g = group_of_[i];
    return g.first <= i && i < g.second;
  }
  bool in_live_group(std::size_t i) const { return member(i) && live_groups_.count(group_of_[i]) > 0; }
  bool in_prefetch(std::size_t i) const { return member(i) && prefetched_.count(group_of_[i]) > 0; }
  // Points parameter i at the core's storage of it (a gathered copy at ZeRO-3), or at
  // nothing (unbind: partitioned; an armed one keeps its shape over a storage without data).
  void bind(std::size_t i);
  void unbind(std::size_t i);
  // The dtype parameter i is gathered in for forward and backward (the autocast dtype for
  // the lower_precision_safe_modules' at ZeRO-3, zero_options::gather_dtypes).
  at::ScalarType gather_type(std::size_t i) const;
  // While set (a save's gathers), parameters are gathered in the parameter dtype.
  bool stored_dtype_ = false;

  // engine.forward's partitioned parameters outside every unit. Armed while a forward's
  // graph lives (one count per forward): each keeps its shape over a storage without
  // data, and is gathered when an operation reads it (param_use's observer calls
  // gather_for_use), while at most stage3_max_live_parameters elements of them are held
  // (more only while one operation reads more); the oldest are released first.
  void arm_outside(const std::vector<std::size_t>& idx);
  void disarm_outside();  // a forward's graph is gone: the last one disarms
  void drop_outside();    // disarms whatever the count (release_all)
  // Parameter i no longer watched; unless held, empty (as a unit's between passes).
  void disarm(std::size_t i);
  void gather_for_use(const std::vector<c10::StorageImpl*>& storages);
  const c10::Storage& storage_of(std::size_t i) const;  // a managed parameter's, or a frozen part's
  std::uint64_t numel_of(std::size_t i) const;
  std::vector<char> outside_;               // armed now
  std::vector<std::size_t> outside_armed_;  // their indices
  std::deque<std::size_t> outside_live_;    // held for an operation, oldest first
  std::uint64_t outside_numel_ = 0;         // elements of outside_live_
  int outside_arms_ = 0;
  std::unordered_map<const c10::StorageImpl*, std::size_t> storage_index_;
  std::shared_ptr<use_listener> listener_;

  std::vector<std::uint32_t> holds_;
  std::vector<c10::Storage> storages_;  // per managed parameter, once bound: kept across gathers
  std::vector<std::pair<std::size_t, std::size_t>> group_of_;  // the core group a held parameter is gathered in
  std::map<std::pair<std::size_t, std::size_t>, std::size_t> live_groups_;  // group -> its held parameters
  std::vector<char> claimed_;  // covered by a gathered_forward call
  std::uint64_t generation_ = 0;  // release_all() count
  ::torch::Tensor placeholder_;  // what a partitioned parameter's tensor holds between gathers
  std::shared_ptr<forward_hold> forward_hold_;  // engine.forward's hold on the unclaimed partitioned parameters, while it runs
  std::vector<std::weak_ptr<unit_call>> backward_units_;  // calls gathered for their backward
  std::set<std::pair<std::size_t, std::size_t>> prefetched_;  // groups whose all-gather runs, not gathered yet
  std::uint64_t prefetch_hits_ = 0;                           // gathers a prefetch had started
  std::exception_ptr deferred_error_;  // see defer_error
  // The order of the units (gathered_forward calls) in the last forward: the parameters of
  // the unit that began after a module's, which its next call prefetches.
  std::unordered_map<const ::torch::nn::Module*, std::vector<std::size_t>> next_unit_;
  const ::torch::nn::Module* last_module_ = nullptr;  // this forward's last unit
  std::weak_ptr<unit_call> last_unit_;

 private:
  engine_state& e_;
};

// Checkpoints: DeepSpeed's layout (`<dir>/<tag>/`: the core's shard files, the module's
// states, the engine's counters and names; `<dir>/latest`), saved and loaded collectively.
// One part of engine_state, which owns it: it reads the engine's core, parameters,
// counters and agreement.
class engine_checkpoints {
 public:
  explicit engine_checkpoints(engine_state& e) : e_(e) {}
  void save(const std::string& save_dir, const std::string& tag, const nlohmann::json& client_state, bool save_latest);
  std::optional<engine_base::loaded_checkpoint> load(const std::string& load_dir, const std::string& tag,
                                                     bool module_only);
  std::size_t save_16bit(const std::string& save_dir, const std::string& filename);

 private:
  nlohmann::json engine_json(const std::string& tag, const nlohmann::json& client_state, std::uint64_t save_id) const;
  // AutoTP, a load at another tensor-parallel size: `saved` (tensor-parallel rank 0's
  // entries of the save in tag_dir) becomes this rank's: each entry the save split is
  // joined from every saved rank's file, and each one this engine splits is cut to its slice.
  void reshard_module_states(const fs::path& tag_dir, std::uint64_t saved_tp, const detail::saved_tp_layout& layout,
                             std::unordered_map<std::string, ::torch::Tensor>& saved,
                             const std::function<bool(const std::string&)>& wanted);
  // The module's parameters, then its buffers, by name, each as a placeholder that
  // fetch() turns into its values (detail::write_torch_file), so that a save holds one
  // tensor at a time: at ZeRO-3 a partitioned parameter is gathered for it, then released.
  // whole: AutoTP's split parameters joined from the tensor-parallel ranks' slices
  // (save_16bit_model); otherwise this rank's slices (a checkpoint's tp_rank_<r> files).
  std::vector<std::pair<std::string, at::Tensor>> module_tensors(bool whole = false);
  c10::IValue module_states(std::uint64_t save_id);
  // Collective: every rank fetches every tensor in file order; rank 0 gets the values
  // (on the CPU), the others an undefined tensor.
  at::Tensor fetch(const at::Tensor& placeholder);

  struct source {
    at::Tensor tensor;        // what the module holds
    std::ptrdiff_t gathered;  // ZeRO-3: its zero3_gatherer index when partitioned, else -1
    const tp_param_plan* tp = nullptr;  // AutoTP, whole: the split to join the slices by
  };
  bool world_writer_ = false;  // fetch's values go to rank 0 of the world, not of comm_
  std::unordered_map<const c10::StorageImpl*, source> sources_;  // by placeholder, during a save

  engine_state& e_;
};

// Backward-pass tracking: which graph tasks make up one backward pass as this engine
// sees it, whether it was scaled (fp16), and when its epilogue runs (reducing the last
// buckets). Parameter hooks, output hooks and engine.scale()'s root call in here. One
// part of engine_state, which owns it: it reads the engine's core, names and streams.
class backward_tracker {
 public:
  explicit backward_tracker(engine_state& e) : e_(e) {}

  enum class event { scale_root, output, param };

  // The pass of the current graph task; nullptr for an output or scale-root event in a
  // graph task that opens none (see acquire).
  pass* acquire(event e);
  void on_param_grad(std::size_t i, const ::torch::Tensor& param);
  void on_output() { (void)acquire(event::output); }
  void on_scale_root();
  void on_callback(const std::shared_ptr<pass>& p);
  void epilogue();
  // Passes without a live callback (started in forward or nested only) end at the next step.
  void drop_stale_passes() {
    retire_if([](const pass& q) { return !q.has_callback || q.alive.expired(); });
  }
  ::torch::Tensor backward(const ::torch::Tensor& loss, bool retain_graph, bool scale_wrt_gas);
  ::torch::Tensor scale(const ::torch::Tensor& loss);

  int forward_depth_ = 0;      // engine forwards running (nested ones counted)
  std::uint64_t epilogues_ = 0;
  std::uint64_t lookups_ = 0;  // acquire() calls past the one-entry cache

 private:
  // Ends the open passes `pred` selects: done, their graph tasks forgotten. (Open and
  // not done are the same thing: a pass leaves open_ only here.)
  template <class Pred>
  void retire_if(Pred pred) {
    open_.erase(std::remove_if(open_.begin(), open_.end(),
                               [&](const std::shared_ptr<pass>& q) {
                                 if (!pred(*q)) return false;
                                 q->done = true;
                                 for (int t : q->tasks) passes_.erase(t);
                                 return true;
                               }),
                open_.end());
    cache_task_ = std::numeric_limits<int>::min();
    cache_ = nullptr;
  }
  void close(pass& p) {
    retire_if([&](const pass& q) { return &q == &p; });
  }

  std::unordered_map<int, std::shared_ptr<pass>> passes_;  // graph task id -> pass
  std::vector<std::shared_ptr<pass>> open_;                // passes not yet ended
  int cache_task_ = std::numeric_limits<int>::min();       // the last lookup, for O(1) hooks
  pass* cache_ = nullptr;
  int own_scaled_task_ = std::numeric_limits<int>::min();  // the graph task this engine's scale() root last ran in
  struct direct_backward {
    bool scale_wrt_gas;
  };
  std::optional<direct_backward> pending_;  // engine.backward is running
  std::shared_ptr<pass> manual_;            // the pass engine.backward started
  // The last tensor scale() returned (fp16), so that engine.backward refuses it.
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> last_scaled_;

  engine_state& e_;
};

// ZeRO-3: the frozen floating parameters above stage3_param_persistence_threshold, which
// the engine partitions itself (no gradient, no optimizer state): each rank keeps
// slice_range of their elements, and zero3_gatherer gathers them, after the managed
// parameters in its numbering (params_.size() + f), around their units' forwards. One
// part of engine_state, which owns it: it reads the engine's core (for its broadcasts),
// communicator and configuration.
class frozen_shards {
 public:
  explicit frozen_shards(engine_state& e) : e_(e) {}
  struct part {
    ::torch::Tensor param;  // the module's tensor: empty, or a view of `storage` while gathered
    ::torch::Tensor slice;  // this rank's elements, in the parameter dtype, on its device
    std::vector<std::int64_t> shape;
    c10::Storage storage;  // kept across gathers, as zero3_gatherer::bind keeps a managed one's
  };
  // A frozen parameter's values as initialize converted them: partitioned (then
  // `converted` becomes empty) when stage 3 keeps it in slices.
  void partition(const ::torch::Tensor& param, ::torch::Tensor& converted);
  // Rebuilt whole from the ranks' slices (each broadcasts its own, through the host) into
  // a buffer the parameter's storage points at; release() frees it.
  void gather(std::size_t f);
  // keep_shape: the parameter stays a view of its storage, without data (armed by
  // zero3_gatherer for a forward, gathered again when an operation reads it).
  void release(std::size_t f, bool keep_shape = false);
  const part* part_of(const ::torch::Tensor& t) const {
    const auto it = index_.find(t.unsafeGetTensorImpl());
    return it == index_.end() ? nullptr : &parts_[it->second];
  }
  std::size_t size() const { return parts_.size(); }

  std::vector<part> parts_;
  std::unordered_map<const c10::TensorImpl*, std::size_t> index_;  // tensor -> parts_ index

 private:
  engine_state& e_;
};

class engine_state : public std::enable_shared_from_this<engine_state> {
 public:
  engine_state(std::shared_ptr<::torch::nn::Module> module, mpzero::torch::config cfg, any_communicator comm)
      : cfg_(std::move(cfg)), comm_(std::move(comm)), module_(std::move(module)) {}

  ~engine_state() {
    // Leave the model usable: give each parameter that became a view of the core's
    // buffer its own storage again (the buffer dies with the core); a failed init
    // leaves the others untouched. The hooks stay installed but find no engine.
    // ZeRO-3: a partitioned parameter keeps its values only if gathered now; the others
    // stay empty (gathering them here would be a collective in a destructor).
    ::torch::NoGradGuard ng;
    try {
      if (core_) join_core();  // the copies below read what the core's stream wrote
    } catch (...) {
    }
    {
      std::lock_guard<std::mutex> lock(frozen_owners_mutex);
      for (const auto& [impl, f] : frozen_shards_.index_) frozen_owners.erase(impl);
      for (const auto& [impl, f] : tp_frozen_) frozen_owners.erase(impl);
    }
    for (std::size_t i : std::exchange(z3_.outside_armed_, {})) {
      try {
        z3_.disarm(i);
      } catch (...) {
      }
    }
    for (std::size_t i = 0; i < bound_; ++i) {
      try {
        if (core_->partitioned(i) && z3_.holds_[i] == 0) continue;
        // (A parameter that something else rebound since keeps its storage.)
        if (params_[i].data_ptr() == core_->param_data(i)) params_[i].set_data(params_[i].detach().clone());
      } catch (...) {
      }
    }
  }

  // initialize in two halves around the ranks' agreement (make_engine_state):
  // prepare() runs this rank's own checks and plans the core, and returns what every
  // rank must have alike (empty at world size 1); start() makes the core (collective),
  // broadcasts rank 0's values and binds the parameters to the core.
  // {what is hashed across ranks, how a mismatch message names this rank's side}
  std::pair<std::string, std::string> prepare();
  void start();
  // prepare()'s parts: each managed parameter's gradient reduction dtype (DeepSpeed's
  // get_comm_dtype), and what the ranks compare.
  std::vector<dtype> reduction_dtypes() const;
  // Per managed parameter: whether it belongs to a lower_precision_safe_modules class
  // (torch_autocast enabled; all false otherwise).
  std::vector<bool> lower_precision_safe() const;
  // Matches the managed parameters' names to config::param_groups and sets the core's
  // groups (zero_options::param_groups and group_of); nothing without groups.
  void assign_param_groups(zero_options& zo);
  // The lr group g's next step uses, and its weight decay.
  double group_lr(std::size_t g) const { return next_lr() * group_opts_[g].lr_scale; }
  double group_weight_decay(std::size_t g) const {
    return group_opts_[g].weight_decay.value_or(cfg_.optimizer.weight_decay);
  }
  // Each group's name, next lr and weight decay, and each managed parameter's group, as
  // checkpoints record them; null without groups.
  nlohmann::json param_group_record() const {
    if (group_of_.empty()) return nullptr;
    nlohmann::json groups = nlohmann::json::array(), of = nlohmann::json::array();
    for (std::size_t g = 0; g < group_names_.size(); ++g)
      groups.push_back({{"name", group_names_[g]}, {"lr", group_lr(g)}, {"weight_decay", group_weight_decay(g)}});
    for (std::size_t i = 0; i < group_of_.size(); ++i) of.push_back(group_names_[group_of_[i]]);
    return {{"groups", groups}, {"parameter_groups", of}};
  }
  std::pair<std::string, std::string> rank_identity(const core_spec& spec, const zero_options& zo,
                                                    const std::vector<::torch::Tensor>& frozen,
                                                    const std::vector<std::pair<std::string, ::torch::Tensor>>& kept) const;
  // Where max_over_ranks stages the agreement: a communicator that reads device memory
  // gets its device (else the parameters', else the current one) and torch's current
  // stream there.
  static core_place agreement_place(const any_communicator& comm, const engine_state* st);

  // ---- API ------------------------------------------------------------------------
  void step();
  void zero_grad() {
    bw_.drop_stale_passes();
    core_->zero_grad();
    for (auto& p : params_) p.mutable_grad().reset();
  }
  bool is_boundary() const {
    if (boundary_override_) return *boundary_override_;
    if (!cfg_.managed_gradient_accumulation) return true;  // the caller's step() is the boundary
    return (micro_steps_ + 1) % cfg_.gradient_accumulation_steps == 0;
  }
  double next_lr() const { return lr_at(cfg_.scheduler, cfg_.optimizer.lr, scheduler_steps_); }
  std::optional<std::pair<double, double>> next_betas() const {
    if (auto b = betas_at(cfg_.scheduler, scheduler_steps_)) return b;
    return core_->betas();
  }
  // The schedule's learning rate and, when it cycles momentum, betas, for the next update.
  void apply_schedule() {
    core_->set_lr(next_lr());
    const auto b = betas_at(cfg_.scheduler, scheduler_steps_);
    if (!b) return;
    try {
      core_->set_betas(b->first, b->second);
    } catch (const mpzero::invalid_argument& e) {
      fail("engine.step(): the OneCycle schedule gives beta1 = " + format_double(b->first) + " after " +
           std::to_string(scheduler_steps_) + " steps, which the optimizer refuses (" + e.what() +
           "); lower scheduler.params.decay_mom_rate or cycle_max_mom, or set cycle_momentum to false");
    }
  }
  std::size_t index_of(const ::torch::Tensor& t, const char* what) const {
    if (!t.defined()) fail(std::string(what) + ": the tensor is undefined; pass one of engine.parameters()");
    auto it = index_.find(t.unsafeGetTensorImpl());
    if (it == index_.end()) {
      fail(std::string(what) + ": the tensor (shape " + shape_of(t.sizes()) +
           ") is not a parameter this engine manages; pass one of engine.parameters()");
    }
    return it->second;
  }
  ::torch::Tensor full_grad(std::size_t i) {
    std::vector<float> g = core_->full_grad(i);
    return ::torch::tensor(at::ArrayRef<float>(g), ::torch::kFloat).reshape(shapes_[i]).to(device_);
  }

  // ---- agreement between the ranks ------------------------------------------------------
  // The n values at v become their largest over the ranks (collective).
  // With AutoTP over the whole world: a tensor-parallel group's ranks run one sequence of
  // collectives, and one rank's failure must stop them all.
  void all_reduce_max(std::int32_t* v, int n) {
    any_communicator& c = tp_comm_ ? world_comm_ : comm_;
    max_over_ranks(c, std::span<std::int32_t>(v, static_cast<std::size_t>(n)), agreement_place(c, this));
  }
  // Runs `local` on this rank; every rank then learns whether any failed.
  template <class F>
  void agree(const std::string& who, const std::string& consequence, F&& local) {
    mpzero::detail::agree_on_failure(
        comm_.rank(), comm_.size(), [&](std::int32_t* v, int n) { all_reduce_max(v, n); }, "engine." + who,
        consequence, std::forward<F>(local));
  }
  // Throws on every rank unless every rank has the same `value` (compared by hash);
  // `shown` is how the message spells this rank's value.
  void same_on_every_rank(const std::string& who, const std::string& what, const std::string& value,
                          const std::string& shown) {
    mpzero::detail::agree_on_failure_and_identity(
        comm_.rank(), comm_.size(), [&](std::int32_t* v, int n) { all_reduce_max(v, n); }, "engine." + who,
        "nothing changed", what, [&] { return std::pair{value, shown}; });
  }
  void require_boundary(const std::string& who) const {
    if (core_->grads_pending()) {
      fail("engine." + who + ": gradients are accumulated toward the next optimizer step (micro-step " +
           std::to_string(micro_steps_) + ", gradient_accumulation_steps = " +
           std::to_string(cfg_.gradient_accumulation_steps) +
           "); a checkpoint holds no gradients. Call it at an accumulation boundary (after the step() that updates), "
           "or drop them with zero_grad() first");
    }
  }

  // ---- streams (CUDA parameters) ------------------------------------------------------
  // The core queues its work on torch's current stream of the parameters' device as it
  // was at initialize (core_stream_). Work torch queues on another stream (a backward
  // or step under a stream guard) is ordered with events, both ways; no host waits.
  c10::Stream current_stream() const { return c10::impl::getDeviceGuardImpl(device_.type())->getStream(device_); }
  // The core's next work starts after what torch's current stream has queued. Returns
  // whether that stream is another one than the core's.
  bool core_waits() {
    if (!core_stream_) return false;
    const c10::Stream s = current_stream();
    if (s == *core_stream_) return false;
    core_->wait_stream(s.native_handle());
    return true;
  }
  // What torch's current stream queues next starts after the core's work.
  void join_core() {
    if (!core_stream_) return;
    const c10::Stream s = current_stream();
    if (s != *core_stream_) core_->join_stream(s.native_handle());
  }

  // ZeRO-3: gathering partitioned parameters (zero3_gatherer).
  bool zero3_ = false;
  std::vector<std::vector<std::int64_t>> shapes_;  // per managed parameter (its tensor is empty while partitioned)
  zero3_gatherer z3_{*this};
  engine_checkpoints checkpoints_{*this};
  backward_tracker bw_{*this};
  frozen_shards frozen_shards_{*this};

  mpzero::torch::config cfg_;
  any_communicator comm_;  // the core's: with AutoTP, this rank's data-parallel group
  // AutoTP (cfg_.tensor_parallel): this rank's tensor-parallel group (from start()), each
  // managed parameter's split, and the shapes of the whole parameters.
  std::optional<any_communicator> tp_comm_;
  any_communicator world_comm_;  // AutoTP: every rank (comm_ is then the data-parallel group)
  std::vector<tp_param_plan> tp_plan_;
  std::vector<std::vector<std::int64_t>> full_shapes_;
  // {tensor-parallel, data-parallel} groups the program made (parallel_groups), until start().
  std::optional<std::pair<any_communicator, any_communicator>> given_groups_;
  // Refuses given groups that do not form a grid over the world (collective over comm_, the world).
  void check_given_groups();
  // The frozen floating parameters a spec splits too (by tensor), with their whole shapes.
  struct tp_frozen {
    tp_param_plan plan;
    std::vector<std::int64_t> whole;
  };
  std::unordered_map<const c10::TensorImpl*, tp_frozen> tp_frozen_;
  // Every frozen floating parameter's name and whole shape, for the plan a load at another
  // tensor-parallel size rebuilds: [[name, shape], ...].
  nlohmann::json tp_frozen_record_ = nlohmann::json::array();
  // Rank 0 of the world writes what is one file for every rank.
  int world_rank() const { return tp_comm_ ? world_comm_.rank() : comm_.rank(); }
  // AutoTP: how parameter t (trainable or frozen) is split, or nullptr (replicated, or no AutoTP).
  const tp_param_plan* tp_split_of(const ::torch::Tensor& t) const {
    if (!tp_comm_) return nullptr;
    if (const auto m = index_.find(t.unsafeGetTensorImpl()); m != index_.end())
      return tp_plan_[m->second].type == tp_partition::skip ? nullptr : &tp_plan_[m->second];
    const auto f = tp_frozen_.find(t.unsafeGetTensorImpl());
    return f == tp_frozen_.end() ? nullptr : &f->second.plan;
  }
  // Its whole shape (of a split parameter).
  const std::vector<std::int64_t>& tp_whole_shape(const ::torch::Tensor& t) const {
    if (const auto m = index_.find(t.unsafeGetTensorImpl()); m != index_.end()) return full_shapes_[m->second];
    return tp_frozen_.at(t.unsafeGetTensorImpl()).whole;
  }
  // The whole values of a split parameter from the tensor-parallel ranks' slices `mine`
  // (collective over the tensor-parallel group): flat, on the CPU, in mine's dtype.
  ::torch::Tensor tp_join(const tp_param_plan& p, const ::torch::Tensor& mine);
  // AutoTP's start: every rank takes rank 0's values of the whole parameters, frozen
  // parameters and floating buffers over the world, and keeps its slice of each split
  // parameter; the core is then made over the data-parallel group.
  void start_tensor_parallel();
  // What a checkpoint's engine file records of AutoTP (null without): the section as the
  // config resolved it, this rank's place, and the whole parameters' shapes, from which
  // the fp32 export joins the slices.
  nlohmann::json tensor_parallel_record() const {
    if (!tp_comm_) return nullptr;
    return {{"config", to_json(cfg_).at("tensor_parallel")}, {"rank", tp_comm_->rank()}, {"size", tp_comm_->size()},
            {"shapes", full_shapes_}, {"frozen", tp_frozen_record_}};
  }

  std::shared_ptr<::torch::nn::Module> module_;
  std::unique_ptr<zero_core> core_;
  std::vector<::torch::Tensor> params_;
  std::vector<::torch::Tensor> frozen_;  // frozen floating parameters, from prepare() to start()
  // The parameters (trainable or frozen) built partitioned under zero_init, from prepare()
  // to start(): their tensors are empty, and start() rebuilds them from the ranks' slices.
  std::unordered_map<const c10::TensorImpl*, built_slice> built_;
  // zero3_gatherer's numbering: the managed parameters, then the frozen parts.
  std::size_t z3_size() const { return params_.size() + frozen_shards_.size(); }
  bool z3_partitioned(std::size_t i) const { return i >= params_.size() || core_->partitioned(i); }
  bool take_built(const std::string& name, const ::torch::Tensor& p);
  // A parameter rebuilt whole: every rank's slice of `whole` from its owner (collective).
  void broadcast_slices(std::vector<float>& whole);
  // start()'s parts. all: the managed parameters, then the n_frozen frozen floating ones,
  // then the floating buffers; converted[k - params_.size()]: the value all[k] takes.
  // Every value from rank 0, through a bounded host window (not those built partitioned):
  void load_from_rank0(const std::vector<::torch::Tensor>& all, std::size_t n_frozen,
                       std::vector<::torch::Tensor>& converted);
  // Those built partitioned, from the ranks' slices:
  void load_built(const std::vector<::torch::Tensor>& all, std::vector<::torch::Tensor>& converted);
  // The parameters become views of the core's buffer (or empty: ZeRO-3) with their hooks;
  // the frozen ones and the buffers take their converted values.
  void bind_parameters(const std::vector<::torch::Tensor>& all, const std::vector<::torch::Tensor>& converted);
  struct start_plan {
    core_plan core;
    core_place place;
    std::vector<std::uint64_t> numels;
  };
  std::optional<start_plan> plan_;  // the core start() makes
  std::size_t bound_ = 0;  // params_[0, bound_) are views of the core's buffer
  std::vector<std::string> names_;
  std::unordered_map<const c10::TensorImpl*, std::size_t> index_;
  std::vector<dtype> comm_dtypes_;  // per managed parameter: the dtype its gradient is reduced in
  // ZeRO-3 with torch_autocast on an fp32 model: per managed parameter, the dtype it is
  // gathered in (zero_options::gather_dtypes); empty otherwise.
  std::vector<dtype> gather_dtypes_;
  // Parameter groups (config::param_groups): "default" (the parameters no group matches)
  // first, then the config's, with the core's hyperparameter adjustments; and each
  // managed parameter's group.
  std::vector<std::string> group_names_{"default"};
  std::vector<param_group_options> group_opts_{param_group_options{}};
  std::vector<std::uint32_t> group_of_;
  c10::Device device_ = c10::Device(c10::kCPU);  // where the managed parameters live
  std::optional<c10::Stream> core_stream_;       // a CUDA core's stream
  bool needs_scaling_ = false;
  float inv_gas_ = 1.0f;
  at::ScalarType param_type_ = at::kFloat;

  // Steps.
  std::uint64_t micro_steps_ = 0, global_steps_ = 0, skipped_steps_ = 0, scheduler_steps_ = 0;
  std::optional<bool> boundary_override_;
  step_report last_{};
  bool stepped_ = false;
};

namespace {

// Hands a parameter's accumulated gradient to the engine. Chains the hook that was in
// the single post-accumulate-grad slot before (e.g. another library's).
struct grad_hook final : ag::PostAccumulateGradHook {
  std::weak_ptr<engine_state> st;
  std::size_t index = 0;
  std::unique_ptr<ag::PostAccumulateGradHook> prev;
  void operator()(const ag::Variable& v) override {
    if (prev) (*prev)(v);
    if (auto s = st.lock()) s->bw_.on_param_grad(index, v);
  }
};

// The live engine whose hook parameter p feeds, or nullptr (initialize refuses a second
// one, so there is at most one).
std::shared_ptr<engine_state> managing_engine(const ::torch::Tensor& p) {
  for (auto* h = dynamic_cast<grad_hook*>(ag::impl::post_acc_grad_hooks(p).get()); h != nullptr;
       h = dynamic_cast<grad_hook*>(h->prev.get())) {
    if (auto s = h->st.lock()) return s;
  }
  return nullptr;
}

}  // namespace

// ---- ZeRO-3 -------------------------------------------------------------------------

// A gathered_forward call: its parameters, and whether its backward holds them.
class unit_call {
 public:
  unit_call(std::weak_ptr<engine_state> st, std::uint64_t generation, std::vector<std::size_t> params,
            std::weak_ptr<unit_call> prev)
      : st_(std::move(st)), generation_(generation), params_(std::move(params)), prev_(std::move(prev)) {}
  ~unit_call() {
    drop(forward_held_);
    drop(backward_held_);
  }
  unit_call(const unit_call&) = delete;
  unit_call& operator=(const unit_call&) = delete;

  void hold_forward(engine_state& s) {
    s.z3_.hold(params_);
    forward_held_ = true;
  }
  void end_forward() noexcept { drop(forward_held_); }
  void add_input() { ++inputs_; }
  // The first output gradient of a backward: gather for the submodule's backward.
  void on_output_grad(const std::shared_ptr<unit_call>& self) {
    if (backward_held_) return;
    auto s = st_.lock();
    if (!s) return;
    if (s->z3_.generation_ != generation_) released_since_forward("a gathered_forward call");
    s->z3_.hold(params_);
    backward_held_ = true;
    pending_ = inputs_;
    s->z3_.backward_units_.push_back(self);  // the epilogue releases it if no input does
    // The unit that ran before this one in forward is the next one backward reaches.
    if (auto p = prev_.lock()) s->z3_.prefetch(p->params_);
  }
  // An input's gradient is complete: once all are, the submodule's backward is over.
  void on_input_grad() noexcept {
    if (backward_held_ && pending_ > 0 && --pending_ == 0) drop(backward_held_);
  }
  void end_backward() noexcept { drop(backward_held_); }

 private:
  void drop(bool& held) noexcept {
    if (!held) return;
    held = false;
    try {
      if (auto s = st_.lock(); s && s->z3_.generation_ == generation_) s->z3_.unhold(params_);
    } catch (...) {
    }
  }

  std::weak_ptr<engine_state> st_;
  std::uint64_t generation_;
  std::vector<std::size_t> params_;
  std::weak_ptr<unit_call> prev_;  // the unit that began before this one in the same forward
  bool forward_held_ = false, backward_held_ = false;
  int inputs_ = 0, pending_ = 0;
};

// engine.forward's hold on the unclaimed partitioned parameters (trainable and frozen),
// kept alive by the outputs' graph: while it lives they are armed (zero3_gatherer).
struct forward_hold {
  std::weak_ptr<engine_state> st;
  std::uint64_t generation = 0;
  bool armed = false;
  ~forward_hold() {
    try {
      auto s = st.lock();
      if (!s || s->z3_.generation_ != generation) return;
      if (armed) s->z3_.disarm_outside();
    } catch (...) {
    }
  }
};

// param_use's listener for one engine: gathers what an operation is about to read.
struct outside_listener final : use_listener {
  std::weak_ptr<engine_state> st;
  void before_use(const std::vector<c10::StorageImpl*>& storages) noexcept override;
};

at::ScalarType zero3_gatherer::gather_type(std::size_t i) const {
  return e_.gather_dtypes_.empty() ? e_.param_type_ : scalar_type_of(e_.gather_dtypes_[i]);
}

void zero3_gatherer::bind(std::size_t i) {
  const unobserved own;
  void* data = e_.core_->param_data(i);
  const at::ScalarType type = scalar_type_of(e_.core_->param_data_dtype(i));
  const auto blob = [&] {
    // target_device: no driver lookup of the pointer (which fails on the null pointer of
    // an empty model's buffer).
    return at::for_blob(data, e_.shapes_[i])
        .options(::torch::TensorOptions().dtype(type).device(e_.device_))
        .target_device(e_.device_)
        .make_tensor();
  };
  if (type != gather_type(i)) {
    // A save's gather in the parameter dtype: a tensor of its own, so that the storage
    // forward's saved views share keeps the gather dtype.
    e_.params_[i].set_data(blob());
    return;
  }
  if (!storages_[i]) {
    e_.params_[i].set_data(blob());
    storages_[i] = e_.params_[i].storage();
    return;
  }
  // ZeRO-3, gathered again: the parameter keeps its storage, re-pointed at the new copy,
  // so that views of it that forward saved for backward (Linear saves weight.t()) read
  // the copy backward gathers, not the one released after forward.
  storages_[i].set_data_ptr_noswap(c10::DataPtr(data, e_.device_));
  storages_[i].set_nbytes(static_cast<std::size_t>(c10::multiply_integers(e_.shapes_[i])) * c10::elementSize(type));
  // Armed, it is a view of the storage already (an operation that reads it is on its way).
  if (e_.params_[i].unsafeGetTensorImpl()->has_storage() &&
      e_.params_[i].storage().unsafeGetStorageImpl() == storages_[i].unsafeGetStorageImpl() &&
      e_.params_[i].sizes() == c10::IntArrayRef(e_.shapes_[i]) && e_.params_[i].scalar_type() == type) {
    return;
  }
  e_.params_[i].set_data(
      ::torch::empty({0}, ::torch::TensorOptions().dtype(type).device(e_.device_)).set_(storages_[i], 0, e_.shapes_[i]));
}

void zero3_gatherer::unbind(std::size_t i) {
  const unobserved own;
  if (!outside_[i]) e_.params_[i].set_data(placeholder_);
  if (!storages_[i]) return;
  // Views of the parameter still in a graph point nowhere until the next gather.
  storages_[i].set_data_ptr_noswap(c10::DataPtr(nullptr, e_.device_));
  storages_[i].set_nbytes(0);
}

void zero3_gatherer::hold(const std::vector<std::size_t>& idx) {
  // Parameters not held yet: rebind those whose group is still gathered, wait for those
  // a prefetch fetches, gather the others in contiguous runs (idx is sorted).
  auto bind_in = [&](std::size_t i, const std::pair<std::size_t, std::size_t>& group) {
    group_of_[i] = group;
    ++live_groups_[group];
    bind(i);
  };
  std::vector<std::size_t> fresh, fetched, frozen;
  for (std::size_t i : idx) {
    if (holds_[i]++ > 0) continue;
    if (i >= e_.params_.size()) {
      frozen.push_back(i);
    } else if (in_live_group(i)) {
      bind_in(i, group_of_[i]);
    } else if (in_prefetch(i)) {
      fetched.push_back(i);
    } else {
      fresh.push_back(i);
    }
  }
  if (fresh.empty() && fetched.empty() && frozen.empty()) return;
  e_.core_waits();
  try {
    for (std::size_t i : frozen) e_.frozen_shards_.gather(i - e_.params_.size());
    for (std::size_t i : fetched) {
      const auto group = group_of_[i];
      if (prefetched_.erase(group) > 0) {  // the first of its parameters: wait for it
        e_.core_->gather(group.first, group.second, stored_dtype_);
        live_groups_[group] = 0;
        ++prefetch_hits_;
      }
      bind_in(i, group);
    }
    std::size_t k = 0;
    for (const auto& group : runs_of(fresh)) {
      e_.core_->gather(group.first, group.second, stored_dtype_);
      live_groups_[group] = 0;
      for (; k < fresh.size() && fresh[k] < group.second; ++k) bind_in(fresh[k], group);
    }
  } catch (...) {
    // A failed all-gather leaves the ranks out of step anyway: drop every gather (each
    // hold taken before does nothing when dropped), so that the counts stay consistent.
    // The gather's error is the one to report: a release failing after it says less.
    try {
      release_all();
    } catch (...) {
    }
    throw;
  }
  e_.join_core();  // torch's stream reads what the gathers wrote
}

void zero3_gatherer::prefetch(const std::vector<std::size_t>& idx) {
  const std::uint64_t limit = e_.cfg_.zero.stage3_prefetch_bucket_size;
  std::vector<std::size_t> fresh;
  std::uint64_t n = 0;
  for (std::size_t i : idx) {
    if (i >= e_.params_.size()) continue;  // frozen parts gather when held
    if (holds_[i] > 0 || in_live_group(i) || in_prefetch(i)) continue;
    fresh.push_back(i);
    n += static_cast<std::uint64_t>(c10::multiply_integers(e_.shapes_[i]));
  }
  if (fresh.empty() || n > limit) return;  // limit 0: no prefetch
  std::size_t k = 0;
  for (const auto& group : runs_of(fresh)) {
    e_.core_->prefetch(group.first, group.second);
    prefetched_.insert(group);
    for (; k < fresh.size() && fresh[k] < group.second; ++k) group_of_[fresh[k]] = group;
  }
}

void zero3_gatherer::drop_prefetches() {
  // Each group leaves the list before its release: one whose release throws (its
  // all-gather failed) must not leave those released before it listed, which the next
  // release_all would release a second time. The rest are still released; the first
  // error is rethrown.
  std::exception_ptr first;
  while (!prefetched_.empty()) {
    const auto g = *prefetched_.begin();
    prefetched_.erase(prefetched_.begin());
    release_keeping_first_error(g, first);
  }
  if (first) std::rethrow_exception(first);
}

void zero3_gatherer::release_keeping_first_error(std::pair<std::size_t, std::size_t> group, std::exception_ptr& first) {
  try {
    e_.core_->release(group.first, group.second);
  } catch (...) {
    if (!first) first = std::current_exception();
  }
}

void zero3_gatherer::defer_error(const std::string& where) {
  if (deferred_error_) return;  // the first one says most
  try {
    throw;
  } catch (const comm::comm_error& e) {
    deferred_error_ = std::make_exception_ptr(comm::comm_error(where + ": " + e.what()));
  } catch (const std::exception& e) {
    deferred_error_ = std::make_exception_ptr(std::runtime_error(where + ": " + e.what()));
  } catch (...) {
    deferred_error_ = std::current_exception();
  }
}

void zero3_gatherer::rethrow_deferred() {
  if (!deferred_error_) return;
  std::exception_ptr e = std::exchange(deferred_error_, nullptr);  // reported once
  std::rethrow_exception(e);
}

void zero3_gatherer::unhold(const std::vector<std::size_t>& idx) {
  bool waited = false;
  for (std::size_t i : idx) {
    if (holds_[i] == 0 || --holds_[i] > 0) continue;
    if (i >= e_.params_.size()) {
      e_.frozen_shards_.release(i - e_.params_.size(), outside_[i] != 0);
      continue;
    }
    unbind(i);
    auto g = live_groups_.find(group_of_[i]);
    if (g == live_groups_.end() || --g->second > 0) continue;
    if (!waited) waited = true, e_.core_waits();  // the copy is freed after torch's reads of it
    e_.core_->release(g->first.first, g->first.second);
    live_groups_.erase(g);
  }
}

void zero3_gatherer::release_all() {
  if (!e_.zero3_) return;
  ++generation_;  // first: the holds dropped below (and any taken before) do nothing
  backward_units_.clear();
  forward_hold_.reset();
  drop_outside();
  if (!live_groups_.empty() || !prefetched_.empty()) e_.core_waits();  // freed after torch's reads
  // Everything is released and forgotten even if a release throws (a failed all-gather,
  // see drop_prefetches); the first error is rethrown at the end.
  std::exception_ptr first;
  try {
    drop_prefetches();
  } catch (...) {
    first = std::current_exception();
  }
  while (!live_groups_.empty()) {
    const auto g = live_groups_.begin()->first;
    live_groups_.erase(live_groups_.begin());
    release_keeping_first_error(g, first);
  }
  for (std::size_t i = 0; i < e_.z3_size(); ++i) {
    if (holds_[i] > 0 && i >= e_.params_.size()) {
      e_.frozen_shards_.release(i - e_.params_.size());
    } else if (holds_[i] > 0 && e_.core_->partitioned(i)) {
      unbind(i);
    }
    holds_[i] = 0;
  }
  if (first) std::rethrow_exception(first);
}

void zero3_gatherer::arm_outside(const std::vector<std::size_t>& idx) {
  const unobserved own;
  ++outside_arms_;
  if (!listener_) {
    auto l = std::make_shared<outside_listener>();
    l->st = e_.weak_from_this();
    listener_ = std::move(l);
  }
  for (std::size_t i : idx) {
    if (outside_[i]) continue;
    outside_[i] = 1;
    outside_armed_.push_back(i);
    const bool frozen = i >= e_.params_.size();
    auto* fp = frozen ? &e_.frozen_shards_.parts_[i - e_.params_.size()] : nullptr;
    c10::Storage& storage = frozen ? fp->storage : storages_[i];
    const c10::Device device = frozen ? fp->slice.device() : e_.device_;
    const at::ScalarType type = frozen ? fp->slice.scalar_type() : gather_type(i);
    if (!storage) {  // a storage of its own, kept across gathers as bind() keeps it
      storage = c10::Storage(c10::Storage::use_byte_size_t(), 0, c10::DataPtr(nullptr, device), /*allocator=*/nullptr,
                             /*resizable=*/false);
    }
    storage_index_[storage.unsafeGetStorageImpl()] = i;
    watch_storage(storage.unsafeGetStorageImpl(), listener_);
    if (holds_[i] > 0) continue;  // gathered (a unit of an outer forward): already a view of it
    auto t = at::detail::make_tensor<c10::TensorImpl>(
        c10::Storage(storage), c10::DispatchKeySet(c10::computeDispatchKey(type, at::kStrided, device)),
        c10::scalarTypeToTypeMeta(type));
    t.unsafeGetTensorImpl()->set_sizes_contiguous(frozen ? fp->shape : e_.shapes_[i]);
    (frozen ? fp->param : e_.params_[i]).set_data(t);
  }
}

const c10::Storage& zero3_gatherer::storage_of(std::size_t i) const {
  return i < e_.params_.size() ? storages_[i] : e_.frozen_shards_.parts_[i - e_.params_.size()].storage;
}

std::uint64_t zero3_gatherer::numel_of(std::size_t i) const {
  const auto& shape = i < e_.params_.size() ? e_.shapes_[i] : e_.frozen_shards_.parts_[i - e_.params_.size()].shape;
  return static_cast<std::uint64_t>(c10::multiply_integers(shape));
}

void zero3_gatherer::disarm_outside() {
  if (outside_arms_ > 0 && --outside_arms_ == 0) drop_outside();
}

void zero3_gatherer::drop_outside() {
  const unobserved own;
  outside_arms_ = 0;
  std::vector<std::size_t> live(outside_live_.begin(), outside_live_.end());
  outside_live_.clear();
  outside_numel_ = 0;
  std::sort(live.begin(), live.end());
  std::exception_ptr first;
  try {
    unhold(live);
  } catch (...) {
    first = std::current_exception();
  }
  for (std::size_t i : std::exchange(outside_armed_, {})) disarm(i);
  if (first) std::rethrow_exception(first);
}

void zero3_gatherer::disarm(std::size_t i) {
  const unobserved own;
  outside_[i] = 0;
  unwatch_storage(storage_of(i).unsafeGetStorageImpl());
  storage_index_.erase(storage_of(i).unsafeGetStorageImpl());
  if (holds_[i] > 0) return;
  if (i < e_.params_.size()) {
    e_.params_[i].set_data(placeholder_);
  } else {
    e_.frozen_shards_.release(i - e_.params_.size());
  }
}

void zero3_gatherer::gather_for_use(const std::vector<c10::StorageImpl*>& storages) {
  std::vector<std::size_t> need, fresh;
  for (const c10::StorageImpl* s : storages) {
    const auto it = storage_index_.find(s);
    if (it == storage_index_.end() || !outside_[it->second]) continue;
    need.push_back(it->second);
    if (holds_[it->second] == 0) fresh.push_back(it->second);
  }
  if (fresh.empty()) return;
  std::uint64_t n = 0;
  for (std::size_t i : fresh) n += numel_of(i);
  // Release the oldest, except what this operation reads, until the new ones fit.
  const std::uint64_t limit = e_.cfg_.zero.stage3_max_live_parameters;
  std::vector<std::size_t> keep, drop;
  while (!outside_live_.empty() && outside_numel_ + n > limit) {
    const std::size_t j = outside_live_.front();
    outside_live_.pop_front();
    if (std::find(need.begin(), need.end(), j) != need.end()) {
      keep.push_back(j);
    } else {
      drop.push_back(j);
      outside_numel_ -= numel_of(j);
    }
  }
  outside_live_.insert(outside_live_.begin(), keep.begin(), keep.end());
  std::sort(drop.begin(), drop.end());
  unhold(drop);
  // Each in a group of its own, so that releasing it frees it.
  std::sort(fresh.begin(), fresh.end());
  for (std::size_t i : fresh) {
    hold({i});
    outside_live_.push_back(i);
    outside_numel_ += numel_of(i);
  }
}

void outside_listener::before_use(const std::vector<c10::StorageImpl*>& storages) noexcept {
  auto s = st.lock();
  if (!s) return;
  try {
    s->z3_.gather_for_use(storages);
  } catch (...) {
    // The operation then finds no data and LibTorch stops it; the engine's next call
    // reports why.
    s->z3_.defer_error("mpzero: ZeRO-3 could not gather a parameter used outside every gathered_forward unit");
  }
}

std::vector<std::size_t> zero3_gatherer::partitioned_params(bool unclaimed_only) const {
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < e_.z3_size(); ++i)
    if (e_.z3_partitioned(i) && !(unclaimed_only && claimed_[i])) out.push_back(i);
  return out;
}

void zero3_gatherer::release_backward_units() {
  auto units = std::move(backward_units_);
  backward_units_.clear();
  for (auto& w : units)
    if (auto c = w.lock()) c->end_backward();
}

std::vector<std::pair<std::size_t, std::size_t>> zero3_gatherer::runs_of(const std::vector<std::size_t>& sorted) const {
  std::vector<std::pair<std::size_t, std::size_t>> out;
  for (std::size_t i : sorted) {
    bool join = !out.empty();
    for (std::size_t k = join ? out.back().second : 0; join && k < i; ++k) join = !e_.core_->partitioned(k);
    if (join) {
      out.back().second = i + 1;
    } else {
      out.emplace_back(i, i + 1);
    }
  }
  return out;
}

std::shared_ptr<unit_call> begin_unit(const ::torch::nn::Module& m) {
  // The engine: the one managing the first parameter of m that a ZeRO-3 engine manages.
  std::shared_ptr<engine_state> st;
  const auto params = m.parameters(/*recurse=*/true);
  for (const auto& p : params) {
    st = p.requires_grad() ? managing_engine(p) : frozen_owner(p);
    if (st && st->zero3_) break;
    st.reset();
  }
  if (!st) return nullptr;
  std::vector<std::size_t> idx;
  for (const auto& p : params) {
    auto it = st->index_.find(p.unsafeGetTensorImpl());
    if (it != st->index_.end() && st->core_->partitioned(it->second)) idx.push_back(it->second);
    auto f = st->frozen_shards_.index_.find(p.unsafeGetTensorImpl());
    if (f != st->frozen_shards_.index_.end()) idx.push_back(st->params_.size() + f->second);
  }
  std::sort(idx.begin(), idx.end());
  idx.erase(std::unique(idx.begin(), idx.end()), idx.end());
  if (idx.empty()) return nullptr;
  for (std::size_t i : idx) st->z3_.claimed_[i] = 1;
  // The order of the units: what began after the last one is what its next call prefetches.
  if (st->z3_.last_module_ != nullptr) st->z3_.next_unit_[st->z3_.last_module_] = idx;
  st->z3_.last_module_ = &m;
  auto c = std::make_shared<unit_call>(st, st->z3_.generation_, idx, st->z3_.last_unit_);
  st->z3_.last_unit_ = c;
  c->hold_forward(*st);
  // The next unit's all-gather runs while this one computes.
  if (auto next = st->z3_.next_unit_.find(&m); next != st->z3_.next_unit_.end()) st->z3_.prefetch(next->second);
  return c;
}

::torch::Tensor unit_input(const std::shared_ptr<unit_call>& c, const ::torch::Tensor& x) {
  if (!x.defined() || !x.requires_grad() || !::torch::GradMode::is_enabled()) return x;
  ::torch::Tensor v = x.view_as(x);
  c->add_input();
  v.register_hook([c](const ::torch::Tensor&) { c->on_input_grad(); });
  return v;
}

void unit_output(const std::shared_ptr<unit_call>& c, const ::torch::Tensor& y) {
  if (!y.defined() || !y.requires_grad() || !y.grad_fn()) return;
  y.register_hook([c](const ::torch::Tensor&) { c->on_output_grad(c); });
}

void end_unit(unit_call& c) noexcept { c.end_forward(); }

std::pair<std::string, std::string> engine_state::prepare() {
  const int world = comm_.size();
  if (cfg_.gradient_accumulation_steps == 0) fail("gradient_accumulation_steps = 0; it must be at least 1");
  inv_gas_ = static_cast<float>(1.0 / static_cast<double>(cfg_.gradient_accumulation_steps));

  // The trainable parameters, once each (tied weights appear under several names).
  std::unordered_set<const c10::TensorImpl*> seen;
  std::vector<::torch::Tensor> frozen;
  std::vector<std::string> frozen_names;
  std::vector<std::pair<std::string, ::torch::Tensor>> kept;  // frozen, not floating: left as they are
  std::string first_name;
  // Frozen floating parameters and floating buffers take rank 0's values at start(),
  // through the host: one without data (on the meta device) has none to give or take.
  auto check_copyable = [](const std::string& kind, const std::string& name, const ::torch::Tensor& t) {
    if (!t.device().is_cpu() && !t.device().is_cuda()) {
      fail(kind + " '" + name + "' is on " + t.device().str() +
           "; the engine copies frozen parameters and floating buffers from rank 0, so they must be on the CPU or "
           "a CUDA device: materialize it (model->to(torch::kCPU), or load its values) before initialize");
    }
  };
  for (const auto& item : module_->named_buffers(/*recurse=*/true))
    if (item.value().defined() && item.value().is_floating_point()) check_copyable("buffer", item.key(), item.value());
  for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
    const ::torch::Tensor& p = item.value();
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    if (!p.requires_grad()) {
      // Floating ones take the model's dtype; an integer index or a bool mask keeps its
      // own (through float and bf16 it would lose values and its type).
      if (p.is_floating_point()) {
        check_copyable("frozen parameter", item.key(), p);
        take_built(item.key(), p);
        frozen.push_back(p);
        frozen_names.push_back(item.key());
      } else {
        kept.emplace_back(item.key(), p);
      }
      continue;
    }
    // A parameter another live engine manages is a view of that engine's buffer, and
    // its hook feeds that engine: a second engine would train nothing.
    if (managing_engine(p)) {
      fail("parameter '" + item.key() +
           "' is already managed by another mpzero engine; destroy that engine first (let it go out of "
           "scope, or assign a new engine only after the old one is gone), or pass a fresh model");
    }
    if (!p.device().is_cpu() && !p.device().is_cuda()) {
      fail("parameter '" + item.key() + "' is on " + p.device().str() +
           "; the engine manages CPU or CUDA parameters: move the model with model->to(torch::kCUDA) or to the CPU");
    }
    if (params_.empty()) {
      device_ = p.device();
      first_name = item.key();
    } else if (p.device() != device_) {
      fail("parameter '" + item.key() + "' is on " + p.device().str() + " but '" + first_name + "' is on " +
           device_.str() + "; one engine manages parameters on one device: move the whole model with model->to(device)");
    }
    if (!dtype_of(p.scalar_type())) {
      fail("parameter '" + item.key() + "' has dtype " + std::string(c10::toString(p.scalar_type())) +
           "; trainable parameters must be float, bfloat16 or half");
    }
    index_[p.unsafeGetTensorImpl()] = params_.size();
    params_.push_back(p);
    names_.push_back(item.key());
    shapes_.push_back(take_built(item.key(), p) ? built_.at(p.unsafeGetTensorImpl()).shape : p.sizes().vec());
  }

  if (given_groups_) {
    const any_communicator &tpg = given_groups_->first, &dpg = given_groups_->second;
    const std::string sizes = "the tensor-parallel group given ('" + tpg.name() + "') has " + std::to_string(tpg.size()) +
                              " ranks and the data-parallel group ('" + dpg.name() + "') " + std::to_string(dpg.size());
    if (!cfg_.tensor_parallel.enabled()) {
      fail("initialize: parallel_groups were given, but tensor_parallel.autotp_size is " +
           std::to_string(cfg_.tensor_parallel.autotp_size) +
           "; set it to the tensor-parallel group's size, or pass the data-parallel communicator alone for data "
           "parallelism");
    }
    if (static_cast<std::uint64_t>(tpg.size()) != cfg_.tensor_parallel.autotp_size ||
        static_cast<std::uint64_t>(tpg.size()) * static_cast<std::uint64_t>(dpg.size()) != static_cast<std::uint64_t>(world)) {
      fail("initialize: tensor_parallel.autotp_size is " + std::to_string(cfg_.tensor_parallel.autotp_size) + " and the world has " +
           std::to_string(world) + " ranks, but " + sizes +
           "; pass groups of autotp_size and world / autotp_size ranks");
    }
  }
  if (cfg_.tensor_parallel.enabled()) {
    if (!built_.empty()) fail("tensor_parallel with a model built under zero_init: build it whole (zero_init is for ZeRO-3)");
    for (const auto& p : params_) {
      if (!p.device().is_cpu()) {
        fail("tensor_parallel with parameters on " + p.device().str() +
             ": the engine's AutoTP runs on CPU parameters over MPI so far; move the model to the CPU or set "
             "autotp_size to 1");
      }
    }
    // The split of each trainable parameter (config_error naming a bad spec); the core
    // holds the slices.
    // Frozen floating parameters are planned with them: a spec may split a frozen weight
    // (a frozen column layer's bias follows it) and its slice is all a rank keeps.
    std::vector<std::string> all_names = names_;
    std::vector<std::vector<std::int64_t>> all_shapes = shapes_;
    for (std::size_t f = 0; f < frozen.size(); ++f) {
      all_names.push_back(frozen_names[f]);
      all_shapes.push_back(frozen[f].sizes().vec());
      tp_frozen_record_.push_back({frozen_names[f], all_shapes.back()});
    }
    std::vector<tp_param_plan> all_plans = plan_tensor_parallel(cfg_.tensor_parallel, all_names, all_shapes);
    for (std::size_t f = 0; f < frozen.size(); ++f) {
      tp_param_plan& fp = all_plans[params_.size() + f];
      if (fp.type != tp_partition::skip)
        tp_frozen_[frozen[f].unsafeGetTensorImpl()] = {std::move(fp), all_shapes[params_.size() + f]};
    }
    all_plans.resize(params_.size());
    tp_plan_ = std::move(all_plans);
    full_shapes_ = shapes_;
    for (std::size_t i = 0; i < params_.size(); ++i) shapes_[i] = tp_plan_[i].shard_shape;
  }
  if (params_.empty()) {
    fail("the model has no trainable parameters (" + std::to_string(seen.size()) +
         " parameter(s), none with requires_grad); set requires_grad on the parameters to train");
  }

  const core_device device = device_.is_cuda() ? core_device::cuda : core_device::cpu;
  param_type_ = scalar_type_of(cfg_.param_dtype());
  core_place place;
  if (device_.is_cuda()) {
    // The core runs on torch's current stream of the device: what the model computes
    // there (gradients, then reading the parameters) is ordered with it for free.
    core_stream_ = c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStream(device_);  // a tensor's device has an index
    place.device = device_.index();
    place.stream = core_stream_->native_handle();
  }
  needs_scaling_ = cfg_.loss_scaling();

  comm_dtypes_ = reduction_dtypes();
  core_plan planned = plan_core(cfg_, device, comm_dtypes_);
  assign_param_groups(planned.zo);
  // DeepSpeed's ZeRO-3 all-gathers the lower_precision_safe_modules' parameters in the
  // autocast dtype: an fp32 model's gathers of them move half the bytes, and autocast
  // would round those weights to it anyway.
  if (cfg_.zero.stage == 3 && cfg_.torch_autocast.enabled && cfg_.param_dtype() == dtype::fp32) {
    const std::vector<bool> safe = lower_precision_safe();
    gather_dtypes_.assign(params_.size(), dtype::fp32);
    for (std::size_t i = 0; i < safe.size(); ++i)
      if (safe[i]) gather_dtypes_[i] = cfg_.torch_autocast.dtype_;
    planned.zo.gather_dtypes = gather_dtypes_;
  }
  const core_spec& spec = planned.spec;
  const zero_options& zo = planned.zo;

  std::vector<std::uint64_t> numels;
  for (const auto& shape : shapes_) numels.push_back(static_cast<std::uint64_t>(c10::multiply_integers(shape)));
  // The core is made by start(), after the ranks' agreement: its constructor is collective.
  plan_.emplace(start_plan{planned, place, std::move(numels)});

  // Every rank must pass the same model and configuration (make_engine_state compares).
  std::pair<std::string, std::string> id;
  if (world > 1) id = rank_identity(spec, zo, frozen, kept);
  frozen_ = std::move(frozen);
  return id;
}

void engine_state::assign_param_groups(zero_options& zo) {
  const std::vector<param_group>& groups = cfg_.param_groups;
  if (groups.empty()) return;
  check_param_groups(groups);  // the config may have been changed in code after parsing
  group_of_.assign(params_.size(), 0);
  std::vector<std::size_t> members(groups.size(), 0);
  std::vector<std::vector<std::regex>> res(groups.size());
  for (std::size_t g = 0; g < groups.size(); ++g)
    for (const std::string& p : groups[g].patterns) res[g].emplace_back(p, std::regex::ECMAScript);
  std::vector<std::string> taken(groups.size());  // per group: a parameter it matches that an earlier group took
  for (std::size_t i = 0; i < params_.size(); ++i) {
    for (std::size_t g = 0; g < groups.size(); ++g) {
      const bool match = std::any_of(res[g].begin(), res[g].end(),
                                     [&](const std::regex& re) { return std::regex_search(names_[i], re); });
      if (!match) continue;
      if (group_of_[i] == 0) {
        group_of_[i] = static_cast<std::uint32_t>(g + 1);
        ++members[g];
      } else if (taken[g].empty()) {
        taken[g] = "'" + names_[i] + "' matches, but the earlier group '" + groups[group_of_[i] - 1].name +
                   "' takes it";
      }
    }
  }
  const double base = cfg_.optimizer.lr;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const param_group& pg = groups[g];
    std::string patterns;
    for (const std::string& p : pg.patterns) patterns += (patterns.empty() ? "\"" : ", \"") + p + "\"";
    if (members[g] == 0) {
      std::string some;
      for (std::size_t i = 0; i < std::min<std::size_t>(names_.size(), 6); ++i) some += (i ? ", " : "") + names_[i];
      if (names_.size() > 6) some += ", ...";
      fail("param_groups '" + pg.name + "' (patterns " + patterns + ") has no trainable parameter" +
           (taken[g].empty() ? " (the trainable parameters: " + some + ")" : ": " + taken[g]) +
           "; fix the patterns, reorder the groups (the first match takes a parameter) or remove the group");
    }
    param_group_options o;
    if (pg.lr) {
      if (base == 0.0 && *pg.lr != 0.0) {
        fail("param_groups '" + pg.name + "' sets lr = " + format_double(*pg.lr) +
             ", but optimizer.params.lr is 0: a group's lr is kept in proportion to it under every schedule; "
             "give the optimizer a non-zero lr");
      }
      o.lr_scale = base == 0.0 ? 1.0 : *pg.lr / base;
    }
    o.weight_decay = pg.weight_decay;
    group_names_.push_back(pg.name);
    group_opts_.push_back(o);
  }
  zo.param_groups = group_opts_;
  zo.group_of = group_of_;
}

// The dtype each gradient is reduced in, per managed parameter.
std::vector<dtype> engine_state::reduction_dtypes() const {
  // The dtype each gradient is reduced in (DeepSpeed's get_comm_dtype): the autocast
  // dtype for the parameters of lower_precision_safe_modules, communication_data_type
  // for the others, else their own (accumulation) dtype. Passed to the core at run
  // time, so no instantiation is added for it; all in the gradient dtype is the
  // core's default path (no list).
  std::vector<dtype> out(params_.size(), cfg_.comm_dtype());
  const std::vector<bool> safe = lower_precision_safe();
  for (std::size_t i = 0; i < out.size(); ++i)
    if (safe[i]) out[i] = cfg_.torch_autocast.dtype_;
  return out;
}

std::vector<bool> engine_state::lower_precision_safe() const {
  std::vector<bool> out(params_.size(), false);
  if (cfg_.torch_autocast.enabled) {
    const auto& entries = cfg_.torch_autocast.lower_precision_safe_modules;
    std::vector<bool> matched(entries.size(), false);
    for (const auto& m : module_->modules(/*include_self=*/true)) {
      bool safe = false;
      for (std::size_t e = 0; e < entries.size(); ++e) {
        if (is_lower_precision_safe(m->name(), {entries[e]})) matched[e] = safe = true;
      }
      if (!safe) continue;
      for (const auto& p : m->parameters(/*recurse=*/false)) {
        auto it = index_.find(p.unsafeGetTensorImpl());
        if (it != index_.end()) out[it->second] = true;
      }
    }
    // A class the user named that the model lacks is a typo or a module of another
    // model (DeepSpeed refuses a name it cannot import); the defaults may match nothing.
    const auto unmatched = std::find(matched.begin(), matched.end(), false);
    if (cfg_.torch_autocast.lower_precision_safe_modules_given && unmatched != matched.end()) {
      std::string classes;
      std::unordered_set<std::string> seen;
      for (const auto& m : module_->modules(/*include_self=*/true)) {
        if (seen.insert(m->name()).second) classes += (classes.empty() ? "" : ", ") + m->name();
      }
      fail("torch_autocast.lower_precision_safe_modules entry \"" + entries[unmatched - matched.begin()] +
           "\" matches no module of the model (its classes: " + classes +
           "); name a class the model has (e.g. \"torch.nn.Linear\" or \"Linear\") or remove the entry");
    }
  }
  return out;
}

// What every rank must have alike, compared by hash across the ranks: a rank-dependent
// model or configuration would mismatch the start-up broadcast (or, with equal totals,
// partition differently) and every collective after it; and how a mismatch message names
// this rank's side.
std::pair<std::string, std::string> engine_state::rank_identity(
    const core_spec& spec, const zero_options& zo, const std::vector<::torch::Tensor>& frozen,
    const std::vector<std::pair<std::string, ::torch::Tensor>>& kept) const {
  std::pair<std::string, std::string> id;
  // The config as it was understood (to_json: every key that sets the layout, the
  // collectives or the step, exact values in shortest round-trip digits), except the
  // stochastic-rounding key where nothing rounds stochastically; the parameters'
  // device kind and their gradients' wire dtypes. The core compares its own layout
  // and options too.
  nlohmann::json cfg = to_json(cfg_);
  if (!spec.stochastic_rounding) cfg.erase("seed");
  std::string what = cfg.dump() + "\n" + spec.describe() + ", wire";
  for (const dtype d : zo.wire_dtypes) {
    what += ' ';
    what += name_of(d);
  }
  const auto& o = cfg_.optimizer;
  std::int64_t elements = 0;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    what += "\n" + names_[i] + " " + shape_of(shapes_[i]) +
            (built_.count(params_[i].unsafeGetTensorImpl()) > 0 ? " (built partitioned)" : "");
    elements += c10::multiply_integers(shapes_[i]);
  }
  for (const auto& t : frozen) {
    const auto b = built_.find(t.unsafeGetTensorImpl());
    what += "\nfrozen " + (b != built_.end() ? shape_of(b->second.shape) + " (built partitioned)" : shape_of(t.sizes()));
  }
  // Frozen integer or bool parameters are not broadcast (they keep their dtype): every
  // rank must hold the same values, so the values are compared too.
  for (const auto& [name, t] : kept) {
    const ::torch::Tensor c = t.detach().to(at::kCPU).contiguous();
    what += "\nkept " + name + " " + shape_of(t.sizes()) + " " +
            std::string(static_cast<const char*>(c.const_data_ptr()), c.nbytes());
  }
  for (const auto& b : module_->buffers(/*recurse=*/true))
    if (b.is_floating_point()) what += "\nbuffer " + shape_of(b.sizes());
  id.first = std::move(what);
  id.second = std::to_string(params_.size()) + " trainable parameters of " + std::to_string(elements) +
             " elements, " + std::to_string(frozen.size()) + " frozen; " + spec.describe() +
             ", gradient_accumulation_steps " + std::to_string(cfg_.gradient_accumulation_steps) + ", lr " +
             format_double(o.lr) + ", gradient_clipping " + format_double(zo.gradient_clipping) +
             (spec.stochastic_rounding ? ", seed " + std::to_string(zo.seed) : "");
  return id;
}

core_place engine_state::agreement_place(const any_communicator& comm, const engine_state* st) {
  core_place place;
  if (!comm.base().reads_device_memory()) return place;
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::kCUDA);
  int d = comm.base().cuda_device();
  if (d < 0 && st != nullptr && st->device_.is_cuda()) d = st->device_.index();
  if (d < 0) d = impl->getDevice().index();
  place.device = d;
  place.stream = impl->getStream(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(d))).native_handle();
  return place;
}

namespace {
// The whole parameter (flat) from the slices `parts[r]` that plan p gives each of
// parts.size() tensor-parallel ranks.
::torch::Tensor join_tp_slices(const tp_param_plan& p, const std::vector<::torch::Tensor>& parts) {
  const auto tp = static_cast<std::uint64_t>(parts.size());
  std::int64_t numel = 1;
  for (const std::int64_t d : p.view) numel *= d;
  ::torch::Tensor whole = ::torch::empty({numel}, parts[0].options());
  for (std::uint64_t r = 0; r < tp; ++r) {
    const ::torch::Tensor part = parts[r].reshape({-1});
    std::int64_t at = 0;
    for (const auto& [first, len] : tp_shard_runs(p, tp, r)) {
      whole.narrow(0, first, len).copy_(part.narrow(0, at, len));
      at += len;
    }
  }
  return whole;
}
// Rank `rank`'s slice of a whole parameter, in the shard's shape.
::torch::Tensor cut_tp_slice(const tp_param_plan& p, std::uint64_t tp, std::uint64_t rank, const ::torch::Tensor& whole) {
  const ::torch::Tensor flat = whole.reshape({-1});
  std::vector<::torch::Tensor> pieces;
  for (const auto& [first, n] : tp_shard_runs(p, tp, rank)) pieces.push_back(flat.narrow(0, first, n));
  return ::torch::cat(pieces).reshape(p.shard_shape);
}
}  // namespace

void engine_checkpoints::reshard_module_states(const fs::path& tag_dir, std::uint64_t saved_tp,
                                               const detail::saved_tp_layout& layout,
                                               std::unordered_map<std::string, ::torch::Tensor>& saved,
                                               const std::function<bool(const std::string&)>& wanted) {
  const std::string who = "engine.load_checkpoint";
  std::unordered_map<std::string, const tp_param_plan*> was_split;
  for (std::size_t k = 0; k < layout.plan_all.size(); ++k) {
    const std::string& name = k < layout.names.size() ? layout.names[k] : layout.frozen_names[k - layout.names.size()];
    if (layout.plan_all[k].type != tp_partition::skip && saved.count(name) > 0) was_split[name] = &layout.plan_all[k];
  }
  if (!was_split.empty()) {
    std::unordered_map<std::string, std::vector<::torch::Tensor>> parts;
    for (const auto& [name, p] : was_split) parts[name].push_back(saved.at(name));
    for (std::uint64_t r = 1; r < saved_tp; ++r) {
      const fs::path d = tag_dir / tp_checkpoint_directory(r);
      const detail::engine_meta meta = detail::read_engine_meta(who, d / "mpzero_engine.json");
      const auto split_and_wanted = [&](const std::string& name) { return was_split.count(name) > 0 && wanted(name); };
      for (auto& [name, t] :
           detail::read_module_states(who, d / "model_states.pt", meta.save_id, d / "mpzero_engine.json", split_and_wanted))
        parts[name].push_back(std::move(t));
    }
    for (auto& [name, p] : was_split) {
      if (parts[name].size() != saved_tp) {
        fail(who + ": '" + name + "' is split over " + std::to_string(saved_tp) + " tensor-parallel ranks in " +
             quoted(tag_dir) + ", but only " + std::to_string(parts[name].size()) +
             " of their model_states.pt files hold it; the checkpoint is incomplete");
      }
      saved[name] = join_tp_slices(*p, parts[name]);
    }
  }
  if (!e_.tp_comm_) {
    // Whole here: each joined entry takes its parameter's shape.
    for (const auto& item : e_.module_->named_parameters(/*recurse=*/true)) {
      const auto it = saved.find(item.key());
      if (it == saved.end() || !was_split.count(item.key())) continue;
      const auto m = e_.index_.find(item.value().unsafeGetTensorImpl());
      const at::IntArrayRef shape = m != e_.index_.end() ? at::IntArrayRef(e_.shapes_[m->second]) : item.value().sizes();
      if (it->second.numel() == c10::multiply_integers(shape)) it->second = it->second.reshape(shape);
    }
    return;
  }
  const auto tp = static_cast<std::uint64_t>(e_.tp_comm_->size()), rank = static_cast<std::uint64_t>(e_.tp_comm_->rank());
  for (const auto& item : e_.module_->named_parameters(/*recurse=*/true)) {
    const tp_param_plan* p = e_.tp_split_of(item.value());
    const auto it = saved.find(item.key());
    if (p == nullptr || it == saved.end()) continue;
    const std::vector<std::int64_t>& whole = e_.tp_whole_shape(item.value());
    if (it->second.numel() != c10::multiply_integers(whole)) {
      fail(who + ": '" + item.key() + "' has " + std::to_string(it->second.numel()) + " elements (whole) in " +
           quoted(tag_dir) + " and " + shape_of(whole) + " here. Load a checkpoint of this model");
    }
    it->second = cut_tp_slice(*p, tp, rank, it->second);
  }
}

::torch::Tensor engine_state::tp_join(const tp_param_plan& p, const ::torch::Tensor& mine) {
  const auto tp = static_cast<std::uint64_t>(tp_comm_->size());
  // Through fp32: bf16 and fp16 widen to it exactly, so the bits come back unchanged.
  const ::torch::Tensor part = mine.detach().to(at::kCPU, at::kFloat).contiguous().reshape({-1});
  const auto n = static_cast<std::uint64_t>(part.numel());
  ::torch::Tensor all = ::torch::empty({static_cast<std::int64_t>(n * tp)}, part.options());
  const std::vector<std::uint64_t> counts(tp, n);
  tp_comm_->base().iall_gather_v(part.data_ptr(), n, all.data_ptr(), counts, wire_dtype::f32)->wait();
  std::vector<::torch::Tensor> parts;
  for (std::uint64_t r = 0; r < tp; ++r) parts.push_back(all.narrow(0, static_cast<std::int64_t>(r * n), static_cast<std::int64_t>(n)));
  return join_tp_slices(p, parts).to(mine.scalar_type());
}

void engine_state::check_given_groups() {
  const any_communicator& tpg = given_groups_->first;
  const any_communicator& dpg = given_groups_->second;
  const int world = comm_.size(), me = comm_.rank(), t = tpg.rank(), d = dpg.rank();
  // Every rank's {tensor-parallel rank, data-parallel rank}, and the world ranks of this
  // rank's two groups, by their ranks there.
  std::vector<std::int32_t> place(2 * static_cast<std::size_t>(world), -1), tp_members(static_cast<std::size_t>(tpg.size()), -1),
      dp_members(static_cast<std::size_t>(dpg.size()), -1);
  place[2 * static_cast<std::size_t>(me)] = t;
  place[2 * static_cast<std::size_t>(me) + 1] = d;
  tp_members[static_cast<std::size_t>(t)] = me;
  dp_members[static_cast<std::size_t>(d)] = me;
  max_over_ranks(comm_, std::span<std::int32_t>(place), agreement_place(comm_, this));
  any_communicator tp_copy = tpg, dp_copy = dpg;
  max_over_ranks(tp_copy, std::span<std::int32_t>(tp_members), agreement_place(tp_copy, this));
  max_over_ranks(dp_copy, std::span<std::int32_t>(dp_members), agreement_place(dp_copy, this));
  agree("initialize", "no rank made an engine", [&] {
    const std::string groups = " (parallel_groups: tensor-parallel '" + tpg.name() + "', data-parallel '" + dpg.name() + "')";
    for (int r = 0; r < world; ++r) {
      for (int q = 0; q < r; ++q) {
        if (place[2 * r] == place[2 * q] && place[2 * r + 1] == place[2 * q + 1]) {
          fail("initialize: ranks " + std::to_string(q) + " and " + std::to_string(r) +
               " of the world are both tensor-parallel rank " + std::to_string(place[2 * r]) + " and data-parallel rank " +
               std::to_string(place[2 * r + 1]) + groups +
               "; each rank needs its own place in the grid of tensor- and data-parallel ranks");
        }
      }
    }
    for (std::size_t k = 0; k < tp_members.size(); ++k) {
      const std::int32_t w = tp_members[k];
      if (place[2 * static_cast<std::size_t>(w) + 1] != d) {
        fail("initialize: world rank " + std::to_string(w) + " is in the tensor-parallel group of world rank " +
             std::to_string(me) + " but is data-parallel rank " + std::to_string(place[2 * static_cast<std::size_t>(w) + 1]) +
             ", not " + std::to_string(d) + groups +
             "; the ranks of a tensor-parallel group must hold the same data-parallel rank (one replica)");
      }
    }
    for (std::size_t k = 0; k < dp_members.size(); ++k) {
      const std::int32_t w = dp_members[k];
      if (place[2 * static_cast<std::size_t>(w)] != t) {
        fail("initialize: world rank " + std::to_string(w) + " is in the data-parallel group of world rank " +
             std::to_string(me) + " but is tensor-parallel rank " + std::to_string(place[2 * static_cast<std::size_t>(w)]) +
             ", not " + std::to_string(t) + groups +
             "; the ranks of a data-parallel group must hold the same tensor-parallel rank (the same slices)");
      }
    }
  });
}

void engine_state::start_tensor_parallel() {
  const auto tp = static_cast<int>(cfg_.tensor_parallel.autotp_size);
  if (given_groups_) check_given_groups();
  auto [tp_group, dp_group] = given_groups_ ? std::move(*given_groups_) : tensor_parallel_groups(comm_, tp);
  given_groups_.reset();
  ::torch::NoGradGuard no_grad;
  std::vector<::torch::Tensor> all = params_;
  for (const auto& t : frozen_) all.push_back(t);
  for (const auto& b : module_->buffers(/*recurse=*/true))
    if (b.is_floating_point()) all.push_back(b);
  for (std::size_t k = 0; k < all.size(); ++k) {
    ::torch::Tensor& t = all[k];
    ::torch::Tensor whole = t.detach().to(at::kCPU, at::kFloat).contiguous();
    if (comm_.size() > 1) comm_.base().ibroadcast(whole.data_ptr(), static_cast<std::uint64_t>(whole.numel()), wire_dtype::f32, 0)->wait();
    const tp_param_plan* split = k < params_.size() ? (tp_plan_[k].type == tp_partition::skip ? nullptr : &tp_plan_[k])
                                 : k < params_.size() + frozen_.size()
                                     ? (tp_frozen_.count(t.unsafeGetTensorImpl()) ? &tp_frozen_.at(t.unsafeGetTensorImpl()).plan : nullptr)
                                     : nullptr;
    if (split == nullptr) {
      t.copy_(whole.view(t.sizes()));
      continue;
    }
    t.set_data(cut_tp_slice(*split, static_cast<std::uint64_t>(tp), static_cast<std::uint64_t>(tp_group.rank()), whole)
                   .to(t.scalar_type()));
  }
  tp_comm_.emplace(std::move(tp_group));
  world_comm_ = comm_;
  comm_ = std::move(dp_group);
}

void engine_state::start() {
  if (cfg_.tensor_parallel.enabled()) start_tensor_parallel();
  // Collective: a rank whose core cannot be made (memory, say) makes every rank throw.
  core_ = make_zero_core(plan_->core.spec, comm_, plan_->numels, cfg_.optimizer, plan_->core.zo, plan_->place);
  if (tp_comm_) {
    std::vector<bool> split(params_.size());
    for (std::size_t i = 0; i < split.size(); ++i) split[i] = tp_plan_[i].type != tp_partition::skip;
    core_->set_tensor_parallel(*tp_comm_, split);
  }
  plan_.reset();
  std::vector<::torch::Tensor> frozen = std::move(frozen_);
  ::torch::NoGradGuard no_grad;
  // Every rank starts from rank 0's values, as DeepSpeed broadcasts the model: the
  // trainable parameters (into the core), then the frozen floating parameters and the
  // floating buffers (in the parameter dtype, as after DeepSpeed's module.bfloat16()).
  std::vector<::torch::Tensor> all = params_;
  all.insert(all.end(), frozen.begin(), frozen.end());
  for (const auto& b : module_->buffers(/*recurse=*/true))
    if (b.is_floating_point()) all.push_back(b);
  // Frozen parameters and buffers: their values in the parameter dtype, set below.
  std::vector<::torch::Tensor> converted(all.size() - params_.size());
  load_from_rank0(all, frozen.size(), converted);
  load_built(all, converted);
  bind_parameters(all, converted);
}

void engine_state::load_from_rank0(const std::vector<::torch::Tensor>& all, std::size_t n_frozen,
                                   std::vector<::torch::Tensor>& converted) {
  // The values cross the communicator in fp32 through one host window of at most
  // startup_window_elements (or the largest tensor, which loads whole), not the whole
  // model at once: 4 bytes per parameter of a 7B model would be 28 GB of host memory per
  // rank. Rank 0 fills each window; the others only receive it.
  const std::uint64_t limit = detail::startup_window_elements();
  // Parameters built partitioned have no values on rank 0 to give: load_built rebuilds them.
  const auto count = [&](std::size_t k) -> std::uint64_t {
    return built_.count(all[k].unsafeGetTensorImpl()) > 0 ? 0 : static_cast<std::uint64_t>(all[k].numel());
  };
  std::vector<std::size_t> ends;  // all[ends[w-1], ends[w]) is window w
  std::uint64_t window = 0;
  {
    std::uint64_t filled = 0;
    for (std::size_t k = 0; k < all.size(); ++k) {
      const auto n = count(k);
      if (filled > 0 && filled + n > limit) {
        ends.push_back(k);
        filled = 0;
      }
      filled += n;
      window = std::max(window, filled);
    }
    ends.push_back(all.size());
  }
  const int world = comm_.size();
  const bool root = comm_.rank() == 0;
  auto first = [&](std::size_t w) { return w == 0 ? std::size_t{0} : ends[w - 1]; };
  auto elements = [&](std::size_t w) {
    std::uint64_t n = 0;
    for (std::size_t k = first(w); k < ends[w]; ++k) n += count(k);
    return n;
  };
  std::vector<float> flat;
  // Window w's values into `flat` (rank 0; the others receive them).
  auto fill = [&](std::size_t w) {
    if (flat.empty()) flat.resize(static_cast<std::size_t>(window));
    if (!root && world > 1) return;
    std::int64_t off = 0;
    for (std::size_t k = first(w); k < ends[w]; ++k) {
      if (count(k) == 0) continue;
      auto c = all[k].detach().to(at::kCPU, at::kFloat).contiguous();
      std::copy_n(c.const_data_ptr<float>(), c.numel(), flat.data() + off);
      off += c.numel();
    }
  };
  // Window w's values from `flat` into the core (trainable) or `converted` (bound later).
  auto load = [&](std::size_t w) {
    std::int64_t off = 0;
    for (std::size_t k = first(w); k < ends[w]; ++k) {
      const auto& t = all[k];
      if (count(k) == 0) continue;
      if (k < params_.size()) {
        core_->load_param(k, flat.data() + off, dtype::fp32);
      } else {
        converted[k - params_.size()] = ::torch::from_blob(flat.data() + off, t.sizes(), ::torch::kFloat)
                                            .to(t.device(), param_type_, /*non_blocking=*/false, /*copy=*/true);
        if (k < params_.size() + n_frozen) frozen_shards_.partition(t, converted[k - params_.size()]);
      }
      off += t.numel();
    }
  };
  // A rank that fails (memory, a device error) must not leave the others waiting in the
  // next broadcast: before each one the ranks agree on the previous window's load and
  // this window's fill, and once more after the last load. The model changes only after.
  const std::string consequence = "no rank made an engine, and the model is unchanged";
  for (std::size_t w = 0; w < ends.size(); ++w) {
    agree("initialize", consequence, [&] {
      if (w > 0) load(w - 1);
      fill(w);
    });
    if (world > 1 && elements(w) > 0) core_->broadcast(flat.data(), elements(w), 0);
  }
  agree("initialize", consequence, [&] { load(ends.size() - 1); });
}

void engine_state::bind_parameters(const std::vector<::torch::Tensor>& all, const std::vector<::torch::Tensor>& converted) {
  zero3_ = cfg_.zero.stage == 3;
  z3_.holds_.assign(z3_size(), 0);
  z3_.storages_.assign(params_.size(), c10::Storage());
  z3_.group_of_.assign(z3_size(), {0, 0});
  z3_.claimed_.assign(z3_size(), 0);
  z3_.outside_.assign(z3_size(), 0);
  z3_.placeholder_ = ::torch::empty({0}, ::torch::TensorOptions().dtype(param_type_).device(device_));
  // Built partitioned: each in a submodule that runs through gathered_forward, so the
  // first forward need not gather them for the whole pass.
  for (std::size_t i = 0; i < params_.size(); ++i) z3_.claimed_[i] = built_.count(params_[i].unsafeGetTensorImpl()) > 0;
  for (std::size_t f = 0; f < frozen_shards_.parts_.size(); ++f) {
    z3_.claimed_[params_.size() + f] = built_.count(frozen_shards_.parts_[f].param.unsafeGetTensorImpl()) > 0;
  }
  for (std::size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    // The parameter becomes a view of the core's buffer: forward reads it, step() writes
    // it. ZeRO-3: a partitioned one is empty until gathered.
    if (core_->partitioned(i)) {
      p.set_data(z3_.placeholder_);
    } else {
      z3_.bind(i);
    }
    bound_ = i + 1;
    p.mutable_grad().reset();
    auto hook = std::make_unique<grad_hook>();
    hook->st = weak_from_this();
    hook->index = i;
    hook->prev = std::move(ag::impl::post_acc_grad_hooks(p));
    ag::impl::set_post_acc_grad_hooks(p, std::move(hook));
  }
  for (std::size_t k = params_.size(); k < all.size(); ++k) all[k].set_data(converted[k - params_.size()]);
  {
    // The engine has the values now: the records go.
    std::lock_guard<std::mutex> lock(built_slices_mutex);
    for (const auto& [impl, rec] : built_) built_slices.erase(impl);
  }
  built_.clear();
  {
    std::lock_guard<std::mutex> lock(frozen_owners_mutex);
    for (const auto& [impl, f] : frozen_shards_.index_) frozen_owners[impl] = weak_from_this();
    for (const auto& [impl, f] : tp_frozen_) frozen_owners[impl] = weak_from_this();
  }
  join_core();  // the forward reads what load_param wrote on the core's stream
}

void frozen_shards::partition(const ::torch::Tensor& param, ::torch::Tensor& converted) {
  if (e_.cfg_.zero.stage != 3 || static_cast<std::uint64_t>(converted.numel()) <= e_.cfg_.zero.stage3_param_persistence_threshold) {
    return;
  }
  part fp;
  fp.param = param;
  fp.shape = converted.sizes().vec();
  const auto [begin, end] = slice_range(converted.numel(), e_.comm_.size(), e_.comm_.rank());
  fp.slice = converted.reshape({-1}).slice(0, begin, end).clone();
  converted = ::torch::empty({0}, converted.options());  // what the module holds until gathered
  index_[param.unsafeGetTensorImpl()] = parts_.size();
  parts_.push_back(std::move(fp));
}

// Rebuilt whole from the ranks' slices (each broadcasts its own, through the host) into
// a buffer the parameter's storage points at.
void frozen_shards::gather(std::size_t f) {
  const unobserved own;
  part& fp = parts_[f];
  const std::int64_t n = c10::multiply_integers(fp.shape);
  std::vector<float> whole(static_cast<std::size_t>(n));
  put_own_slice(whole, fp.slice, e_.comm_.size(), e_.comm_.rank());
  e_.broadcast_slices(whole);
  const c10::Device dev = fp.slice.device();
  const std::size_t bytes = static_cast<std::size_t>(n) * c10::elementSize(e_.param_type_);
  c10::DataPtr data = c10::GetAllocator(dev.type())->allocate(bytes);
  if (!fp.storage) {
    fp.storage = c10::Storage(c10::Storage::use_byte_size_t(), bytes, std::move(data), /*allocator=*/nullptr,
                              /*resizable=*/false);
  } else {
    // Gathered again: the same storage, so that what forward saved for backward reads it.
    fp.storage.set_data_ptr_noswap(std::move(data));
    fp.storage.set_nbytes(bytes);
  }
  ::torch::NoGradGuard ng;
  ::torch::Tensor t = ::torch::empty({0}, fp.slice.options()).set_(fp.storage, 0, fp.shape);
  t.copy_(::torch::from_blob(whole.data(), fp.shape, ::torch::kFloat));
  fp.param.set_data(t);
}

void frozen_shards::release(std::size_t f, bool keep_shape) {
  const unobserved own;
  part& fp = parts_[f];
  if (!keep_shape) fp.param.set_data(::torch::empty({0}, fp.slice.options()));
  if (!fp.storage) return;
  fp.storage.set_data_ptr_noswap(c10::DataPtr(nullptr, fp.slice.device()));
  fp.storage.set_nbytes(0);
}

bool engine_state::take_built(const std::string& name, const ::torch::Tensor& p) {
  auto b = built_slice_of(p);
  if (!b) return false;
  if (b->world != comm_.size() || b->rank != comm_.rank()) {
    fail("parameter '" + name + "' was built partitioned for rank " + std::to_string(b->rank) + " of " +
         std::to_string(b->world) + ", but initialize gets rank " + std::to_string(comm_.rank()) + " of " +
         std::to_string(comm_.size()) + "; build the model under zero_init(comm) with the communicator passed to "
         "initialize");
  }
  built_.emplace(p.unsafeGetTensorImpl(), std::move(*b));
  return true;
}

// Each parameter built partitioned, rebuilt whole from the ranks' slices (every rank
// broadcasts its own), one at a time: into the core (trainable: all[k], k < params_.size()),
// or into converted (frozen). The ranks then compare the whole with what each built.
void engine_state::broadcast_slices(std::vector<float>& whole) {
  for (int r = 0; r < comm_.size(); ++r) {
    const auto [begin, end] = slice_range(static_cast<std::int64_t>(whole.size()), comm_.size(), r);
    core_->broadcast(whole.data() + begin, static_cast<std::uint64_t>(end - begin), r);
  }
}

void engine_state::load_built(const std::vector<::torch::Tensor>& all, std::vector<::torch::Tensor>& converted) {
  const std::string consequence = "no rank made an engine, and the model is unchanged";
  for (std::size_t k = 0; k < all.size(); ++k) {
    const auto it = built_.find(all[k].unsafeGetTensorImpl());
    if (it == built_.end()) continue;
    const built_slice& b = it->second;
    const std::int64_t n = c10::multiply_integers(b.shape);
    std::vector<float> whole;
    agree("initialize", consequence, [&] {
      whole.resize(static_cast<std::size_t>(n));
      put_own_slice(whole, b.slice, comm_.size(), comm_.rank());
    });
    broadcast_slices(whole);
    agree("initialize", consequence, [&] {
      if (whole_hash(whole.data(), whole.size()) != b.hash) {
        fail((k < params_.size() ? "parameter '" + names_[k] + "'" : "a frozen parameter of shape " + shape_of(b.shape)) +
             " was built with other values on this rank than on the others under zero_init (each rank keeps "
             "the slice it built, so the model would be a mix); seed torch alike on every rank "
             "(torch::manual_seed) before building the model");
      }
      if (k < params_.size()) {
        core_->load_param(k, whole.data(), dtype::fp32);
      } else {
        converted[k - params_.size()] = ::torch::from_blob(whole.data(), b.shape, ::torch::kFloat)
                                            .to(all[k].device(), param_type_, /*non_blocking=*/false, /*copy=*/true);
        frozen_shards_.partition(all[k], converted[k - params_.size()]);  // built partitioned: a parameter, not a buffer
      }
    });
  }
}

pass* backward_tracker::acquire(event e) {
  const int task = ag::get_current_graph_task_id();
  if (task == cache_task_ && cache_ != nullptr) {
    if (e == event::scale_root) cache_->scaled = true;
    return cache_;
  }
  e_.z3_.rethrow_deferred();  // a backward's first event (a new graph task) reports it, not every hook
  ++lookups_;
  if (auto it = passes_.find(task); it != passes_.end()) {
    cache_task_ = task;
    cache_ = it->second.get();
    if (e == event::scale_root) cache_->scaled = true;
    return cache_;
  }
  // torch::autograd::grad, or backward(inputs=...): a graph task that runs only part of
  // the graph. grad() accumulates into no parameter, so it must not touch the engine
  // (an epilogue would reduce every bucket, collectively, for nothing; fp16 would
  // refuse a gradient penalty). Only a parameter hook, which fires when autograd does
  // accumulate into a parameter, opens a pass in such a task (own_scaled_task_ remembers
  // an engine.scale() root seen first).
  if (e != event::param && partial_graph_task()) return nullptr;

  // A graph task this engine has not seen. Passes whose graph task died without running
  // its callbacks (an exception in backward) are over.
  retire_if([](const pass& q) { return q.has_callback && q.alive.expired(); });
  const int depth = current_reentrant_depth();
  // Nested: a backward started inside another backward (depth > 0), or, when the depth
  // cannot be read, any backward while one of ours is still open. It joins the open
  // pass and runs no epilogue of its own.
  const bool outer_running =
      std::any_of(open_.begin(), open_.end(), [](const auto& q) { return q->has_callback; });
  const bool nested = depth > 0 || (depth < 0 && outer_running);
  std::shared_ptr<pass> p;
  if (!open_.empty() && (nested || (forward_depth_ == 0 && !open_.back()->has_callback))) {
    // Join the open pass; or adopt a pass that so far only saw backwards nested in
    // another one or run inside forward, now that a user backward reaches us.
    p = open_.back();
    p->tasks.push_back(task);
  } else {
    p = std::make_shared<pass>();
    p->tasks.push_back(task);
    open_.push_back(p);
  }
  if (pending_ && !p->manual && !p->has_callback) {
    // The backward engine.backward started, reached first in a nested graph task or
    // not: every gradient it brings gets its scale_wrt_gas, and engine.backward runs
    // the epilogue once root.backward() returns.
    p->scaled = true;
    p->scale_wrt_gas = pending_->scale_wrt_gas;
    p->manual = true;
    manual_ = p;
  }
  if (task == own_scaled_task_) p->scaled = true;

  // The epilogue belongs to the outermost user backward: not to a nested one, nor to a
  // backward run inside forward (that one's gradients join the next pass).
  if (!p->has_callback && !nested && forward_depth_ == 0) {
    if (e_.needs_scaling_ && !p->scaled) {
      close(*p);
      if (scaled_task() == task) {
        throw mpzero::error(
            "mpzero::torch: Loss scaling is required for fp16 training: this backward was scaled by another "
            "engine's loss scale, not this one's. fp16 engines chained into one another (one engine's output "
            "feeding the next) cannot share a backward, since each divides its gradients by its own scale: use "
            "bf16 for them, or one engine for the chained modules. Engines that share a loss but not a path "
            "each scale their own term: (e1.scale(l1) + e2.scale(l2)).backward()");
      }
      throw mpzero::error(
          "mpzero::torch: Loss scaling is required for fp16 training: this backward was not scaled. Use "
          "engine.backward(loss), or engine.scale(loss).backward() instead of loss.backward(); for a non-scalar "
          "output, instead of out.backward(grad), engine.backward((out * grad).sum()) (fp16 gradients underflow "
          "without the loss scale, and step() divides them by it)");
    }
    auto token = std::make_shared<char>(0);
    p->alive = token;
    p->has_callback = true;
    ag::Engine::get_default_engine().queue_callback(
        [w = e_.weak_from_this(), p, token] {
          if (auto s = w.lock()) s->bw_.on_callback(p);
        });
  }
  passes_[task] = p;
  cache_task_ = task;
  cache_ = p.get();
  return p.get();
}

void backward_tracker::on_callback(const std::shared_ptr<pass>& p) {
  if (p->done) return;
  close(*p);
  if (!p->manual) epilogue();  // engine.backward runs it itself once backward returns
}

void backward_tracker::on_param_grad(std::size_t i, const ::torch::Tensor& param) {
  const pass& p = *acquire(event::param);  // never nullptr for a parameter
  ::torch::Tensor g = param.grad();
  if (!g.defined()) return;
  if (g.is_sparse()) fail("parameter '" + e_.names_[i] + "' got a sparse gradient; the engine supports dense gradients only");
  auto t = dtype_of(g.scalar_type());
  if (!t) {
    g = g.to(at::kFloat);
    t = dtype::fp32;
  }
  g = g.contiguous();
  // Produced on another stream: the caching allocator must not reuse g before the core has read it.
  if (e_.core_waits()) g.record_stream(*e_.core_stream_);
  e_.core_->accumulate_grad(i, g.data_ptr(), *t, p.scale_wrt_gas ? e_.inv_gas_ : 1.0f);
  // The core holds the gradient now; release autograd's copy.
  param.mutable_grad().reset();
}

::torch::Tensor backward_tracker::backward(const ::torch::Tensor& loss, bool retain_graph, bool scale_wrt_gas) {
  e_.z3_.rethrow_deferred();
  if (!loss.defined() || loss.numel() != 1) {
    fail("engine.backward: the loss has shape " + (loss.defined() ? shape_of(loss.sizes()) : std::string("(undefined)")) +
         "; it takes a scalar (one-element) loss. For a non-scalar output call out.backward(grad) directly (bf16, fp32), "
         "or engine.backward((out * grad).sum()), which computes the same gradients in any precision, fp16 included");
  }
  if (!loss.requires_grad()) {
    fail("engine.backward: the loss does not require grad (no graph to run backward on); compute it from the "
         "engine's forward outside torch::NoGradGuard");
  }
  if (e_.needs_scaling_ && last_scaled_ && last_scaled_->lock().get() == loss.unsafeGetTensorImpl()) {
    fail("engine.backward: the loss is engine.scale()'s result, and engine.backward scales the loss itself, so "
         "its gradients would be scaled twice; pass the unscaled loss: engine.backward(loss), or call "
         "engine.scale(loss).backward()");
  }
  ::torch::Tensor root = e_.needs_scaling_ ? loss.to(at::kFloat) * e_.core_->loss_scale() : loss;
  if (e_.needs_scaling_) {  // for another engine's message when this backward reaches it unscaled
    root.register_hook([](const ::torch::Tensor&) { scaled_task() = ag::get_current_graph_task_id(); });
  }
  pending_ = direct_backward{scale_wrt_gas};
  manual_.reset();
  try {
    root.backward({}, retain_graph);
  } catch (...) {
    pending_.reset();
    if (manual_ && !manual_->done) close(*manual_);
    manual_.reset();
    throw;
  }
  pending_.reset();
  if (auto p = std::exchange(manual_, nullptr)) {
    if (!p->done) close(*p);  // nested-only or in-forward pass: end it here
    epilogue();
  }
  ::torch::NoGradGuard ng;
  return scale_wrt_gas ? loss.detach() / static_cast<double>(e_.cfg_.gradient_accumulation_steps) : loss.detach();
}

::torch::Tensor backward_tracker::scale(const ::torch::Tensor& loss) {
  if (!loss.defined() || loss.numel() != 1) {
    fail("engine.scale: the loss has shape " + (loss.defined() ? shape_of(loss.sizes()) : std::string("(undefined)")) +
         "; scale() takes a scalar (one-element) loss, as the loss scale applies to the loss. For a non-scalar "
         "output out with gradient grad, scale the loss whose gradients those are: "
         "engine.scale((out * grad).sum()).backward(), or engine.backward((out * grad).sum())");
  }
  if (!e_.needs_scaling_) return loss;
  if (!loss.requires_grad()) fail("engine.scale: the loss does not require grad; there is no backward to scale");
  ::torch::Tensor scaled = loss.to(at::kFloat) * e_.core_->loss_scale();
  last_scaled_.emplace(scaled.getIntrusivePtr());
  // Marks the backward that starts here as scaled: the hook fires first, at the root.
  scaled.register_hook([w = e_.weak_from_this()](const ::torch::Tensor&) {
    if (auto s = w.lock()) s->bw_.on_scale_root();
  });
  return scaled;
}

void backward_tracker::on_scale_root() {
  own_scaled_task_ = scaled_task() = ag::get_current_graph_task_id();
  (void)acquire(event::scale_root);
}

void backward_tracker::epilogue() {
  e_.core_waits();
  e_.core_->end_backward();
  ++epilogues_;
  e_.z3_.release_backward_units();
  e_.z3_.drop_prefetches();
}

void engine_state::step() {
  z3_.rethrow_deferred();
  if (is_boundary()) {
    bw_.drop_stale_passes();
    z3_.release_all();  // ZeRO-3: the step rewrites the partitions the gathered copies came from
    apply_schedule();
    core_waits();
    try {
      last_ = core_->step();
    } catch (const mpzero::no_gradients_error&) {
      fail("engine.step(): no backward reached this engine's parameters on any rank since the last step or "
           "zero_grad() (micro-step " + std::to_string(micro_steps_) +
           "), so the update would come from zero gradients; run loss.backward() or engine.backward(loss) on a "
           "loss computed from the engine's model first, or leave engine.step() out of this iteration");
    }
    join_core();  // the next forward reads the updated parameters
    stepped_ = true;
    ++global_steps_;
    if (last_.skipped) {
      ++skipped_steps_;
    } else {
      ++scheduler_steps_;
    }
    for (auto& p : params_) p.mutable_grad().reset();
  }
  ++micro_steps_;
}

nlohmann::json engine_checkpoints::engine_json(const std::string& tag, const nlohmann::json& client_state,
                                         std::uint64_t save_id) const {
  // Tied weights are managed once, under their first name; their other names are
  // "aliases" (the fp32 export gives every name the master weights).
  std::vector<std::vector<std::string>> aliases(e_.params_.size());
  for (const auto& item : e_.module_->named_parameters(/*recurse=*/true)) {
    const auto it = e_.index_.find(item.value().unsafeGetTensorImpl());
    if (it != e_.index_.end() && item.key() != e_.names_[it->second]) aliases[it->second].push_back(item.key());
  }
  nlohmann::json params = nlohmann::json::array();
  for (std::size_t i = 0; i < e_.params_.size(); ++i) {
    params.push_back({{"name", e_.names_[i]}, {"shape", e_.shapes_[i]}});
    if (!aliases[i].empty()) params.back()["aliases"] = aliases[i];
  }
  return {{"format", "mpzero engine checkpoint"},
          {"version", 1},
          {"tag", tag},
          {"global_steps", e_.global_steps_},
          {"micro_steps", e_.micro_steps_},
          {"skipped_steps", e_.skipped_steps_},
          {"scheduler_steps", e_.scheduler_steps_},
          {"world_size", e_.comm_.size()},
          {"zero_stage", e_.cfg_.zero.stage},
          {"precision", e_.core_->spec().describe()},
          {"save_id", save_id},
          {"parameters", params},
          {"param_groups", e_.param_group_record()},
          {"tensor_parallel", e_.tensor_parallel_record()},
          {"client_state", client_state}};
}

// The module's parameters and buffers as DeepSpeed's model_states file holds them:
// {"module": {name: tensor}, "global_steps": N}, and the save id that ties it to its shards.
std::vector<std::pair<std::string, at::Tensor>> engine_checkpoints::module_tensors(bool whole) {
  sources_.clear();
  std::vector<std::pair<std::string, at::Tensor>> out;
  const auto add = [&](const std::string& name, const at::Tensor& t, c10::IntArrayRef shape, std::ptrdiff_t gathered,
                       const tp_param_plan* tp = nullptr) {
    at::Tensor ph = detail::placeholder(shape, t.scalar_type());
    sources_.emplace(ph.storage().unsafeGetStorageImpl(), source{t, gathered, tp});
    out.emplace_back(name, std::move(ph));
  };
  for (const auto& item : e_.module_->named_parameters(/*recurse=*/true)) {
    const at::Tensor& t = item.value();
    const auto managed = e_.index_.find(t.unsafeGetTensorImpl());
    const auto frozen = e_.frozen_shards_.index_.find(t.unsafeGetTensorImpl());
    const tp_param_plan* split = whole ? e_.tp_split_of(t) : nullptr;
    if (split != nullptr) {
      add(item.key(), t, e_.tp_whole_shape(t), -1, split);
    } else if (managed != e_.index_.end()) {
      const std::size_t i = managed->second;
      add(item.key(), t, e_.shapes_[i], e_.core_->partitioned(i) ? static_cast<std::ptrdiff_t>(i) : -1);
    } else if (frozen != e_.frozen_shards_.index_.end()) {
      add(item.key(), t, e_.frozen_shards_.parts_[frozen->second].shape,
          static_cast<std::ptrdiff_t>(e_.params_.size() + frozen->second));
    } else {
      add(item.key(), t, t.sizes(), -1);
    }
  }
  for (const auto& item : e_.module_->named_buffers(/*recurse=*/true)) add(item.key(), item.value(), item.value().sizes(), -1);
  return out;
}

at::Tensor engine_checkpoints::fetch(const at::Tensor& placeholder) {
  const source& src = sources_.at(placeholder.storage().unsafeGetStorageImpl());
  const bool writer = world_writer_ ? e_.world_rank() == 0 : e_.comm_.rank() == 0;
  const auto copy = [&] { return src.tensor.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true); };
  if (src.tp != nullptr) {
    // AutoTP: joined from the tensor-parallel group's slices (collective over it).
    at::Tensor joined = e_.tp_join(*src.tp, src.tensor);
    return writer ? joined.reshape(placeholder.sizes()) : at::Tensor();
  }
  if (src.gathered < 0) return writer ? copy() : at::Tensor();
  // ZeRO-3: gathered for this tensor only (collective), in the parameter dtype, then released.
  const std::vector<std::size_t> one{static_cast<std::size_t>(src.gathered)};
  const struct stored_dtype {
    bool& flag;
    explicit stored_dtype(bool& f) : flag(f) { flag = true; }
    ~stored_dtype() { flag = false; }
  } stored(e_.z3_.stored_dtype_);
  e_.z3_.hold(one);
  at::Tensor values;
  try {
    if (writer) values = copy();
  } catch (...) {
    e_.z3_.unhold(one);
    throw;
  }
  e_.z3_.unhold(one);
  return values;
}

c10::IValue engine_checkpoints::module_states(std::uint64_t save_id) {
  c10::Dict<std::string, at::Tensor> state;
  for (auto& [name, t] : module_tensors()) state.insert(name, t);
  c10::impl::GenericDict top(c10::StringType::get(), c10::AnyType::get());
  top.insert("module", state);
  top.insert("global_steps", static_cast<std::int64_t>(e_.global_steps_));
  top.insert("mpzero_save_id", static_cast<std::int64_t>(save_id));  // < 2^52
  return top;
}

std::size_t engine_checkpoints::save_16bit(const std::string& save_dir, const std::string& filename) {
  e_.same_on_every_rank("save_16bit_model", "arguments", filename, "save_filename '" + filename + "'");
  if (filename.empty() || fs::path(filename).filename() != fs::path(filename)) {
    fail("engine.save_16bit_model: save_filename '" + filename +
         "' is not a file name; pass a name without directories (e.g. \"pytorch_model.bin\" or "
         "\"model.safetensors\") and the directory as save_dir");
  }
  if (e_.zero3_ && !e_.cfg_.zero.stage3_gather_16bit_weights_on_model_save) {
    fail("engine.save_16bit_model: at ZeRO stage 3 the parameters are partitioned and "
         "zero_optimization.stage3_gather_16bit_weights_on_model_save is false, so nothing was saved; set it to true "
         "(each parameter is then gathered for the save alone, so no rank holds the whole model), or save a "
         "checkpoint and export it with mpzero_zero_to_fp32");
  }
  const fs::path path = fs::path(save_dir) / filename;
  e_.agree("save_16bit_model", "nothing was saved", [&] {
    std::error_code ec;
    fs::create_directories(path.parent_path(), ec);
    if (ec) {
      fail("engine.save_16bit_model: cannot create " + quoted(path.parent_path()) + " (" + ec.message() +
           "); pass a save_dir that is writable");
    }
  });
  e_.core_waits();
  e_.join_core();  // the parameters as the last step left them
  // One file for the world: with AutoTP the split parameters are joined whole, and rank 0
  // of the world writes it.
  const bool writer = e_.world_rank() == 0;
  const struct world_writer {
    bool& flag;
    explicit world_writer(bool& f) : flag(f) { flag = true; }
    ~world_writer() { flag = false; }
  } whole_file(world_writer_);
  const auto fetch_one = [this](const at::Tensor& t) { return fetch(t); };
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  e_.agree("save_16bit_model", "nothing was saved", [&] {
    tensors = module_tensors(/*whole=*/true);
    if (path.extension() == ".safetensors") {
      detail::write_safetensors(path, tensors, {{"format", "pt"}, {"source", "mpzero save_16bit_model"}}, writer,
                                fetch_one);
    } else {
      c10::Dict<std::string, at::Tensor> dict;
      for (const auto& [name, t] : tensors) dict.insert(name, t);
      detail::write_torch_file(path, dict, writer, fetch_one);
    }
  });
  sources_.clear();
  return tensors.size();
}

void engine_checkpoints::save(const std::string& save_dir, const std::string& tag_arg,
                                   const nlohmann::json& client_state, bool save_latest) {
  const std::string tag = tag_arg.empty() ? "global_step" + std::to_string(e_.global_steps_) : tag_arg;
  // Equal arguments everywhere, or the ranks would issue different collectives below.
  e_.same_on_every_rank("save_checkpoint", "arguments", tag + (save_latest ? "\n1" : "\n0"),
                     "tag '" + tag + "', save_latest " + (save_latest ? "true" : "false"));
  // AutoTP: each tensor-parallel rank's files (its slices, over its data-parallel group)
  // in a directory of their own.
  const fs::path dir = e_.tp_comm_ ? fs::path(save_dir) / tag / tp_checkpoint_directory(static_cast<std::uint64_t>(e_.tp_comm_->rank()))
                                   : fs::path(save_dir) / tag;
  e_.agree("save_checkpoint", "nothing was saved", [&] {
    check_tag("engine.save_checkpoint", tag);
    e_.require_boundary("save_checkpoint");
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) {
      fail("engine.save_checkpoint: cannot create " + quoted(dir) + " (" + ec.message() +
           "); pass a save_dir that is writable and reachable from every rank");
    }
  });
  e_.core_waits();  // the core reads its buffers after what torch's current stream queued
  e_.join_core();   // and module_states reads the parameters after the core's last step
  // The shards first, then the files that name their save id: a load refuses engine files
  // of another save than the shards beside them.
  const std::uint64_t id = e_.core_->save_checkpoint(dir.string());
  // model_states.pt holds whole parameters: at ZeRO-3 every rank gathers them for it, one
  // at a time, while rank 0 writes (fetch).
  e_.agree("save_checkpoint", "the shard files were written, but the checkpoint is incomplete", [&] {
    const bool writer = e_.comm_.rank() == 0;
    detail::write_torch_file(dir / "model_states.pt", module_states(id), writer,
                             [this](const at::Tensor& t) { return fetch(t); });
    sources_.clear();
    if (writer) write_atomically(dir / "mpzero_engine.json", engine_json(tag, client_state, id).dump(2));
  });
  if (save_latest) {
    e_.agree("save_checkpoint", "the checkpoint is complete, but 'latest' does not name it", [&] {
      // One writer in the world (with AutoTP, the agreement above spans every rank, so
      // every tensor-parallel rank's files are complete by now).
      if (e_.comm_.rank() == 0 && (!e_.tp_comm_ || e_.tp_comm_->rank() == 0))
        write_atomically(fs::path(save_dir) / "latest", tag);
    });
  }
}

std::optional<engine_base::loaded_checkpoint> engine_checkpoints::load(const std::string& load_dir,
                                                                            const std::string& tag_arg,
                                                                            bool module_only) {
  e_.same_on_every_rank("load_checkpoint", "arguments", tag_arg + (module_only ? "\n1" : "\n0"),
                     "tag '" + tag_arg + "', load_module_only " + (module_only ? "true" : "false"));
  const fs::path root(load_dir);
  std::string tag = tag_arg;
  std::int32_t no_latest = 0;
  e_.agree("load_checkpoint", "nothing was loaded", [&] {
    if (!tag.empty()) return;
    const auto latest = detail::read_latest("load_checkpoint", root);
    if (!latest) {
      no_latest = 1;
      return;
    }
    tag = *latest;
  });
  if (tag_arg.empty()) {
    std::int32_t v[2] = {no_latest, -no_latest};
    e_.all_reduce_max(v, 2);
    const std::int32_t any = v[0], all = -v[1];
    if (any != all) {
      fail("engine.load_checkpoint: " + quoted(root / "latest") + " exists on some ranks only (on this one: " +
           (no_latest ? "no" : "yes") + "); checkpoints need a directory every rank can read");
    }
    if (all) return std::nullopt;  // nothing saved there yet, as DeepSpeed
  }
  e_.same_on_every_rank("load_checkpoint", "tags", tag, "'" + tag + "', from 'latest'");
  // AutoTP: this tensor-parallel rank's files; a save at another tensor-parallel size is
  // resharded first into a shard file of this rank's slices (its engine file and module
  // states are tensor-parallel rank 0's: their entries that the load reads are whole).
  const std::uint64_t tp = e_.tp_comm_ ? static_cast<std::uint64_t>(e_.tp_comm_->size()) : 1;
  const std::uint64_t tp_rank = e_.tp_comm_ ? static_cast<std::uint64_t>(e_.tp_comm_->rank()) : 0;
  std::uint64_t saved_tp = 1;
  e_.agree("load_checkpoint", "nothing was loaded", [&] { saved_tp = saved_tensor_parallel_size(root / tag); });
  const bool reshard = saved_tp != tp;

  const fs::path dir = saved_tp > 1 ? root / tag / tp_checkpoint_directory(reshard ? 0 : tp_rank) : root / tag;
  const fs::path resharded = fs::temp_directory_path() /
                             ("mpzero_reshard_" + std::to_string(::getpid()) + "_" + std::to_string(tp_rank) + "_" +
                              std::to_string(e_.comm_.rank()));
  struct remove_dir {
    fs::path p;
    bool on = false;
    ~remove_dir() {
      std::error_code ec;
      if (on) fs::remove_all(p, ec);
    }
  } cleanup{resharded, reshard};
  const fs::path core_dir = reshard ? resharded : dir;

  // Read and check everything before anything changes.
  struct copy {
    ::torch::Tensor dst, src;
  };
  std::vector<copy> copies;
  std::vector<::torch::Tensor> trainable(e_.params_.size());
  nlohmann::json client_state;
  std::uint64_t counters[4] = {};
  nlohmann::json saved_groups;
  e_.agree("load_checkpoint", "nothing was loaded", [&] {
    check_tag("engine.load_checkpoint", tag);
    e_.require_boundary("load_checkpoint");
    const fs::path meta_path = dir / "mpzero_engine.json", module_path = dir / "model_states.pt";
    const detail::engine_meta meta = detail::read_engine_meta("engine.load_checkpoint", meta_path);
    // A full load needs the same trainable parameters; a module-only load matches
    // model_states.pt by name below, so which ones train may differ.
    if (!module_only && meta.params.size() != e_.params_.size()) {
      fail("engine.load_checkpoint: " + quoted(meta_path) + " lists " + std::to_string(meta.params.size()) +
           " trainable parameters; this engine has " + std::to_string(e_.params_.size()) +
           ". Load a checkpoint of this model");
    }
    detail::saved_tp_layout layout;
    if (reshard) layout = detail::read_saved_tp_layout("engine.load_checkpoint", root / tag, saved_tp);
    if (reshard && !module_only) {
      // The whole parameters must be this model's; their slices then follow from both plans.
      const auto& whole = tp > 1 ? e_.full_shapes_ : e_.shapes_;
      for (std::size_t i = 0; i < e_.params_.size(); ++i) {
        if (layout.names[i] != e_.names_[i] || layout.shapes[i] != whole[i]) {
          fail("engine.load_checkpoint: trainable parameter " + std::to_string(i) + " is '" + layout.names[i] +
               "' of shape " + shape_of(layout.shapes[i]) + " (whole) in " + quoted(root / tag) + ", '" +
               e_.names_[i] + "' of shape " + shape_of(whole[i]) + " here. Load a checkpoint of this model");
        }
      }
      tensor_parallel_config one;
      const std::vector<tp_param_plan> now = tp > 1 ? e_.tp_plan_ : plan_tensor_parallel(one, e_.names_, e_.shapes_);
      reshard_tensor_parallel(root / tag, saved_tp, layout.plan, tp, tp_rank, now, resharded);
    }
    for (std::size_t i = 0; !module_only && !reshard && i < e_.params_.size(); ++i) {
      const auto& saved_param = meta.params[i];
      if (saved_param.name != e_.names_[i] || saved_param.shape != e_.shapes_[i]) {
        fail("engine.load_checkpoint: trainable parameter " + std::to_string(i) + " is '" + saved_param.name +
             "' of shape " + shape_of(saved_param.shape) + " in " + quoted(meta_path) + ", '" + e_.names_[i] +
             "' of shape " + shape_of(e_.shapes_[i]) + " here. Load a checkpoint of this model");
      }
    }
    counters[0] = meta.global_steps;
    counters[1] = meta.micro_steps;
    counters[2] = meta.skipped_steps;
    counters[3] = meta.scheduler_steps;
    client_state = meta.client_state;
    saved_groups = meta.param_groups;

    if (!module_only) {
      const fs::path shard = checkpoint::shard_path(core_dir, 0);
      std::ifstream in;
      if (checkpoint::read_header(in, shard).save_id != meta.save_id) {
        detail::different_saves("engine.load_checkpoint", meta_path, shard);
      }
    }
    std::unordered_map<std::string, ::torch::Tensor> saved;
    // The managed parameters come from the shard files (unless module_only): their
    // records in model_states.pt are not read.
    std::unordered_set<std::string> managed_names;
    if (!module_only) {
      for (const auto& item : e_.module_->named_parameters(/*recurse=*/true))
        if (e_.index_.count(item.value().unsafeGetTensorImpl()) > 0) managed_names.insert(item.key());
    }
    const auto wanted = [&](const std::string& name) { return managed_names.count(name) == 0; };
    for (auto& [name, t] :
         detail::read_module_states("engine.load_checkpoint", module_path, meta.save_id, meta_path, wanted)) {
      saved.emplace(std::move(name), std::move(t));
    }
    if (reshard) reshard_module_states(root / tag, saved_tp, layout, saved, wanted);
    std::unordered_set<std::string> used;
    auto take = [&](const std::string& name, const ::torch::Tensor& like) {
      auto it = saved.find(name);
      if (it == saved.end()) {
        fail("engine.load_checkpoint: " + quoted(module_path) + " has no '" + name +
             "', which this model has. Load a checkpoint of this model");
      }
      // (A ZeRO-3 partitioned parameter's tensor is empty: its shape is the engine's.)
      const auto managed = e_.index_.find(like.unsafeGetTensorImpl());
      const auto* part = e_.frozen_shards_.part_of(like);
      const at::IntArrayRef shape = managed != e_.index_.end() ? at::IntArrayRef(e_.shapes_[managed->second])
                                    : part != nullptr          ? at::IntArrayRef(part->shape)
                                                               : like.sizes();
      // (Resharded, a managed parameter's entry is a slice of another size; it is not read.)
      if (it->second.sizes() != shape && !(reshard && managed != e_.index_.end())) {
        fail("engine.load_checkpoint: '" + name + "' has shape " + shape_of(it->second.sizes()) + " in " + quoted(module_path) +
             " and " + shape_of(shape) + " here. Load a checkpoint of this model");
      }
      used.insert(name);
      return it->second;
    };
    for (const auto& item : e_.module_->named_parameters(/*recurse=*/true)) {
      const ::torch::Tensor src = take(item.key(), item.value());
      auto managed = e_.index_.find(item.value().unsafeGetTensorImpl());
      if (const auto* part = e_.frozen_shards_.part_of(item.value())) {
        // ZeRO-3: this rank's slice of it.
        const auto [begin, end] = slice_range(src.numel(), e_.comm_.size(), e_.comm_.rank());
        copies.push_back({part->slice, src.reshape({-1}).slice(0, begin, end)});
      } else if (managed == e_.index_.end()) {
        copies.push_back({item.value(), src});  // frozen
      } else if (module_only) {
        trainable[managed->second] = src;
      }
    }
    for (const auto& item : e_.module_->named_buffers(/*recurse=*/true)) copies.push_back({item.value(), take(item.key(), item.value())});
    for (const auto& [name, t] : saved) {
      if (!used.count(name)) {
        fail("engine.load_checkpoint: " + quoted(module_path) + " holds '" + name +
             "', which this model does not have. Load a checkpoint of this model");
      }
    }
  });

  e_.z3_.release_all();  // ZeRO-3: the load rewrites the partitions
  e_.core_waits();
  if (module_only) {
    for (std::size_t i = 0; i < e_.params_.size(); ++i) {
      const ::torch::Tensor v = trainable[i].to(at::kCPU, at::kFloat).contiguous();
      e_.core_->load_param(i, v.data_ptr<float>(), dtype::fp32);
    }
  } else {
    // Collective; throws on every rank, changing nothing, if any rank fails.
    const std::uint32_t stream = e_.core_->load_checkpoint(core_dir.string());
    if (e_.cfg_.stochastic_rounding() && stream != 0 && stream != rounding_stream && e_.comm_.rank() == 0) {
      std::fprintf(stderr,
                   "mpzero: engine.load_checkpoint: the checkpoint was written with stochastic-rounding stream %u; this "
                   "build draws stream %u. The loaded values are exact; the rounding bits of the steps from here on "
                   "differ from those the saving build would have drawn (docs/precision.md)\n",
                   static_cast<unsigned>(stream), static_cast<unsigned>(rounding_stream));
    }
    e_.global_steps_ = counters[0];
    e_.micro_steps_ = counters[1];
    e_.skipped_steps_ = counters[2];
    e_.scheduler_steps_ = counters[3];
    // Hyperparameters come from the config and the code, as optimizer.params.lr does;
    // groups that differ from the checkpoint's are worth a line (said once, by rank 0).
    const nlohmann::json now = e_.param_group_record();
    if (saved_groups != now && e_.comm_.rank() == 0) {
      std::fprintf(stderr,
                   "mpzero: engine.load_checkpoint: the checkpoint's parameter groups were %s; this engine's are %s "
                   "and apply from the next step\n",
                   saved_groups.is_null() ? "none" : saved_groups.dump().c_str(),
                   now.is_null() ? "none" : now.dump().c_str());
    }
  }
  e_.join_core();
  {
    ::torch::NoGradGuard ng;
    for (auto& c : copies) c.dst.copy_(c.src);
  }
  e_.stepped_ = false;
  e_.last_ = {};
  return engine_base::loaded_checkpoint{dir.string(), client_state};
}

namespace {
std::atomic<std::uint64_t> startup_window{std::uint64_t{16} << 20};
}  // namespace

std::uint64_t startup_window_elements() { return startup_window.load(); }
std::uint64_t set_startup_window_elements(std::uint64_t elements) {
  if (elements == 0) fail("set_startup_window_elements(0): the window must hold at least one element");
  return startup_window.exchange(elements);
}

std::shared_ptr<engine_state> make_engine_state(std::shared_ptr<::torch::nn::Module> module,
                                                const std::function<mpzero::torch::config(int)>& make_config,
                                                any_communicator comm, std::optional<parallel_groups> groups) {
  if (module) comm = launched(std::move(comm), *module);
  // This rank's own checks (the configuration, the model). A rank that fails one must
  // not leave the others waiting for it in the first collective until the
  // communicator's timeout: every rank reaches the agreement below, where one
  // all-reduce tells each whether any rank failed and whether all passed the same
  // model and configuration. Then the core (whose constructor agrees the same way on
  // its own layout and on memory) and the start-up broadcast.
  std::shared_ptr<engine_state> st;
  mpzero::detail::agree_on_failure_and_identity(
      comm.rank(), comm.size(),
      [&](std::int32_t* v, int n) {
        max_over_ranks(comm, std::span<std::int32_t>(v, static_cast<std::size_t>(n)),
                       engine_state::agreement_place(comm, st.get()));
      },
      "engine.initialize", "no rank made an engine, and the model is unchanged", "models or configurations", [&] {
        if (!module) fail("initialize: the model is null");
        st = std::make_shared<engine_state>(std::move(module), make_config(comm.size()), comm);
        if (groups) st->given_groups_.emplace(std::move(groups->tensor_parallel), std::move(groups->data_parallel));
        return st->prepare();
      });
  st->start();
  // The config's notices (DeepSpeed's deprecated spellings, mpzero's default optimizer):
  // said once, by rank 0.
  if (comm.rank() == 0)
    for (const std::string& n : st->cfg_.notices) std::fprintf(stderr, "mpzero: config: %s\n", n.c_str());
  return st;
}

mpzero::torch::config config_from_string(const std::string& s, int world_size) {
  return is_config_text(s) ? parse_config_text(s, world_size) : load_config_file(s, world_size);
}

void partition_module(::torch::nn::Module& m) {
  zero_init* scope = zero_init::current();
  if (scope == nullptr) return;
  ::torch::NoGradGuard no_grad;
  std::lock_guard<std::mutex> lock(built_slices_mutex);
  drop_dead_slices();
  for (const auto& item : m.named_parameters(/*recurse=*/true)) {
    const ::torch::Tensor& p = item.value();
    // Once each: a tied weight, or a submodule partitioned before its parent.
    if (!p.defined() || built_slices.count(p.unsafeGetTensorImpl()) > 0) continue;
    if (!p.is_floating_point()) continue;  // integer parameters stay whole, as initialize keeps them
    if (!p.device().is_cpu() && !p.device().is_cuda()) {
      fail("mpzero::torch::partitioned: parameter '" + item.key() + "' is on " + p.device().str() +
           "; build the model on the CPU (or a CUDA device) under zero_init");
    }
    const ::torch::Tensor whole = p.detach().reshape({-1}).to(at::kCPU, at::kFloat).contiguous();
    const auto [begin, end] = slice_range(whole.numel(), scope->world_size(), scope->rank());
    built_slice rec;
    rec.owner = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(p.getIntrusivePtr());
    rec.slice = p.detach().reshape({-1}).slice(0, begin, end).to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
    rec.shape = p.sizes().vec();
    rec.world = scope->world_size();
    rec.rank = scope->rank();
    rec.hash = whole_hash(whole.const_data_ptr<float>(), static_cast<std::size_t>(whole.numel()));
    built_slices.emplace(p.unsafeGetTensorImpl(), std::move(rec));
    scope->count(static_cast<std::uint64_t>(p.numel()), static_cast<std::uint64_t>(end - begin));
    const_cast<::torch::Tensor&>(p).set_data(::torch::empty({0}, p.options()));
  }
}

}  // namespace detail

zero_init::zero_init(int world_size, int rank) : world_(world_size), rank_(rank), outer_(current_zero_init) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    fail("zero_init: world_size " + std::to_string(world_size) + " and rank " + std::to_string(rank) +
         " are not a rank of a world; pass the communicator initialize will get (zero_init(comm))");
  }
  current_zero_init = this;
}
zero_init::~zero_init() { current_zero_init = outer_; }
zero_init* zero_init::current() noexcept { return current_zero_init; }

// ---- engine_base: forwards to the state ------------------------------------------------

engine_base::forward_scope::forward_scope(detail::engine_state& st) : st_(st) {
  if (st_.bw_.forward_depth_ == 0) st_.z3_.rethrow_deferred();
  if (st_.zero3_ && st_.bw_.forward_depth_ == 0) {
    // ZeRO-3: the partitioned parameters no gathered_forward call covers, for this
    // forward and its backward (the outputs' graph keeps the hold; see watch()).
    auto h = std::make_shared<detail::forward_hold>();
    h->st = st_.weak_from_this();
    h->generation = st_.z3_.generation_;
    const std::vector<std::size_t> outside = st_.z3_.partitioned_params(/*unclaimed_only=*/true);
    if (!outside.empty()) {
      st_.z3_.arm_outside(outside);
      h->armed = true;
    }
    st_.z3_.forward_hold_ = std::move(h);
    st_.z3_.last_module_ = nullptr;  // the units' order starts again
    st_.z3_.last_unit_.reset();
  }
  ++st_.bw_.forward_depth_;
  const auto& ac = st_.cfg_.torch_autocast;
  if (ac.enabled) {
    autocast_ = true;
    const c10::DeviceType d = st_.device_.type();
    prev_enabled_ = at::autocast::is_autocast_enabled(d);
    prev_dtype_ = at::autocast::get_autocast_dtype(d);
    at::autocast::set_autocast_enabled(d, true);
    at::autocast::set_autocast_dtype(d, scalar_type_of(ac.dtype_));
    at::autocast::increment_nesting();
  }
}

engine_base::forward_scope::~forward_scope() {
  if (autocast_) {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(st_.device_.type(), prev_enabled_);
    at::autocast::set_autocast_dtype(st_.device_.type(), prev_dtype_);
  }
  // Released here unless an output that requires grad keeps it for the backward.
  if (--st_.bw_.forward_depth_ == 0) {
    st_.z3_.forward_hold_.reset();
    if (st_.zero3_) {
      try {
        st_.z3_.drop_prefetches();  // a unit that was to follow the last one and did not
      } catch (...) {
        // A destructor must not throw: the engine's next call reports it (forward,
        // backward, step, the hooks), unless an exception is already on its way out.
        if (std::uncaught_exceptions() == 0) {
          st_.z3_.defer_error("mpzero: the end of an earlier engine forward could not release a prefetched all-gather");
        }
      }
    }
  }
}

void engine_base::watch(const ::torch::Tensor& out) {
  // A leaf (a parameter or an input returned as is) would keep the hook for good, one
  // more per forward; the parameter hooks cover it.
  if (!out.defined() || !out.requires_grad() || !out.grad_fn()) return;
  out.register_hook([w = std::weak_ptr<detail::engine_state>(st_), hold = st_->z3_.forward_hold_](const ::torch::Tensor&) {
    // ZeRO-3: engine.forward's gathered parameters live as long as this graph.
    auto s = w.lock();
    if (!s) return;
    if (hold && hold->generation != s->z3_.generation_) detail::released_since_forward("an engine.forward output");
    s->bw_.on_output();
  });
}

void engine_base::explain_forward_error(const c10::Error& e, std::span<const at::ScalarType> inputs) const {
  const at::ScalarType param = st_->param_type_;
  if (param == at::kFloat || st_->cfg_.torch_autocast.enabled) return;
  const std::string what = e.what_without_backtrace();
  if (what.find("dtype") == std::string::npos && what.find("scalar type") == std::string::npos) return;
  const auto other = std::find_if(inputs.begin(), inputs.end(), [&](at::ScalarType t) { return t != param; });
  if (other == inputs.end()) return;
  const std::string p = c10::toString(param), in = c10::toString(*other);
  throw mpzero::error("mpzero::torch: the model's forward failed: " + what + "\nThe engine's parameters are " + p +
                      " and an input is " + in + ": cast floating inputs to " + p + " before engine.forward (x.to(" +
                      p + ")), or run the forward under \"torch_autocast\" (DeepSpeed's engine does not cast them "
                      "either, except under fp16.auto_cast)");
}

::torch::Tensor engine_base::backward(const ::torch::Tensor& loss, bool retain_graph, bool scale_wrt_gas) {
  return st_->bw_.backward(loss, retain_graph, scale_wrt_gas);
}
::torch::Tensor engine_base::scale(const ::torch::Tensor& loss, bool /*retain_graph*/) { return st_->bw_.scale(loss); }
void engine_base::step() { st_->step(); }
void engine_base::zero_grad() { st_->zero_grad(); }
bool engine_base::is_gradient_accumulation_boundary() const { return st_->is_boundary(); }
void engine_base::set_gradient_accumulation_boundary(bool b) { st_->boundary_override_ = b; }
void engine_base::clear_gradient_accumulation_boundary() { st_->boundary_override_.reset(); }
std::uint64_t engine_base::global_steps() const { return st_->global_steps_; }
std::uint64_t engine_base::micro_steps() const { return st_->micro_steps_; }
std::uint64_t engine_base::skipped_steps() const { return st_->skipped_steps_; }
double engine_base::get_lr() const { return st_->next_lr(); }
double engine_base::get_lr(const std::string& group) const {
  const auto& names = st_->group_names_;
  const auto it = std::find(names.begin(), names.end(), group);
  if (it == names.end()) {
    std::string known;
    for (const std::string& n : names) known += (known.empty() ? "'" : ", '") + n + "'";
    fail("engine.get_lr(\"" + group + "\"): no parameter group of that name; the groups are " + known);
  }
  return st_->group_lr(static_cast<std::size_t>(it - names.begin()));
}
std::optional<std::pair<double, double>> engine_base::get_mom() const { return st_->next_betas(); }
double engine_base::loss_scale() const { return st_->core_->loss_scale(); }
double engine_base::global_grad_norm() const {
  return st_->stepped_ ? st_->last_.grad_norm : std::numeric_limits<double>::quiet_NaN();
}
const step_report& engine_base::last_step_report() const { return st_->last_; }
std::uint64_t engine_base::gradient_accumulation_steps() const { return st_->cfg_.gradient_accumulation_steps; }
const mpzero::torch::config& engine_base::config() const { return st_->cfg_; }
int engine_base::rank() const { return st_->comm_.rank(); }
int engine_base::world_size() const { return st_->comm_.size(); }
int engine_base::tensor_parallel_rank() const { return st_->tp_comm_ ? st_->tp_comm_->rank() : 0; }
int engine_base::tensor_parallel_size() const { return st_->tp_comm_ ? st_->tp_comm_->size() : 1; }
void engine_base::save_checkpoint(const std::string& save_dir, const std::string& tag, const nlohmann::json& client_state,
                                  bool save_latest) {
  st_->checkpoints_.save(save_dir, tag, client_state, save_latest);
}
std::optional<engine_base::loaded_checkpoint> engine_base::load_checkpoint(const std::string& load_dir,
                                                                           const std::string& tag,
                                                                           bool load_module_only) {
  return st_->checkpoints_.load(load_dir, tag, load_module_only);
}
std::size_t engine_base::save_16bit_model(const std::string& save_dir, const std::string& save_filename) {
  return st_->checkpoints_.save_16bit(save_dir, save_filename);
}

namespace {

// All-reduces a CPU tensor's values in place over `c` (a sum).
void all_reduce_sum(any_communicator& c, ::torch::Tensor& t) {
  if (c.size() == 1) return;
  const wire_dtype w = t.scalar_type() == at::kBFloat16 ? wire_dtype::bf16
                       : t.scalar_type() == at::kHalf   ? wire_dtype::fp16
                                                        : wire_dtype::f32;
  if (w == wire_dtype::f32 && t.scalar_type() != at::kFloat) fail("tp_forward: tensors of dtype " + std::string(c10::toString(t.scalar_type())) + " cannot be reduced; use float, bfloat16 or half");
  c.base().iall_reduce(t.data_ptr(), t.data_ptr(), static_cast<std::uint64_t>(t.numel()), w, comm::reduce_op::sum)->wait();
}

any_communicator& comm_at(std::int64_t address) { return *reinterpret_cast<any_communicator*>(address); }

// Megatron's f: the input of a column-parallel layer, whole on every tensor-parallel
// rank; its gradient (each rank's part) is summed over the group.
struct tp_copy_in : ag::Function<tp_copy_in> {
  static ::torch::Tensor forward(ag::AutogradContext* ctx, const ::torch::Tensor& x, std::int64_t comm) {
    ctx->saved_data["comm"] = comm;
    return x;  // autograd makes the output a view of x, so no copy is made
  }
  static ag::variable_list backward(ag::AutogradContext* ctx, ag::variable_list grads) {
    ::torch::Tensor g = grads[0].contiguous().clone();
    all_reduce_sum(comm_at(ctx->saved_data["comm"].toInt()), g);
    return {g, ::torch::Tensor()};
  }
};

// Megatron's g: a row-parallel layer's partial outputs, summed over the group; the
// gradient goes to every rank whole.
struct tp_reduce_out : ag::Function<tp_reduce_out> {
  static ::torch::Tensor forward(ag::AutogradContext*, const ::torch::Tensor& x, std::int64_t comm) {
    ::torch::Tensor y = x.contiguous().clone();
    all_reduce_sum(comm_at(comm), y);
    return y;
  }
  static ag::variable_list backward(ag::AutogradContext*, ag::variable_list grads) { return {grads[0], ::torch::Tensor()}; }
};

}  // namespace

::torch::Tensor tp_forward(::torch::nn::Linear& linear, const ::torch::Tensor& x) {
  const ::torch::Tensor& w = linear->weight;
  const auto st = w.requires_grad() ? detail::managing_engine(w) : frozen_owner(w);
  if (!st || !st->tp_comm_) return linear->forward(x);
  const tp_param_plan* split = st->tp_split_of(w);
  if (split == nullptr) return linear->forward(x);
  const tp_param_plan& p = *split;
  const auto comm = reinterpret_cast<std::int64_t>(&*st->tp_comm_);
  switch (p.type) {
    case tp_partition::column:
      return ::torch::nn::functional::linear(tp_copy_in::apply(x, comm), w, linear->bias);
    case tp_partition::row: {
      ::torch::Tensor y = tp_reduce_out::apply(::torch::nn::functional::linear(x, w), comm);
      return linear->bias.defined() ? y + linear->bias : y;  // the bias once, after the sum
    }
    case tp_partition::skip:
      break;
  }
  return linear->forward(x);
}
const std::vector<::torch::Tensor>& engine_base::parameters() const { return st_->params_; }
const std::vector<std::string>& engine_base::parameter_names() const { return st_->names_; }
::torch::Tensor engine_base::full_grad(const ::torch::Tensor& param) { return st_->full_grad(st_->index_of(param, "full_grad")); }
std::vector<::torch::Tensor> engine_base::full_grads() {
  std::vector<::torch::Tensor> out;
  for (std::size_t i = 0; i < st_->params_.size(); ++i) out.push_back(st_->full_grad(i));
  return out;
}
std::vector<::torch::Tensor> engine_base::master_weights() {
  auto all = st_->core_->full_master();
  std::vector<::torch::Tensor> out;
  for (std::size_t i = 0; i < all.size(); ++i) {
    out.push_back(
        ::torch::tensor(at::ArrayRef<float>(all[i]), ::torch::kFloat).reshape(st_->shapes_[i]).to(st_->device_));
  }
  return out;
}
dtype engine_base::comm_dtype(const ::torch::Tensor& param) const { return st_->comm_dtypes_[st_->index_of(param, "comm_dtype")]; }
std::uint64_t engine_base::epilogues() const { return st_->bw_.epilogues_; }
std::uint64_t engine_base::bookkeeping_lookups() const { return st_->bw_.lookups_; }
memory_report engine_base::memory() const { return st_->core_->memory(); }
std::vector<std::int64_t> engine_base::parameter_shape(const ::torch::Tensor& param) const {
  return st_->shapes_[st_->index_of(param, "parameter_shape")];
}
std::uint64_t engine_base::gathered_numel() const {
  std::uint64_t n = 0;
  for (std::size_t i = 0; i < st_->params_.size(); ++i)
    if (st_->z3_.holds_[i] > 0 && st_->core_->partitioned(i)) n += static_cast<std::uint64_t>(st_->params_[i].numel());
  for (std::size_t f = 0; f < st_->frozen_shards_.parts_.size(); ++f)
    if (st_->z3_.holds_[st_->params_.size() + f] > 0) n += static_cast<std::uint64_t>(st_->frozen_shards_.parts_[f].param.numel());
  return n;
}
std::uint64_t engine_base::prefetched_gathers() const { return st_->z3_.prefetch_hits_; }
std::string engine_base::describe() const { return st_->core_->spec().describe(); }

}  // namespace mpzero::torch

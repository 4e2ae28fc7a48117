// mpzero::torch: the training engine for LibTorch models, with PyTorch-style backward.
//
//   auto engine = mpzero::torch::initialize(model, "ds_config.json");  // or JSON text, json, config
//   auto loss = loss_fn(engine.forward(x), y);
//   loss.backward();   // plain autograd: ZeRO runs in hooks
//   engine.step();
//
// What the engine does (src/engine.cpp has the details):
// - Parameters: the model's trainable parameters are converted to the configured
//   parameter dtype and re-pointed at views of the ZeRO optimizer's flat parameter
//   buffer, so forward reads them and step() updates them in place. Rank 0's values are
//   broadcast at initialisation, through a bounded host window
//   (detail::startup_window_elements). Frozen parameters and floating buffers are
//   converted to the parameter dtype too (as DeepSpeed's module.bfloat16() does) but
//   not managed (at ZeRO-3 the frozen ones above the persistence threshold are kept in
//   slices and gathered with their unit, like managed ones). A model may be built
//   partitioned (zero_init, below): then no rank holds it whole.
// - Gradients: a post-accumulate-grad hook per trainable parameter hands the gradient to
//   the ZeRO core (bucketed reduce-scatter at stage 2), scaled by 1/GAS, and releases
//   param.grad(). Dividing at the parameter (not at the model's outputs) divides once,
//   whatever the path: a gradient that flows from one engine's output into another
//   engine is not divided twice.
// - End of backward: the first hook of a backward queues an autograd final callback that
//   runs the epilogue (flushes the buckets). State is kept per autograd graph task, so a
//   second backward through a retained graph, or two losses of one forward, each get
//   their own epilogue and their gradients add up; a backward nested inside another
//   backward (reentrant checkpointing) or started inside forward runs no epilogue of its
//   own. Bookkeeping is O(1) per hook.
// - fp16 (weights, or torch_autocast in fp16): a backward must be scaled, by
//   engine.backward(loss) or engine.scale(loss); an unscaled one throws "Loss scaling is
//   required" from its first hook, on every rank, before any collective (no hang), for
//   dynamic and static loss scales.
//
// Threads: one backward at a time per engine. CPU parameters: the hooks run on the
// thread that called backward, which must own the communicator (MPI: the main thread).
// CUDA parameters: the hooks (and sometimes the end-of-backward callback) run on
// autograd's worker thread for the device, so the communicator must accept calls from
// it: mpzero's NCCL communicator and c10d groups do (a host communicator such as MPI is
// refused with CUDA parameters anyway).
//
// Devices: the trainable parameters are all on the CPU (host backend) or all on one CUDA
// device (cuda_backend, when the adapter is built with MPZERO_TORCH_CUDA). On CUDA the
// core runs on torch's current stream of the device as it was at initialize; backward
// or step() under another stream is ordered with it by events (docs/torch.md, "CUDA
// parameters"). The communicator must then read device memory (NCCL).
//
// Nested backward detection reads the current autograd GraphTask's reentrant depth
// through LibTorch's exported get_current_graph_task_exec_info() (LibTorch has no
// accessor for the depth itself), verified against get_current_graph_task_id(). If a
// LibTorch build ever lays GraphTask out differently, the check fails and the engine
// falls back to "a backward that starts while one of this engine's is still open is
// nested": then only a forward that bypasses the engine *and* whose first gradient of
// this engine comes from a nested backward gets an early epilogue (still correct
// gradients, one extra bucket flush).
//
// CPU offload (zero_optimization.offload_optimizer.device = "cpu", stages 1-2): master
// weights, optimizer states and the gradient partition live in host memory and the step
// runs there; with CPU parameters this mostly moves the accounting, on a GPU it is
// ZeRO-Offload.
//
// Gradient reduction dtypes: with torch_autocast enabled, the parameters of the
// lower_precision_safe_modules (matched by exact class, as DeepSpeed) are reduced in the
// autocast dtype, the others in communication_data_type, else in their own dtype; the
// core takes them as zero_options::wire_dtypes (comm_dtype(param) reports each). At
// ZeRO-3 an fp32 model's lower_precision_safe_modules parameters are also gathered in
// the autocast dtype (zero_options::gather_dtypes), as DeepSpeed gathers them; saves
// gather in the model's dtype.
//
// ZeRO-3 (zero_optimization.stage = 3): parameters above
// stage3_param_persistence_threshold exist only as shards; between steps their tensors
// are empty (shape [0]; engine.parameter_shape(p) has the real one). For its forward and
// backward, engine.forward has every such parameter that no gathered_forward() call
// covered in an earlier forward (on the first forward: all of them) gathered when an
// operation reads it, at most stage3_max_live_parameters elements at once (the oldest
// released first). gathered_forward(submodule, args...) inside the model's forward gathers a
// submodule's parameters around its forward only, and again around its backward, which
// is where ZeRO-3 saves memory: wrap each transformer block. LibTorch C++ has no module
// hooks, hence the call. The next unit's all-gather is prefetched (the order is learned
// from the previous forward; stage3_prefetch_bucket_size bounds it, 0 turns it off).
// docs/torch.md, "ZeRO-3", has the rules.
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <mpzero/torch/communicator.hpp>
#include <mpzero/torch/launch.hpp>
#include <mpzero/torch/config.hpp>
#include <mpzero/numeric/dtype.hpp>
#include <mpzero/zero/options.hpp>

namespace mpzero::torch {

namespace detail {
class engine_state;

// f(t) for each tensor t in `out`: a tensor, or tuples and ranges of them, nested. Other
// types hold none we can see.
template <class T, class F>
void for_each_tensor(const T& out, F&& f) {
  if constexpr (std::is_convertible_v<const T&, const ::torch::Tensor&>) {
    f(out);
  } else if constexpr (requires { std::tuple_size<T>::value; }) {
    std::apply([&](const auto&... e) { (for_each_tensor(e, f), ...); }, out);
  } else if constexpr (requires { out.begin(); out.end(); }) {
    for (const auto& e : out) for_each_tensor(e, f);
  }
}
}  // namespace detail

// Engine state shared by every engine<Model>; the template only adds the model's forward.
class engine_base {
 public:
  // ---- DeepSpeed's training API ---------------------------------------------------
  // Runs backward on a one-element loss: applies the loss scale, then the epilogue
  // itself. Returns loss / gradient_accumulation_steps (loss if !scale_wrt_gas), detached.
  // A non-scalar output with gradient grad: backward((out * grad).sum()), the same
  // gradients as out.backward(grad), with the fp16 loss scale.
  ::torch::Tensor backward(const ::torch::Tensor& loss, bool retain_graph = false, bool scale_wrt_gas = true);
  // loss times the current loss scale (fp16 weights, or torch_autocast in fp16), marked
  // as scaled (for loss.backward()). Without loss scaling it returns loss. One-element
  // tensors only. Engines sharing a loss
  // each scale their own term: (e1.scale(l1) + e2.scale(l2)).backward().
  // retain_graph is DeepSpeed's parameter and changes nothing here: a later backward over
  // the retained graph finds the parameters (ZeRO-3 gathers them again), so pass it to the
  // backward itself: engine.scale(loss, true).backward({}, true).
  ::torch::Tensor scale(const ::torch::Tensor& loss, bool retain_graph = false);
  // Counts a micro-step; at the gradient accumulation boundary also updates the
  // parameters (and the learning rate from the scheduler). Collective at the boundary.
  void step();
  // Drops the gradients accumulated so far.
  void zero_grad();
  // (micro_steps + 1) % gradient_accumulation_steps == 0, unless overridden; always with
  // managed_gradient_accumulation false (every step() is a boundary).
  bool is_gradient_accumulation_boundary() const;
  // Overrides the boundary until the next call (or clear_...): e.g. several backward
  // calls per optimizer step with gradient_accumulation_steps = 1.
  void set_gradient_accumulation_boundary(bool is_boundary);
  void clear_gradient_accumulation_boundary();

  std::uint64_t global_steps() const;  // optimizer steps taken (skipped overflow steps included, as in DeepSpeed)
  std::uint64_t micro_steps() const;
  std::uint64_t skipped_steps() const;
  double get_lr() const;      // the learning rate the next step will use (the "default" group's)
  // The learning rate parameter group `group` (a config::param_groups name, or "default"
  // for the parameters no group takes) will use in the next step.
  double get_lr(const std::string& group) const;
  // The (beta1, beta2) the next step will use (OneCycle cycles them); nullopt for SGD.
  std::optional<std::pair<double, double>> get_mom() const;
  double loss_scale() const;  // the loss scale (1 without loss scaling)
  // The global gradient norm of the last step (unscaled, before clipping); NaN before the first.
  double global_grad_norm() const;
  const step_report& last_step_report() const;
  std::uint64_t gradient_accumulation_steps() const;
  const mpzero::torch::config& config() const;
  // The data-parallel rank and size (with tensor_parallel, within this rank's
  // data-parallel group), and the tensor-parallel ones (0 and 1 without it).
  int rank() const;
  int world_size() const;
  int tensor_parallel_rank() const;
  int tensor_parallel_size() const;

  // ---- checkpoints: DeepSpeed's save_checkpoint / load_checkpoint -------------------
  // save_checkpoint writes <save_dir>/<tag>/ (tag "global_step<N>" by default): the ZeRO
  // shards of every rank (zero_shard_<rank>.mpz: parameters, master weights, optimizer
  // states, step count, loss scaler), mpzero_engine.json (counters, parameter names and
  // shapes, client_state) and model_states.pt (the module's parameters and buffers,
  // {"module": {name: tensor}}, readable by torch::pickle_load and Python's
  // torch.load(path, weights_only=True));
  // then, with save_latest, <save_dir>/latest names the tag. Call it at an accumulation
  // boundary (after the step() that updates): gradients are not saved. Every rank calls
  // it with the same arguments; save_dir must be a directory every rank can reach.
  void save_checkpoint(const std::string& save_dir, const std::string& tag = "",
                       const nlohmann::json& client_state = nlohmann::json::object(), bool save_latest = true);
  struct loaded_checkpoint {
    std::string path;            // <load_dir>/<tag>
    nlohmann::json client_state;  // as saved
  };
  // Restores a checkpoint of the same model (parameter names and shapes) at any world
  // size, ZeRO stage or precision configuration. An empty tag reads <load_dir>/latest;
  // without that file, nothing is loaded and the result is empty (DeepSpeed returns
  // None). load_module_only: only the module's values, by name (which parameters are
  // trainable may differ); the master weights start from the loaded parameters, and the
  // optimizer states and counters are left as they are (fresh in a new engine), as in
  // DeepSpeed. Collective, with the same arguments on every rank; a failure throws on
  // every rank and changes nothing.
  std::optional<loaded_checkpoint> load_checkpoint(const std::string& load_dir, const std::string& tag = "",
                                                   bool load_module_only = false);
  // DeepSpeed's save_16bit_model: the module's state dict (parameters in the dtype the
  // model trains in: 16-bit with bf16 or fp16, fp32 for fp32 models; then its buffers) as
  // one file, <save_dir>/<save_filename>, written by rank 0: in the safetensors format
  // when the name ends in ".safetensors", else in torch.save's (torch::pickle_load in C++,
  // torch.load(path, weights_only=True) in Python). Any stage; at ZeRO-3 it needs
  // zero_optimization.stage3_gather_16bit_weights_on_model_save = true, and gathers one
  // parameter at a time while rank 0 writes it, so no rank holds the whole model (nor
  // does rank 0 on the host: tensors are written as they come). Collective, with the same
  // save_filename on every rank. Returns the number of tensors written.
  std::size_t save_16bit_model(const std::string& save_dir, const std::string& save_filename = "pytorch_model.bin");

  // ---- inspection ------------------------------------------------------------------
  // The managed (trainable) parameters, in the core's order, and their names.
  const std::vector<::torch::Tensor>& parameters() const;
  const std::vector<std::string>& parameter_names() const;
  // A parameter's gradient as the step will use it: reduced, averaged over ranks,
  // unscaled, before clipping, fp32, shaped like the parameter, on its device. Collective; call it at
  // the accumulation boundary before step() (no backward may follow until step() or
  // zero_grad()). DeepSpeed's safe_get_full_grad.
  ::torch::Tensor full_grad(const ::torch::Tensor& param);
  std::vector<::torch::Tensor> full_grads();
  // Every managed parameter's master weights, fp32, whole, on every rank, on the
  // parameters' device. Collective.
  std::vector<::torch::Tensor> master_weights();
  // The dtype a managed parameter's gradient is reduced in (DeepSpeed's get_comm_dtype):
  // torch_autocast.dtype for the parameters of lower_precision_safe_modules when autocast
  // is enabled, else communication_data_type, else the gradient dtype.
  dtype comm_dtype(const ::torch::Tensor& param) const;
  // How many backward epilogues have run (diagnostics and tests).
  std::uint64_t epilogues() const;
  // How often a hook looked its backward up past the one-entry cache of the last graph
  // task (diagnostics and tests): once per graph task, whatever the number of parameters.
  std::uint64_t bookkeeping_lookups() const;
  memory_report memory() const;
  // ZeRO-3: a managed parameter's shape (its tensor is empty while partitioned), and
  // how many elements of partitioned parameters are gathered on this rank now.
  std::vector<std::int64_t> parameter_shape(const ::torch::Tensor& param) const;
  std::uint64_t gathered_numel() const;
  // ZeRO-3: how many all-gathers (one per unit, or per run of its parameters that
  // other partitioned parameters interrupt) were already under way, started by a
  // prefetch, when their unit needed them.
  std::uint64_t prefetched_gathers() const;
  // The compiled instantiation, e.g. "param bf16, master fp32, ..., ZeRO stage 2".
  std::string describe() const;

 protected:
  engine_base() = default;
  explicit engine_base(std::shared_ptr<detail::engine_state> st) : st_(std::move(st)) {}

  // RAII: the engine is in forward (autocast on if configured; a backward started
  // meanwhile is internal and runs no epilogue).
  class forward_scope {
   public:
    explicit forward_scope(detail::engine_state& st);
    ~forward_scope();
    forward_scope(const forward_scope&) = delete;
    forward_scope& operator=(const forward_scope&) = delete;

   private:
    detail::engine_state& st_;
    bool autocast_ = false, prev_enabled_ = false;
    at::ScalarType prev_dtype_ = at::kFloat;
  };

  // Registers the end-of-backward prologue hook on an output.
  void watch(const ::torch::Tensor& out);
  // A forward's c10::Error that a floating input of another dtype than the engine's
  // 16-bit parameters explains: thrown again as mpzero::error that says what to cast.
  void explain_forward_error(const c10::Error& e, std::span<const at::ScalarType> inputs) const;
  template <class T>
  void watch_any(const T& out) {
    // Outputs with no tensors we can see: parameter hooks still find the backward.
    detail::for_each_tensor(out, [&](const ::torch::Tensor& t) { watch(t); });
  }

  std::shared_ptr<detail::engine_state> st_;

  friend class detail::engine_state;
  template <class M>
  friend class engine;
};

// The engine for a model: a ModuleHolder (torch::nn::Linear, a TORCH_MODULE) or a
// std::shared_ptr to a torch::nn::Module subclass.
template <class Model>
class engine : public engine_base {
 public:
  engine(Model model, std::shared_ptr<detail::engine_state> st) : engine_base(std::move(st)), model_(std::move(model)) {}

  // model->forward(args...), under the engine (autocast, output hooks). A forward that
  // LibTorch stops on a dtype mismatch, with floating inputs of another dtype than 16-bit
  // parameters, is explained (DeepSpeed's engine does not cast inputs either).
  template <class... Args>
  auto forward(Args&&... args) {
    forward_scope scope(*st_);
    // The first floating inputs' dtypes, read before the arguments are handed on (and
    // possibly moved); a fixed array, so that a forward allocates nothing for it.
    std::array<at::ScalarType, 8> inputs{};
    std::size_t n_inputs = 0;
    (detail::for_each_tensor(args,
                             [&](const ::torch::Tensor& t) {
                               if (n_inputs < inputs.size() && t.defined() && t.is_floating_point()) {
                                 inputs[n_inputs++] = t.scalar_type();
                               }
                             }),
     ...);
    try {
      auto out = model_->forward(std::forward<Args>(args)...);
      watch_any(out);
      return out;
    } catch (const c10::Error& e) {
      explain_forward_error(e, std::span<const at::ScalarType>(inputs.data(), n_inputs));  // throws, or returns
      throw;
    }
  }
  template <class... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  Model& module() noexcept { return model_; }
  const Model& module() const noexcept { return model_; }

 private:
  Model model_;
};

namespace detail {

// ZeRO-3 gathered calls (gathered_forward): one per call of a submodule whose
// partitioned parameters an engine manages.
class unit_call;
// The call's state, or nullptr when no live ZeRO-3 engine manages a partitioned
// parameter of `m` (then gathered_forward is a plain call). Gathers them (collective).
std::shared_ptr<unit_call> begin_unit(const ::torch::nn::Module& m);
// An input that requires grad becomes a view whose gradient, once complete, releases
// the parameters gathered for the call's backward.
::torch::Tensor unit_input(const std::shared_ptr<unit_call>& c, const ::torch::Tensor& x);
// An output that requires grad gathers the parameters again when its gradient arrives.
void unit_output(const std::shared_ptr<unit_call>& c, const ::torch::Tensor& y);
// Releases what begin_unit gathered (the forward's copy).
void end_unit(unit_call& c) noexcept;

struct unit_guard {
  std::shared_ptr<unit_call> call;
  ~unit_guard() {
    if (call) end_unit(*call);
  }
};
template <class A>
decltype(auto) unit_arg(const std::shared_ptr<unit_call>& c, A&& a) {
  if constexpr (std::is_same_v<std::remove_cvref_t<A>, ::torch::Tensor>) {
    return unit_input(c, a);
  } else {
    return std::forward<A>(a);
  }
}
// Outputs with no tensors we can see gather nothing for backward; the backward then finds
// the parameters only if engine.forward still holds them (see gathered_forward).
template <class T>
void unit_outputs(const std::shared_ptr<unit_call>& c, const T& out) {
  for_each_tensor(out, [&](const ::torch::Tensor& t) { unit_output(c, t); });
}

// The start-up broadcast's host window, in fp32 elements: initialize moves rank 0's
// values through at most this many (or the largest tensor's count, which loads whole).
// Default 16 Mi elements (64 MiB). The setter (for tests) returns the previous value.
std::uint64_t startup_window_elements();
std::uint64_t set_startup_window_elements(std::uint64_t elements);

// Collective: `comm` is resolved first (launched(), below), then make_config(world size)
// runs inside, so that a rank whose configuration fails to parse (a file missing on one
// node, say) is refused on every rank like one whose model fails a check, rather than
// leaving the others waiting in the first collective.
std::shared_ptr<engine_state> make_engine_state(std::shared_ptr<::torch::nn::Module> module,
                                                const std::function<mpzero::torch::config(int)>& make_config,
                                                any_communicator comm, std::optional<parallel_groups> groups = {});

template <class Model>
std::shared_ptr<::torch::nn::Module> module_ptr(const Model& m) {
  if constexpr (requires { m.ptr(); }) {
    return m.ptr();
  } else {
    static_assert(std::is_convertible_v<Model, std::shared_ptr<::torch::nn::Module>>,
                  "mpzero::torch::initialize: pass a torch::nn::ModuleHolder (e.g. torch::nn::Linear, a "
                  "TORCH_MODULE) or a std::shared_ptr to a torch::nn::Module subclass");
    return m;
  }
}

// Partitioned construction (zero_init): keeps this rank's slice of each parameter of
// `m` not kept yet and empties the tensor.
void partition_module(::torch::nn::Module& m);

// A JSON string ('{' first) or a path.
mpzero::torch::config config_from_string(const std::string& path_or_json, int world_size);

// `comm`, or when it is the default (none given), the launcher's world for the device of
// `m`'s parameters (communicator_from_environment); rank 0 says which it joined.
any_communicator launched(any_communicator comm, const ::torch::nn::Module& m);

}  // namespace detail

// ---- ZeRO-3: gathered submodules --------------------------------------------------
// module->forward(args...) with the partitioned (ZeRO-3) parameters of `module` gathered
// only while its forward runs and again while its backward runs; `module` is a
// ModuleHolder or a std::shared_ptr to a Module, as for initialize. Call it inside the
// model's forward for each large submodule (a transformer block):
//
//   for (auto& block : blocks) x = mpzero::torch::gathered_forward(block, x);
//
// Without a ZeRO-3 engine managing the submodule's parameters (another stage, no engine,
// frozen parameters) it is exactly module->forward(args...), so a model written with it
// trains at any stage. Tensor arguments that require grad are passed on as views of
// themselves: the backward releases the parameters once their gradients are complete.
// Collective at stage 3: every rank must make the same calls in the same order, forward
// and backward (the gathers are all-gathers). A parameter gathered_forward covered must
// be used only inside such a call: engine.forward leaves it partitioned from the next
// forward on (docs/torch.md, "ZeRO-3").
template <class M, class... Args>
auto gathered_forward(M&& module, Args&&... args) {
  detail::unit_guard guard{detail::begin_unit(*detail::module_ptr(module))};
  if (!guard.call) return module->forward(std::forward<Args>(args)...);
  auto out = module->forward(detail::unit_arg(guard.call, std::forward<Args>(args))...);
  detail::unit_outputs(guard.call, out);
  return out;
}

// ---- AutoTP --------------------------------------------------------------------------
// DeepSpeed's AutoTP training (the config's "tensor_parallel"): initialize splits each
// parameter (trainable or frozen) that a layer spec names across the tensor-parallel
// group of its rank (autotp_size consecutive ranks, or the groups given as
// parallel_groups; ZeRO stages 0-2 run over the data-parallel groups across them); the
// model computes each split Linear through tp_forward:
//
//   x = x + mpzero::torch::tp_forward(attn_out, heads);   // row-parallel: its input is split
//
// A column-parallel layer takes its whole input and gives this rank's slice of the output
// features (its input's gradient summed over the group); a row-parallel one takes the
// slice and gives the whole output, summed over the group, its bias added once. A Linear
// no spec splits, or outside an AutoTP engine, runs its own forward. Sizes that depend on
// the split (a rank's attention heads) follow from the weight's shape. CPU parameters.
::torch::Tensor tp_forward(::torch::nn::Linear& linear, const ::torch::Tensor& x);

// ---- initialize ---------------------------------------------------------------------
// `comm` decides the world. Not given (any_communicator{}): the world mpirun started,
// joined through MPI (launch.hpp; a launched world it cannot join is refused), or one
// process without a launcher; any_communicator::local() is one process regardless.
// Wrap an MPI or other comm::communicator with any_communicator::wrap(c); a c10d
// ProcessGroup with process_group_communicator (process_group.hpp). Collective over comm.
//
// A rank that fails its own checks (its configuration or its model) throws why, and
// every other rank throws mpzero::error naming that rank; ranks that pass different
// models or configurations all throw. No rank is left waiting, and no model changes.
template <class Model>
engine<Model> initialize(Model model, mpzero::torch::config cfg, any_communicator comm = {}) {
  auto st = detail::make_engine_state(
      detail::module_ptr(model), [&](int) -> mpzero::torch::config { return std::move(cfg); }, std::move(comm));
  return engine<Model>(std::move(model), std::move(st));
}
// ---- partitioned construction: DeepSpeed's zero.Init ---------------------------------
// A model whose parameters do not fit one rank whole is built under a zero_init scope,
// with each large submodule (a transformer block, the embedding) passed through
// partitioned() as it is made:
//
//   mpzero::torch::zero_init init(comm);           // this thread, until it ends
//   GPT model(cfg);   // its constructor: blocks->push_back(mpzero::torch::partitioned(Block(cfg)));
//   auto engine = mpzero::torch::initialize(model, config, comm);   // ZeRO-3
//
// partitioned(m) keeps this rank's slice of each of m's parameters (1/world of its
// elements, in the parameter's dtype, on the CPU) and empties the tensor (shape [0]), so
// a rank holds its slices plus the one submodule being built, never the whole model.
// Without a scope it returns m unchanged: the same model code builds whole. initialize
// rebuilds each parameter from the ranks' slices, one at a time, into the ZeRO core (and
// keeps only this rank's partition at stage 3); the values are those every rank built,
// so training is bit for bit that of the model built whole with the same seed. Every
// rank must build the same values (torch::manual_seed alike before building, as DeepSpeed
// assumes too): initialize compares a hash of each parameter as built and refuses, naming
// it, where the ranks differ. Parameters partitioned here count as gathered_forward units
// from the first forward: run each such submodule through gathered_forward. At stage 3,
// frozen parameters are partitioned by initialize too (zero_init or not) and gathered
// around their unit's forward, never given gradients or optimizer state.
class zero_init {
 public:
  // The world size and rank of the communicator initialize will get.
  zero_init(int world_size, int rank);
  // Those of `comm`: any communicator initialize takes (any_communicator, MPI, NCCL, a c10d group's).
  template <class Comm>
    requires requires(const Comm& c) {
      { c.size() } -> std::convertible_to<int>;
      { c.rank() } -> std::convertible_to<int>;
    }
  explicit zero_init(const Comm& comm) : zero_init(comm.size(), comm.rank()) {}
  ~zero_init();
  zero_init(const zero_init&) = delete;
  zero_init& operator=(const zero_init&) = delete;

  int world_size() const noexcept { return world_; }
  int rank() const noexcept { return rank_; }
  // Elements of the parameters partitioned under this scope, whole, and this rank's part.
  std::uint64_t partitioned_elements() const noexcept { return whole_; }
  std::uint64_t kept_elements() const noexcept { return kept_; }

  // The scope active on this thread, or nullptr.
  static zero_init* current() noexcept;
  // (partition_module's bookkeeping)
  void count(std::uint64_t whole, std::uint64_t kept) noexcept {
    whole_ += whole;
    kept_ += kept;
  }

 private:
  int world_, rank_;
  std::uint64_t whole_ = 0, kept_ = 0;
  zero_init* outer_;
};

// Under a zero_init scope on this thread: partitions `module`'s parameters (see
// zero_init) and returns it; without one, returns it unchanged.
template <class M>
M partitioned(M module) {
  if (zero_init::current() != nullptr) detail::partition_module(*detail::module_ptr(module));
  return module;
}

template <class Model>
engine<Model> initialize(Model model, const nlohmann::json& cfg, any_communicator comm = {}) {
  auto st = detail::make_engine_state(
      detail::module_ptr(model), [&](int world) { return parse_config(cfg, world); }, std::move(comm));
  return engine<Model>(std::move(model), std::move(st));
}
// A path to a JSON file, or JSON text (anything whose first non-blank character is '{').
template <class Model>
engine<Model> initialize(Model model, const std::string& path_or_json, any_communicator comm = {}) {
  auto st = detail::make_engine_state(
      detail::module_ptr(model), [&](int world) { return detail::config_from_string(path_or_json, world); }, std::move(comm));
  return engine<Model>(std::move(model), std::move(st));
}
template <class Model>
engine<Model> initialize(Model model, const char* path_or_json, any_communicator comm = {}) {
  return initialize(std::move(model), std::string(path_or_json), std::move(comm));
}
// DeepSpeed's client optimizer: the optimizer given in code, for a config (JSON, JSON
// text or a file) without an "optimizer" section; one in both is refused. It is read by
// the section's rules, with the defaults it implies (WarmupLR's peak is its lr):
//
//   mpzero::torch::optimizer_config adamw{.type = mpzero::torch::optimizer_type::adamw, .lr = 3e-4,
//                                          .weight_decay = 0.1};
//   auto engine = mpzero::torch::initialize(model, "ds_config.json", adamw, comm);
template <class Model>
engine<Model> initialize(Model model, const nlohmann::json& cfg, const optimizer_config& optimizer,
                         any_communicator comm = {}) {
  auto st = detail::make_engine_state(
      detail::module_ptr(model), [&](int world) { return parse_config_with_optimizer(cfg, optimizer, world); }, std::move(comm));
  return engine<Model>(std::move(model), std::move(st));
}
template <class Model>
engine<Model> initialize(Model model, const std::string& path_or_json, const optimizer_config& optimizer,
                         any_communicator comm = {}) {
  auto st = detail::make_engine_state(
      detail::module_ptr(model),
      [&](int world) { return parse_config_with_optimizer(read_config_json(path_or_json), optimizer, world); }, std::move(comm));
  return engine<Model>(std::move(model), std::move(st));
}
template <class Model>
engine<Model> initialize(Model model, const char* path_or_json, const optimizer_config& optimizer,
                         any_communicator comm = {}) {
  return initialize(std::move(model), std::string(path_or_json), optimizer, std::move(comm));
}
// AutoTP over groups the program made (parallel_groups, launch.hpp; DeepSpeed's mpu)
// instead of the consecutive-rank groups the engine splits from MPI's world:
//
//   MPI_Comm tp, dp;                                   // or two c10d ProcessGroups
//   MPI_Comm_split(MPI_COMM_WORLD, rank % 2, rank / 2, &tp);   // tensor-parallel: ranks {0, 2}, {1, 3}
//   MPI_Comm_split(MPI_COMM_WORLD, rank / 2, rank % 2, &dp);   // data-parallel: {0, 1}, {2, 3}
//   using mpzero::comm::mpi_communicator;             // (it duplicates the MPI_Comm it is given)
//   auto engine = mpzero::torch::initialize(model, config, mpzero::torch::parallel_groups{
//       {}, any_communicator::own(mpi_communicator(tp), "tp"), any_communicator::own(mpi_communicator(dp), "dp")});
//
// Rank 0 of the world gives every rank its starting values. Collective over the world.
template <class Model>
engine<Model> initialize(Model model, const nlohmann::json& cfg, parallel_groups groups) {
  any_communicator world = groups.world;
  auto st = detail::make_engine_state(
      detail::module_ptr(model), [&](int w) { return parse_config(cfg, w); }, std::move(world), std::move(groups));
  return engine<Model>(std::move(model), std::move(st));
}
template <class Model>
engine<Model> initialize(Model model, mpzero::torch::config cfg, parallel_groups groups) {
  any_communicator world = groups.world;
  auto st = detail::make_engine_state(
      detail::module_ptr(model), [&](int) -> mpzero::torch::config { return std::move(cfg); }, std::move(world),
      std::move(groups));
  return engine<Model>(std::move(model), std::move(st));
}
template <class Model>
engine<Model> initialize(Model model, const std::string& path_or_json, parallel_groups groups) {
  any_communicator world = groups.world;
  auto st = detail::make_engine_state(
      detail::module_ptr(model), [&](int w) { return detail::config_from_string(path_or_json, w); }, std::move(world),
      std::move(groups));
  return engine<Model>(std::move(model), std::move(st));
}
template <class Model>
engine<Model> initialize(Model model, const char* path_or_json, parallel_groups groups) {
  return initialize(std::move(model), std::string(path_or_json), std::move(groups));
}
// Both: the optimizer given in code and the groups the program made (DeepSpeed's
// initialize(model, config, optimizer, mpu)).
template <class Model>
engine<Model> initialize(Model model, const nlohmann::json& cfg, const optimizer_config& optimizer,
                         parallel_groups groups) {
  any_communicator world = groups.world;
  auto st = detail::make_engine_state(
      detail::module_ptr(model), [&](int w) { return parse_config_with_optimizer(cfg, optimizer, w); },
      std::move(world), std::move(groups));
  return engine<Model>(std::move(model), std::move(st));
}
template <class Model>
engine<Model> initialize(Model model, const std::string& path_or_json, const optimizer_config& optimizer,
                         parallel_groups groups) {
  any_communicator world = groups.world;
  auto st = detail::make_engine_state(
      detail::module_ptr(model),
      [&](int w) { return parse_config_with_optimizer(read_config_json(path_or_json), optimizer, w); },
      std::move(world), std::move(groups));
  return engine<Model>(std::move(model), std::move(st));
}
template <class Model>
engine<Model> initialize(Model model, const char* path_or_json, const optimizer_config& optimizer,
                         parallel_groups groups) {
  return initialize(std::move(model), std::string(path_or_json), optimizer, std::move(groups));
}
template <class Model, class Config, comm::communicator C>
  requires(!std::is_same_v<std::remove_cvref_t<C>, any_communicator>)
engine<Model> initialize(Model model, const Config& cfg, const optimizer_config& optimizer, C& comm) {
  return initialize(std::move(model), cfg, optimizer, any_communicator::wrap(comm));
}
// Any comm::communicator the caller owns and keeps alive (e.g. mpi_communicator).
template <class Model, class Config, comm::communicator C>
  requires(!std::is_same_v<std::remove_cvref_t<C>, any_communicator>)
engine<Model> initialize(Model model, const Config& cfg, C& comm) {
  return initialize(std::move(model), cfg, any_communicator::wrap(comm));
}

}  // namespace mpzero::torch

// mpzero: one fused optimizer step over many tensors. This header holds the
// description of the work (tensors, plan, per-step arguments) and the update of one
// element; backends (host.hpp, cuda/fused_step.cuh) only move data and call it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../config.hpp"
#include "../error.hpp"
#include "../multi_tensor/plan.hpp"
#include "../numeric/convert.hpp"
#include "../numeric/fp_ops.hpp"
#include "../numeric/rounding_bits.hpp"
#include "../optim/optimizer.hpp"
#include "../policy/precision.hpp"

namespace mpzero {

// One tensor of the step: where its states live, in the dtypes the policy names.
template <precision_policy Policy, optim::rule Optimizer>
struct step_tensor {
  using param_type = typename Policy::param_type;
  using master_type = typename Policy::master_type;
  using grad_type = typename Policy::grad_type;
  using state_type = typename Policy::state_type;
  static constexpr int n_states = Optimizer::n_states;

  param_type* param = nullptr;    // model weights, written every step
  master_type* master = nullptr;  // null when Policy::master_is_param (the param is the master)
  const grad_type* grad = nullptr;
  state_type* states[n_states] = {};
  std::uint64_t numel = 0;
  // Index of element 0 in the model's global element space. Keys the stochastic
  // rounding bits, so it must not overlap another tensor's range (see
  // assign_global_offsets); it does not change when the tensor is sharded.
  std::uint64_t global_offset = 0;
};

// Gives each tensor a global offset equal to the running sum of the numels before it.
template <class Tensor>
void assign_global_offsets(std::span<Tensor> tensors, std::uint64_t first = 0) noexcept {
  for (auto& t : tensors) {
    t.global_offset = first;
    first += t.numel;
  }
}

// Per-step arguments: the optimizer's prepared scalars, the gradient multiplier
// (1 / loss scale, times the clipping coefficient) and the rounding key.
template <optim::rule Optimizer>
struct step_args {
  typename Optimizer::params opt;
  float grad_scale = 1.0f;
  std::uint64_t seed = 0;
  std::uint64_t step = 1;
};

template <optim::rule Optimizer>
step_args<Optimizer> make_step_args(const typename Optimizer::options& o, std::uint64_t step, float grad_scale = 1.0f,
                                    std::uint64_t seed = 0) {
  return step_args<Optimizer>{Optimizer::prepare(o, step), grad_scale, seed, step};
}

// How many halves of element_bits a policy's step reads: half 0 rounds the master,
// half 1 + k state k (16-bit states only). Loops hash only the words these come from
// (element_rounding_bits<Halves>).
template <precision_policy Policy, optim::rule Optimizer>
inline constexpr int rounding_halves = sizeof(typename Policy::state_type) == 2 ? 1 + Optimizer::n_states : 1;

// The whole update of one element, in registers, from float inputs: `wf` is the
// master value, `g` the gradient before the multiplier. Writes the master rounded to
// its dtype into `w` and the optimizer states into `s`, and returns the updated master
// in float (what a separate parameter copy is rounded from). `bits` are the element's
// stochastic-rounding bits (element_rounding_bits; ignored under nearest rounding):
// the master rounds with half 0, optimizer state k with half 1 + k. Loops make the
// step's rounding_key once and draw each element's words from it. The host loop calls
// this directly where it converts whole blocks of 16-bit values with vector
// instructions (backend/host.hpp); everything else goes through
// update_element_with_bits. `Mode` is the optimizer's mode when the caller chose it
// for a whole loop (optim::update_in_mode); -1 lets the rule choose per element.
template <precision_policy Policy, optim::rule Optimizer, int Mode = -1>
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE float update_element_float(const step_args<Optimizer>& a, element_bits bits,
                                                                 float wf, float g,
                                                                 typename Policy::state_type (&s)[Optimizer::n_states],
                                                                 typename Policy::master_type& w) {
  using R = typename Policy::rounding;
  constexpr int n = Optimizer::n_states;
  static_assert(1 + n <= 4, "stochastic rounding gives each element four 16-bit random halves (master + 3 states); "
                            "an optimizer with more than 3 states needs a wider draw per element");
  const float gf = fp::mul(g, a.grad_scale);
  float sf[n];
  for (int k = 0; k < n; ++k) sf[k] = to_float(s[k]);
  optim::update_in_mode<Optimizer, Mode>(a.opt, wf, gf, sf);
  w = round_as<typename Policy::master_type, R>(wf, bits.half(0));
  for (int k = 0; k < n; ++k) s[k] = round_as<typename Policy::state_type, R>(sf[k], bits.half(1 + k));
  return wf;
}

// The same in the storage dtypes. `w` is the master value (the parameter itself when
// Policy::master_is_param); `p` receives the parameter when the master is separate.
template <precision_policy Policy, optim::rule Optimizer, int Mode = -1>
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE void update_element_with_bits(const step_args<Optimizer>& a, element_bits bits,
                                                                    typename Policy::master_type& w,
                                                                    typename Policy::grad_type g,
                                                                    typename Policy::state_type (&s)[Optimizer::n_states],
                                                                    typename Policy::param_type& p) {
  const float wf = update_element_float<Policy, Optimizer, Mode>(a, bits, to_float(w), to_float(g), s, w);
  if constexpr (!Policy::master_is_param) {
    // The parameter is a copy of a wider master: nearest rounding, the master keeps the precision.
    p = from_float<typename Policy::param_type>(wf);
  } else {
    (void)p;
    (void)wf;
  }
}

// The same update with the element's bits drawn on their own (the key made for one
// element): the scalar reference, and the path for elements updated one at a time.
template <precision_policy Policy, optim::rule Optimizer, int Mode = -1>
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE void update_element(const step_args<Optimizer>& a, std::uint64_t global_index,
                                                          typename Policy::master_type& w,
                                                          typename Policy::grad_type g,
                                                          typename Policy::state_type (&s)[Optimizer::n_states],
                                                          typename Policy::param_type& p) {
  element_bits bits{};
  if constexpr (Policy::rounding::stochastic) bits = element_rounding_bits(a.seed, a.step, global_index);
  update_element_with_bits<Policy, Optimizer, Mode>(a, bits, w, g, s, p);
}

// The description of a fused step: validated tensors and their chunk plan. Build it
// once (tensors rarely change) and run it every step on a backend.
template <precision_policy Policy, optim::rule Optimizer>
class fused_step {
 public:
  using policy = Policy;
  using optimizer = Optimizer;
  using tensor = step_tensor<Policy, Optimizer>;

  explicit fused_step(std::vector<tensor> tensors, plan_options options = {}) : tensors_(std::move(tensors)) {
    validate();
    std::vector<std::uint64_t> numels(tensors_.size());
    for (std::size_t i = 0; i < tensors_.size(); ++i) numels[i] = tensors_[i].numel;
    plan_ = multi_tensor_plan(numels, options);
  }

  // Views into the step, deleted on rvalues: a temporary step's would dangle once the
  // statement ends. Keep the step in a variable.
  std::span<const tensor> tensors() const& noexcept { return tensors_; }
  std::span<const tensor> tensors() const&& = delete;
  const multi_tensor_plan& plan() const& noexcept { return plan_; }
  const multi_tensor_plan& plan() const&& = delete;

 private:
  void validate() const {
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      const tensor& t = tensors_[i];
      const std::string where = "fused_step: tensor " + std::to_string(i) + " (numel " + std::to_string(t.numel) + ")";
      if constexpr (Policy::master_is_param) {
        if (t.master != nullptr) {
          detail::throw_invalid(where + ": master must be null, because this policy's master weights are the "
                                        "parameters themselves (Master == Param)");
        }
      }
      if (t.numel == 0) continue;
      if (t.param == nullptr || t.grad == nullptr) detail::throw_invalid(where + ": param and grad must not be null");
      if constexpr (!Policy::master_is_param) {
        if (t.master == nullptr) detail::throw_invalid(where + ": master must point to the master weights");
      }
      for (int k = 0; k < tensor::n_states; ++k) {
        if (t.states[k] == nullptr) {
          detail::throw_invalid(where + ": optimizer state " + std::to_string(k) + " of " +
                                std::string(Optimizer::name) + " must not be null");
        }
      }
      if (t.global_offset + t.numel < t.global_offset) detail::throw_invalid(where + ": global_offset overflows");
    }
    check_disjoint_memory();
    if constexpr (Policy::stochastic_rounding) check_disjoint_offsets();
  }

  // Every array the step writes (parameters, masters, optimizer states) must share no
  // byte with any other array of the step: threads would race on the shared elements
  // and the result would depend on their order. Gradients are only read, so two
  // tensors may share a gradient buffer, but no gradient may overlap a written array.
  void check_disjoint_memory() const {
    struct range {
      std::uintptr_t begin, end;
      std::size_t tensor;
      const char* what;
      bool written;
    };
    std::vector<range> ranges;
    ranges.reserve(tensors_.size() * (3 + tensor::n_states));
    static constexpr const char* state_names[] = {"optimizer state 0", "optimizer state 1", "optimizer state 2",
                                                  "optimizer state 3"};
    static_assert(tensor::n_states <= 4, "name the extra optimizer states in check_disjoint_memory");
    auto add = [&](const void* p, std::size_t bytes, std::size_t i, const char* what, bool written) {
      const auto begin = reinterpret_cast<std::uintptr_t>(p);
      const std::uint64_t numel = tensors_[i].numel;
      if (numel > UINTPTR_MAX / bytes || begin > UINTPTR_MAX - numel * bytes) {
        detail::throw_invalid("fused_step: tensor " + std::to_string(i) + " (numel " + std::to_string(numel) + "): " +
                              what + " would extend past the end of the address space; check numel");
      }
      ranges.push_back(range{begin, begin + static_cast<std::uintptr_t>(numel * bytes), i, what, written});
    };
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      const tensor& t = tensors_[i];
      if (t.numel == 0) continue;
      add(t.param, sizeof(*t.param), i, "param", true);
      if constexpr (!Policy::master_is_param) add(t.master, sizeof(*t.master), i, "master", true);
      add(t.grad, sizeof(*t.grad), i, "grad", false);
      for (int k = 0; k < tensor::n_states; ++k) add(t.states[k], sizeof(*t.states[k]), i, state_names[k], true);
    }
    std::sort(ranges.begin(), ranges.end(), [](const range& a, const range& b) { return a.begin < b.begin; });
    // One sweep in address order: a range overlaps an earlier one exactly when that one
    // ends past its start, so the farthest-reaching earlier range (written, or of any
    // kind) is the only one to compare with.
    const range* reach_any = nullptr;
    const range* reach_written = nullptr;
    for (const range& r : ranges) {
      const range* hit = r.written ? reach_any : reach_written;
      if (hit != nullptr && hit->end > r.begin) {
        detail::throw_invalid("fused_step: tensor " + std::to_string(hit->tensor) + "'s " + hit->what + " and tensor " +
                              std::to_string(r.tensor) + "'s " + r.what +
                              " share memory; the step writes one of them, so the result would depend on the order "
                              "of threads. Give every parameter, master and optimizer state its own memory, "
                              "and no gradient memory that the step writes.");
      }
      if (reach_any == nullptr || r.end > reach_any->end) reach_any = &r;
      if (r.written && (reach_written == nullptr || r.end > reach_written->end)) reach_written = &r;
    }
  }

  // Stochastic rounding draws its bits from the global index: two tensors that share
  // indices would round with the same bits, a correlated bias.
  void check_disjoint_offsets() const {
    std::vector<std::pair<std::uint64_t, std::size_t>> order;
    for (std::size_t i = 0; i < tensors_.size(); ++i)
      if (tensors_[i].numel > 0) order.emplace_back(tensors_[i].global_offset, i);
    std::sort(order.begin(), order.end());
    for (std::size_t k = 1; k < order.size(); ++k) {
      const tensor& prev = tensors_[order[k - 1].second];
      if (prev.global_offset + prev.numel > order[k].first) {
        detail::throw_invalid("fused_step: tensors " + std::to_string(order[k - 1].second) + " and " +
                              std::to_string(order[k].second) +
                              " overlap in global element index; stochastic rounding would give them the same "
                              "random bits. Give each tensor its own range (mpzero::assign_global_offsets).");
      }
    }
  }

  std::vector<tensor> tensors_;
  multi_tensor_plan plan_;
};

}  // namespace mpzero

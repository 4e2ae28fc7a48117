// mpzero::torch: DeepSpeed's learning-rate schedules (WarmupLR, WarmupDecayLR,
// WarmupCosineLR, LRRangeTest, OneCycle), torch-free.
//
// The formulas are DeepSpeed's (deepspeed/runtime/lr_schedules.py, v0.19.3+), step for step,
// so that a run ported from DeepSpeed sees the same learning rates:
//  - `step` counts the scheduler steps taken, i.e. the optimizer updates applied so far
//    (DeepSpeed's engine steps the scheduler after every update it does not skip). The
//    lr that update number k (1-based) uses is lr_at(s, base_lr, k - 1). DeepSpeed's
//    last_batch_iteration is step - 1.
//  - Before any step (step == 0), WarmupLR and WarmupDecayLR give warmup_min_lr and
//    WarmupCosineLR gives 0 (DeepSpeed's get_lr returns 0.0 there, whatever
//    warmup_min_ratio says); with iteration i = step - 1 >= 0:
//  - Warmup (i < W, W = max(2, warmup_num_steps), as DeepSpeed clamps it):
//      "log":    gamma = ln(i + 1) / ln(W)        "linear": gamma = i / W
//    WarmupLR/WarmupDecayLR: lr = min_lr + (max_lr - min_lr) * gamma
//    WarmupCosineLR: lr = base_lr * (min_ratio + (1 - min_ratio) * gamma)
//  - After warmup (i >= W), with T = total_num_steps:
//    WarmupLR:       lr = max_lr
//    WarmupDecayLR:  lr = min_lr + (max_lr - min_lr) * max(0, (T - i) / max(1, T - W))
//    WarmupCosineLR: p = min(1, (i - W + 1) / max(1, T - W)),
//                    lr = base_lr * max(0, cos_min + (1 - cos_min) * (1 + cos(pi p)) / 2)
//    DeepSpeed clamps p the same way since v0.19.3 (its PR #8142); before, its p kept
//    growing past T, so its cosine turned back up. All agree up to total_num_steps.
//  - WarmupLR and WarmupDecayLR set the lr outright (base_lr is not used); WarmupCosineLR
//    scales the optimizer's lr. scheduler_type::none returns base_lr.
//  - LRRangeTest sets lr = min_lr * (1 + step_rate * interval) outright, interval =
//    step / step_size (DeepSpeed's (last_batch_iteration + 1) / step_size), floored when
//    staircase; step 0 gives min_lr.
//  - OneCycle sets lr outright and, with cycle_momentum, the optimizer's betas to
//    (mom, 0.99), as DeepSpeed does (its beta2 is fixed at 0.99 while momentum cycles).
//    Step 0 gives (cycle_min_lr, cycle_min_mom). For 1 <= step <= C, C = first + second
//    step sizes, r = first / C, x = step / C - floor(step / C) (DeepSpeed's cycle position),
//    s = x / r if x <= r else (x - 1) / (r - 1):
//      lr = min_lr + (max_lr - min_lr) * s,   mom = max_mom - (max_mom - min_mom) * s.
//    After the cycle, d = step - C steps into the decay, k = d / decay_step_size:
//      lr = min_lr / (1 + decay_lr_rate * k),   mom = max_mom * (1 + decay_mom_rate * k),
//    each left at min_lr / max_mom when its rate or decay_step_size is 0.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <optional>
#include <utility>

#include "config.hpp"

namespace mpzero::torch {

namespace detail {

// DeepSpeed's warmup gamma at iteration i (0 <= i < W).
inline double warmup_gamma(const scheduler_config& s, double i, double w) {
  if (s.warmup_type == "linear") return i / w;
  // "log" (DeepSpeed's fallback for any other name too): (1 / ln W) * ln(i + 1).
  return (1.0 / std::log(w)) * std::log(i + 1.0);
}

// OneCycle's position in the cycle (0 at either end, 1 at the peak), 1 <= step <= C.
inline double one_cycle_scale(const scheduler_config& s, std::uint64_t step) {
  const double total = static_cast<double>(s.cycle_first_step_size + s.cycle_second_step_size);
  const double ratio = static_cast<double>(s.cycle_first_step_size) / total;
  const double b = static_cast<double>(step);
  const double x = 1.0 + b / total - std::floor(1.0 + b / total);
  return x <= ratio ? x / ratio : (x - 1.0) / (ratio - 1.0);
}

// OneCycle's decay intervals after the cycle, or nullopt while it runs.
inline std::optional<double> one_cycle_decay(const scheduler_config& s, std::uint64_t step) {
  const std::uint64_t total = s.cycle_first_step_size + s.cycle_second_step_size;
  if (step <= total) return std::nullopt;
  if (s.decay_step_size == 0) return 0.0;
  return static_cast<double>(step - total) / static_cast<double>(s.decay_step_size);
}

inline double one_cycle_lr(const scheduler_config& s, std::uint64_t step) {
  if (step == 0) return s.cycle_min_lr;
  if (const auto k = one_cycle_decay(s, step)) return s.cycle_min_lr / (1.0 + s.decay_lr_rate * *k);
  return s.cycle_min_lr + (s.cycle_max_lr - s.cycle_min_lr) * one_cycle_scale(s, step);
}

}  // namespace detail

// The learning rate after `step` scheduler steps (see above).
inline double lr_at(const scheduler_config& s, double base_lr, std::uint64_t step) {
  if (s.type == scheduler_type::none) return base_lr;
  if (s.type == scheduler_type::one_cycle) return detail::one_cycle_lr(s, step);
  if (s.type == scheduler_type::lr_range_test) {
    double interval = static_cast<double>(step) / static_cast<double>(s.lr_range_test_step_size);
    if (s.lr_range_test_staircase) interval = std::floor(interval);
    return s.lr_range_test_min_lr * (1.0 + s.lr_range_test_step_rate * interval);
  }
  const double w = static_cast<double>(std::max<std::uint64_t>(2, s.warmup_num_steps));
  const double t = static_cast<double>(s.total_num_steps);
  if (s.type == scheduler_type::warmup_cosine_lr) {
    if (step == 0) return 0.0;
    const double i = static_cast<double>(step - 1);
    double ratio;
    if (i < w) {
      ratio = s.warmup_min_ratio + detail::warmup_gamma(s, i, w) * (1.0 - s.warmup_min_ratio);
    } else {
      const double progress = std::min(1.0, (i - w + 1.0) / std::max(1.0, t - w));
      const double cosine = (1.0 + std::cos(std::numbers::pi * progress)) / 2.0;
      ratio = std::max(0.0, s.cos_min_ratio + (1.0 - s.cos_min_ratio) * cosine);
    }
    return base_lr * ratio;
  }
  if (step == 0) return s.warmup_min_lr;
  const double i = static_cast<double>(step - 1);
  double gamma;
  if (i < w) {
    gamma = detail::warmup_gamma(s, i, w);
  } else if (s.type == scheduler_type::warmup_decay_lr) {
    gamma = std::max(0.0, (t - i) / std::max(1.0, t - w));
  } else {
    gamma = 1.0;
  }
  return s.warmup_min_lr + (s.warmup_max_lr - s.warmup_min_lr) * gamma;
}

// The optimizer's (beta1, beta2) after `step` scheduler steps, when the schedule sets
// them (OneCycle with cycle_momentum); nullopt leaves the optimizer's own.
inline std::optional<std::pair<double, double>> betas_at(const scheduler_config& s, std::uint64_t step) {
  if (s.type != scheduler_type::one_cycle || !s.cycle_momentum) return std::nullopt;
  constexpr double beta2 = 0.99;  // DeepSpeed's OneCycle fixes it
  if (step == 0) return std::pair{s.cycle_min_mom, beta2};
  if (const auto k = detail::one_cycle_decay(s, step)) return std::pair{s.cycle_max_mom * (1.0 + s.decay_mom_rate * *k), beta2};
  return std::pair{s.cycle_max_mom - (s.cycle_max_mom - s.cycle_min_mom) * detail::one_cycle_scale(s, step), beta2};
}

// A schedule with its position: lr() is the rate for the next update; step() after each
// applied (not skipped) update. The position is the only state a checkpoint needs.
class lr_schedule {
 public:
  lr_schedule(scheduler_config s, double base_lr) : s_(std::move(s)), base_lr_(base_lr) {}

  double lr() const { return lr_at(s_, base_lr_, steps_); }
  void step() { ++steps_; }
  std::uint64_t steps() const noexcept { return steps_; }
  void set_steps(std::uint64_t n) noexcept { steps_ = n; }
  double base_lr() const noexcept { return base_lr_; }
  const scheduler_config& config() const noexcept { return s_; }

 private:
  scheduler_config s_;
  double base_lr_;
  std::uint64_t steps_ = 0;
};

}  // namespace mpzero::torch

// mpzero: the fp16 loss scaler (static or dynamic), pure host logic.
//
// The dynamic rule reproduces DeepSpeed's DynamicLossScaler.update_scale
// (deepspeed/runtime/fp16/loss_scaler.py, unchanged from v0.9 to v0.19), which ZeRO
// stages 1-3 call once per optimizer step with the overflow flag max-reduced over all
// ranks. Behaviour matched, step by step:
//  - Overflow with the hysteresis counter used up (<= 1): if the scale is already at
//    min_loss_scale, raise; otherwise scale = max(scale / 2, min_loss_scale). The counter
//    is NOT refilled by a halving: later overflows halve again immediately until a
//    growth (or, with consecutive_hysteresis, any clean step) refills it.
//  - Overflow with counter > 1: the counter decrements and the scale stays. An overflow
//    at the minimum scale with hysteresis left therefore does not raise.
//  - Every overflow (halving or not) restarts the clean-step count.
//  - Clean step: with consecutive_hysteresis the counter is refilled first. Then, if the
//    number of clean steps *before* this one (since the last overflow, or since
//    construction) is a positive multiple of loss_scale_window, the scale doubles and,
//    without consecutive_hysteresis, the counter is refilled. So the first doubling
//    comes on the (window+1)-th clean step after an overflow and later ones every
//    `window` clean steps: DeepSpeed's `stable_interval = cur_iter - last_overflow_iter - 1`
//    counts from the overflow, and growth does not restart it (modulo instead).
//  - A static scale (fp16.loss_scale > 0) never changes; an overflow still skips the
//    step, as in DeepSpeed, whose ZeRO step checks overflow for every fp16 run and
//    returns early, and whose static LossScaler.update_scale does nothing.
// Deliberate differences:
//  - The minimum-scale error is mpzero::loss_scale_error with advice, and the scaler's
//    state is untouched when it is thrown (DeepSpeed raises a bare Exception, also
//    before changing anything).
//  - Options are checked up front (DeepSpeed accepts hysteresis 0, which never halves,
//    and an initial scale below the minimum, which makes a "halving" raise the scale).
//  - Scale growth is not capped, as in DeepSpeed: fp16 overflows long before the double
//    could, and the next overflow halves it back.
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "../error.hpp"

namespace mpzero {

// The fp16 section of a DeepSpeed config, in the loss scaler's terms.
struct loss_scale_options {
  bool dynamic = true;              // fp16.loss_scale == 0 in DeepSpeed's config
  double static_scale = 1.0;        // used when !dynamic (fp16.loss_scale > 0)
  int initial_scale_power = 16;     // initial dynamic scale = 2^power
  int loss_scale_window = 1000;     // clean steps before the scale doubles
  int hysteresis = 2;               // overflows tolerated before the scale halves
  bool consecutive_hysteresis = false;  // if true, a clean step restores hysteresis to its initial value
  double min_loss_scale = 1.0;
};

// Raised when a dynamic scale must halve but is already at min_loss_scale.
class loss_scale_error : public mpzero::error {
 public:
  using error::error;
};

namespace detail {

}  // namespace detail

class loss_scaler {
 public:
  // Bounds on initial_scale_power: 2^±64 keeps 1/scale a normal float and is far past
  // anything fp16 training can use (fp16's largest value is about 2^16).
  static constexpr int min_scale_power = -64;
  static constexpr int max_scale_power = 64;
  // last_overflow_iter before any overflow: DeepSpeed's -1, as an unsigned value, so
  // that clean_steps == iter - last_overflow_iter - 1 holds with wrap-around.
  static constexpr std::uint64_t no_overflow = std::numeric_limits<std::uint64_t>::max();

  // Checks only the options the chosen mode uses (as DeepSpeed does, so a static config
  // carrying unused dynamic keys stays valid).
  explicit loss_scaler(const loss_scale_options& o = {}) : opts_(o) {
    if (o.dynamic) {
      validate_dynamic(o);
      scale_ = std::ldexp(1.0, o.initial_scale_power);
      hysteresis_left_ = o.hysteresis;
    } else {
      if (!(std::isfinite(o.static_scale) && o.static_scale > 0)) {
        detail::throw_invalid("loss_scaler: static loss scale fp16.loss_scale = " + detail::format_double(o.static_scale) +
                              " is invalid; a static scale must be a finite number > 0 (or set "
                              "fp16.loss_scale = 0 for dynamic loss scaling)");
      }
      scale_ = o.static_scale;
      hysteresis_left_ = 0;
    }
  }

  double scale() const noexcept { return scale_; }
  // The gradient multiplier; exact for power-of-two scales.
  float inverse() const noexcept { return static_cast<float>(1.0 / scale_); }
  bool dynamic() const noexcept { return opts_.dynamic; }
  // Overflows still tolerated before the next one halves the scale (0 for a static scale).
  int hysteresis_left() const noexcept { return hysteresis_left_; }
  // Consecutive clean updates since the last overflow (or construction). A growth does
  // not reset it; growth happens when the count before a clean step is a positive
  // multiple of loss_scale_window.
  std::uint64_t clean_steps() const noexcept { return clean_steps_; }
  // Updates done so far.
  std::uint64_t iter() const noexcept { return iter_; }
  // Index (0-based, in updates) of the last overflow, or no_overflow.
  std::uint64_t last_overflow_iter() const noexcept { return last_overflow_iter_; }
  const loss_scale_options& options() const noexcept { return opts_; }

  // Called once per optimizer step with the overflow decision already agreed by all
  // ranks. Returns true if the step must be skipped (exactly when `overflow`). Throws
  // loss_scale_error, changing nothing, when a dynamic scale at its minimum overflows
  // with no hysteresis left.
  bool update(bool overflow) {
    if (opts_.dynamic) {
      if (overflow) {
        if (hysteresis_left_ <= 1) {
          if (scale_ <= opts_.min_loss_scale) throw_at_minimum();
          scale_ = std::fmax(scale_ / 2, opts_.min_loss_scale);
        } else {
          --hysteresis_left_;
        }
      } else {
        if (opts_.consecutive_hysteresis) hysteresis_left_ = opts_.hysteresis;
        if (clean_steps_ > 0 && clean_steps_ % static_cast<std::uint64_t>(opts_.loss_scale_window) == 0) {
          if (!opts_.consecutive_hysteresis) hysteresis_left_ = opts_.hysteresis;
          scale_ *= 2;
        }
      }
    }
    if (overflow) {
      last_overflow_iter_ = iter_;
      clean_steps_ = 0;
    } else {
      ++clean_steps_;
    }
    ++iter_;
    return overflow;
  }

  // State for checkpoints. Written by save(); clean_steps is redundant with the two
  // iteration counters (clean_steps == iter - last_overflow_iter - 1, wrapping) and load
  // checks that it agrees.
  struct state {
    double scale;
    int hysteresis_left;
    std::uint64_t clean_steps;
    std::uint64_t last_overflow_iter;
    std::uint64_t iter;
  };

  state save() const { return {scale_, hysteresis_left_, clean_steps_, last_overflow_iter_, iter_}; }

  // Restores a saved state under this scaler's options. A dynamic scaler takes the saved
  // scale and hysteresis; a static scaler keeps its configured scale (the scale is
  // configuration, not state: DeepSpeed instead unpickles its whole scaler object, which
  // silently overrides a changed fp16.loss_scale) and restores only the counters.
  // Throws invalid_argument, changing nothing, on a state these options cannot hold.
  void load(const state& s) {
    if (s.last_overflow_iter != no_overflow && s.last_overflow_iter >= s.iter) {
      detail::throw_invalid("loss_scaler::load: last_overflow_iter = " + std::to_string(s.last_overflow_iter) +
                            " is not before iter = " + std::to_string(s.iter) +
                            "; the state is corrupt (pass a state written by loss_scaler::save)");
    }
    if (s.clean_steps != s.iter - s.last_overflow_iter - 1) {
      detail::throw_invalid("loss_scaler::load: clean_steps = " + std::to_string(s.clean_steps) +
                            " disagrees with iter = " + std::to_string(s.iter) + " and last_overflow_iter = " +
                            (s.last_overflow_iter == no_overflow ? std::string("none")
                                                                  : std::to_string(s.last_overflow_iter)) +
                            "; the state is corrupt (pass a state written by loss_scaler::save)");
    }
    if (opts_.dynamic) {
      if (!(std::isfinite(s.scale) && s.scale >= opts_.min_loss_scale)) {
        detail::throw_invalid("loss_scaler::load: saved loss scale " + detail::format_double(s.scale) +
                              " is not a finite value >= fp16.min_loss_scale = " +
                              detail::format_double(opts_.min_loss_scale) +
                              "; lower fp16.min_loss_scale to the checkpoint's value or reset the scaler");
      }
      if (s.hysteresis_left < 1 || s.hysteresis_left > opts_.hysteresis) {
        detail::throw_invalid("loss_scaler::load: saved hysteresis_left = " + std::to_string(s.hysteresis_left) +
                              " is outside [1, fp16.hysteresis = " + std::to_string(opts_.hysteresis) +
                              "]; restore the fp16.hysteresis the checkpoint was written with "
                              "(a static-scale checkpoint saves 0 and cannot seed a dynamic scaler)");
      }
      scale_ = s.scale;
      hysteresis_left_ = s.hysteresis_left;
    }
    clean_steps_ = s.clean_steps;
    last_overflow_iter_ = s.last_overflow_iter;
    iter_ = s.iter;
  }

 private:
  static void validate_dynamic(const loss_scale_options& o) {
    if (o.initial_scale_power < min_scale_power || o.initial_scale_power > max_scale_power) {
      detail::throw_invalid("loss_scaler: fp16.initial_scale_power = " + std::to_string(o.initial_scale_power) +
                            " is out of range; it must lie in [" + std::to_string(min_scale_power) + ", " +
                            std::to_string(max_scale_power) + "] (DeepSpeed's default is 16)");
    }
    if (o.loss_scale_window < 1) {
      detail::throw_invalid("loss_scaler: fp16.loss_scale_window = " + std::to_string(o.loss_scale_window) +
                            " is invalid; it must be >= 1 clean steps between doublings (DeepSpeed's default is 1000)");
    }
    if (o.hysteresis < 1) {
      detail::throw_invalid("loss_scaler: fp16.hysteresis = " + std::to_string(o.hysteresis) +
                            " is invalid; it must be >= 1 (1 halves the scale on every overflow; "
                            "DeepSpeed's default is 2)");
    }
    if (!(std::isfinite(o.min_loss_scale) && o.min_loss_scale > 0)) {
      detail::throw_invalid("loss_scaler: fp16.min_loss_scale = " + detail::format_double(o.min_loss_scale) +
                            " is invalid; it must be a finite number > 0 (DeepSpeed's default is 1)");
    }
    if (std::ldexp(1.0, o.initial_scale_power) < o.min_loss_scale) {
      detail::throw_invalid("loss_scaler: initial scale 2^fp16.initial_scale_power = 2^" +
                            std::to_string(o.initial_scale_power) + " is below fp16.min_loss_scale = " +
                            detail::format_double(o.min_loss_scale) +
                            "; raise initial_scale_power or lower min_loss_scale");
    }
  }

  [[noreturn]] void throw_at_minimum() const {
    throw loss_scale_error(
        "mpzero: fp16 gradients overflowed with the loss scale already at its minimum (scale = " +
        detail::format_double(scale_) + ", fp16.min_loss_scale = " + detail::format_double(opts_.min_loss_scale) +
        ", after " + std::to_string(iter_) + " updates" +
        "): the scale cannot decrease any more, so fp16 training has diverged. Train in bf16 "
        "(no loss scaling needed), lower the learning rate, enable gradient_clipping, or lower "
        "fp16.min_loss_scale");
  }

  loss_scale_options opts_;
  double scale_ = 1.0;
  int hysteresis_left_ = 0;
  std::uint64_t clean_steps_ = 0;
  std::uint64_t last_overflow_iter_ = no_overflow;
  std::uint64_t iter_ = 0;
};

}  // namespace mpzero

// DeepSpeed's LR schedules. The reference mirrors DeepSpeed's stateful scheduler objects
// (last_batch_iteration starts at -1; step() increments it; get_lr() reads it), written
// from the formulas in long double, and shares no code with lr_schedule.hpp. Spot values
// are worked out by hand. WarmupCosineLR's progress is clamped at 1 after
// total_num_steps, as in DeepSpeed since v0.19.3 (PR #8142; older versions differ there).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <nlohmann/json.hpp>

#include <mpzero/torch/config.hpp>
#include <mpzero/torch/lr_schedule.hpp>

using namespace mpzero::torch;

namespace {

// DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR as a small state machine.
struct deepspeed_reference {
  scheduler_config s;
  long double base_lr;
  long long last_batch_iteration = -1;

  void step() { ++last_batch_iteration; }

  long double lr() const {
    const long long it = last_batch_iteration;
    const long double W = s.warmup_num_steps < 2 ? 2.0L : static_cast<long double>(s.warmup_num_steps);
    const long double T = static_cast<long double>(s.total_num_steps);
    const bool linear = s.warmup_type == "linear";
    // Fraction of the warmup done at iteration `it` (< W).
    auto warm = [&](long double i) { return linear ? i / W : std::log(i + 1.0L) / std::log(W); };
    if (s.type == scheduler_type::warmup_cosine_lr) {
      if (it < 0) return 0.0L;  // DeepSpeed's get_lr before the first step
      const long double i = static_cast<long double>(it);
      if (i < W) return base_lr * (s.warmup_min_ratio + (1.0L - s.warmup_min_ratio) * warm(i));
      long double progress = (i - W + 1.0L) / (T - W > 1.0L ? T - W : 1.0L);
      if (progress > 1.0L) progress = 1.0L;
      const long double half_cos = 0.5L * (1.0L + std::cos(3.14159265358979323846264338327950288L * progress));
      const long double ratio = s.cos_min_ratio + (1.0L - s.cos_min_ratio) * half_cos;
      return base_lr * (ratio > 0 ? ratio : 0.0L);
    }
    const long double lo = s.warmup_min_lr, hi = s.warmup_max_lr;
    if (it < 0) return lo;
    const long double i = static_cast<long double>(it);
    if (i < W) return lo + (hi - lo) * warm(i);
    if (s.type == scheduler_type::warmup_lr) return hi;
    long double frac = (T - i) / (T - W > 1.0L ? T - W : 1.0L);
    if (frac < 0) frac = 0;
    return lo + (hi - lo) * frac;
  }
};

scheduler_config make(scheduler_type t, std::uint64_t warmup, const char* type, std::uint64_t total = 0) {
  scheduler_config s;
  s.type = t;
  s.warmup_num_steps = warmup;
  s.warmup_type = type;
  s.total_num_steps = total;
  return s;
}

// Agreement with the long-double reference to 1e-13 of the schedule's scale: the cosine
// tail's 1 + cos(pi p) cancels (in DeepSpeed's formula too), so a relative bound on the
// tiny values near the floor would test double rounding, not the formula.
bool close(double got, long double want, long double scale) {
  return std::fabs(static_cast<long double>(got) - want) <= 1e-13L * scale;
}

}  // namespace

TEST_CASE("lr_schedule: hand-worked values", "[config]") {
  // WarmupLR, linear, 0 -> 1 over 10 steps: lr(i) = i / 10 for iteration i = step - 1.
  auto s = make(scheduler_type::warmup_lr, 10, "linear");
  s.warmup_min_lr = 0.0;
  s.warmup_max_lr = 1.0;
  CHECK(lr_at(s, 123.0, 0) == 0.0);   // before any step: warmup_min_lr
  CHECK(lr_at(s, 123.0, 1) == 0.0);   // iteration 0
  CHECK(lr_at(s, 123.0, 6) == 0.5);   // iteration 5
  CHECK(lr_at(s, 123.0, 10) == Approx(0.9).epsilon(1e-15));
  CHECK(lr_at(s, 123.0, 11) == 1.0);  // iteration 10: warmup done
  CHECK(lr_at(s, 123.0, 1'000'000) == 1.0);

  // WarmupLR, log, over 100 steps from 0.1 to 0.3: iteration 9 is ln 10 / ln 100 = 1/2 -> 0.2.
  s = make(scheduler_type::warmup_lr, 100, "log");
  s.warmup_min_lr = 0.1;
  s.warmup_max_lr = 0.3;
  CHECK(lr_at(s, 0.0, 10) == Approx(0.2).epsilon(1e-14));
  CHECK(lr_at(s, 0.0, 1) == Approx(0.1).epsilon(1e-15));  // ln 1 = 0

  // WarmupDecayLR, linear, W = 10, T = 30, 0 -> 1: decays linearly to 0 at iteration T.
  s = make(scheduler_type::warmup_decay_lr, 10, "linear", 30);
  s.warmup_min_lr = 0.0;
  s.warmup_max_lr = 1.0;
  CHECK(lr_at(s, 0.0, 11) == 1.0);   // iteration 10: (30 - 10) / 20
  CHECK(lr_at(s, 0.0, 21) == 0.5);   // iteration 20: (30 - 20) / 20
  CHECK(lr_at(s, 0.0, 31) == 0.0);   // iteration 30
  CHECK(lr_at(s, 0.0, 500) == 0.0);  // clamped at 0 afterwards

  // WarmupCosineLR, linear, W = 10, T = 110, ratio 0.5 -> 1, cos_min 0.2, base 2.
  s = make(scheduler_type::warmup_cosine_lr, 10, "linear", 110);
  s.warmup_min_ratio = 0.5;
  s.cos_min_ratio = 0.2;
  CHECK(lr_at(s, 2.0, 0) == 0.0);    // DeepSpeed returns 0 before the first step
  CHECK(lr_at(s, 2.0, 1) == 1.0);    // iteration 0: 2 x 0.5
  CHECK(lr_at(s, 2.0, 6) == 1.5);    // iteration 5: 2 x (0.5 + 0.5 x 0.5)
  // iteration 59: progress (59 - 10 + 1) / 100 = 1/2, cos = 0 -> ratio 0.2 + 0.8 x 0.5 = 0.6
  CHECK(lr_at(s, 2.0, 60) == Approx(1.2).epsilon(1e-14));
  // iteration 109: progress 1 -> ratio = cos_min = 0.2; and it stays there
  CHECK(lr_at(s, 2.0, 110) == Approx(0.4).epsilon(1e-14));
  CHECK(lr_at(s, 2.0, 10'000) == Approx(0.4).epsilon(1e-14));

  // No scheduler: the optimizer's lr.
  CHECK(lr_at(scheduler_config{}, 0.125, 0) == 0.125);
  CHECK(lr_at(scheduler_config{}, 0.125, 99) == 0.125);
}

TEST_CASE("lr_schedule: LRRangeTest, worked by hand from DeepSpeed's definition", "[config]") {
  // lr = min_lr * (1 + step_rate * interval), interval = (last_batch_iteration + 1) /
  // step_size, floored with staircase; last_batch_iteration = steps taken - 1.
  const config c = parse_config_text(R"({"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": "LRRangeTest",
      "params": {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 4, "lr_range_test_step_rate": 2}}})",
                                     1);
  REQUIRE(c.scheduler.type == scheduler_type::lr_range_test);
  CHECK(lr_at(c.scheduler, 123.0, 0) == Approx(0.01));           // before any step: min_lr
  CHECK(lr_at(c.scheduler, 123.0, 1) == Approx(0.01 * 1.5));     // 1 + 2 * 1/4
  CHECK(lr_at(c.scheduler, 123.0, 4) == Approx(0.01 * 3.0));     // 1 + 2 * 4/4
  CHECK(lr_at(c.scheduler, 123.0, 10) == Approx(0.01 * 6.0));    // 1 + 2 * 10/4
  scheduler_config stairs = c.scheduler;
  stairs.lr_range_test_staircase = true;
  CHECK(lr_at(stairs, 123.0, 3) == Approx(0.01));                // floor(3/4) = 0
  CHECK(lr_at(stairs, 123.0, 4) == Approx(0.03));                // floor(4/4) = 1
  CHECK(lr_at(stairs, 123.0, 11) == Approx(0.05));               // floor(11/4) = 2
  // DeepSpeed's defaults: min_lr 1e-3, step_size 2000, step_rate 1, no staircase.
  const config d = parse_config_text(
      R"({"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": "LRRangeTest"}})", 1);
  CHECK(lr_at(d.scheduler, 1.0, 2000) == Approx(2e-3));
  CHECK(to_json(parse_config(to_json(c), 1)) == to_json(c));
  CHECK_THROWS_WITH(parse_config_text(R"({"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": "LRRangeTest",
      "params": {"lr_range_test_step_size": 0}}})",
                                      1),
                    Catch::Contains("lr_range_test_step_size"));
}

TEST_CASE("lr_schedule: OneCycle, worked by hand from DeepSpeed's definition", "[config]") {
  // A cycle of 4 + 2 steps (peak at x = 2/3), then decay every 2 steps.
  const config c = parse_config_text(R"({"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": "OneCycle",
      "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.05, "cycle_first_step_size": 4,
                 "cycle_second_step_size": 2, "decay_step_size": 2, "decay_lr_rate": 0.5,
                 "cycle_min_mom": 0.8, "cycle_max_mom": 0.9, "decay_mom_rate": 0.05}}})",
                                     1);
  REQUIRE(c.scheduler.type == scheduler_type::one_cycle);
  struct row {
    std::uint64_t step;
    double lr, mom;
  };
  const row rows[] = {
      {0, 0.01, 0.8},                  // before any step: the minima
      {1, 0.02, 0.875},                // x 1/6, scale 1/4
      {2, 0.03, 0.85},                 // x 1/3, scale 1/2
      {4, 0.05, 0.8},                  // x 2/3: the peak
      {5, 0.03, 0.85},                 // x 5/6: scale (5/6 - 1) / (2/3 - 1) = 1/2
      {6, 0.01, 0.9},                  // x 0: the cycle's end
      {7, 0.01 / 1.25, 0.9 * 1.025},   // decay: 1 step = 1/2 interval
      {10, 0.01 / 2.0, 0.9 * 1.1},     // 4 steps = 2 intervals
  };
  for (const row& r : rows) {
    INFO("step " << r.step);
    CHECK(lr_at(c.scheduler, 123.0, r.step) == Approx(r.lr).epsilon(1e-14));
    const auto b = betas_at(c.scheduler, r.step);
    REQUIRE(b.has_value());
    CHECK(b->first == Approx(r.mom).epsilon(1e-14));
    CHECK(b->second == 0.99);  // DeepSpeed fixes beta2 while momentum cycles
  }
  CHECK(to_json(parse_config(to_json(c), 1)) == to_json(c));

  // Without decay_step_size the rates stay at the cycle's end; without cycle_momentum the
  // optimizer keeps its betas.
  scheduler_config flat = c.scheduler;
  flat.decay_step_size = 0;
  CHECK(lr_at(flat, 1.0, 50) == 0.01);
  CHECK(betas_at(flat, 50)->first == 0.9);
  flat.cycle_momentum = false;
  CHECK_FALSE(betas_at(flat, 3).has_value());
  CHECK_FALSE(betas_at(scheduler_config{}, 3).has_value());

  // DeepSpeed's defaults: second step size = first (2000), momentum 0.8 -> 0.9.
  const config d = parse_config_text(R"({"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": "OneCycle",
      "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.002}}})",
                                     1);
  CHECK(d.scheduler.cycle_second_step_size == 2000);
  CHECK(lr_at(d.scheduler, 1.0, 2000) == Approx(0.002));
  CHECK(betas_at(d.scheduler, 2000)->first == Approx(0.8));

  CHECK_THROWS_WITH(parse_config_text(R"({"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": "OneCycle",
      "params": {"cycle_min_lr": 0.001}}})",
                                      1),
                    Catch::Contains("scheduler.params.cycle_max_lr' is missing"));
  CHECK_THROWS_WITH(parse_config_text(R"({"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": "OneCycle",
      "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.002, "cycle_max_mom": 1.0}}})",
                                      1),
                    Catch::Contains("cycle_max_mom"));
  CHECK_THROWS_WITH(parse_config_text(R"({"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": "OneCycle",
      "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.002, "cycle_first_step_size": 0}}})",
                                      1),
                    Catch::Contains("cycle_first_step_size"));
}

TEST_CASE("lr_schedule: agrees with DeepSpeed's formulas over whole runs", "[config]") {
  struct row {
    scheduler_type type;
    std::uint64_t warmup, total;
    const char* warmup_type;
    double min_lr, max_lr, min_ratio, cos_min;
  };
  const row rows[] = {
      {scheduler_type::warmup_lr, 1000, 0, "log", 0.0, 1e-3, 0, 0},
      {scheduler_type::warmup_lr, 37, 0, "linear", 1e-5, 3e-4, 0, 0},
      {scheduler_type::warmup_lr, 1, 0, "log", 0.0, 0.01, 0, 0},  // DeepSpeed uses max(2, W)
      {scheduler_type::warmup_lr, 50, 0, "log", 0.02, 0.01, 0, 0},  // a decreasing "warmup" is allowed
      {scheduler_type::warmup_decay_lr, 100, 1000, "log", 0.0, 1e-3, 0, 0},
      {scheduler_type::warmup_decay_lr, 25, 400, "linear", 1e-6, 2e-4, 0, 0},
      {scheduler_type::warmup_decay_lr, 50, 20, "linear", 0.0, 1e-3, 0, 0},  // total < warmup
      {scheduler_type::warmup_cosine_lr, 100, 1000, "log", 0, 0, 0.0, 1e-4},
      {scheduler_type::warmup_cosine_lr, 30, 700, "linear", 0, 0, 0.1, 0.01},
      {scheduler_type::warmup_cosine_lr, 2, 3, "linear", 0, 0, 0.3, 0.05},
      {scheduler_type::warmup_cosine_lr, 40, 10, "log", 0, 0, 0.0, 0.2},  // total < warmup: the floor after
  };
  const double base_lr = 6e-4;
  for (const auto& r : rows) {
    scheduler_config s = make(r.type, r.warmup, r.warmup_type, r.total);
    s.warmup_min_lr = r.min_lr;
    s.warmup_max_lr = r.max_lr;
    s.warmup_min_ratio = r.min_ratio;
    s.cos_min_ratio = r.cos_min;
    deepspeed_reference ref{s, base_lr};
    lr_schedule sched(s, base_lr);
    const std::uint64_t steps = std::max<std::uint64_t>(r.warmup, r.total) + 200;
    const long double scale = r.type == scheduler_type::warmup_cosine_lr ? base_lr : std::max(r.min_lr, r.max_lr);
    for (std::uint64_t k = 0; k <= steps; ++k) {
      INFO("schedule " << scheduler_name(r.type) << " W=" << r.warmup << " T=" << r.total << " "
                       << r.warmup_type << ", step " << k);
      const double got = lr_at(s, base_lr, k);
      REQUIRE(close(got, ref.lr(), scale));
      REQUIRE(sched.lr() == got);
      REQUIRE(sched.steps() == k);
      ref.step();
      sched.step();
    }
  }
}

TEST_CASE("lr_schedule: the position is its only state", "[config]") {
  auto s = make(scheduler_type::warmup_decay_lr, 10, "linear", 100);
  s.warmup_max_lr = 1.0;
  lr_schedule a(s, 0.5);
  for (int i = 0; i < 37; ++i) a.step();
  lr_schedule b(s, 0.5);
  b.set_steps(a.steps());
  CHECK(b.lr() == a.lr());
  CHECK(b.base_lr() == 0.5);
  CHECK(b.config().total_num_steps == 100);
}

TEST_CASE("lr_schedule: parsed schedules use the optimizer's lr as DeepSpeed does", "[config]") {
  // WarmupLR without warmup_max_lr warms up to the optimizer's lr.
  const config w = parse_config_text(
      R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.004}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear"}}})",
      1);
  CHECK(lr_at(w.scheduler, w.optimizer.lr, 3) == Approx(0.004 * 2 / 4).epsilon(1e-15));  // iteration 2
  CHECK(lr_at(w.scheduler, w.optimizer.lr, 5) == 0.004);
  // WarmupCosineLR scales the optimizer's lr.
  const config c = parse_config_text(
      R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.004}},
          "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 20, "warmup_num_steps": 4,
                        "warmup_type": "linear", "warmup_min_ratio": 0.25}}})",
      1);
  CHECK(lr_at(c.scheduler, c.optimizer.lr, 1) == Approx(0.001).epsilon(1e-15));  // 0.004 x 0.25
}

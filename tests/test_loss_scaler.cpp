// The fp16 loss scaler and the gradient-clipping coefficient.
//
// Expected sequences are either written out by hand (with the DeepSpeed rule that
// produces each value) or produced by ref_scaler below, a transcription of the rule in
// DeepSpeed's own terms (signed iteration counters, last_overflow_iter = -1,
// stable_interval = cur_iter - last_overflow_iter - 1), which shares no code or state
// layout with mpzero::loss_scaler (that one counts clean steps directly).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <mpzero/zero/clipping.hpp>
#include <mpzero/zero/loss_scaler.hpp>

using namespace mpzero;
using Catch::Matchers::Contains;

namespace {

// DeepSpeed's DynamicLossScaler.update_scale, restated. update() returns false where
// DeepSpeed would raise at the minimum scale (and then changes nothing, as DeepSpeed).
struct ref_scaler {
  double cur_scale;
  long long cur_iter = 0;
  long long last_overflow_iter = -1;
  int delayed_shift, cur_hysteresis, scale_window;
  bool consecutive;
  double min_scale;

  explicit ref_scaler(const loss_scale_options& o)
      : cur_scale(static_cast<double>(std::pow(2.0L, o.initial_scale_power))),
        delayed_shift(o.hysteresis),
        cur_hysteresis(o.hysteresis),
        scale_window(o.loss_scale_window),
        consecutive(o.consecutive_hysteresis),
        min_scale(o.min_loss_scale) {}

  bool update(bool overflow) {
    if (overflow) {
      if (delayed_shift == 1 || cur_hysteresis == 1) {
        if (cur_scale == min_scale) return false;
        cur_scale = std::max(cur_scale / 2.0, min_scale);
      } else {
        cur_hysteresis -= 1;
      }
      last_overflow_iter = cur_iter;
    } else {
      if (consecutive) cur_hysteresis = delayed_shift;
      const long long stable_interval = (cur_iter - last_overflow_iter) - 1;
      if (stable_interval > 0 && stable_interval % scale_window == 0) {
        if (!consecutive) cur_hysteresis = delayed_shift;
        cur_scale *= 2.0;
      }
    }
    cur_iter += 1;
    return true;
  }
};

loss_scale_options dyn(int power, int window, int hysteresis, bool consecutive = false, double min_scale = 1.0) {
  loss_scale_options o;
  o.dynamic = true;
  o.initial_scale_power = power;
  o.loss_scale_window = window;
  o.hysteresis = hysteresis;
  o.consecutive_hysteresis = consecutive;
  o.min_loss_scale = min_scale;
  return o;
}

struct expect_step {
  bool overflow;
  double scale;  // after the update
  int hysteresis_left;
};

void run_sequence(loss_scaler& s, const std::vector<expect_step>& seq) {
  for (std::size_t i = 0; i < seq.size(); ++i) {
    INFO("update " << i << " overflow=" << seq[i].overflow);
    CHECK(s.update(seq[i].overflow) == seq[i].overflow);
    CHECK(s.scale() == seq[i].scale);
    CHECK(s.hysteresis_left() == seq[i].hysteresis_left);
  }
}

}  // namespace

TEST_CASE("loss_scaler: defaults are DeepSpeed's fp16 defaults", "[zero]") {
  loss_scaler s;
  CHECK(s.dynamic());
  CHECK(s.scale() == 65536.0);  // 2^16
  CHECK(s.inverse() == 1.0f / 65536.0f);
  CHECK(s.hysteresis_left() == 2);
  CHECK(s.clean_steps() == 0);
  CHECK(s.iter() == 0);
  CHECK(s.last_overflow_iter() == loss_scaler::no_overflow);
}

TEST_CASE("loss_scaler: hysteresis counts down, then every overflow halves", "[zero]") {
  loss_scaler s(dyn(/*power*/ 10, /*window*/ 1000, /*hysteresis*/ 3));
  run_sequence(s, {
                      {true, 1024, 2},   // 3 > 1: decrement, scale kept
                      {true, 1024, 1},   // 2 > 1: decrement
                      {true, 512, 1},    // used up: halve; the counter is not refilled
                      {true, 256, 1},    // so the next overflow halves at once
                      {false, 256, 1},   // a clean step refills nothing without consecutive_hysteresis
                      {true, 128, 1},
                  });
  CHECK(s.iter() == 6);
  CHECK(s.last_overflow_iter() == 5);
  CHECK(s.clean_steps() == 0);
}

TEST_CASE("loss_scaler: hysteresis 1 halves on every overflow", "[zero]") {
  loss_scaler s(dyn(4, 1000, 1));
  run_sequence(s, {{true, 8, 1}, {true, 4, 1}, {false, 4, 1}, {true, 2, 1}});
}

TEST_CASE("loss_scaler: consecutive_hysteresis refills the counter on a clean step", "[zero]") {
  SECTION("on") {
    loss_scaler s(dyn(8, 1000, 2, /*consecutive*/ true));
    run_sequence(s, {
                        {true, 256, 1},   // decrement
                        {false, 256, 2},  // clean: refilled
                        {true, 256, 1},   // decrement again instead of halving
                        {true, 128, 1},   // two overflows in a row: halve
                        {false, 128, 2},
                    });
  }
  SECTION("off") {
    loss_scaler s(dyn(8, 1000, 2, /*consecutive*/ false));
    run_sequence(s, {
                        {true, 256, 1},
                        {false, 256, 1},  // not refilled
                        {true, 128, 1},   // so this one halves
                        {false, 128, 1},
                    });
  }
}

TEST_CASE("loss_scaler: growth exactly at the window boundary", "[zero]") {
  // window 4, no overflow yet: DeepSpeed's stable_interval at 0-based update k is k, and
  // the scale doubles when it is a positive multiple of 4, i.e. at updates 4 and 8 (after
  // 4 clean steps, the next clean step doubles; then every 4).
  loss_scaler s(dyn(4, 4, 2));
  const std::vector<double> after = {16, 16, 16, 16, 32, 32, 32, 32, 64, 64};
  for (std::size_t k = 0; k < after.size(); ++k) {
    INFO("update " << k);
    CHECK_FALSE(s.update(false));
    CHECK(s.scale() == after[k]);
    CHECK(s.clean_steps() == k + 1);  // growth does not restart the count
  }
}

TEST_CASE("loss_scaler: growth refills hysteresis (without consecutive_hysteresis)", "[zero]") {
  loss_scaler s(dyn(4, 2, 2));
  run_sequence(s, {
                      {true, 16, 1},   // update 0: decrement; last overflow = 0
                      {false, 16, 1},  // update 1: stable_interval 0
                      {false, 16, 1},  // update 2: 1
                      {false, 32, 2},  // update 3: 2 = window: double and refill
                      {true, 32, 1},   // update 4: decrement (refilled counter)
                  });
}

TEST_CASE("loss_scaler: an overflow restarts the growth count", "[zero]") {
  SECTION("a halving overflow") {
    loss_scaler s(dyn(4, 4, 1));
    // Updates 0-2 clean (no growth: stable_interval 0..2), update 3 overflows (16 -> 8).
    // Afterwards stable_interval = k - 3 - 1: doubles at k = 8 and k = 12.
    const std::vector<bool> ov = {false, false, false, true, false, false, false, false, false,
                                  false, false, false, false};
    const std::vector<double> after = {16, 16, 16, 8, 8, 8, 8, 8, 16, 16, 16, 16, 32};
    for (std::size_t k = 0; k < ov.size(); ++k) {
      INFO("update " << k);
      CHECK(s.update(ov[k]) == ov[k]);
      CHECK(s.scale() == after[k]);
    }
    CHECK(s.last_overflow_iter() == 3);
    CHECK(s.clean_steps() == 9);
  }
  SECTION("an overflow absorbed by hysteresis") {
    loss_scaler s(dyn(4, 4, 2));
    // Update 3 overflows but only decrements hysteresis; the count still restarts, so
    // the doubling that update 4 would have brought comes at update 8.
    const std::vector<bool> ov = {false, false, false, true, false, false, false, false, false};
    const std::vector<double> after = {16, 16, 16, 16, 16, 16, 16, 16, 32};
    for (std::size_t k = 0; k < ov.size(); ++k) {
      INFO("update " << k);
      CHECK(s.update(ov[k]) == ov[k]);
      CHECK(s.scale() == after[k]);
    }
    CHECK(s.hysteresis_left() == 2);  // refilled by the growth
  }
}

TEST_CASE("loss_scaler: halving is clamped at the minimum, then overflow raises", "[zero]") {
  loss_scaler s(dyn(4, 1000, 1, false, /*min*/ 5.0));
  run_sequence(s, {
                      {true, 8, 1},  // 16 / 2
                      {true, 5, 1},  // max(8 / 2, 5)
                  });
  const auto before = s.save();
  CHECK_THROWS_AS(s.update(true), loss_scale_error);
  try {
    s.update(true);
    FAIL("expected loss_scale_error");
  } catch (const loss_scale_error& e) {
    const std::string msg = e.what();
    CHECK_THAT(msg, Contains("minimum"));
    CHECK_THAT(msg, Contains("min_loss_scale = 5"));
    CHECK_THAT(msg, Contains("diverged"));
    CHECK_THAT(msg, Contains("bf16"));
    CHECK_THAT(msg, Contains("learning rate"));
  }
  // Nothing changed by the failed updates.
  const auto after = s.save();
  CHECK(after.scale == before.scale);
  CHECK(after.hysteresis_left == before.hysteresis_left);
  CHECK(after.iter == before.iter);
  CHECK(after.last_overflow_iter == before.last_overflow_iter);
  CHECK(after.clean_steps == before.clean_steps);
  // The error is an mpzero::error too.
  CHECK_THROWS_AS(s.update(true), mpzero::error);
  // A clean step is still fine.
  CHECK_FALSE(s.update(false));
  CHECK(s.scale() == 5);
}

TEST_CASE("loss_scaler: an overflow at the minimum with hysteresis left does not raise", "[zero]") {
  // DeepSpeed only checks the minimum when it is about to halve.
  loss_scaler s(dyn(0, 1000, 2, false, 1.0));
  CHECK(s.scale() == 1.0);
  CHECK(s.update(true));
  CHECK(s.hysteresis_left() == 1);
  CHECK_THROWS_AS(s.update(true), loss_scale_error);
}

TEST_CASE("loss_scaler: static scale never changes, overflow still skips", "[zero]") {
  loss_scale_options o;
  o.dynamic = false;
  o.static_scale = 128.0;
  o.loss_scale_window = 1;  // unused by a static scale
  o.hysteresis = 1;
  loss_scaler s(o);
  CHECK_FALSE(s.dynamic());
  CHECK(s.inverse() == 1.0f / 128.0f);
  std::mt19937 rng(7);
  std::bernoulli_distribution coin(0.3);
  std::uint64_t clean_run = 0;
  for (int k = 0; k < 200; ++k) {
    const bool ov = coin(rng);
    CHECK(s.update(ov) == ov);
    clean_run = ov ? 0 : clean_run + 1;
    CHECK(s.scale() == 128.0);
    CHECK(s.hysteresis_left() == 0);
    CHECK(s.clean_steps() == clean_run);
  }
  // Many overflows in a row: no error (there is no minimum to hit).
  for (int k = 0; k < 50; ++k) CHECK(s.update(true));
  CHECK(s.scale() == 128.0);
}

TEST_CASE("loss_scaler: random sequences match DeepSpeed's rule", "[zero]") {
  std::mt19937 rng(12345);
  const double mins[] = {1.0, 0.25, 3.0, 8.0};
  int configs = 0, raised = 0;
  for (int power : {3, 6, 10}) {
    for (int window : {1, 2, 3, 7}) {
      for (int hyst : {1, 2, 3}) {
        for (bool consecutive : {false, true}) {
          for (double mn : mins) {
            if (std::ldexp(1.0, power) < mn) continue;
            for (double p_overflow : {0.05, 0.3, 0.7}) {
              ++configs;
              const auto o = dyn(power, window, hyst, consecutive, mn);
              loss_scaler s(o);
              ref_scaler r(o);
              std::bernoulli_distribution coin(p_overflow);
              long long clean_run = 0;
              for (int k = 0; k < 300; ++k) {
                const bool ov = coin(rng);
                INFO("power " << power << " window " << window << " hysteresis " << hyst << " consecutive "
                              << consecutive << " min " << mn << " p " << p_overflow << " update " << k);
                if (!r.update(ov)) {
                  CHECK_THROWS_AS(s.update(ov), loss_scale_error);
                  ++raised;
                  break;
                }
                REQUIRE(s.update(ov) == ov);
                clean_run = ov ? 0 : clean_run + 1;
                REQUIRE(s.scale() == r.cur_scale);
                REQUIRE(s.hysteresis_left() == r.cur_hysteresis);
                REQUIRE(s.inverse() == static_cast<float>(1.0 / r.cur_scale));
                REQUIRE(s.clean_steps() == static_cast<std::uint64_t>(clean_run));
                REQUIRE(s.iter() == static_cast<std::uint64_t>(r.cur_iter));
              }
            }
          }
        }
      }
    }
  }
  // The sweep exercised both outcomes.
  CHECK(configs > 100);
  CHECK(raised > 0);
}

TEST_CASE("loss_scaler: save/load round trip continues identically", "[zero]") {
  std::mt19937 rng(99);
  std::bernoulli_distribution coin(0.2);
  for (bool consecutive : {false, true}) {
    const auto o = dyn(12, 3, 3, consecutive, 1.0);
    for (int cut : {0, 1, 5, 17, 40}) {
      INFO("consecutive " << consecutive << " cut " << cut);
      std::vector<bool> ov(80);
      for (auto&& b : ov) b = coin(rng);
      loss_scaler a(o);
      ref_scaler r(o);
      for (int k = 0; k < cut; ++k) {
        REQUIRE(r.update(ov[k]));
        a.update(ov[k]);
      }
      const loss_scaler::state st = a.save();
      CHECK(st.scale == r.cur_scale);
      CHECK(st.hysteresis_left == r.cur_hysteresis);
      CHECK(st.iter == static_cast<std::uint64_t>(r.cur_iter));
      CHECK(st.last_overflow_iter == static_cast<std::uint64_t>(r.last_overflow_iter));  // -1 -> no_overflow
      loss_scaler b(o);  // fresh, then restored
      b.load(st);
      CHECK(b.scale() == a.scale());
      CHECK(b.hysteresis_left() == a.hysteresis_left());
      CHECK(b.clean_steps() == a.clean_steps());
      for (std::size_t k = cut; k < ov.size(); ++k) {
        REQUIRE(r.update(ov[k]));
        CHECK(b.update(ov[k]) == ov[k]);
        REQUIRE(b.scale() == r.cur_scale);
        REQUIRE(b.hysteresis_left() == r.cur_hysteresis);
      }
    }
  }
}

TEST_CASE("loss_scaler: load keeps a static scaler's configured scale", "[zero]") {
  loss_scale_options o;
  o.dynamic = false;
  o.static_scale = 64.0;
  loss_scaler s(o);
  s.load({/*scale*/ 1024.0, /*hysteresis_left*/ 0, /*clean_steps*/ 2, /*last_overflow_iter*/ 4, /*iter*/ 7});
  CHECK(s.scale() == 64.0);
  CHECK(s.clean_steps() == 2);
  CHECK(s.iter() == 7);
  CHECK(s.last_overflow_iter() == 4);
}

TEST_CASE("loss_scaler: load rejects states these options cannot hold", "[zero]") {
  loss_scaler s(dyn(8, 10, 2, false, 2.0));
  const auto good = s.save();
  auto bad = good;

  bad = good;
  bad.scale = 1.0;  // below min 2
  CHECK_THROWS_WITH(s.load(bad), Contains("min_loss_scale = 2"));
  bad.scale = std::numeric_limits<double>::infinity();
  CHECK_THROWS_AS(s.load(bad), invalid_argument);

  bad = good;
  bad.hysteresis_left = 3;
  CHECK_THROWS_WITH(s.load(bad), Contains("fp16.hysteresis = 2"));
  bad.hysteresis_left = 0;
  CHECK_THROWS_AS(s.load(bad), invalid_argument);

  bad = good;
  bad.iter = 5;
  bad.clean_steps = 4;  // no overflow yet, so it must equal iter
  CHECK_THROWS_WITH(s.load(bad), Contains("clean_steps = 4"));
  bad.last_overflow_iter = 5;  // not before iter
  CHECK_THROWS_WITH(s.load(bad), Contains("last_overflow_iter = 5"));
  bad.last_overflow_iter = 0;
  bad.clean_steps = 4;  // 5 - 0 - 1: consistent
  CHECK_NOTHROW(s.load(bad));
  CHECK(s.clean_steps() == 4);

  // A failed load changes nothing.
  const auto kept = s.save();
  bad.scale = 0.5;
  CHECK_THROWS(s.load(bad));
  CHECK(s.save().scale == kept.scale);
  CHECK(s.save().iter == kept.iter);
}

TEST_CASE("loss_scaler: option validation names the key and the fix", "[zero]") {
  auto rejects = [](loss_scale_options o, const char* key) {
    INFO("key " << key);
    CHECK_THROWS_AS(loss_scaler(o), invalid_argument);
    CHECK_THROWS_WITH(loss_scaler(o), Contains(key));
  };
  auto o = dyn(16, 1000, 2);
  o.loss_scale_window = 0;
  rejects(o, "fp16.loss_scale_window = 0");
  o = dyn(16, -3, 2);
  rejects(o, "fp16.loss_scale_window = -3");
  o = dyn(16, 1000, 0);
  rejects(o, "fp16.hysteresis = 0");
  o = dyn(65, 1000, 2);
  rejects(o, "fp16.initial_scale_power = 65");
  o = dyn(-65, 1000, 2);
  rejects(o, "fp16.initial_scale_power = -65");
  o = dyn(16, 1000, 2, false, 0.0);
  rejects(o, "fp16.min_loss_scale = 0");
  o = dyn(16, 1000, 2, false, -1.0);
  rejects(o, "fp16.min_loss_scale = -1");
  o = dyn(16, 1000, 2, false, std::numeric_limits<double>::quiet_NaN());
  rejects(o, "fp16.min_loss_scale");
  o = dyn(2, 1000, 2, false, 8.0);  // 2^2 < 8
  rejects(o, "min_loss_scale = 8");

  loss_scale_options st;
  st.dynamic = false;
  for (double v : {0.0, -2.0, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    st.static_scale = v;
    rejects(st, "fp16.loss_scale");
  }
  // A static scale ignores the dynamic keys, as DeepSpeed does.
  st.static_scale = 4.0;
  st.loss_scale_window = 0;
  st.hysteresis = 0;
  st.min_loss_scale = 0;
  st.initial_scale_power = 1000;
  CHECK_NOTHROW(loss_scaler(st));

  // The range ends are accepted.
  CHECK(loss_scaler(dyn(64, 1, 1, false, 1.0)).scale() == std::ldexp(1.0, 64));
  CHECK(loss_scaler(dyn(-64, 1, 1, false, std::ldexp(1.0, -64))).inverse() == std::ldexp(1.0f, 64));
}

TEST_CASE("clip_coefficient: DeepSpeed's max_norm / (norm + 1e-6), only below 1", "[zero]") {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  struct row {
    double norm, max_norm;
    long double expect;  // from the formula, in long double
  };
  const long double eps = 1e-6L;
  const row table[] = {
      {0.0, 1.0, 1.0L},                                   // 1 / 1e-6 >= 1: no clipping
      {0.5, 1.0, 1.0L},                                   // below the threshold
      {1.0, 1.0, 1.0L / (1.0L + eps)},                    // equal: coefficient just below 1 is applied
      {4.0, 1.0, 1.0L / (4.0L + eps)},                    // above
      {1e6, 0.5, 0.5L / (1e6L + eps)},                    // far above
      {2.0, 2.0, 2.0L / (2.0L + eps)},                    // equal, another threshold
      {0.0, 1e-7, 1e-7L / eps},                           // a tiny max_norm clips even a zero gradient
      {3.0, 0.0, 1.0L},                                   // 0 disables
      {3.0, -1.0, 1.0L},                                  // negative disables
      {3.0, nan, 1.0L},                                   // NaN disables
      {3.0, inf, 1.0L},                                   // infinite threshold never clips
      {nan, 1.0, 1.0L},                                   // non-finite norm: the step is skipped anyway
      {inf, 1.0, 1.0L},
      {-inf, 1.0, 1.0L},
      {-1.0, 1.0, 1.0L},                                  // DeepSpeed's masked-norm sentinel
  };
  for (const auto& t : table) {
    INFO("norm " << t.norm << " max_norm " << t.max_norm);
    const double got = clip_coefficient(t.norm, t.max_norm);
    CHECK(got <= 1.0);
    CHECK(got == Approx(static_cast<double>(t.expect)).epsilon(1e-15));
  }
  // Exactly 1 (not merely close) whenever clipping does not apply.
  CHECK(clip_coefficient(0.5, 1.0) == 1.0);
  CHECK(clip_coefficient(nan, 1.0) == 1.0);
  CHECK(clip_coefficient(3.0, 0.0) == 1.0);
  CHECK(clip_coefficient(1.0, 1.0) < 1.0);
  // Usable in constant expressions (and so on the device).
  static_assert(clip_coefficient(0.5, 1.0) == 1.0);
  static_assert(clip_coefficient(3.0, 0.0) == 1.0);
  static_assert(clip_coefficient(9.0, 1.0) < 1.0);
}

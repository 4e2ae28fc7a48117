// Flat layouts and bucket plans.
//
// The reference model below lays the buffer out element by element (walk the
// parameters, then walk the partitions counting elements) and never calls the code
// under test, so every offset, owner, segment and count is checked against a
// brute-force answer rather than the same formula written twice.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <mpzero/partition/bucket_plan.hpp>
#include <mpzero/partition/flat_layout.hpp>

using namespace mpzero;
using Catch::Matchers::Contains;

namespace {

constexpr long padding_param = -1;

// Per-element brute force. Small shapes only: it stores one entry per element.
struct reference {
  std::vector<std::uint64_t> numels;
  int ws;
  std::uint64_t align;
  std::uint64_t total = 0, padded = 0, part = 0;
  std::vector<std::vector<std::uint64_t>> flat_of;  // flat index of element e of param p
  std::vector<long> param_at;                        // param at flat index, or padding_param
  std::vector<std::uint64_t> elem_at;                // element index within that param
  std::vector<int> owner;                            // rank holding each flat index
  std::vector<std::uint64_t> offset;                 // first flat index of each param

  reference(std::vector<std::uint64_t> n, int world, std::uint64_t al) : numels(std::move(n)), ws(world), align(al) {
    for (std::size_t p = 0; p < numels.size(); ++p) {
      offset.push_back(total);
      flat_of.emplace_back();
      for (std::uint64_t e = 0; e < numels[p]; ++e) {
        flat_of[p].push_back(total);
        param_at.push_back(static_cast<long>(p));
        elem_at.push_back(e);
        ++total;
      }
    }
    // Smallest multiple of ws * align that holds every element, found by stepping.
    while (padded < total) padded += static_cast<std::uint64_t>(ws) * align;
    part = padded / static_cast<std::uint64_t>(ws);
    param_at.resize(padded, padding_param);
    elem_at.resize(padded, 0);
    int rank = 0;
    std::uint64_t in_rank = 0;
    for (std::uint64_t f = 0; f < padded; ++f) {
      owner.push_back(rank);
      if (++in_rank == part) {
        ++rank;
        in_rank = 0;
      }
    }
  }
};

// Checks that `segs` lists exactly the parameter elements of `r`, once each, in flat order.
void check_segments_of_range(const reference& ref, const std::vector<segment>& segs, flat_range r) {
  std::uint64_t expected_next = r.begin;  // segments must be strictly increasing and disjoint
  std::vector<int> seen(r.size(), 0);
  for (const segment& s : segs) {
    INFO("segment param " << s.param << " param_offset " << s.param_offset << " flat_offset " << s.flat_offset
                          << " count " << s.count);
    REQUIRE(s.param < ref.numels.size());
    REQUIRE(s.count > 0);
    REQUIRE(s.param_offset + s.count <= ref.numels[s.param]);
    CHECK(s.flat_offset >= expected_next);
    REQUIRE(s.flat_offset >= r.begin);
    REQUIRE(s.flat_offset + s.count <= r.end);
    expected_next = s.flat_offset + s.count;
    for (std::uint64_t i = 0; i < s.count; ++i) {
      const std::uint64_t f = ref.flat_of[s.param][s.param_offset + i];
      REQUIRE(f == s.flat_offset + i);
      ++seen[f - r.begin];
    }
  }
  for (std::uint64_t f = r.begin; f < r.end; ++f) {
    INFO("flat index " << f);
    CHECK(seen[f - r.begin] == (ref.param_at[f] == padding_param ? 0 : 1));
  }
}

// Checks every observable of `layout` against the brute-force reference.
void check_layout(const reference& ref, const flat_layout& layout) {
  INFO("world_size " << ref.ws << ", align " << ref.align << ", params " << ref.numels.size() << ", total "
                     << ref.total);
  REQUIRE(layout.world_size() == ref.ws);
  REQUIRE(layout.num_params() == ref.numels.size());
  REQUIRE(layout.total_numel() == ref.total);
  REQUIRE(layout.padded_numel() == ref.padded);
  REQUIRE(layout.partition_numel() == ref.part);
  CHECK(layout.padding() == flat_range{ref.total, ref.padded});

  // Alignment: every slice has a multiple of align elements and starts at one.
  CHECK(layout.partition_numel() % ref.align == 0);
  CHECK(layout.padded_numel() - layout.total_numel() < static_cast<std::uint64_t>(ref.ws) * ref.align);

  for (std::size_t p = 0; p < ref.numels.size(); ++p) {
    CHECK(layout.offset(p) == ref.offset[p]);
    CHECK(layout.numel(p) == ref.numels[p]);
    CHECK(layout.param_range(p) == flat_range{ref.offset[p], ref.offset[p] + ref.numels[p]});
  }
  for (std::uint64_t f = 0; f < ref.padded; ++f) {
    INFO("flat index " << f);
    REQUIRE(layout.owner(f) == ref.owner[f]);
  }

  // Partitions tile the padded buffer; their segments tile every parameter exactly
  // once, and each element is listed by the rank the reference says owns it.
  std::vector<std::vector<int>> times_listed(ref.numels.size());
  for (std::size_t p = 0; p < ref.numels.size(); ++p) times_listed[p].assign(ref.numels[p], 0);
  std::uint64_t next_begin = 0;
  for (int k = 0; k < ref.ws; ++k) {
    INFO("rank " << k);
    const flat_range part = layout.partition(k);
    CHECK(part.begin == next_begin);
    CHECK(part.size() == ref.part);
    CHECK(part.begin % ref.align == 0);
    next_begin = part.end;
    const std::vector<segment> segs = layout.segments(part);
    check_segments_of_range(ref, segs, part);
    std::uint64_t listed = 0;
    for (const segment& s : segs) {
      listed += s.count;
      for (std::uint64_t i = 0; i < s.count; ++i) {
        ++times_listed[s.param][s.param_offset + i];
        CHECK(ref.owner[ref.flat_of[s.param][s.param_offset + i]] == k);
      }
    }
    std::uint64_t ref_params_here = 0;
    for (std::uint64_t f = part.begin; f < part.end; ++f) ref_params_here += ref.param_at[f] != padding_param;
    CHECK(listed == ref_params_here);

    const std::vector<std::uint64_t> counts = layout.rank_counts(part);
    REQUIRE(counts.size() == static_cast<std::size_t>(ref.ws));
    for (int j = 0; j < ref.ws; ++j) CHECK(counts[static_cast<std::size_t>(j)] == (j == k ? ref.part : 0));
  }
  CHECK(next_begin == ref.padded);
  for (std::size_t p = 0; p < ref.numels.size(); ++p) {
    for (std::uint64_t e = 0; e < ref.numels[p]; ++e) {
      INFO("param " << p << " element " << e);
      REQUIRE(times_listed[p][e] == 1);
    }
  }
}

// rank_counts and segments of an arbitrary range against per-element counting.
void check_range(const reference& ref, const flat_layout& layout, flat_range r) {
  INFO("range [" << r.begin << ", " << r.end << ")");
  const std::vector<std::uint64_t> counts = layout.rank_counts(r);
  REQUIRE(counts.size() == static_cast<std::size_t>(ref.ws));
  std::vector<std::uint64_t> brute(static_cast<std::size_t>(ref.ws), 0);
  for (std::uint64_t f = r.begin; f < r.end; ++f) ++brute[static_cast<std::size_t>(ref.owner[f])];
  CHECK(counts == brute);
  std::uint64_t sum = 0;
  for (std::uint64_t c : counts) sum += c;
  CHECK(sum == r.size());
  check_segments_of_range(ref, layout.segments(r), r);
}

// Structural properties of a bucket plan, with the layout's numbers from the reference.
void check_buckets(const reference& ref, const bucket_plan& plan, std::uint64_t bucket_numel) {
  INFO("bucket_numel " << bucket_numel);
  const std::size_t n = ref.numels.size();
  const auto buckets = plan.buckets();
  if (n == 0) {
    CHECK(buckets.empty());
    return;
  }
  REQUIRE(!buckets.empty());
  CHECK(buckets.front().first_param == 0);
  CHECK(buckets.back().end_param == n);
  CHECK(buckets.front().range.begin == 0);
  // Padding belongs to no bucket.
  CHECK(buckets.back().range.end == ref.total);
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    INFO("bucket " << b);
    const bucket& bk = buckets[b];
    REQUIRE(bk.first_param < bk.end_param);
    std::uint64_t size = 0;
    std::size_t nonzero = 0;
    for (std::size_t p = bk.first_param; p < bk.end_param; ++p) {
      size += ref.numels[p];
      nonzero += ref.numels[p] > 0;
      CHECK(plan.bucket_of(p) == b);
    }
    CHECK(bk.range == flat_range{ref.offset[bk.first_param], ref.offset[bk.first_param] + size});
    // Over the limit only as a single large parameter (zero-size ones may sit beside it).
    if (size > bucket_numel) CHECK(nonzero == 1);
    // A bucket without elements only when the whole group has none.
    if (size == 0) CHECK((ref.total == 0 && buckets.size() == 1));
    if (b + 1 < buckets.size()) {
      const bucket& next = buckets[b + 1];
      CHECK(next.first_param == bk.end_param);
      CHECK(next.range.begin == bk.range.end);
      // Greedy: the next bucket's first non-empty parameter did not fit in this one.
      std::size_t q = next.first_param;
      while (q < next.end_param && ref.numels[q] == 0) ++q;
      REQUIRE(q < next.end_param);
      CHECK(size + ref.numels[q] > bucket_numel);
    }
  }
}

flat_layout make_layout(const reference& ref) {
  return flat_layout(ref.numels, ref.ws, flat_layout_options{ref.align});
}

}  // namespace

TEST_CASE("flat_layout: parameter count not divisible by the world size", "[partition]") {
  // 3 parameters over 2 and 4 ranks; with align 1 and 4 ranks: 15 elements pad to 16,
  // slices of 4, so param 1 ([5, 12)) is split 3 / 4 between ranks 1 and 2.
  const std::vector<std::uint64_t> numels{5, 7, 3};
  for (int ws : {2, 4}) {
    for (std::uint64_t align : {1u, 8u}) {
      const reference ref(numels, ws, align);
      const flat_layout layout = make_layout(ref);
      check_layout(ref, layout);
      for (std::size_t p = 0; p < numels.size(); ++p) check_range(ref, layout, layout.param_range(p));
    }
  }
  const flat_layout layout(numels, 4, flat_layout_options{1});
  CHECK(layout.rank_counts(layout.param_range(1)) == std::vector<std::uint64_t>{0, 3, 4, 0});
}

TEST_CASE("flat_layout: 3 ranks, two tiny parameters, ranks owning only padding", "[partition]") {
  // Default align 8: 5 elements pad to 24, slices of 8; rank 0 holds everything.
  const std::vector<std::uint64_t> numels{2, 3};
  const reference ref(numels, 3, 8);
  const flat_layout layout(numels, 3);
  check_layout(ref, layout);
  CHECK(layout.partition_numel() == 8);
  CHECK(layout.segments(layout.partition(0)).size() == 2);
  CHECK(layout.segments(layout.partition(1)).empty());
  CHECK(layout.segments(layout.partition(2)).empty());
  CHECK(layout.rank_counts(layout.param_range(1)) == std::vector<std::uint64_t>{3, 0, 0});
  CHECK(layout.owner(layout.padded_numel() - 1) == 2);
  CHECK(layout.rank_counts(layout.padding()) == std::vector<std::uint64_t>{3, 8, 8});

  // Align 1: 5 elements pad to 6, slices of 2; param 1 straddles ranks 1 and 2,
  // and rank 2's slice ends in one element of padding.
  const reference ref1(numels, 3, 1);
  const flat_layout layout1(numels, 3, flat_layout_options{1});
  check_layout(ref1, layout1);
  CHECK(layout1.segments(layout1.partition(2)) == std::vector<segment>{segment{1, 2, 4, 1}});
}

TEST_CASE("flat_layout: zero-size parameters first, in the middle and last", "[partition]") {
  const std::vector<std::uint64_t> numels{0, 5, 0, 0, 9, 0};
  for (int ws = 1; ws <= 4; ++ws) {
    for (std::uint64_t align : {1u, 2u, 8u}) {
      const reference ref(numels, ws, align);
      const flat_layout layout = make_layout(ref);
      check_layout(ref, layout);
      for (std::size_t p = 0; p < numels.size(); ++p) {
        const flat_range pr = layout.param_range(p);
        if (numels[p] == 0) {
          CHECK(pr.empty());
          CHECK(layout.segments(pr).empty());
        }
        check_range(ref, layout, pr);
      }
      // No segment ever names a zero-size parameter.
      const std::vector<segment> all = layout.segments({0, layout.padded_numel()});
      for (const segment& s : all) CHECK(numels[s.param] > 0);
      CHECK(all.size() == 2);

      for (std::uint64_t bucket_numel : {1u, 5u, 9u, 13u, 14u, 100u}) {
        const bucket_plan plan(layout, bucket_numel);
        check_buckets(ref, plan, bucket_numel);
        // Each zero-size parameter shares a bucket with a neighbour.
        for (std::size_t p = 0; p < numels.size(); ++p) {
          if (numels[p] != 0) continue;
          const bool with_prev = p > 0 && plan.bucket_of(p - 1) == plan.bucket_of(p);
          const bool with_next = p + 1 < numels.size() && plan.bucket_of(p + 1) == plan.bucket_of(p);
          CHECK((with_prev || with_next));
        }
      }
    }
  }
}

TEST_CASE("flat_layout: one parameter straddling several partitions", "[partition]") {
  // 105 elements over 4 ranks, align 8: pad to 128, slices of 32. Param 1 is [3, 103).
  const std::vector<std::uint64_t> numels{3, 100, 2};
  const reference ref(numels, 4, 8);
  const flat_layout layout(numels, 4);
  check_layout(ref, layout);
  check_range(ref, layout, layout.param_range(1));
  CHECK(layout.rank_counts(layout.param_range(1)) == std::vector<std::uint64_t>{29, 32, 32, 7});
  // Param 1's pieces, rank by rank, continue each other in parameter coordinates.
  std::uint64_t next = 0;
  for (int k = 0; k < 4; ++k) {
    for (const segment& s : layout.segments(layout.partition(k))) {
      if (s.param != 1) continue;
      CHECK(s.param_offset == next);
      next += s.count;
    }
  }
  CHECK(next == 100);
}

TEST_CASE("flat_layout: world sizes 1 to 8 and alignments", "[partition]") {
  const std::vector<std::uint64_t> numels{7, 1, 64, 0, 33, 5};
  for (int ws = 1; ws <= 8; ++ws) {
    for (std::uint64_t align : {1u, 2u, 3u, 8u, 16u}) {
      const reference ref(numels, ws, align);
      const flat_layout layout = make_layout(ref);
      check_layout(ref, layout);
      check_range(ref, layout, {0, layout.padded_numel()});
    }
  }
  // Default options: every slice starts on a 16-byte boundary for a 16-bit type.
  for (int ws = 1; ws <= 8; ++ws) {
    const flat_layout layout(numels, ws);
    for (int k = 0; k < ws; ++k) CHECK(layout.partition(k).begin * sizeof(std::uint16_t) % 16 == 0);
    // Reference mechanics: the padded buffer is a multiple of 2 x world size.
    CHECK(layout.padded_numel() % (2u * static_cast<std::uint64_t>(ws)) == 0);
  }
}

TEST_CASE("flat_layout and bucket_plan: random shapes against the brute-force reference", "[partition]") {
  std::mt19937_64 rng(20240611);
  const std::uint64_t aligns[] = {1, 2, 3, 4, 8, 16};
  for (int iter = 0; iter < 400; ++iter) {
    const int ws = 1 + static_cast<int>(rng() % 8);
    const std::uint64_t align = aligns[rng() % 6];
    const std::size_t n = rng() % 13;
    std::vector<std::uint64_t> numels(n);
    for (auto& x : numels) {
      const auto kind = rng() % 10;
      x = kind < 3 ? 0 : kind < 8 ? 1 + rng() % 40 : 1 + rng() % 600;
    }
    INFO("iteration " << iter);
    const reference ref(numels, ws, align);
    const flat_layout layout = make_layout(ref);
    check_layout(ref, layout);
    for (int j = 0; j < 6; ++j) {
      const std::uint64_t a = ref.padded ? rng() % (ref.padded + 1) : 0;
      const std::uint64_t b = ref.padded ? rng() % (ref.padded + 1) : 0;
      check_range(ref, layout, {std::min(a, b), std::max(a, b)});
    }
    for (int j = 0; j < 3; ++j) {
      const std::uint64_t bucket_numel = 1 + rng() % (j == 0 ? 8 : j == 1 ? 120 : 3000);
      check_buckets(ref, bucket_plan(layout, bucket_numel), bucket_numel);
    }
  }
}

TEST_CASE("bucket_plan: boundaries and parameters larger than the bucket", "[partition]") {
  auto params_of = [](const bucket_plan& plan) {
    std::vector<std::pair<std::size_t, std::size_t>> v;
    for (const bucket& b : plan.buckets()) v.emplace_back(b.first_param, b.end_param);
    return v;
  };
  using pairs = std::vector<std::pair<std::size_t, std::size_t>>;
  const std::vector<std::uint64_t> four{4, 4, 4, 4};
  const flat_layout even(four, 3);
  CHECK(params_of(bucket_plan(even, 8)) == pairs{{0, 2}, {2, 4}});   // exactly full buckets
  CHECK(params_of(bucket_plan(even, 7)) == pairs{{0, 1}, {1, 2}, {2, 3}, {3, 4}});
  CHECK(params_of(bucket_plan(even, 12)) == pairs{{0, 3}, {3, 4}});
  CHECK(params_of(bucket_plan(even, 1000)) == pairs{{0, 4}});
  const bucket_plan whole(even, 1000);
  CHECK(whole.buckets()[0].range == flat_range{0, 16});  // ends at total (16), not at padded (24)
  CHECK(even.padded_numel() == 24);

  // A parameter larger than the bucket sits alone; its neighbours do not join it.
  const std::vector<std::uint64_t> big_middle{3, 20, 3};
  const flat_layout lb(big_middle, 2);
  const bucket_plan pb(lb, 8);
  CHECK(params_of(pb) == pairs{{0, 1}, {1, 2}, {2, 3}});
  CHECK(pb.buckets()[1].range == flat_range{3, 23});
  CHECK(params_of(bucket_plan(lb, 26)) == pairs{{0, 3}});
  const std::vector<std::uint64_t> big_first{50, 1, 1};
  CHECK(params_of(bucket_plan(flat_layout(big_first, 2), 10)) == pairs{{0, 1}, {1, 3}});

  // A split starts a new bucket at that parameter, whatever room is left; none at 0 or
  // past the end. A zero-size parameter at the split stays with the bucket before it
  // (it holds no elements), and the next parameter with elements starts the new one.
  CHECK(params_of(bucket_plan(even, 1000, 2)) == pairs{{0, 2}, {2, 4}});
  CHECK(params_of(bucket_plan(even, 1000, 3)) == pairs{{0, 3}, {3, 4}});
  CHECK(params_of(bucket_plan(even, 8, 1)) == pairs{{0, 1}, {1, 3}, {3, 4}});  // then 8 per bucket again
  CHECK(params_of(bucket_plan(even, 1000, 0)) == pairs{{0, 4}});
  CHECK(params_of(bucket_plan(even, 1000, 4)) == pairs{{0, 4}});
  const std::vector<std::uint64_t> empty_at_split{4, 0, 4, 4};
  CHECK(params_of(bucket_plan(flat_layout(empty_at_split, 2), 1000, 1)) == pairs{{0, 2}, {2, 4}});
  const bucket_plan split(even, 1000, 2);
  CHECK(split.buckets()[1].range == flat_range{8, 16});
  CHECK(split.bucket_of(1) == 0);
  CHECK(split.bucket_of(2) == 1);

  // Launch order: last-first, the buckets from the split on after the others.
  auto order_of = [](const bucket_plan& plan) {
    return std::vector<std::size_t>(plan.launch_order().begin(), plan.launch_order().end());
  };
  using order = std::vector<std::size_t>;
  CHECK(order_of(bucket_plan(even, 7)) == order{3, 2, 1, 0});        // no split
  CHECK(order_of(bucket_plan(even, 7, 2)) == order{1, 0, 3, 2});     // {0}, {1} | {2}, {3}
  CHECK(order_of(bucket_plan(even, 8, 1)) == order{0, 2, 1});        // {0} | {1, 2}, {3}
  CHECK(order_of(bucket_plan(even, 7, 0)) == order{3, 2, 1, 0});     // all from the split on
  CHECK(order_of(bucket_plan(even, 7, 4)) == order{3, 2, 1, 0});     // none
  const std::vector<std::uint64_t> none;
  const bucket_plan empty_split(flat_layout(none, 4), 8, 0);
  CHECK(empty_split.launch_order().empty());

  // Degenerate groups.
  const bucket_plan empty(flat_layout(none, 4), 8);
  CHECK(empty.buckets().empty());
  const std::vector<std::uint64_t> zeros{0, 0};
  const flat_layout lz(zeros, 4);
  CHECK(lz.padded_numel() == 0);
  CHECK(lz.partition(3) == flat_range{0, 0});
  CHECK(lz.segments(lz.partition(3)).empty());
  const bucket_plan pz(lz, 8);
  REQUIRE(pz.buckets().size() == 1);
  CHECK(pz.buckets()[0] == bucket{0, 2, {0, 0}});
  CHECK(pz.bucket_of(1) == 0);
}

TEST_CASE("flat_layout: default-constructed objects are empty", "[partition]") {
  const flat_layout layout;
  CHECK(layout.world_size() == 1);
  CHECK(layout.num_params() == 0);
  CHECK(layout.padded_numel() == 0);
  CHECK(layout.segments({0, 0}).empty());
  CHECK(layout.rank_counts({0, 0}) == std::vector<std::uint64_t>{0});
  const bucket_plan plan;
  CHECK(plan.buckets().empty());
  CHECK_THROWS_AS(plan.bucket_of(0), invalid_argument);
}

TEST_CASE("flat_layout: 64-bit sizes", "[partition]") {
  // Over 2^32 elements per parameter; sizes from 128-bit arithmetic, not the layout's.
  const std::uint64_t big = 3ull << 32;
  const std::vector<std::uint64_t> numels{big, 5, 1ull << 33};
  const int ws = 3;
  const flat_layout layout(numels, ws);
  using u128 = unsigned __int128;
  const u128 total = u128(big) + 5 + (u128(1) << 33);
  const u128 unit = u128(ws) * 8;
  const u128 padded = (total + unit - 1) / unit * unit;
  CHECK(layout.total_numel() == static_cast<std::uint64_t>(total));
  CHECK(layout.padded_numel() == static_cast<std::uint64_t>(padded));
  CHECK(layout.offset(2) == big + 5);
  std::uint64_t sum = 0;
  for (int k = 0; k < ws; ++k) {
    for (const segment& s : layout.segments(layout.partition(k))) {
      CHECK(s.flat_offset == layout.offset(s.param) + s.param_offset);
      sum += s.count;
    }
  }
  CHECK(sum == static_cast<std::uint64_t>(total));
  const auto counts = layout.rank_counts(layout.param_range(0));
  CHECK(counts[0] + counts[1] + counts[2] == big);
  CHECK(layout.owner(static_cast<std::uint64_t>(padded) - 1) == ws - 1);
  const bucket_plan plan(layout, 1ull << 32);
  CHECK(plan.buckets().size() == 3);  // each big parameter alone, and the 5 between them alone
}

TEST_CASE("flat_layout and bucket_plan: invalid arguments name the value", "[partition]") {
  const std::vector<std::uint64_t> numels{4, 4};
  CHECK_THROWS_AS(flat_layout(numels, 0), invalid_argument);
  CHECK_THROWS_WITH(flat_layout(numels, 0), Contains("world_size = 0"));
  CHECK_THROWS_WITH(flat_layout(numels, -3), Contains("world_size = -3"));
  CHECK_THROWS_AS(flat_layout(numels, 2, flat_layout_options{0}), invalid_argument);
  CHECK_THROWS_WITH(flat_layout(numels, 2, flat_layout_options{0}), Contains("align_elements = 0"));

  const flat_layout layout(numels, 2);
  CHECK_THROWS_AS(layout.offset(2), invalid_argument);
  CHECK_THROWS_WITH(layout.numel(7), Contains("7") && Contains("2 parameters"));
  CHECK_THROWS_AS(layout.param_range(2), invalid_argument);
  CHECK_THROWS_WITH(layout.partition(2), Contains("rank = 2"));
  CHECK_THROWS_AS(layout.partition(-1), invalid_argument);
  CHECK_THROWS_WITH(layout.owner(layout.padded_numel()), Contains(std::to_string(layout.padded_numel())));
  CHECK_THROWS_AS(layout.segments({0, layout.padded_numel() + 1}), invalid_argument);
  CHECK_THROWS_AS(layout.segments({5, 4}), invalid_argument);
  CHECK_THROWS_AS(layout.rank_counts({0, layout.padded_numel() + 1}), invalid_argument);

  CHECK_THROWS_WITH(bucket_plan(layout, 0), Contains("bucket_numel = 0"));
  CHECK_THROWS_WITH(bucket_plan(layout, 4).bucket_of(2), Contains("parameter index 2"));

  // Totals and padding past 2^64 - 1 are refused rather than wrapped.
  const std::uint64_t max64 = std::numeric_limits<std::uint64_t>::max();
  const std::vector<std::uint64_t> too_many{max64, 1};
  CHECK_THROWS_AS(flat_layout(too_many, 1), invalid_argument);
  const std::vector<std::uint64_t> no_room_for_padding{max64 - 3};
  CHECK_THROWS_AS(flat_layout(no_room_for_padding, 2), invalid_argument);
  CHECK_THROWS_AS(flat_layout(numels, std::numeric_limits<int>::max(), flat_layout_options{max64 / 2}),
                  invalid_argument);
}

// mpzero: the gradient side of the ZeRO core: accumulation of reported gradients, their
// reduction over the ranks (stages 0-1 at the step; stages 2-3 in buckets while backward
// runs), and ZeRO-Offload's transfer of the reduced shard to host memory. Private to
// zero/core.hpp.
//
// Memory. Stages 2-3 reduce buckets of at most reduce_bucket_numel elements: a parameter
// larger than that is reduced in pieces (bucket_plan with pieces). A bucket's staging
// buffer is sized to the bucket and is reduce-scattered in place (no receive buffer);
// at most max_in_flight reductions are in flight, and every communication buffer is
// freed at the end of the step (docs/precision.md, "Communication buffers").
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "../partition/bucket_plan.hpp"
#include "core_state.hpp"

namespace mpzero::detail {

class grad_reducer {
 public:
  // Reductions (one per bucket) in flight at once; a further launch completes the oldest.
  static constexpr std::size_t max_in_flight = 2;

  explicit grad_reducer(core_state& st)
      : s_(st), staging_(st.grad_t(), st.dev_meter), wire_(st.dev_meter), host_(st.host_meter) {}

  grad_reducer(const grad_reducer&) = delete;
  grad_reducer& operator=(const grad_reducer&) = delete;

  // Transfers and reductions still in flight (an exception left backward midway) finish,
  // or reach the communicator's deadline, before their buffers go.
  ~grad_reducer() {
    for (auto& f : pending_) {
      for (auto& part : f.parts) quietly(part.request);
    }
    try {
      for (auto& d : downloads_) d.transfer.wait();
    } catch (...) {  // a failed device: nothing left to protect
    }
  }

  // Stages 2-3: the bucket plan, after the layout (small parameters, placed last from
  // slot n_large on, get buckets of their own).
  void plan(std::size_t n_large) {
    const std::size_t n = s_.layout.num_params();
    small_from_ = n_large;
    // A bucket per reduce_bucket_numel elements (and per parameter at most): refuse a plan
    // whose bookkeeping alone would be larger than the buffers it bounds.
    const std::uint64_t most = s_.layout.total_numel() / s_.zo.reduce_bucket_numel + n + 1;
    if (most > (std::uint64_t{1} << 26)) {
      throw_invalid("ZeroOptimizer: reduce_bucket_numel = " + std::to_string(s_.zo.reduce_bucket_numel) + " cuts " +
                    std::to_string(s_.layout.total_numel()) + " elements into up to " + std::to_string(most) +
                    " buckets; use a larger bucket (DeepSpeed's default is 5e8 elements)");
    }
    buckets_ = bucket_plan(s_.layout, s_.zo.reduce_bucket_numel, n_large, /*pieces=*/true);
    const std::size_t nb = buckets_.num_buckets();
    bucket_runs_.assign(nb, {});
    for (std::size_t b = 0; b < nb; ++b) {
      const flat_range br = buckets_.buckets()[b].range;
      for (const wire_run& run : s_.runs) {
        const flat_range r = intersect(run.range, br);
        if (!r.empty()) bucket_runs_[b].push_back(wire_run{r, run.wire});
      }
      // A bucket of empty parameters still takes part (a reduction of nothing).
      if (bucket_runs_[b].empty()) bucket_runs_[b].push_back(wire_run{br, s_.spec.wire});
    }
    // One rank reduces nothing: a bucket whose gradients travel in the gradient dtype (no
    // wire rounding to keep) accumulates straight into the partition, which at world size
    // 1 is the whole gradient (adds_in_place). With offload on a device backend the
    // partition is in host memory and the reports are not: the staged bucket goes there as
    // it is (send_to_host).
    direct_.assign(nb, 0);
    for (std::size_t b = 0; b < nb; ++b) {
      direct_[b] = s_.world == 1 && std::all_of(bucket_runs_[b].begin(), bucket_runs_[b].end(),
                                                [&](const wire_run& w) { return w.wire == s_.grad_t(); });
    }
    params_in_bucket_.assign(nb, 0);
    for (std::size_t p = 0; p < n; ++p) {
      const auto [first, end] = buckets_.buckets_of(p);
      for (std::size_t b = first; b < end; ++b) ++params_in_bucket_[b];
    }
    remaining_ = params_in_bucket_;
    staging_of_.assign(nb, -1);
    launched_.assign(nb, 0);
    dirty_.assign(nb, 0);
    reported_.assign(n, 0);
    launch_pos_ = 0;
  }

  const bucket_plan& buckets() const noexcept { return buckets_; }

  // Stages 2-3: adds src * scale (slot s's gradient, dtype t) to its bucket(s), piece by
  // piece in launch order, launching each bucket that completes.
  void report(std::size_t s, const void* src, dtype t, float scale) {
    const flat_range r = s_.layout.param_range(s);
    const auto [first, end] = buckets_.buckets_of(s);
    const bool again = reported_[s] != 0;
    reported_[s] = 1;
    for (std::size_t b = end; b-- > first;) {
      const bucket& bk = buckets_.buckets()[b];
      const flat_range piece = intersect(r, bk.range);
      const void* from = static_cast<const unsigned char*>(src) + (piece.begin - r.begin) * size_of(t);
      if (adds_in_place(b)) {
        const std::uint64_t at = piece.begin - s_.shard.begin;
        if (s_.offloaded()) {
          s_.host.accumulate(s_.h_grads.at(at), s_.grad_t(), from, t, piece.size(), scale);
        } else {
          s_.be.accumulate(s_.grads.at(at), s_.grad_t(), from, t, piece.size(), scale);
        }
      } else {
        if (staging_of_[b] < 0) staging_of_[b] = acquire_staging(b);
        s_.be.accumulate(offset(staging_.data(staging_of_[b]), piece.begin - bk.range.begin, s_.grad_t()), s_.grad_t(),
                         from, t, piece.size(), scale);
      }
      if (!again) {
        if (--remaining_[b] == 0) launch_ready();
      } else if (launched_[b] && !adds_in_place(b)) {
        dirty_[b] = 1;  // reported again after its bucket went: reduce (or send) it once more at end_pass()
      }
    }
  }

  // Stages 2-3: ends one backward pass. Every bucket still pending is reduced (parameters
  // that got no gradient count as zero); a parameter reported again after its bucket was
  // reduced (a second backward through it, or a shared weight) makes its bucket dirty, and
  // all ranks agree on the dirty set so that they issue the same reductions in order.
  void end_pass() {
    launch_all_remaining();
    if (!dirty_.empty()) {
      if (s_.world > 1) s_.be.all_reduce_host(s_.comm, dirty_.data(), dirty_.size(), comm::reduce_op::max);
      for (std::size_t b = dirty_.size(); b-- > 0;) {
        if (dirty_[b]) launch(b);
      }
    }
    drain();
    std::fill(reported_.begin(), reported_.end(), std::uint8_t{0});
    std::fill(launched_.begin(), launched_.end(), std::uint8_t{0});
    std::fill(dirty_.begin(), dirty_.end(), std::int32_t{0});
    remaining_ = params_in_bucket_;
    launch_pos_ = 0;
  }

  // Stages 0-1: reduces the whole gradient at the step. One run of the wire dtype by
  // default; with per-parameter wire dtypes, one run per stretch of equal dtype, in flat
  // order on every rank. A run in another dtype goes through it at one rank too, so the
  // bits do not depend on the world size or the stage (stages 2 and 3 always send their
  // buckets).
  void reduce_whole() {
    for (const wire_run& run : s_.runs) {
      if (run.wire == s_.grad_t()) {
        if (s_.world > 1) reduce_in_place(run.range);
      } else {
        reduce_on_wire(run.range, run.wire);
      }
    }
  }

  // Frees the communication buffers (end of a step); nothing may be in flight.
  void release_buffers() {
    if (!pending_.empty() || !downloads_.empty()) return;
    if (staging_.any_busy() || wire_.any_busy() || host_.any_busy()) return;
    staging_.clear();
    wire_.clear();
    host_.clear();
  }

  std::uint64_t device_bytes() const { return staging_.bytes() + wire_.bytes(); }
  std::uint64_t host_bytes() const { return host_.bytes(); }

  // The most bytes of communication buffers in the backend's memory that the reductions
  // hold at once, given the plan, when gradients arrive in reverse parameter order (as
  // backward produces them): docs/precision.md, "Communication buffers".
  std::uint64_t device_bound() const {
    const std::uint64_t grad = size_of(s_.grad_t());
    if (s_.stage() < 2) {
      // Stages 0-1: a run in another wire dtype goes through bucket-sized pieces, one
      // buffer at stage 0 (in place), two at stage 1 (send and receive), one dtype at a time.
      std::uint64_t m = 0;
      for (const wire_run& r : s_.runs) {
        if (r.wire == s_.grad_t()) continue;
        const std::uint64_t n = std::min(s_.zo.reduce_bucket_numel, s_.longest_run[static_cast<std::size_t>(r.wire)]);
        m = std::max(m, n * size_of(r.wire) * (s_.stage() == 1 ? 2 : 1));
      }
      return m;
    }
    // Stages 2-3: staging buffers of the max_in_flight buckets being reduced, the one being
    // filled, and the small parameters' buckets (reduced last, filled all through backward);
    // wire-typed copies of the buckets in flight; nothing at all for direct buckets.
    std::uint64_t large = 0, small = 0, wire = 0, all = 0;
    for (std::size_t b = 0; b < buckets_.num_buckets(); ++b) {
      if (adds_in_place(b)) continue;
      const bucket& bk = buckets_.buckets()[b];
      const std::uint64_t n = bk.range.size();
      all += n;
      if (bk.first_param >= small_from_) {
        small += n;
      } else {
        large = std::max(large, n);
      }
      for (const wire_run& r : bucket_runs_[b]) {
        if (r.wire != s_.grad_t()) wire = std::max(wire, n * size_of(r.wire));
      }
    }
    // Offload on a device backend: as many more staging buffers wait for their downloads.
    const std::uint64_t held = max_in_flight + 1 + (s_.offloaded() && s_.be.device_memory() ? max_in_flight : 0);
    return std::min(held * large + small, all) * grad + max_in_flight * wire * 2;
  }

 private:
  struct in_flight {
    struct part {
      wire_run run;
      comm::any_request request;
      const void* block = nullptr;  // this rank's reduced block, in the run's dtype, once complete
    };
    std::size_t bucket = 0;
    int staging = -1;                 // the gradient-typed bucket while a run reduces in it, else -1
    std::array<int, 3> wire{-1, -1, -1};  // per dtype: the wire-typed copy of the bucket, or -1
    std::vector<part> parts;
  };
  // Offload on a device backend: a reduced block on its way to host memory.
  struct download {
    async_transfer transfer;
    dtype wire;
    int host;               // in host_: the copy's destination
    std::uint64_t offset;   // in the host partition
    std::uint64_t n;
    int staging;            // in staging_: busy until the copy is done, else -1
    std::array<int, 3> wire_copy;  // in wire_: busy until the copy is done
  };

  static void quietly(comm::any_request& r) {
    try {
      r.wait();
    } catch (...) {  // timed out or failed: the communicator is aborted, nothing runs on
    }
  }
  static void* offset(void* p, std::uint64_t k, dtype t) { return static_cast<unsigned char*>(p) + k * size_of(t); }

  int acquire_staging(std::size_t b) {
    const std::uint64_t n = buckets_.buckets()[b].range.size();
    bool fresh = false;
    const int idx = staging_.acquire(n, [&](dtype t, std::uint64_t m) { return s_.device_scratch(t, m); }, &fresh);
    // Fresh buffers are zero; a reused one is cleared.
    if (!fresh) s_.be.zero(staging_.data(idx), n * size_of(s_.grad_t()));
    return idx;
  }

  // Buckets go in the plan's launch order (descending, the order backward usually
  // completes them, with the small parameters' buckets last), so every rank issues the
  // same reductions in the same order whatever its timing.
  void launch_ready() {
    const auto order = buckets_.launch_order();
    while (launch_pos_ < order.size() && remaining_[order[launch_pos_]] == 0) {
      launch(order[launch_pos_]);
      ++launch_pos_;
    }
  }
  void launch_all_remaining() {
    const auto order = buckets_.launch_order();
    while (launch_pos_ < order.size()) {
      launch(order[launch_pos_]);  // a bucket with no gradient this pass reduces zeros
      ++launch_pos_;
    }
  }

  // Reduce-scatters bucket b in place, one non-blocking collective per wire run, in flat
  // order. A run in the gradient dtype reduces in the staging buffer; the others in a
  // wire-typed copy of the bucket (one per dtype), so the staging buffer is given back at
  // once when no run needs it. A direct bucket has nothing to reduce.
  void launch(std::size_t b) {
    launched_[b] = 1;
    if (direct_[b]) {
      if (!adds_in_place(b)) send_to_host(b);
      return;
    }
    while (pending_.size() >= max_in_flight) complete_oldest();
    const bucket& bk = buckets_.buckets()[b];
    const std::uint64_t n = bk.range.size();
    if (staging_of_[b] < 0) staging_of_[b] = acquire_staging(b);  // no gradient this pass: zeros
    in_flight f;
    f.bucket = b;
    f.staging = staging_of_[b];
    staging_of_[b] = -1;
    void* staged = staging_.data(f.staging);
    bool reduces_staging = false;
    for (const wire_run& run : bucket_runs_[b]) {
      if (run.wire == s_.grad_t()) {
        reduces_staging = true;
        continue;
      }
      int& w = f.wire[static_cast<std::size_t>(run.wire)];
      if (w < 0) w = wire_[run.wire].acquire(n, [&](dtype t, std::uint64_t m) { return s_.device_scratch(t, m); });
      const std::uint64_t k = run.range.begin - bk.range.begin;
      s_.be.convert(offset(wire_[run.wire].data(w), k, run.wire), run.wire, offset(staged, k, s_.grad_t()),
                    s_.grad_t(), run.range.size());
    }
    if (!reduces_staging) {
      staging_.release(f.staging);
      f.staging = -1;
    }
    for (const wire_run& run : bucket_runs_[b]) {
      const std::vector<std::uint64_t> counts = s_.layout.rank_counts(run.range);
      const std::uint64_t k = run.range.begin - bk.range.begin;
      void* base = run.wire == s_.grad_t() ? offset(staged, k, run.wire)
                                           : offset(wire_[run.wire].data(f.wire[static_cast<std::size_t>(run.wire)]),
                                                    k, run.wire);
      // In place: this rank's block of the run receives the sum.
      void* mine = offset(base, comm::detail::offset_of(counts, s_.rank), run.wire);
      s_.be.before_comm(s_.comm);
      typename in_flight::part p{run, {}, mine};
      p.request = comm::any_request(
          s_.comm.base().ireduce_scatter_v(base, mine, counts, wire_of(run.wire), comm::reduce_op::sum));
      f.parts.push_back(std::move(p));
    }
    pending_.push_back(std::move(f));
  }

  // Offload on a device backend at world size 1, a direct bucket: its staged gradients go
  // to the host partition as they are, with no reduction, through a download that holds
  // the staging buffer until retire_downloads. A bucket that got no gradient this pass
  // adds nothing (stage 0 adds nothing either).
  void send_to_host(std::size_t b) {
    const int st = staging_of_[b];
    if (st < 0) return;
    staging_of_[b] = -1;
    const flat_range r = buckets_.buckets()[b].range;  // within the shard: one rank holds it all
    const dtype g = s_.grad_t();
    const int h = host_[g].acquire(r.size(), [&](dtype t, std::uint64_t m) { return s_.host_scratch(t, m); });
    downloads_.push_back(download{s_.be.download_async(host_[g].data(h), staging_.data(st), r.size() * size_of(g)), g,
                                  h, r.begin - s_.shard.begin, r.size(), st, {-1, -1, -1}});
    retire_downloads(max_in_flight);
  }

  // A direct bucket whose partition its reports can reach: added in place, never staged
  // (without offload, or with offload on a backend whose memory is host memory).
  bool adds_in_place(std::size_t b) const { return direct_[b] && (!s_.offloaded() || !s_.be.device_memory()); }

  void complete_oldest() {
    in_flight f = std::move(pending_.front());
    pending_.pop_front();
    // The buffers a download still reads stay busy until it is done.
    bool staging_held = false;
    std::array<bool, 3> wire_held{false, false, false};
    for (auto& part : f.parts) {
      part.request.wait();
      const flat_range own = intersect(part.run.range, s_.shard);
      if (own.empty()) continue;
      const dtype w = part.run.wire;
      if (!s_.offloaded()) {
        s_.be.accumulate(s_.grads.at(own.begin - s_.shard.begin), s_.grad_t(), part.block, w, own.size(), 1.0f);
      } else if (s_.be.device_memory()) {
        // Overlapped with backward: the block goes to (pinned) host staging on the
        // backend's copy stream and is added when the copy is done (retire_downloads).
        const int h = host_[w].acquire(own.size(), [&](dtype t, std::uint64_t m) { return s_.host_scratch(t, m); });
        download d{s_.be.download_async(host_[w].data(h), part.block, own.size() * size_of(w)), w, h,
                   own.begin - s_.shard.begin, own.size(), -1, {-1, -1, -1}};
        if (w == s_.grad_t()) {
          d.staging = f.staging;
          staging_held = true;
        } else {
          d.wire_copy[static_cast<std::size_t>(w)] = f.wire[static_cast<std::size_t>(w)];
          wire_held[static_cast<std::size_t>(w)] = true;
        }
        downloads_.push_back(std::move(d));
      } else {
        s_.host.accumulate(s_.h_grads.at(own.begin - s_.shard.begin), s_.grad_t(), part.block, w, own.size(), 1.0f);
      }
    }
    // A buffer two downloads read is released by the last of them.
    if (f.staging >= 0 && !staging_held) staging_.release(f.staging);
    for (const dtype d : {dtype::fp32, dtype::bf16, dtype::fp16}) {
      const int w = f.wire[static_cast<std::size_t>(d)];
      if (w >= 0 && !wire_held[static_cast<std::size_t>(d)]) wire_[d].release(w);
    }
    mark_last_readers();
    if (s_.offloaded() && s_.be.device_memory()) retire_downloads(max_in_flight);
  }

  // Of the downloads that read one buffer, only the last releases it.
  void mark_last_readers() {
    for (std::size_t i = 0; i < downloads_.size(); ++i) {
      for (std::size_t j = i + 1; j < downloads_.size(); ++j) {
        if (downloads_[i].staging >= 0 && downloads_[i].staging == downloads_[j].staging) downloads_[i].staging = -1;
        for (std::size_t k = 0; k < 3; ++k) {
          if (downloads_[i].wire_copy[k] >= 0 && downloads_[i].wire_copy[k] == downloads_[j].wire_copy[k])
            downloads_[i].wire_copy[k] = -1;
        }
      }
    }
  }

  // Stages 0 and 1, a run in the gradient dtype: reduced in place, one bucket-sized
  // piece at a time, so that what a communicator allocates for a collective in flight
  // (MPI's scratch: docs/precision.md) is bounded by reduce_bucket_size as well.
  void reduce_in_place(flat_range run) {
    s_.be.before_comm(s_.comm);
    const comm::wire_dtype t = wire_of(s_.grad_t());
    const std::uint64_t piece = std::max<std::uint64_t>(s_.zo.reduce_bucket_numel, 1);
    for (std::uint64_t begin = run.begin; begin < run.end; begin += piece) {
      const flat_range r{begin, std::min(begin + piece, run.end)};
      void* in = s_.grads.at(r.begin);
      if (s_.stage() == 0) {
        s_.comm.base().iall_reduce(in, in, r.size(), t, comm::reduce_op::sum)->wait();
      } else {
        // Rank k receives r's part of partition k, which is in's own block k: in place.
        const std::vector<std::uint64_t> counts = s_.layout.rank_counts(r);
        s_.comm.base()
            .ireduce_scatter_v(in, offset(in, comm::detail::offset_of(counts, s_.rank), s_.grad_t()), counts, t,
                               comm::reduce_op::sum)
            ->wait();
      }
    }
  }

  // Stages 0 and 1, a run in another wire dtype: through wire-typed buffers one
  // bucket-sized piece at a time.
  void reduce_on_wire(flat_range run, dtype w) {
    const std::uint64_t piece = std::min<std::uint64_t>(s_.zo.reduce_bucket_numel, std::max<std::uint64_t>(run.size(), 1));
    const std::uint64_t n = std::min<std::uint64_t>(s_.zo.reduce_bucket_numel, s_.longest_run[static_cast<std::size_t>(w)]);
    auto make = [&](dtype t, std::uint64_t m) { return s_.device_scratch(t, m); };
    const int send = wire_[w].acquire(n, make);
    const int recv = s_.stage() == 1 ? wire_[w].acquire(n, make) : -1;
    const comm::wire_dtype t = wire_of(w);
    for (std::uint64_t begin = run.begin; begin < run.end; begin += piece) {
      const flat_range r{begin, std::min(begin + piece, run.end)};
      void* sb = wire_[w].data(send);
      s_.be.convert(sb, w, s_.grads.at(r.begin), s_.grad_t(), r.size());
      s_.be.before_comm(s_.comm);
      if (s_.stage() == 0) {
        s_.comm.base().iall_reduce(sb, sb, r.size(), t, comm::reduce_op::sum)->wait();
        s_.be.convert(s_.grads.at(r.begin), s_.grad_t(), sb, w, r.size());
      } else {
        const std::vector<std::uint64_t> counts = s_.layout.rank_counts(r);
        s_.comm.base().ireduce_scatter_v(sb, wire_[w].data(recv), counts, t, comm::reduce_op::sum)->wait();
        const flat_range own = intersect(r, s_.shard);
        if (!own.empty()) s_.be.convert(s_.grads.at(own.begin), s_.grad_t(), wire_[w].data(recv), w, own.size());
      }
    }
    wire_[w].release(send);
    if (recv >= 0) wire_[w].release(recv);
  }

  void drain() {
    while (!pending_.empty()) complete_oldest();
    retire_downloads(0);
  }

  // Adds the downloaded blocks to the host partition, oldest first (the order they were
  // reduced in, so sums are formed in the same order as without overlap): those whose
  // copies are done, and, waiting, as many more as leave at most `keep` in flight.
  void retire_downloads(std::size_t keep) {
    while (!downloads_.empty()) {
      download& d = downloads_.front();
      if (downloads_.size() <= keep && !d.transfer.done()) return;
      d.transfer.wait();
      s_.host.accumulate(s_.h_grads.at(d.offset), s_.grad_t(), host_[d.wire].data(d.host), d.wire, d.n, 1.0f);
      host_[d.wire].release(d.host);
      if (d.staging >= 0) staging_.release(d.staging);
      for (const dtype t : {dtype::fp32, dtype::bf16, dtype::fp16}) {
        const int w = d.wire_copy[static_cast<std::size_t>(t)];
        if (w >= 0) wire_[t].release(w);
      }
      downloads_.pop_front();
    }
  }

  core_state& s_;
  bucket_plan buckets_;
  std::size_t small_from_ = 0;
  std::vector<std::vector<wire_run>> bucket_runs_;  // each bucket's runs of equal wire dtype
  std::vector<std::uint32_t> params_in_bucket_, remaining_;
  std::vector<int> staging_of_;
  std::vector<std::uint8_t> launched_, reported_;
  // Buckets with nothing to reduce (world size 1, every run in the gradient dtype):
  // reports accumulate into the gradient partition directly and launch() only marks them;
  // with offload they are staged and launch() sends them to the host partition.
  std::vector<std::uint8_t> direct_;
  std::vector<std::int32_t> dirty_;
  std::size_t launch_pos_ = 0;  // buckets_.launch_order()[launch_pos_] is the next to launch
  buffer_pool staging_;         // gradient-typed buckets being filled or reduced
  pools wire_;                  // wire-typed copies of buckets being reduced
  pools host_;                  // offload: host staging of downloads
  std::deque<in_flight> pending_;
  std::deque<download> downloads_;
};

}  // namespace mpzero::detail

// mpzero: the ZeRO core's checkpoints: this rank's shard to and from files in the format
// of zero/checkpoint.hpp. Private to zero/core.hpp.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "checkpoint.hpp"
#include "core_state.hpp"
#include "loss_scaler.hpp"

namespace mpzero::detail {

// A part of this rank's shard in host memory: flat elements `range`, each array in its
// model-state dtype.
struct host_piece {
  flat_range range;
  raw_buffer params, master;  // master unallocated when the master is the parameter
  std::vector<raw_buffer> states;

  host_piece(const core_state& s, flat_range r) : range(r) {
    params = allocate_host(s.param_t(), r.size(), pageable_host_allocator);
    if (!s.master_is_param()) master = allocate_host(s.master_t(), r.size(), pageable_host_allocator);
    for (int k = 0; k < s.n_states; ++k) states.push_back(allocate_host(s.state_t(), r.size(), pageable_host_allocator));
  }
};

class core_checkpoint {
 public:
  explicit core_checkpoint(core_state& s) : s_(s) {}

  // The checks a checkpoint's first file must pass to load here.
  void check_loadable(const checkpoint::shard_header& h, const std::filesystem::path& path,
                      std::string_view mine) const {
    const std::string where = "ZeroOptimizer::load_checkpoint: " + checkpoint::detail::quoted(path);
    if (h.numels.size() != s_.num_params()) {
      throw_invalid(where + " holds " + std::to_string(h.numels.size()) + " parameters; this optimizer has " +
                    std::to_string(s_.num_params()) + ". Load it into a model with the same parameters, in the same order");
    }
    for (std::size_t i = 0; i < s_.num_params(); ++i) {
      if (h.numels[i] != s_.numel(i)) {
        throw_invalid(where + ": parameter " + std::to_string(i) + " has " + std::to_string(h.numels[i]) +
                      " elements there and " + std::to_string(s_.numel(i)) +
                      " here. Load it into a model with the same parameters, in the same order");
      }
    }
    const auto adam_family = [](std::string_view n) { return n == "Adam" || n == "AdamW"; };
    const bool same = h.optimizer == mine || (adam_family(h.optimizer) && adam_family(mine));
    if (!same || h.n_states != static_cast<std::uint32_t>(s_.n_states)) {
      throw_invalid(where + " holds " + h.optimizer + " states (" + std::to_string(h.n_states) +
                    " per element); this optimizer is " + std::string(mine) +
                    ". Load it with the optimizer it was saved with (Adam and AdamW share their states)");
    }
  }

  // This rank's shard, copied to host memory.
  std::vector<host_piece> download_shard() const {
    std::vector<host_piece> out;
    for (const flat_range& r : s_.shard_pieces()) {
      host_piece& p = out.emplace_back(s_, r);
      const std::uint64_t n = r.size(), at = r.begin - s_.shard.begin;
      s_.be.download(p.params.data(), s_.param_ptr(r.begin), n * size_of(s_.param_t()));
      backend_base& from = s_.offloaded() ? s_.host : s_.be;
      const raw_buffer& master = s_.offloaded() ? s_.h_master : s_.master;
      const std::vector<raw_buffer>& states = s_.offloaded() ? s_.h_states : s_.states;
      if (!s_.master_is_param()) from.download(p.master.data(), master.at(at), n * size_of(s_.master_t()));
      for (int k = 0; k < s_.n_states; ++k)
        from.download(p.states[static_cast<std::size_t>(k)].data(), states[static_cast<std::size_t>(k)].at(at),
                      n * size_of(s_.state_t()));
    }
    return out;
  }

  // Writes this rank's shard file (`h`: the header without its records).
  void write(const std::filesystem::path& dir, checkpoint::shard_header h) const {
    std::vector<host_piece> pieces = download_shard();
    const std::vector<std::size_t> user = user_of_slot();
    struct source {
      std::size_t piece;
      std::uint64_t at;  // in the piece
    };
    std::vector<source> from;
    for (std::size_t k = 0; k < pieces.size(); ++k) {
      for (const segment& sg : s_.layout.segments(pieces[k].range)) {
        h.records.push_back({user[sg.param], sg.param_offset, sg.count, 0});
        from.push_back({k, sg.flat_offset - pieces[k].range.begin});
      }
    }
    const std::vector<checkpoint::record> records = h.records;
    checkpoint::write_shard(checkpoint::shard_path(dir, static_cast<std::uint32_t>(s_.rank)), std::move(h),
                            [&](std::size_t r, auto&& write) {
                              const host_piece& p = pieces[from[r].piece];
                              const std::uint64_t at = from[r].at, n = records[r].count;
                              const auto put = [&](const raw_buffer& b) {
                                write(b.at(at), n * size_of(b.type()));
                              };
                              put(p.params);
                              if (!s_.master_is_param()) put(p.master);
                              for (const raw_buffer& st : p.states) put(st);
                            });
  }

  // Reads this rank's pieces of the checkpoint in `dir` into host memory, with its step count
  // and stochastic-rounding stream; changes nothing.
  void read(const std::filesystem::path& dir, std::string_view optimizer, const std::optional<loss_scaler>& current,
            std::vector<host_piece>& pieces, std::uint64_t& steps, std::uint32_t& stream,
            std::optional<loss_scaler>& scaler) const {
    checkpoint::shard_set files(dir, "ZeroOptimizer::load_checkpoint",
                                [&](const checkpoint::shard_header& h, const std::filesystem::path& p) {
                                  check_loadable(h, p, optimizer);
                                });
    const checkpoint::shard_header& h0 = files.first();
    if (current && h0.scaler) {
      loss_scaler sc = *current;
      const checkpoint::scaler_record& r = *h0.scaler;
      sc.load(loss_scaler::state{r.scale, r.hysteresis_left, r.clean_steps, r.last_overflow_iter, r.iter});
      scaler = std::move(sc);
    }
    steps = h0.steps;
    stream = h0.rounding_stream;
    const std::vector<std::size_t> user = user_of_slot();
    for (const flat_range& range : s_.shard_pieces()) {
      host_piece& p = pieces.emplace_back(s_, range);
      for (const segment& sg : s_.layout.segments(range)) {
        const std::uint64_t base = sg.flat_offset - range.begin;
        files.for_each_run(user[sg.param], sg.param_offset, sg.count, [&](const checkpoint::shard_set::run& r) {
          const checkpoint::shard_header& h = files.header(r.file);
          const auto read = [&](int which, const raw_buffer& dst) {
            files.read(r, which, [&]<class S>(const S* src, std::uint64_t n) {
              s_.host.convert(dst.at(base + r.at), dst.type(), src, dtype_of_v<S>, n);
            });
          };
          if (s_.master_is_param()) {
            read(h.has_master ? 1 : 0, p.params);  // the saved master is the finer source
          } else {
            // The saved parameters when the dtype is the same (bit for bit, stochastic rounding
            // included); otherwise rounded once from the saved master.
            const bool same_param = h.param == s_.param_t();
            read(h.has_master && !same_param ? 1 : 0, p.params);
            read(h.has_master ? 1 : 0, p.master);
          }
          for (int k = 0; k < s_.n_states; ++k) read((h.has_master ? 2 : 1) + k, p.states[static_cast<std::size_t>(k)]);
        }, "that this rank needs");
      }
    }
  }

  // Puts the pieces read by read() in place.
  void install(const std::vector<host_piece>& pieces) const {
    for (const host_piece& p : pieces) {
      const std::uint64_t n = p.range.size(), at = p.range.begin - s_.shard.begin;
      s_.be.upload(s_.param_ptr(p.range.begin), p.params.data(), n * size_of(s_.param_t()));
      if (s_.offloaded()) {
        const raw_buffer& m = s_.master_is_param() ? p.params : p.master;
        s_.host.copy(s_.h_master.at(at), m.data(), n * size_of(s_.master_t()));
        for (int k = 0; k < s_.n_states; ++k)
          s_.host.copy(s_.h_states[static_cast<std::size_t>(k)].at(at), p.states[static_cast<std::size_t>(k)].data(),
                       n * size_of(s_.state_t()));
      } else {
        if (!s_.master_is_param()) s_.be.upload(s_.master.at(at), p.master.data(), n * size_of(s_.master_t()));
        for (int k = 0; k < s_.n_states; ++k)
          s_.be.upload(s_.states[static_cast<std::size_t>(k)].at(at), p.states[static_cast<std::size_t>(k)].data(),
                       n * size_of(s_.state_t()));
      }
    }
  }

  std::vector<std::size_t> user_of_slot() const {
    std::vector<std::size_t> user(s_.slot_of.size());
    for (std::size_t i = 0; i < s_.slot_of.size(); ++i) user[s_.slot_of[i]] = i;
    return user;
  }

 private:
  core_state& s_;
};

}  // namespace mpzero::detail

// mpzero: the shard files of a ZeRO checkpoint (ZeroOptimizer::save_checkpoint and
// load_checkpoint write and read them; this header is the file format).
//
// One file per rank that holds a partition (one file in all at stage 0, where every rank
// holds everything): <dir>/zero_shard_<rank, 5 digits>.mpz. A file holds the rank's
// model elements, keyed by (parameter index, element index inside the parameter), not
// by position in the flat buffer, and padding is not stored. So a checkpoint loads at any
// world size and ZeRO stage, and into another precision policy (values are converted,
// rounding to nearest where the new type is narrower).
//
// Layout (native byte order, checked on read; every integer fixed-width):
//   char[8]  "MPZEROCK"             u32 format version (1)     u32 0x01020304 (byte order)
//   u64      save id (equal in every file of one save)
//   u32      rank, world, files, stage
//   u8       param dtype, master dtype, state dtype, has_master, n_states, has_scaler,
//            rounding stream, pad
//   char[16] optimizer name (zero-padded)
//   u64      steps (optimizer updates applied)
//   f64 scale, i32 hysteresis_left, u32 pad, u64 clean_steps, last_overflow_iter, iter (loss scaler)
//   u64      n_params, then n_params x u64 numel
//   u64      n_records, then n_records x {u64 param, begin, count, data_offset}
//   data: per record, at data_offset: count params (param dtype), count master values (when
//         has_master), then count values of each state (state dtype)
#pragma once

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "../error.hpp"
#include "../numeric/dtype.hpp"
#include "../partition/flat_layout.hpp"

namespace mpzero::checkpoint {

inline constexpr char file_magic[8] = {'M', 'P', 'Z', 'E', 'R', 'O', 'C', 'K'};
inline constexpr std::uint32_t format_version = 1;
inline constexpr std::uint32_t byte_order_mark = 0x01020304u;

// Parameter `param`'s elements [begin, begin + count), stored at data_offset.
struct record {
  std::uint64_t param = 0, begin = 0, count = 0, data_offset = 0;
};

// loss_scaler::state, as stored.
struct scaler_record {
  double scale = 1.0;
  std::int32_t hysteresis_left = 0;
  std::uint64_t clean_steps = 0, last_overflow_iter = 0, iter = 0;
};

struct shard_header {
  std::uint64_t save_id = 0;
  std::uint32_t rank = 0, world = 1, files = 1, stage = 0;
  dtype param = dtype::fp32, master = dtype::fp32, state = dtype::fp32;
  bool has_master = false;  // false: the master weights are the parameters
  std::uint32_t n_states = 0;
  // The stochastic-rounding stream the saving optimizer drew from
  // (numeric/rounding_bits.hpp's rounding_stream); 0 when it rounded to nearest, or
  // when the file predates the field (those files rounded with stream 1).
  std::uint32_t rounding_stream = 0;
  std::string optimizer;
  std::uint64_t steps = 0;
  std::optional<scaler_record> scaler;
  std::vector<std::uint64_t> numels;  // per parameter, in the optimizer's parameter order
  std::vector<record> records;

  // Bytes of one element across a record's arrays.
  std::uint64_t element_bytes() const noexcept {
    return size_of(param) + (has_master ? size_of(master) : 0) + n_states * size_of(state);
  }
  // The dtype of array `which` (0: parameters, 1: master, 2 + k: state k; without a
  // master, state k is 1 + k).
  dtype array_dtype(int which) const noexcept { return which == 0 ? param : (has_master && which == 1 ? master : state); }
  // Byte offset of array `which` for element `k` of record r.
  std::uint64_t array_offset(const record& r, int which, std::uint64_t k) const noexcept {
    std::uint64_t off = r.data_offset;
    if (which == 0) return off + k * size_of(param);
    off += r.count * size_of(param);
    if (has_master) {
      if (which == 1) return off + k * size_of(master);
      off += r.count * size_of(master);
      which -= 2;
    } else {
      which -= 1;
    }
    return off + static_cast<std::uint64_t>(which) * r.count * size_of(state) + k * size_of(state);
  }
};

inline std::filesystem::path shard_path(const std::filesystem::path& dir, std::uint32_t rank) {
  char name[32];
  std::snprintf(name, sizeof name, "zero_shard_%05u.mpz", rank);
  return dir / name;
}

// Removes the shard files in `dir` numbered `files` and above: what an earlier save into
// the same directory at a larger world size left behind (a save's files are numbered
// 0, 1, ... without gaps, so they end at the first number that is missing). A load reads
// the number of files from file 0 and ignores the others, so they are only wasted space
// and a trap for whoever copies the directory by hand. Called by save_checkpoint once
// every file of the new save is in place. Best effort: a file that cannot be removed
// stays, and is still ignored. Returns how many files it removed.
inline std::size_t remove_stale_shards(const std::filesystem::path& dir, std::uint32_t files) {
  std::size_t removed = 0;
  std::error_code ec;
  for (std::uint32_t k = files; k != UINT32_MAX; ++k) {
    const std::filesystem::path p = shard_path(dir, k);
    if (!std::filesystem::exists(p, ec)) break;
    removed += std::filesystem::remove(p, ec) ? 1 : 0;
  }
  return removed;
}

namespace detail {

// (Appended, not "'" + p.string(): GCC 12 warns, falsely, of an overlapping memcpy there: -Wrestrict.)
inline std::string quoted(const std::filesystem::path& p) {
  std::string s = "'";
  s += p.string();
  s += '\'';
  return s;
}

template <class T>
void put(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

class reader {
 public:
  reader(std::ifstream& in, const std::filesystem::path& path) : in_(in), path_(path) {}
  template <class T>
  T get(const char* what) {
    T v{};
    if (!in_.read(reinterpret_cast<char*>(&v), sizeof(T))) truncated(what);
    return v;
  }
  [[noreturn]] void truncated(const char* what) const {
    mpzero::detail::throw_invalid("checkpoint: " + quoted(path_) + " ends inside its header (reading " + what +
                                  "); the file is truncated or not a shard file. Save the checkpoint again");
  }

 private:
  std::ifstream& in_;
  const std::filesystem::path& path_;
};

inline dtype checked_dtype(std::uint8_t v, const std::filesystem::path& path, const char* what) {
  if (v > static_cast<std::uint8_t>(dtype::fp16)) {
    mpzero::detail::throw_invalid("checkpoint: " + quoted(path) + " names dtype code " + std::to_string(v) + " for " +
                                  what + "; the file is corrupt (codes 0-2 are fp32, bf16, fp16)");
  }
  return static_cast<dtype>(v);
}

}  // namespace detail

// Creates `path` through write(std::ofstream&), which returns false or leaves the stream
// failed on error: the file is written beside its name and renamed into place, so it is
// whole or absent. Throws mpzero::error naming the path and the system's reason.
template <class Write>
void write_atomically(const std::filesystem::path& path, Write&& write) {
  std::filesystem::path tmp = path;
  tmp += ".tmp";
  bool opened = false, ok = false;
  std::error_code ec;
  try {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    opened = static_cast<bool>(out);
    ok = opened && write(out) && out.flush();
  } catch (...) {  // write() refused: no half-written file stays behind
    std::filesystem::remove(tmp, ec);
    throw;
  }
  if (!ok) {
    const std::string reason = std::error_code(errno, std::generic_category()).message();
    std::filesystem::remove(tmp, ec);
    throw mpzero::error("mpzero: checkpoint: cannot " + std::string(opened ? "write " : "create ") + detail::quoted(tmp) +
                        " (" + reason +
                        "); check that the directory exists, is writable and has room");
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    const std::string reason = ec.message();
    std::filesystem::remove(tmp, ec);
    throw mpzero::error("mpzero: checkpoint: cannot rename " + detail::quoted(tmp) + " to " + detail::quoted(path) +
                        " (" + reason + ")");
  }
}

// Writes `h` (its records' data offsets are filled in here) and then, for each record in
// order, write_data(record index, put), where put(const void* bytes, std::size_t n)
// writes straight to the file and write_data must put exactly the record's bytes (no
// copy of a record is made in memory). The file appears complete or not at all: it is
// written beside its final name and renamed into place. Throws mpzero::error naming the
// path and the system's reason.
template <class WriteData>
void write_shard(const std::filesystem::path& path, shard_header h, WriteData&& write_data) {
  using detail::put;
  std::string head;
  head.append(file_magic, sizeof file_magic);
  put(head, format_version);
  put(head, byte_order_mark);
  put(head, h.save_id);
  put(head, h.rank), put(head, h.world), put(head, h.files), put(head, h.stage);
  const std::uint8_t flags[8] = {static_cast<std::uint8_t>(h.param),    static_cast<std::uint8_t>(h.master),
                                 static_cast<std::uint8_t>(h.state),    static_cast<std::uint8_t>(h.has_master),
                                 static_cast<std::uint8_t>(h.n_states), static_cast<std::uint8_t>(h.scaler.has_value()),
                                 static_cast<std::uint8_t>(h.rounding_stream), 0};
  head.append(reinterpret_cast<const char*>(flags), sizeof flags);
  char name[16] = {};
  std::memcpy(name, h.optimizer.data(), std::min<std::size_t>(h.optimizer.size(), sizeof name - 1));
  head.append(name, sizeof name);
  put(head, h.steps);
  const scaler_record s = h.scaler.value_or(scaler_record{});
  put(head, s.scale), put(head, s.hysteresis_left), put(head, std::uint32_t{0});
  put(head, s.clean_steps), put(head, s.last_overflow_iter), put(head, s.iter);
  put(head, static_cast<std::uint64_t>(h.numels.size()));
  for (std::uint64_t n : h.numels) put(head, n);
  put(head, static_cast<std::uint64_t>(h.records.size()));
  std::uint64_t offset = head.size() + h.records.size() * 4 * sizeof(std::uint64_t);
  for (record& r : h.records) {
    r.data_offset = offset;
    offset += r.count * h.element_bytes();
    put(head, r.param), put(head, r.begin), put(head, r.count), put(head, r.data_offset);
  }

  write_atomically(path, [&](std::ofstream& out) {
    if (!out.write(head.data(), static_cast<std::streamsize>(head.size()))) return false;
    for (std::size_t k = 0; k < h.records.size(); ++k) {
      std::uint64_t written = 0;
      write_data(k, [&](const void* bytes, std::size_t n) {
        out.write(static_cast<const char*>(bytes), static_cast<std::streamsize>(n));
        written += n;
      });
      if (!out) return false;
      if (written != h.records[k].count * h.element_bytes()) {
        mpzero::detail::throw_invalid("checkpoint::write_shard: record " + std::to_string(k) + " wrote " +
                                      std::to_string(written) + " bytes, its header says " +
                                      std::to_string(h.records[k].count * h.element_bytes()));
      }
    }
    return true;
  });
}

// Reads and checks a shard file's header, leaving `in` open on it.
inline shard_header read_header(std::ifstream& in, const std::filesystem::path& path) {
  in.open(path, std::ios::binary);
  if (!in) {
    std::error_code ec;
    const bool exists = std::filesystem::exists(path, ec);
    mpzero::detail::throw_invalid(
        "checkpoint: cannot open " + detail::quoted(path) +
        (exists ? std::string(" (") + std::error_code(errno, std::generic_category()).message() + ")"
                : std::string(": no such file")) +
        "; pass the directory that save_checkpoint wrote (it holds zero_shard_00000.mpz and one file per rank)");
  }
  detail::reader r(in, path);
  char magic[8];
  if (!in.read(magic, sizeof magic) || std::memcmp(magic, file_magic, sizeof magic) != 0) {
    mpzero::detail::throw_invalid("checkpoint: " + detail::quoted(path) +
                                  " is not an mpzero shard file (it does not start with MPZEROCK)");
  }
  const auto version = r.get<std::uint32_t>("the format version");
  const auto bom = r.get<std::uint32_t>("the byte-order mark");
  if (bom != byte_order_mark) {
    mpzero::detail::throw_invalid("checkpoint: " + detail::quoted(path) +
                                  " was written on a machine of the other byte order; load it on a machine like the "
                                  "one that saved it");
  }
  if (version != format_version) {
    mpzero::detail::throw_invalid("checkpoint: " + detail::quoted(path) + " has format version " +
                                  std::to_string(version) + "; this mpzero reads version " +
                                  std::to_string(format_version));
  }
  shard_header h;
  h.save_id = r.get<std::uint64_t>("the save id");
  h.rank = r.get<std::uint32_t>("the rank");
  h.world = r.get<std::uint32_t>("the world size");
  h.files = r.get<std::uint32_t>("the file count");
  h.stage = r.get<std::uint32_t>("the ZeRO stage");
  std::uint8_t flags[8];
  if (!in.read(reinterpret_cast<char*>(flags), sizeof flags)) r.truncated("the dtypes");
  h.param = detail::checked_dtype(flags[0], path, "the parameters");
  h.master = detail::checked_dtype(flags[1], path, "the master weights");
  h.state = detail::checked_dtype(flags[2], path, "the optimizer states");
  h.has_master = flags[3] != 0;
  h.n_states = flags[4];
  const bool has_scaler = flags[5] != 0;
  h.rounding_stream = flags[6];
  char name[16];
  if (!in.read(name, sizeof name)) r.truncated("the optimizer name");
  h.optimizer.assign(name, static_cast<std::size_t>(std::find(name, name + sizeof name, '\0') - name));
  h.steps = r.get<std::uint64_t>("the step count");
  scaler_record s;
  s.scale = r.get<double>("the loss scale");
  s.hysteresis_left = r.get<std::int32_t>("the loss scaler's hysteresis");
  (void)r.get<std::uint32_t>("padding");
  s.clean_steps = r.get<std::uint64_t>("the loss scaler's clean steps");
  s.last_overflow_iter = r.get<std::uint64_t>("the loss scaler's last overflow");
  s.iter = r.get<std::uint64_t>("the loss scaler's iteration");
  if (has_scaler) h.scaler = s;

  const std::uint64_t file_size = std::filesystem::file_size(path);
  const auto n_params = r.get<std::uint64_t>("the parameter count");
  if (n_params > file_size / sizeof(std::uint64_t)) r.truncated("the parameter sizes");
  h.numels.resize(static_cast<std::size_t>(n_params));
  for (auto& n : h.numels) n = r.get<std::uint64_t>("the parameter sizes");
  const auto n_records = r.get<std::uint64_t>("the record count");
  if (n_records > file_size / (4 * sizeof(std::uint64_t))) r.truncated("the records");
  const std::uint64_t data_begin = static_cast<std::uint64_t>(in.tellg()) + n_records * 4 * sizeof(std::uint64_t);
  h.records.resize(static_cast<std::size_t>(n_records));
  for (record& rec : h.records) {
    rec.param = r.get<std::uint64_t>("a record");
    rec.begin = r.get<std::uint64_t>("a record");
    rec.count = r.get<std::uint64_t>("a record");
    rec.data_offset = r.get<std::uint64_t>("a record");
    const bool in_param = rec.param < n_params && rec.begin <= h.numels[rec.param] &&
                          rec.count <= h.numels[rec.param] - rec.begin;
    if (!in_param || rec.data_offset < data_begin || rec.data_offset > file_size || rec.count > file_size || rec.count * h.element_bytes() > file_size - rec.data_offset) {
      mpzero::detail::throw_invalid("checkpoint: " + detail::quoted(path) + " has a record (parameter " +
                                    std::to_string(rec.param) + ", elements " + std::to_string(rec.begin) + " + " +
                                    std::to_string(rec.count) +
                                    ") outside its parameters or its data; the file is truncated or corrupt. Save "
                                    "the checkpoint again");
    }
  }
  return h;
}

// Reads `count` elements of array `which` (see shard_header::array_offset) of record
// `r`, starting at its element `first`, as raw bytes of the array's dtype.
inline void read_elements(std::ifstream& in, const std::filesystem::path& path, const shard_header& h,
                          const record& r, int which, std::uint64_t first, std::uint64_t count, void* out) {
  in.seekg(static_cast<std::streamoff>(h.array_offset(r, which, first)));
  if (!in.read(static_cast<char*>(out), static_cast<std::streamsize>(count * size_of(h.array_dtype(which))))) {
    mpzero::detail::throw_invalid("checkpoint: " + detail::quoted(path) + " ends inside the data of parameter " +
                                  std::to_string(r.param) + "; the file is truncated. Save the checkpoint again");
  }
}


// Every shard file of one save in a directory: their headers, checked to belong together,
// and, per parameter, the records that hold its elements in element order (checked not to
// overlap: a corrupt set could otherwise cover a gap by counting elements twice). Data is
// read on demand with one file open at a time (a save of thousands of ranks must not
// exhaust file descriptors). `who` starts the messages about the set (e.g.
// "ZeroOptimizer::load_checkpoint"); a single file's problems are named by read_header.
// check_first(header, path), when given, runs on the first file's header before any other
// file is opened: a caller's cheap refusal (another model) comes before the set's.
class shard_set {
 public:
  // A run of stored elements: `n` elements of record `rec` of file `file`, from its
  // element `first`; `at` is the run's offset from the start of the requested range.
  struct run {
    std::size_t file = 0;
    const record* rec = nullptr;
    std::uint64_t first = 0, n = 0, at = 0;
  };

  shard_set(const std::filesystem::path& dir, std::string who,
            const std::function<void(const shard_header&, const std::filesystem::path&)>& check_first = {})
      : dir_(dir), who_(std::move(who)) {
    paths_.push_back(shard_path(dir, 0));
    {
      std::ifstream in;
      heads_.push_back(read_header(in, paths_[0]));
    }
    if (check_first) check_first(heads_[0], paths_[0]);
    if (const shard_header& h0 = heads_[0]; h0.files == 0 || h0.files > h0.world || h0.rank != 0) {
      mpzero::detail::throw_invalid(who_ + ": " + detail::quoted(paths_[0]) + " says it is rank " +
                                    std::to_string(h0.rank) + "'s file of " + std::to_string(h0.files) +
                                    " at world size " + std::to_string(h0.world) +
                                    "; the file is corrupt or renamed. Save the checkpoint again");
    }
    for (std::uint32_t k = 1; k < heads_[0].files; ++k) {
      paths_.push_back(shard_path(dir, k));
      std::ifstream in;
      shard_header h = read_header(in, paths_.back());
      const shard_header& h0 = heads_[0];  // here, not before the loop: heads_ grows below
      const char* differs = h.save_id != h0.save_id ? "save id"
                            : h.rank != k              ? "rank"
                            : h.files != h0.files      ? "file count"
                            : h.numels != h0.numels    ? "parameter sizes"
                            : h.steps != h0.steps      ? "step count"
                            : h.param != h0.param || h.master != h0.master || h.state != h0.state ||
                                      h.has_master != h0.has_master || h.n_states != h0.n_states
                                ? "dtypes"
                                : nullptr;
      if (differs) {
        mpzero::detail::throw_invalid(who_ + ": " + detail::quoted(paths_.back()) +
                                      " does not belong to the save that wrote " + detail::quoted(paths_[0]) +
                                      " (its " + differs +
                                      " differs: a save that failed midway, or files of two checkpoints in one "
                                      "directory); load a checkpoint whose save completed");
      }
      heads_.push_back(std::move(h));
    }
    holders_.resize(heads_[0].numels.size());
    for (std::size_t f = 0; f < heads_.size(); ++f) {
      for (const record& r : heads_[f].records) holders_[r.param].push_back({f, &r});
    }
    for (std::size_t i = 0; i < holders_.size(); ++i) {
      auto& list = holders_[i];
      std::sort(list.begin(), list.end(), [](const held& a, const held& b) { return a.rec->begin < b.rec->begin; });
      for (std::size_t k = 1; k < list.size(); ++k) {
        if (list[k - 1].rec->begin + list[k - 1].rec->count > list[k].rec->begin) {
          mpzero::detail::throw_invalid(who_ + ": two records of parameter " + std::to_string(i) + " overlap (in " +
                                        detail::quoted(paths_[list[k - 1].file]) + " and " +
                                        detail::quoted(paths_[list[k].file]) +
                                        "); the checkpoint is corrupt. Load a checkpoint whose save completed");
        }
      }
    }
  }
  shard_set(const shard_set&) = delete;
  shard_set& operator=(const shard_set&) = delete;

  const shard_header& first() const noexcept { return heads_[0]; }
  const shard_header& header(std::size_t file) const noexcept { return heads_[file]; }
  const std::filesystem::path& path(std::size_t file) const noexcept { return paths_[file]; }
  std::size_t num_params() const noexcept { return holders_.size(); }

  // Calls visit(run) for every stored run of parameter `param`'s elements [begin, begin +
  // count), in element order, and checks that they cover the range: otherwise throws,
  // naming what is missing (`purpose` says whose elements they are, for the message).
  template <class Visit>
  void for_each_run(std::size_t param, std::uint64_t begin, std::uint64_t count, Visit&& visit,
                    std::string_view purpose = "") const {
    const flat_range want{begin, begin + count};
    std::uint64_t found = 0;
    for (const held& x : holders_[param]) {
      const flat_range got = intersect(want, flat_range{x.rec->begin, x.rec->begin + x.rec->count});
      if (got.empty()) continue;
      visit(run{x.file, x.rec, got.begin - x.rec->begin, got.size(), got.begin - begin});
      found += got.size();
    }
    if (found != count) {
      mpzero::detail::throw_invalid(who_ + ": " + detail::quoted(dir_) + " holds " + std::to_string(found) + " of the " +
                                    std::to_string(count) + " elements [" + std::to_string(want.begin) + ", " +
                                    std::to_string(want.end) + ") of parameter " + std::to_string(param) +
                                    (purpose.empty() ? std::string() : " " + std::string(purpose)) +
                                    "; its shard files are incomplete. Load a checkpoint whose save completed");
    }
  }

  // Reads array `which` (shard_header::array_offset) of a run in its stored dtype S and
  // calls use(const S* values, n).
  template <class Use>
  void read(const run& r, int which, Use&& use) {
    const shard_header& h = heads_[r.file];
    visit_dtype(h.array_dtype(which), [&]<class S>(S*) {
      if (open_ != r.file || !file_.is_open()) {
        file_ = std::ifstream(paths_[r.file], std::ios::binary);
        open_ = r.file;
      }
      std::vector<S> values(static_cast<std::size_t>(r.n));
      read_elements(file_, paths_[r.file], h, *r.rec, which, r.first, r.n, values.data());
      use(static_cast<const S*>(values.data()), r.n);
    });
  }

 private:
  struct held {
    std::size_t file;
    const record* rec;
  };
  std::filesystem::path dir_;
  std::string who_;
  std::vector<std::filesystem::path> paths_;
  std::vector<shard_header> heads_;  // their records do not move once read: holders_ points at them
  std::vector<std::vector<held>> holders_;
  std::ifstream file_;
  std::size_t open_ = 0;
};


// A checkpoint's weights, whole and in fp32, for use outside training (DeepSpeed's
// zero_to_fp32): what a save wrote at any world size and ZeRO stage, read by one process
// with no optimizer and no communicator.
struct fp32_weights {
  shard_header header;  // the first file's: save id, step count, optimizer, dtypes, parameter sizes
  // Per parameter, in the optimizer's order: the master weights, or the parameters where
  // the save kept no separate master (fp32 and all-16-bit policies without one).
  std::vector<std::vector<float>> params;
};

// Reads every shard file of the save in `dir` (ZeroOptimizer::save_checkpoint's
// directory; the LibTorch engine's <save_dir>/<tag>). Needs 4 bytes of host memory per
// parameter, for the result. Throws mpzero::invalid_argument naming the file for a
// missing, truncated, corrupt or mixed set of files.
inline fp32_weights read_fp32_weights(const std::filesystem::path& dir) {
  shard_set files(dir, "checkpoint::read_fp32_weights");
  fp32_weights out;
  out.header = files.first();
  out.header.records.clear();  // they describe file 0 only
  out.params.resize(files.num_params());
  for (std::size_t i = 0; i < files.num_params(); ++i) {
    std::vector<float>& dst = out.params[i];
    dst.resize(static_cast<std::size_t>(out.header.numels[i]));
    files.for_each_run(i, 0, dst.size(), [&](const shard_set::run& r) {
      files.read(r, files.header(r.file).has_master ? 1 : 0, [&](const auto* src, std::uint64_t n) {
        for (std::uint64_t k = 0; k < n; ++k) dst[static_cast<std::size_t>(r.at + k)] = to_float(src[k]);
      });
    });
  }
  return out;
}

}  // namespace mpzero::checkpoint

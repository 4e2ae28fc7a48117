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
//   u8       param dtype, master dtype, state dtype, has_master, n_states, has_scaler, pad[2]
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
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "../error.hpp"
#include "../numeric/dtype.hpp"

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

namespace detail {

inline std::string quoted(const std::filesystem::path& p) { return "'" + p.string() + "'"; }

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
// order, write_data(record index, std::string& out), which appends exactly the record's
// bytes. The file appears complete or not at all: it is written beside its final name
// and renamed into place. Throws mpzero::error naming the path and the system's reason.
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
                                 0, 0};
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
    std::string data;
    for (std::size_t k = 0; k < h.records.size(); ++k) {
      data.clear();
      write_data(k, data);
      if (data.size() != h.records[k].count * h.element_bytes()) {
        mpzero::detail::throw_invalid("checkpoint::write_shard: record " + std::to_string(k) + " wrote " +
                                      std::to_string(data.size()) + " bytes, its header says " +
                                      std::to_string(h.records[k].count * h.element_bytes()));
      }
      if (!out.write(data.data(), static_cast<std::streamsize>(data.size()))) return false;
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

}  // namespace mpzero::checkpoint

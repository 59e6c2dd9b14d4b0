#ifndef GROUP_EMBEDDING_OPS_KERNELS_EV_SSD_TIER_H_
#define GROUP_EMBEDDING_OPS_KERNELS_EV_SSD_TIER_H_

// The SSD tier of an EmbeddingVariable (issue 36): an append-only file of
// fixed-size records under the EV's own folder, and a compact in-memory
// index key -> record number (TierIndex, 12 bytes a slot), used by the EV table (ev_storage.h) for
// StorageType.DRAM_SSDHASH and SSDHASH; TF-free so that it is tested on its own (tests/group_embedding/
// test_ev_ssd_tier_file.py builds a driver with g++).
//
// File layout (little-endian, as written by this host):
//   header  16 bytes: "GESSDT01", uint32 dim, uint32 slot_floats
//   record  int64 key, int64 freq, int64 version, float row[dim],
//           float slots[slot_floats], uint32 crc32c(all bytes before it)
// A record is superseded by a later one of the same key or by Erase; the
// dead bytes are reclaimed by Compact (rewrite the live records into a
// new file, then rename it over the old one).
//
// Errors are returned as strings (empty = ok) naming the EV and the file.
// A failed append leaves the index and the file's earlier records as they
// were: nothing already stored is lost. A read checks bounds, checksum and
// key, so a truncated or corrupted file is an error, never a wrong row.
// Not thread-safe: the caller serialises access.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "hash_mix.h"

namespace group_embedding {

// CRC-32C (Castagnoli), bitwise-table software version; the check value of
// "123456789" is 0xE3069283.
inline uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0) {
  static const struct Table {
    uint32_t v[256];
    Table() {
      for (uint32_t i = 0; i < 256; ++i) {
        uint32_t c = i;
        for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        v[i] = c;
      }
    }
  } table;
  const unsigned char* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table.v[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

// The tier's index: key -> record number and two mark bits, by open
// addressing (linear probing, backward-shift deletion: no tombstones) in
// two parallel arrays: the key (8 bytes) and a uint32 holding the record
// number (low 30 bits) and the marks (top 2), 12 bytes a slot. The table
// has any number of slots (a key's home is Mix(key) scaled to it), grows
// by a quarter when 80% full, so its load stays in [0.64, 0.8]: 15 to 19
// bytes a key. An std::unordered_map<int64, uint64> took about 41 (a
// 32-byte node and a bucket pointer). At the scale (200M keys on
// disk) that is about 3.4 GiB instead of 7.6. Record numbers stop at
// 2^30 - 2 (dead records included; compaction keeps those below the live
// ones, so about 2^29 live keys per tier file).
class TierIndex {
 public:
  static constexpr uint32_t kNone = 0xffffffffu;
  static constexpr uint64_t kMaxRecords = (uint64_t{1} << 30) - 2;
  static constexpr uint32_t kRecordMask = (uint32_t{1} << 30) - 1;

  TierIndex() { Reset(kMinSlots); }

  uint64_t size() const { return size_; }
  // Bytes of the two arrays.
  uint64_t Bytes() const { return keys_.size() * (8 + 4); }

  // The slot of `key`, or -1.
  int64_t Find(int64_t key) const {
    uint64_t h = Home(key);
    while (recs_[h] != kNone) {
      if (keys_[h] == key) return static_cast<int64_t>(h);
      h = Next(h);
    }
    return -1;
  }
  uint32_t record(int64_t slot) const { return recs_[slot] & kRecordMask; }
  uint8_t marks(int64_t slot) const { return recs_[slot] >> 30; }
  void set_marks(int64_t slot, uint8_t m) {
    recs_[slot] = (recs_[slot] & kRecordMask) | (uint32_t{m} << 30);
  }

  // Points `key` at record `rec` (<= kMaxRecords; keeps its marks if
  // present, else 0).
  void Set(int64_t key, uint32_t rec) {
    const int64_t at = Find(key);
    if (at >= 0) {
      recs_[at] = (recs_[at] & ~kRecordMask) | rec;
      return;
    }
    if ((size_ + 1) * 5 > keys_.size() * 4) {
      Reset(keys_.size() + keys_.size() / 4);
    }
    uint64_t h = Home(key);
    while (recs_[h] != kNone) h = Next(h);
    keys_[h] = key;
    recs_[h] = rec;
    ++size_;
  }

  // Removes `key`; returns whether it was there.
  bool Erase(int64_t key) {
    const int64_t at = Find(key);
    if (at < 0) return false;
    uint64_t hole = static_cast<uint64_t>(at);
    recs_[hole] = kNone;
    --size_;
    for (uint64_t j = Next(hole); recs_[j] != kNone; j = Next(j)) {
      const uint64_t home = Home(keys_[j]);
      // Move j into the hole if its home is not in (hole, j] cyclically.
      const bool stays = hole <= j ? (home > hole && home <= j)
                                   : (home > hole || home <= j);
      if (stays) continue;
      keys_[hole] = keys_[j];
      recs_[hole] = recs_[j];
      recs_[j] = kNone;
      hole = j;
    }
    return true;
  }

  void Clear() {
    keys_.clear();
    recs_.clear();
    size_ = 0;
    Reset(kMinSlots);
  }
  void Swap(TierIndex& other) {
    keys_.swap(other.keys_);
    recs_.swap(other.recs_);
    std::swap(size_, other.size_);
  }

  // f(key, record, marks) for every entry.
  template <typename F>
  void ForEach(F f) const {
    for (uint64_t h = 0; h < keys_.size(); ++h) {
      if (recs_[h] != kNone) f(keys_[h], recs_[h] & kRecordMask, recs_[h] >> 30);
    }
  }
  // m = f(key, m) for the marks of every entry.
  template <typename F>
  void UpdateMarks(F f) {
    for (uint64_t h = 0; h < keys_.size(); ++h) {
      if (recs_[h] != kNone) set_marks(h, f(keys_[h], marks(h)));
    }
  }

 private:
  static constexpr uint64_t kMinSlots = 64;

  // Mix(key) scaled to [0, slots): any table size, no modulo.
  uint64_t Home(int64_t key) const {
    return static_cast<uint64_t>(
        (static_cast<unsigned __int128>(Mix(static_cast<uint64_t>(key))) *
         keys_.size()) >> 64);
  }
  uint64_t Next(uint64_t h) const { return h + 1 == keys_.size() ? 0 : h + 1; }

  // Rebuilds with `capacity` slots (more than size()).
  void Reset(uint64_t capacity) {
    std::vector<int64_t> keys(capacity);
    std::vector<uint32_t> recs(capacity, kNone);
    keys.swap(keys_);
    recs.swap(recs_);
    for (uint64_t h = 0; h < keys.size(); ++h) {
      if (recs[h] == kNone) continue;
      uint64_t at = Home(keys[h]);
      while (recs_[at] != kNone) at = Next(at);
      keys_[at] = keys[h];
      recs_[at] = recs[h];
    }
  }

  std::vector<int64_t> keys_;
  std::vector<uint32_t> recs_;
  uint64_t size_ = 0;
};

// One key's full state, as moved between tiers.
struct TierRecord {
  int64_t key = 0;
  int64_t freq = 0;
  int64_t version = 0;
  std::vector<float> row;    // dim floats
  std::vector<float> slots;  // slot_floats floats
};

class SsdTierFile {
 public:
  static constexpr char kMagic[9] = "GESSDT01";
  static constexpr uint64_t kHeaderBytes = 16;

  SsdTierFile(std::string ev_name, std::string path, uint32_t dim,
              uint32_t slot_floats)
      : ev_name_(std::move(ev_name)), path_(std::move(path)), dim_(dim),
        slot_floats_(slot_floats),
        record_bytes_(24 + 4 * (uint64_t(dim) + slot_floats) + 4) {}
  ~SsdTierFile() { Close(); }
  SsdTierFile(const SsdTierFile&) = delete;
  SsdTierFile& operator=(const SsdTierFile&) = delete;

  // Creates (truncates) the file and writes its header. The tier is a
  // cache of one process: an existing file is not reused.
  std::string Open() {
    Close();
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd_ < 0) return Error("cannot create", errno);
    index_.Clear();
    end_ = 0;
    dead_ = 0;
    std::string header = Header();
    std::string err = WriteAll(header.data(), header.size(), 0);
    if (!err.empty()) return err;
    end_ = kHeaderBytes;
    return "";
  }

  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  // Closes and deletes the file (the EV is gone).
  void CloseAndRemove() {
    Close();
    ::unlink(path_.c_str());
  }

  // Appends the record; on success the index points at it (a former record
  // of the key becomes dead). On failure the file is cut back to its former
  // end and the index is unchanged.
  std::string Put(const TierRecord& r) {
    if (r.row.size() != dim_ || r.slots.size() != slot_floats_)
      return Error("record of the wrong width for key " + std::to_string(r.key), 0);
    std::vector<char> buf(record_bytes_);
    Encode(r, buf.data());
    return PutEncoded(buf.data(), &r.key, 1);
  }

  // Put of `n` records of distinct `keys`, already Encode()d one after
  // the other in `buf` (n * record_bytes() bytes), in one write: a spill
  // of many rows costs one system call, not one per row. On failure the
  // file is cut back and none of them is indexed.
  std::string PutEncoded(const char* buf, const int64_t* keys, uint64_t n) {
    const uint64_t first = (end_ - kHeaderBytes) / record_bytes_;
    if (first + n > TierIndex::kMaxRecords + 1)
      return Error("is full (" + std::to_string(first) + " records, the "
                   "most its index numbers is " +
                   std::to_string(TierIndex::kMaxRecords + 1) + ")", 0);
    std::string err = WriteAll(buf, n * record_bytes_, end_);
    if (!err.empty()) {
      // Best effort: the bytes past end_ are unreachable from the index.
      if (::ftruncate(fd_, static_cast<off_t>(end_)) != 0) {}
      return err;
    }
    for (uint64_t i = 0; i < n; ++i) {
      if (index_.Find(keys[i]) >= 0) dead_ += record_bytes_;
      index_.Set(keys[i], static_cast<uint32_t>(first + i));
    }
    end_ += n * record_bytes_;
    return "";
  }

  // Lays `r` (of this file's widths) out as a record at `p`
  // (record_bytes() bytes), checksum included.
  void Encode(const TierRecord& r, char* p) const {
    std::memcpy(p, &r.key, 8);
    std::memcpy(p + 8, &r.freq, 8);
    std::memcpy(p + 16, &r.version, 8);
    std::memcpy(p + 24, r.row.data(), 4 * uint64_t(dim_));
    std::memcpy(p + 24 + 4 * uint64_t(dim_), r.slots.data(), 4 * uint64_t(slot_floats_));
    uint32_t crc = Crc32c(p, record_bytes_ - 4);
    std::memcpy(p + record_bytes_ - 4, &crc, 4);
  }

  bool Contains(int64_t key) const { return index_.Find(key) >= 0; }

  // The two mark bits the EV keeps per key (its change tracking, see
  // ev_storage.h); 0 for a key not here. They follow the key through
  // Put and compaction and go with Erase.
  uint8_t Marks(int64_t key) const {
    const int64_t at = index_.Find(key);
    return at < 0 ? 0 : index_.marks(at);
  }
  void SetMarks(int64_t key, uint8_t marks) {
    const int64_t at = index_.Find(key);
    if (at >= 0) index_.set_marks(at, marks);
  }
  // f(key, marks&) for every key: change the marks in place.
  template <typename F>
  void ForEachMarks(F f) {
    index_.UpdateMarks([&f](int64_t key, uint8_t m) {
      f(key, m);
      return m;
    });
  }
  // Bytes of the in-memory index.
  uint64_t IndexBytes() const { return index_.Bytes(); }

  // Reads the key's record into *out; *found is false if the key is not in
  // this tier. A short read, a checksum mismatch or a record of another key
  // is an error naming the EV and the file.
  std::string Get(int64_t key, TierRecord* out, bool* found) const {
    const int64_t at = index_.Find(key);
    *found = at >= 0;
    if (!*found) return "";
    return ReadAt(Offset(index_.record(at)), key, out);
  }

  // Drops the key (its record becomes dead); returns whether it was here.
  bool Erase(int64_t key) {
    if (!index_.Erase(key)) return false;
    dead_ += record_bytes_;
    return true;
  }

  // Rewrites the live records into path + ".compact" and renames it over
  // the file. Each record is verified as it is copied; on any error the
  // old file and index stay in use.
  std::string Compact() { return Rewrite(slot_floats_, 0.0f); }

  // Compact, and widens every record to `slot_floats` slot floats (at
  // least the current ones), the new ones set to `init`: an optimizer
  // slot created while keys are in this tier.
  std::string Rewrite(uint32_t slot_floats, float init) {
    SsdTierFile next(ev_name_, path_ + ".compact", dim_, slot_floats);
    std::string err = next.Open();
    if (!err.empty()) return err;
    TierRecord r;
    const TierIndex& index = index_;
    index.ForEach([&](int64_t key, uint32_t rec, uint8_t marks) {
      if (!err.empty()) return;
      err = ReadAt(Offset(rec), key, &r);
      if (err.empty()) {
        r.slots.resize(slot_floats, init);
        err = next.Put(r);
      }
      if (err.empty()) next.SetMarks(key, marks);
    });
    if (!err.empty()) {
      next.Close();
      ::unlink(next.path_.c_str());
      return err;
    }
    if (::rename(next.path_.c_str(), path_.c_str()) != 0) {
      int e = errno;
      next.Close();
      ::unlink(next.path_.c_str());
      return Error("cannot rename the compacted file over", e);
    }
    Close();
    fd_ = next.fd_;
    next.fd_ = -1;
    index_.Swap(next.index_);
    end_ = next.end_;
    dead_ = 0;
    slot_floats_ = slot_floats;
    record_bytes_ = next.record_bytes_;
    return "";
  }

  // Whether the dead bytes are worth a compaction (more than the live ones
  // and over 1 MiB: amortised O(1) rewrites per put).
  bool WantsCompaction() const {
    return dead_ > (1u << 20) && dead_ > LiveBytes();
  }

  uint64_t size() const { return index_.size(); }  // keys
  uint64_t file_bytes() const { return end_; }
  uint64_t dead_bytes() const { return dead_; }
  uint64_t LiveBytes() const { return index_.size() * record_bytes_; }
  uint64_t record_bytes() const { return record_bytes_; }
  uint32_t slot_floats() const { return slot_floats_; }
  const std::string& path() const { return path_; }
  // The keys of this tier (for export, filters and eviction scans).
  template <typename F>
  void ForEachKey(F f) const {
    index_.ForEach([&f](int64_t key, uint32_t, uint8_t) { f(key); });
  }

 private:
  uint64_t Offset(uint32_t rec) const {
    return kHeaderBytes + uint64_t{rec} * record_bytes_;
  }

  std::string Header() const {
    std::string h(kMagic, 8);
    h.append(reinterpret_cast<const char*>(&dim_), 4);
    h.append(reinterpret_cast<const char*>(&slot_floats_), 4);
    return h;
  }

  std::string ReadAt(uint64_t offset, int64_t key, TierRecord* out) const {
    // offset came from this process's index; the bound guards a file cut
    // behind our back (offset + record_bytes_ cannot overflow: both are
    // below the file end we wrote, itself an off_t).
    struct stat st;
    if (::fstat(fd_, &st) != 0) return Error("cannot stat", errno);
    if (offset + record_bytes_ > static_cast<uint64_t>(st.st_size))
      return Error("truncated (record of key " + std::to_string(key) + " at offset " +
                       std::to_string(offset) + " past the end) in", 0);
    std::vector<char> buf(record_bytes_);
    uint64_t done = 0;
    while (done < record_bytes_) {
      ssize_t n = ::pread(fd_, buf.data() + done, record_bytes_ - done,
                          static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return Error("cannot read", errno);
      if (n == 0) return Error("truncated (short read) in", 0);
      done += static_cast<uint64_t>(n);
    }
    uint32_t crc;
    std::memcpy(&crc, buf.data() + record_bytes_ - 4, 4);
    if (crc != Crc32c(buf.data(), record_bytes_ - 4))
      return Error("checksum mismatch (record of key " + std::to_string(key) +
                       " at offset " + std::to_string(offset) + ") in", 0);
    int64_t stored;
    std::memcpy(&stored, buf.data(), 8);
    if (stored != key)
      return Error("record at offset " + std::to_string(offset) + " holds key " +
                       std::to_string(stored) + ", expected " + std::to_string(key) + ", in", 0);
    out->key = key;
    std::memcpy(&out->freq, buf.data() + 8, 8);
    std::memcpy(&out->version, buf.data() + 16, 8);
    out->row.resize(dim_);
    out->slots.resize(slot_floats_);
    std::memcpy(out->row.data(), buf.data() + 24, 4 * uint64_t(dim_));
    std::memcpy(out->slots.data(), buf.data() + 24 + 4 * uint64_t(dim_),
                4 * uint64_t(slot_floats_));
    return "";
  }

  std::string WriteAll(const char* p, uint64_t n, uint64_t offset) {
    uint64_t done = 0;
    while (done < n) {
      ssize_t w = ::pwrite(fd_, p + done, n - done, static_cast<off_t>(offset + done));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) return Error("cannot write (disk full?)", w < 0 ? errno : ENOSPC);
      done += static_cast<uint64_t>(w);
    }
    return "";
  }

  std::string Error(const std::string& what, int err) const {
    std::string msg = "EmbeddingVariable '" + ev_name_ + "': SSD tier file " +
                      what + " '" + path_ + "'";
    if (err != 0) msg += ": " + std::string(std::strerror(err));
    return msg;
  }

  std::string ev_name_;
  std::string path_;
  uint32_t dim_;
  uint32_t slot_floats_;
  uint64_t record_bytes_;
  int fd_ = -1;
  uint64_t end_ = 0;   // bytes written, header included
  uint64_t dead_ = 0;  // bytes of superseded or erased records
  TierIndex index_;  // key -> record number (and the EV's marks)
};

}  // namespace group_embedding

#endif  // GROUP_EMBEDDING_OPS_KERNELS_EV_SSD_TIER_H_

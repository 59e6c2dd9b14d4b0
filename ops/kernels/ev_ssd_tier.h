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
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "hash_mix.h"

namespace group_embedding {

// CRC-32C (Castagnoli); the check value of "123456789" is 0xE3069283.
// The portable version is table-driven, a byte a step; on x86 CPUs with
// SSE4.2 (checked once, at run time: the kernels may be built without
// -msse4.2) the crc32 instruction takes 8 bytes a step, about 10x faster:
// every record spilled, promoted or compacted is checksummed, and the
// table version was a tenth of a spill's time.
inline uint32_t Crc32cPortable(const void* data, size_t n, uint32_t crc = 0) {
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

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GE_HAVE_CRC32C_HW 1
__attribute__((target("sse4.2"))) inline uint32_t Crc32cSse42(
    const void* data, size_t n, uint32_t crc = 0) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  uint64_t c = ~crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = __builtin_ia32_crc32qi(c32, *p);
  return ~c32;
}
#endif

// Whether Crc32c uses the CPU's crc32 instruction.
inline bool Crc32cHardware() {
#ifdef GE_HAVE_CRC32C_HW
  static const bool on = __builtin_cpu_supports("sse4.2");
  return on;
#else
  return false;
#endif
}

inline uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0) {
#ifdef GE_HAVE_CRC32C_HW
  if (Crc32cHardware()) return Crc32cSse42(data, n, crc);
#endif
  return Crc32cPortable(data, n, crc);
}

// Memory for the index's tables straight from mmap: a table that grows
// frees its old arrays (megabytes each at scale) with munmap, so they go
// back to the system at once. From malloc they stayed in the heap as
// holes the next, larger table did not fit: the process held about 1 GiB
// more than the budget at 100M keys on disk.
template <typename T>
struct PageAllocator {
  using value_type = T;
  PageAllocator() = default;
  template <typename U>
  PageAllocator(const PageAllocator<U>&) {}  // NOLINT: rebind
  T* allocate(size_t n) {
    void* p = ::mmap(nullptr, n * sizeof(T), PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t n) { ::munmap(p, n * sizeof(T)); }
  template <typename U>
  bool operator==(const PageAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const PageAllocator<U>&) const { return false; }
};

// The tier's index: key -> record number and two mark bits, by open
// addressing (linear probing, backward-shift deletion: no tombstones) in
// two parallel arrays: the key (8 bytes) and a uint32 holding the record
// number (low 30 bits) and the marks (top 2), 12 bytes a slot. A table
// has any number of slots (a key's home is its hash scaled to it), grows
// by a quarter when 80% full, so its load stays in [0.64, 0.8]: 15 to 19
// bytes a key. An std::unordered_map<int64, uint64> took about 41 (a
// 32-byte node and a bucket pointer). At the scale (200M keys on
// disk) that is about 3.4 GiB instead of 7.6. Record numbers stop at
// 2^30 - 2 (dead records included; compaction keeps those below the live
// ones, so about 2^29 live keys per tier file).
//
// Past kSplitSlots slots the index splits into 256 tables by the top
// byte of the hash: a table grows by copying into a new one, and with one
// table the old and the new would both be alive at the largest size (3.4
// GiB + 4.2 GiB at 200M keys, beyond a 4 GiB DRAM budget + 2 GiB); with
// 256 a growth needs 1/256 of the index more.
class TierIndex {
 public:
  static constexpr uint32_t kNone = 0xffffffffu;
  static constexpr uint64_t kMaxRecords = (uint64_t{1} << 30) - 2;
  static constexpr uint32_t kRecordMask = (uint32_t{1} << 30) - 1;
  static constexpr uint64_t kSplitSlots = uint64_t{1} << 20;
  static constexpr int kShardBits = 8;

  TierIndex() { Clear(); }

  // Tests only: split at `slots` slots instead of kSplitSlots (kept by
  // Clear).
  void SetSplitSlots(uint64_t slots) { split_slots_ = slots; }
  uint64_t split_slots() const { return split_slots_; }
  // Tables (1 before the split, 256 after).
  uint64_t tables() const { return tables_.size(); }

  uint64_t size() const { return size_; }
  // Bytes of the arrays.
  uint64_t Bytes() const { return slots_ * (8 + 4); }

  // The slot of `key` (a position in the index), or -1.
  int64_t Find(int64_t key) const {
    const uint64_t hash = Mix(static_cast<uint64_t>(key));
    const uint64_t t = TableOf(hash);
    const int64_t at = tables_[t].Find(key, Local(hash));
    return at < 0 ? -1 : static_cast<int64_t>((t << 40) | uint64_t(at));
  }
  // Starts loading the cache lines where Find(key) begins.
  void Prefetch(int64_t key) const {
    const uint64_t hash = Mix(static_cast<uint64_t>(key));
    const Table& t = tables_[TableOf(hash)];
    const uint64_t h = t.Home(Local(hash));
    __builtin_prefetch(&t.keys[h]);
    __builtin_prefetch(&t.recs[h]);
  }
  uint32_t record(int64_t slot) const { return Rec(slot) & kRecordMask; }
  uint8_t marks(int64_t slot) const { return Rec(slot) >> 30; }
  void set_marks(int64_t slot, uint8_t m) {
    uint32_t& r = tables_[uint64_t(slot) >> 40].recs[slot & kLocalMask];
    r = (r & kRecordMask) | (uint32_t{m} << 30);
  }

  // Points `key` at record `rec` (<= kMaxRecords) with marks `*marks`,
  // or without `marks` its former ones (0 if new); returns whether the
  // key was here. One probe.
  bool Set(int64_t key, uint32_t rec, const uint8_t* marks = nullptr) {
    uint64_t hash = Mix(static_cast<uint64_t>(key));
    Table* table = &tables_[TableOf(hash)];
    const int64_t at = table->Find(key, Local(hash));
    const uint32_t m = marks ? uint32_t{*marks} << 30 : 0;
    if (at >= 0) {
      table->recs[at] = (marks ? m : table->recs[at] & ~kRecordMask) | rec;
      return true;
    }
    if ((table->size + 1) * 5 > table->keys.size() * 4) {
      if (tables_.size() == 1 && table->keys.size() >= split_slots_) {
        Split();
      } else {
        slots_ -= table->keys.size();
        table->Reset(table->keys.size() + table->keys.size() / 4, shift_);
        slots_ += table->keys.size();
      }
      table = &tables_[TableOf(hash)];
    }
    table->Insert(key, rec | m, Local(hash));
    ++size_;
    return false;
  }

  // Removes `key`; returns whether it was there (and its marks in
  // `*marks`, when given).
  bool Erase(int64_t key, uint8_t* marks = nullptr) {
    const uint64_t hash = Mix(static_cast<uint64_t>(key));
    if (!tables_[TableOf(hash)].Erase(key, Local(hash), shift_, marks)) {
      return false;
    }
    --size_;
    return true;
  }

  void Clear() {
    tables_.assign(1, Table());
    tables_[0].Reset(kMinSlots, 0);
    shift_ = 0;
    slots_ = kMinSlots;
    size_ = 0;
  }
  void Swap(TierIndex& other) {
    tables_.swap(other.tables_);
    std::swap(shift_, other.shift_);
    std::swap(slots_, other.slots_);
    std::swap(size_, other.size_);
    std::swap(split_slots_, other.split_slots_);
  }

  // f(key, record, marks) for every entry.
  template <typename F>
  void ForEach(F f) const {
    for (const Table& t : tables_) {
      for (uint64_t h = 0; h < t.keys.size(); ++h) {
        if (t.recs[h] != kNone) f(t.keys[h], t.recs[h] & kRecordMask, t.recs[h] >> 30);
      }
    }
  }
  // m = f(key, m) for the marks of every entry.
  template <typename F>
  void UpdateMarks(F f) {
    for (Table& t : tables_) {
      for (uint64_t h = 0; h < t.keys.size(); ++h) {
        if (t.recs[h] == kNone) continue;
        const uint8_t m = f(t.keys[h], static_cast<uint8_t>(t.recs[h] >> 30));
        t.recs[h] = (t.recs[h] & kRecordMask) | (uint32_t{m} << 30);
      }
    }
  }

 private:
  static constexpr uint64_t kMinSlots = 64;
  static constexpr uint64_t kLocalMask = (uint64_t{1} << 40) - 1;

  // One open-addressing table; `local` is the key's hash without the
  // bits that chose the table.
  struct Table {
    std::vector<int64_t, PageAllocator<int64_t>> keys;
    std::vector<uint32_t, PageAllocator<uint32_t>> recs;
    uint64_t size = 0;

    // Its hash scaled to [0, slots): any table size, no modulo.
    uint64_t Home(uint64_t local) const {
      return static_cast<uint64_t>(
          (static_cast<unsigned __int128>(local) * keys.size()) >> 64);
    }
    uint64_t Next(uint64_t h) const { return h + 1 == keys.size() ? 0 : h + 1; }
    int64_t Find(int64_t key, uint64_t local) const {
      for (uint64_t h = Home(local); recs[h] != kNone; h = Next(h)) {
        if (keys[h] == key) return static_cast<int64_t>(h);
      }
      return -1;
    }
    void Insert(int64_t key, uint32_t rec, uint64_t local) {
      uint64_t h = Home(local);
      while (recs[h] != kNone) h = Next(h);
      keys[h] = key;
      recs[h] = rec;
      ++size;
    }
    bool Erase(int64_t key, uint64_t local, int shift, uint8_t* marks) {
      const int64_t at = Find(key, local);
      if (at < 0) return false;
      if (marks) *marks = static_cast<uint8_t>(recs[at] >> 30);
      uint64_t hole = static_cast<uint64_t>(at);
      recs[hole] = kNone;
      --size;
      for (uint64_t j = Next(hole); recs[j] != kNone; j = Next(j)) {
        const uint64_t home =
            Home(Mix(static_cast<uint64_t>(keys[j])) << shift);
        // Move j into the hole if its home is not in (hole, j] cyclically.
        const bool stays = hole <= j ? (home > hole && home <= j)
                                     : (home > hole || home <= j);
        if (stays) continue;
        keys[hole] = keys[j];
        recs[hole] = recs[j];
        recs[j] = kNone;
        hole = j;
      }
      return true;
    }
    // Rebuilds with `capacity` slots (more than size).
    void Reset(uint64_t capacity, int shift) {
      std::vector<int64_t, PageAllocator<int64_t>> old_keys(capacity);
      std::vector<uint32_t, PageAllocator<uint32_t>> old_recs(capacity, kNone);
      old_keys.swap(keys);
      old_recs.swap(recs);
      size = 0;
      for (uint64_t h = 0; h < old_keys.size(); ++h) {
        if (old_recs[h] == kNone) continue;
        Insert(old_keys[h], old_recs[h],
               Mix(static_cast<uint64_t>(old_keys[h])) << shift);
      }
    }
  };

  uint64_t TableOf(uint64_t hash) const {
    return shift_ == 0 ? 0 : hash >> (64 - kShardBits);
  }
  uint64_t Local(uint64_t hash) const { return hash << shift_; }
  uint32_t Rec(int64_t slot) const {
    return tables_[uint64_t(slot) >> 40].recs[slot & kLocalMask];
  }

  // One table -> 2^kShardBits tables, each sized for its share at the
  // load a growth would give.
  void Split() {
    std::vector<Table> old(1u << kShardBits);
    old.swap(tables_);
    shift_ = kShardBits;
    const uint64_t each = std::max<uint64_t>(
        kMinSlots, (old[0].keys.size() + old[0].keys.size() / 4) >> kShardBits);
    for (Table& t : tables_) t.Reset(each, shift_);
    slots_ = each << kShardBits;
    const Table& o = old[0];
    for (uint64_t h = 0; h < o.keys.size(); ++h) {
      if (o.recs[h] == kNone) continue;
      const uint64_t hash = Mix(static_cast<uint64_t>(o.keys[h]));
      Table& t = tables_[TableOf(hash)];
      if ((t.size + 1) * 5 > t.keys.size() * 4) {  // an unlucky share
        slots_ -= t.keys.size();
        t.Reset(t.keys.size() + t.keys.size() / 4, shift_);
        slots_ += t.keys.size();
      }
      t.Insert(o.keys[h], o.recs[h], Local(hash));
    }
  }

  std::vector<Table> tables_;
  int shift_ = 0;       // 0: one table; kShardBits: 256
  uint64_t split_slots_ = kSplitSlots;
  uint64_t slots_ = 0;  // over all tables
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

  // Creates the file, locked (flock) while this object has it open, and
  // writes its header. The tier is a cache of one process: a file left
  // by a process that is gone (unlocked) is truncated and reused; one
  // that another open file holds is left untouched, an error with
  // `*busy` set (when given): a second process on the same path would
  // otherwise truncate the first one's records and write its own at
  // their offsets, with valid checksums and the same keys: wrong rows.
  std::string Open(bool* busy = nullptr) {
    Close();
    if (busy != nullptr) *busy = false;
    // The file locked must still be the one the path names: another
    // process may have renamed a compacted file over it, or removed it,
    // between our open and our lock. Then open the path again.
    for (int attempt = 0;; ++attempt) {
      const int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
      if (fd < 0) return Error("cannot create", errno);
      if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
        const int e = errno;
        ::close(fd);
        if (e == EWOULDBLOCK) {
          if (busy != nullptr) *busy = true;
          return Error("is in use by another process:", 0);
        }
        // flock keeps two processes off one file; a file system without
        // it (some network ones) cannot hold a tier safely.
        return Error("cannot be locked (flock: use a local file system)", e);
      }
      struct stat held, named;
      if (::fstat(fd, &held) == 0 && ::stat(path_.c_str(), &named) == 0 &&
          held.st_dev == named.st_dev && held.st_ino == named.st_ino) {
        fd_ = fd;
        return Clear(slot_floats_);
      }
      ::close(fd);
      if (attempt == 16) return Error("keeps being replaced:", 0);
    }
  }

  // Empties the open file (a restore replaces the whole content) with
  // `slot_floats` slot floats a record, keeping its lock.
  // A failed truncation changes nothing.
  std::string Clear(uint32_t slot_floats) {
    if (::ftruncate(fd_, 0) != 0) return Error("cannot truncate", errno);
    index_.Clear();
    end_ = 0;
    dead_ = 0;
    slot_floats_ = slot_floats;
    record_bytes_ = 24 + 4 * (uint64_t(dim_) + slot_floats) + 4;
    std::string header = Header();
    std::string err = WriteAll(header.data(), header.size(), 0);
    if (!err.empty()) return err;
    end_ = kHeaderBytes;
    return "";
  }

  void Close() {
    if (fd_ >= 0) ::close(fd_);  // releases the lock
    fd_ = -1;
  }

  // Deletes and closes the file (the EV is gone). Unlinked while still
  // locked: a process that takes the name then creates a new file.
  void CloseAndRemove() {
    if (fd_ >= 0) ::unlink(path_.c_str());
    Close();
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
  // of many rows costs one system call, not one per row. With `marks`,
  // key i gets the marks marks[i] (else it keeps its own). On failure the
  // file is cut back and none of them is indexed.
  std::string PutEncoded(const char* buf, const int64_t* keys, uint64_t n,
                         const uint8_t* marks = nullptr) {
    std::string err = CheckAppend(n);
    if (err.empty()) err = WriteAppended(buf, n, AppendOffset(0));
    if (!err.empty()) return AbandonAppend(err);
    IndexAppended(keys, n, marks);
    return "";
  }

  // PutEncoded in parts, for a caller that writes while it does other
  // work (the page-cache copy of a large spill is most of its cost):
  // CheckAppend(n); WriteAppended of the n records (in parts, from any
  // thread) at AppendOffset(their number in the append); then
  // IndexAppended, or AbandonAppend on an error. Until IndexAppended
  // nothing written is reachable.
  std::string CheckAppend(uint64_t n) const {
    const uint64_t first = (end_ - kHeaderBytes) / record_bytes_;
    if (first + n > TierIndex::kMaxRecords + 1)
      return Error("is full (" + std::to_string(first) + " records, the "
                   "most its index numbers is " +
                   std::to_string(TierIndex::kMaxRecords + 1) + ")", 0);
    return "";
  }
  // The file offset of record `at` of the next append.
  uint64_t AppendOffset(uint64_t at) const {
    return end_ + at * record_bytes_;
  }
  // Writes `count` encoded records (at `buf`) from file offset `offset`
  // (AppendOffset's). Only a pwrite: safe beside the other calls.
  std::string WriteAppended(const char* buf, uint64_t count,
                            uint64_t offset) const {
    return WriteAll(buf, count * record_bytes_, offset);
  }
  std::string AbandonAppend(const std::string& err) {
    // Best effort: the bytes past end_ are unreachable from the index.
    if (::ftruncate(fd_, static_cast<off_t>(end_)) != 0) {}
    return err;
  }
  void IndexAppended(const int64_t* keys, uint64_t n, const uint8_t* marks) {
    const uint64_t first = (end_ - kHeaderBytes) / record_bytes_;
    for (uint64_t i = 0; i < n; ++i) {
      // Random slots of an index of up to GBs: one miss each, unless
      // loaded ahead.
      if (i + 8 < n) index_.Prefetch(keys[i + 8]);
      if (index_.Set(keys[i], static_cast<uint32_t>(first + i),
                     marks ? marks + i : nullptr)) {
        dead_ += record_bytes_;
      }
    }
    end_ += n * record_bytes_;
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
  // ev_storage.h) live in the index: PutEncoded sets them, Erase returns
  // them, compaction keeps them.
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
  // The index's tables (see TierIndex) and, for tests, the size at which
  // it splits into 256.
  uint64_t IndexTables() const { return index_.tables(); }
  void SetIndexSplitSlots(uint64_t slots) { index_.SetSplitSlots(slots); }

  // Reads the key's record into *out; *found is false if the key is not in
  // this tier. A short read, a checksum mismatch or a record of another key
  // is an error naming the EV and the file.
  std::string Get(int64_t key, TierRecord* out, bool* found) const {
    const int64_t at = index_.Find(key);
    *found = at >= 0;
    if (!*found) return "";
    std::vector<char> buf(record_bytes_);
    const uint64_t offset = Offset(index_.record(at));
    std::string err = ReadFull(offset, buf.data(), record_bytes_);
    if (err.empty()) err = Check(buf.data(), key, offset);
    if (err.empty()) Decode(buf.data(), out);
    return err;
  }

  void PrefetchKey(int64_t key) const { index_.Prefetch(key); }
  // The record number of `key`, or -1 when it is not in this tier.
  int64_t RecordOf(int64_t key) const {
    const int64_t at = index_.Find(key);
    return at < 0 ? -1 : static_cast<int64_t>(index_.record(at));
  }

  // Reads the records `recs` (of `keys`, as RecordOf gave them, distinct,
  // in increasing order) into `out` (n * record_bytes() bytes), checked
  // as Get checks them. Records less than 4 KiB apart come in one pread
  // (of up to 1 MiB): a batch's promotions cost a few system calls and
  // read the file front to back, not one call per key in batch order.
  std::string ReadMany(const uint32_t* recs, const int64_t* keys, uint64_t n,
                       char* out) const {
    const uint64_t gap = std::max<uint64_t>(1, 4096 / record_bytes_);
    const uint64_t most = std::max<uint64_t>(1, (1 << 20) / record_bytes_);
    std::vector<char> span;
    for (uint64_t i = 0; i < n;) {
      uint64_t j = i + 1;
      while (j < n && recs[j] - recs[j - 1] <= gap &&
             uint64_t(recs[j]) - recs[i] < most) {
        ++j;
      }
      const uint64_t count = uint64_t(recs[j - 1]) - recs[i] + 1;
      char* base = out + i * record_bytes_;
      if (count != j - i) {  // gaps: read the span, keep the wanted records
        span.resize(count * record_bytes_);
        base = span.data();
      }
      std::string err = ReadFull(Offset(recs[i]), base, count * record_bytes_);
      for (uint64_t k = i; k < j && err.empty(); ++k) {
        const char* p = base + (uint64_t(recs[k]) - recs[i]) * record_bytes_;
        err = Check(p, keys[k], Offset(recs[k]));
        if (p != out + k * record_bytes_) {
          std::memcpy(out + k * record_bytes_, p, record_bytes_);
        }
      }
      if (!err.empty()) return err;
      i = j;
    }
    return "";
  }

  // The fields of the record at `p` (of this file's widths).
  void Decode(const char* p, TierRecord* out) const {
    std::memcpy(&out->key, p, 8);
    std::memcpy(&out->freq, p + 8, 8);
    std::memcpy(&out->version, p + 16, 8);
    out->row.resize(dim_);
    out->slots.resize(slot_floats_);
    std::memcpy(out->row.data(), p + 24, 4 * uint64_t(dim_));
    std::memcpy(out->slots.data(), p + 24 + 4 * uint64_t(dim_),
                4 * uint64_t(slot_floats_));
  }

  // Drops the key (its record becomes dead); returns whether it was here
  // (and its marks in `*marks`, when given).
  bool Erase(int64_t key, uint8_t* marks = nullptr) {
    if (!index_.Erase(key, marks)) return false;
    dead_ += record_bytes_;
    return true;
  }

  // Rewrites the live records into path + ".compact" and renames it over
  // the file. Each record is verified as it is copied; on any error the
  // old file and index stay in use.
  std::string Compact() { return Rewrite(slot_floats_, 0.0f); }

  // Compact, and widens every record to `slot_floats` slot floats (at
  // least the current ones), the new ones set to `init`: an optimizer
  // slot created while keys are in this tier. The old file is read front
  // to back in 4 MiB chunks (a record is live when the index points at
  // it), not one read per key in index order.
  std::string Rewrite(uint32_t slot_floats, float init) {
    SsdTierFile next(ev_name_, path_ + ".compact", dim_, slot_floats);
    next.SetIndexSplitSlots(index_.split_slots());
    std::string err = next.Open();
    if (!err.empty()) return err;
    const uint64_t records = (end_ - kHeaderBytes) / record_bytes_;
    const uint64_t per_chunk = std::max<uint64_t>(1, (4 << 20) / record_bytes_);
    std::vector<char> in(std::min(per_chunk, std::max<uint64_t>(records, 1)) *
                         record_bytes_);
    std::vector<char> out(in.size() / record_bytes_ * next.record_bytes_);
    std::vector<int64_t> keys;
    std::vector<uint8_t> marks;
    TierRecord r;
    uint64_t live = 0;
    for (uint64_t first = 0; first < records && err.empty(); first += per_chunk) {
      const uint64_t n = std::min(per_chunk, records - first);
      err = ReadFull(Offset(first), in.data(), n * record_bytes_);
      keys.clear();
      marks.clear();
      for (uint64_t i = 0; i < n && err.empty(); ++i) {
        const char* p = in.data() + i * record_bytes_;
        int64_t key;
        std::memcpy(&key, p, 8);
        const int64_t at = index_.Find(key);
        if (at < 0 || index_.record(at) != first + i) continue;  // dead
        err = Check(p, key, Offset(first + i));
        char* q = out.data() + keys.size() * next.record_bytes_;
        if (slot_floats == slot_floats_) {
          std::memcpy(q, p, record_bytes_);
        } else {
          Decode(p, &r);
          r.slots.resize(slot_floats, init);
          next.Encode(r, q);
        }
        keys.push_back(key);
        marks.push_back(index_.marks(at));
      }
      if (err.empty()) {
        err = next.PutEncoded(out.data(), keys.data(), keys.size(), marks.data());
      }
      live += keys.size();
    }
    // A live record whose key bytes were damaged is not found above.
    if (err.empty() && live != index_.size()) {
      err = Error("damaged: " + std::to_string(index_.size() - live) +
                      " indexed records not found by compaction, in", 0);
    }
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

  // Reads n bytes at `offset`; a short read (the file cut behind our
  // back) is an error.
  std::string ReadFull(uint64_t offset, char* buf, uint64_t n) const {
    uint64_t done = 0;
    while (done < n) {
      ssize_t got = ::pread(fd_, buf + done, n - done,
                            static_cast<off_t>(offset + done));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) return Error("cannot read", errno);
      if (got == 0)
        return Error("truncated (short read at offset " +
                         std::to_string(offset + done) + ") in", 0);
      done += static_cast<uint64_t>(got);
    }
    return "";
  }

  // The record at `p` (read from `offset`) has a good checksum and is
  // `key`'s.
  std::string Check(const char* p, int64_t key, uint64_t offset) const {
    uint32_t crc;
    std::memcpy(&crc, p + record_bytes_ - 4, 4);
    if (crc != Crc32c(p, record_bytes_ - 4))
      return Error("checksum mismatch (record of key " + std::to_string(key) +
                       " at offset " + std::to_string(offset) + ") in", 0);
    int64_t stored;
    std::memcpy(&stored, p, 8);
    if (stored != key)
      return Error("record at offset " + std::to_string(offset) + " holds key " +
                       std::to_string(stored) + ", expected " + std::to_string(key) + ", in", 0);
    return "";
  }

  std::string WriteAll(const char* p, uint64_t n, uint64_t offset) const {
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

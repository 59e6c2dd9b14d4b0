#ifndef GROUP_EMBEDDING_OPS_KERNELS_EV_STORAGE_H_
#define GROUP_EMBEDDING_OPS_KERNELS_EV_STORAGE_H_

// EmbeddingVariable storage (one C++ resource per variable), shared by
// the storage ops (embedding_variable_ops.cc), the fused pooled lookup
// (ev_lookup_ops.cc) and the sparse optimizer updates (ev_apply_ops.cc).
//
// Why one resource holds keys, values, frequencies, versions AND optimizer
// slots: every op sees all of them under one lock, so an export is a
// consistent snapshot of exactly one key set (DeepRec snapshots values and
// slots at different moments and can restore slots of other keys).
//
// Layout (per live key, D = embedding dim, S = slots):
//   hash map   uint32 row index per bucket, load factor in (0.4, 0.8]
//   rows       key int64, freq int64 (saturating), version int64 (the
//              last step the key was seen, admitted or not, as wide as
//              the global step, so that steps past 2^32 or timestamps
//              still order), value
//              float[D], S parallel float[D] slot arenas
// Rows live in fixed-size chunks, so growth never moves a row; evicted
// rows go to a free list and are reused by the next insert. Only an SSD
// tier's spill moves rows (PackRows, before any row of its op is taken),
// to give back the memory of rows its DRAM budget no longer pays for.
//
// Change tracking (incremental checkpoints, GroupEmbeddingEVExportChanges), two
// bits per row instead of a 64-bit stamp (8 bytes a key, 8% of a dim-16 row):
// every write to a row (insert, count, version, optimizer update, import) sets
// its `changed` bit; an export numbers itself with a 64-bit sequence, moves
// `changed` into `exported` and writes the rows in `exported`, i.e. everything
// changed since the last save confirmed durable (GroupEmbeddingEVConfirmSave),
// failed saves included: a save that fails before its confirmation loses no
// marks. The confirmation clears `exported` and makes that export the base of
// the next delta. Keys evicted are recorded with the sequence of the next
// export (once an incremental export asked for them); a change no delta can
// express (an untracked eviction, a new slot, an import) leaves no base.
//
// SSD tier (StorageType.DRAM_SSDHASH / SSDHASH, issue 36): with
// `tier_dir` set, the rows above the DRAM budget (`dram_bytes`, which also
// pays for the tier's in-memory index, TierIndex: 15-19 bytes a key) live in
// an SsdTierFile (ev_ssd_tier.h) as whole records: key, freq, version,
// value and every slot, bit for bit. The ops that take rows by index run
// PrepareTier(keys) first, under the exclusive lock: it spills the coldest
// rows (LFU: least freq; LRU: oldest version, the last step seen; ties by
// key) down to the budget, then promotes the batch's keys found in the
// tier. So the kernels below only ever see DRAM rows. The updates (and
// the weighted lookup's backward pass) spill only when DRAM is over the
// budget by more than their own keys: right after the lookup of those
// keys, their rows stay. DRAM holds at most the budget plus the keys of
// two ops' batches. A spilled row carries
// its two change marks into the tier's index, so incremental exports see it.
// Whole-table ops (size, export, eviction) visit both tiers. The tier file
// is a cache of one process: checkpoints are the truth.

#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"
#include "ev_ssd_tier.h"
#include "id_map.h"
#include "op_checks.h"
#include "work_queue.h"

namespace group_embedding {
namespace ev {

// The other TF names come from op_checks.h, as in every kernel file.
using ::tensorflow::ResourceHandle;
using CpuWorkers = ::tensorflow::DeviceBase::CpuWorkerThreads;

// Chunks grow 16, 32, ..., 512 rows, then stay at 1024: a variable with a
// handful of keys (Criteo has fields of 3 or 4 values) does not pay for
// 1024 rows, and a big one still allocates rarely.
constexpr int kFirstChunkShift = 4;  // 16 rows
constexpr int kSmallChunks = 6;      // 16 .. 512 rows
constexpr int kChunkShift = 10;      // then 1024 rows per chunk
constexpr int64_t kChunkRows = int64_t{1} << kChunkShift;
constexpr int64_t kSmallRows =
    ((int64_t{1} << kSmallChunks) - 1) << kFirstChunkShift;  // 1008
constexpr uint32_t kEmpty = 0xffffffffu;
// A hash bucket (5 bytes, packed): a row and a hint byte of its key: the
// high nibble is the bucket's distance from the key's home bucket (15:
// 15 or more), the low one 4 bits of the key's hash that the home does
// not use. A probe reads a row's key (a cache miss per occupied bucket)
// only where both match; a deletion finds a bucket's home from its
// distance without reading its key. One byte, not a wider tag, so that
// a live key still costs at most 1.5 x its value's bytes + 8 (the
// memory target of ev_bench.py and test_embedding_variable.py).
struct __attribute__((packed)) Bucket {
  uint32_t row;
  uint8_t hint;
};
static_assert(sizeof(Bucket) == 5, "packed bucket");
constexpr Bucket kEmptyBucket = {kEmpty, 0};
constexpr uint64_t kFarHint = 15;  // distance nibble: 15 or more
// Row indices are uint32 and kEmpty marks a free bucket, so at most
// 2^32 - 2 rows: the (2^32 - 1)-th insert fails (ResourceExhausted)
// instead of wrapping onto row 0.
constexpr int64_t kMaxRows = int64_t{0xfffffffe};

// Keys hash with the kernels' one mixer, group_embedding::Mix (hash_mix.h).

// Rows of `width` Ts in chunks (see kFirstChunkShift): a row's address
// never changes once allocated.
template <typename T>
class ChunkedArray {
 public:
  explicit ChunkedArray(int64_t width = 1) : width_(width) {}
  T* Row(int64_t r) { return Locate(r); }
  const T* Row(int64_t r) const { return Locate(r); }
  void Reserve(int64_t rows) {
    while (capacity_ < rows) {
      const int64_t n = ChunkRows(static_cast<int>(chunks_.size()));
      chunks_.emplace_back(new T[width_ * n]());
      capacity_ += n;
    }
  }
  void Clear() {
    chunks_.clear();
    capacity_ = 0;
  }
  // Frees the last chunks while the rest still hold `rows` rows.
  void Shrink(int64_t rows) {
    while (!chunks_.empty()) {
      const int64_t last = ChunkRows(static_cast<int>(chunks_.size()) - 1);
      if (capacity_ - last < rows) break;
      chunks_.pop_back();
      capacity_ -= last;
    }
  }
  // The fewest rows >= `rows` that end a chunk.
  static int64_t ChunkEnd(int64_t rows) {
    int64_t end = 0;
    for (int c = 0; end < rows; ++c) end += ChunkRows(c);
    return end;
  }
  int64_t Bytes() const { return capacity_ * width_ * sizeof(T); }

 private:
  static int64_t ChunkRows(int c) {
    return c < kSmallChunks ? int64_t{1} << (kFirstChunkShift + c)
                            : kChunkRows;
  }
  T* Locate(int64_t r) const {
    if (r < kSmallRows) {
      // Chunk c starts at row 16 * (2^c - 1).
      const uint64_t q = static_cast<uint64_t>(r >> kFirstChunkShift) + 1;
      const int c = 63 - __builtin_clzll(q);
      const int64_t start = ((int64_t{1} << c) - 1) << kFirstChunkShift;
      return chunks_[c].get() + (r - start) * width_;
    }
    const int64_t big = r - kSmallRows;
    return chunks_[kSmallChunks + (big >> kChunkShift)].get() +
           (big & (kChunkRows - 1)) * width_;
  }

  int64_t width_;
  int64_t capacity_ = 0;
  std::vector<std::unique_ptr<T[]>> chunks_;
};

inline const float* DefaultRowOf(int64_t key, const float* defaults,
                                 int64_t default_rows, int64_t dim) {
  int64_t m = key % default_rows;
  if (m < 0) m += default_rows;
  return defaults + m * dim;
}

// Versions are steps; a negative step (none given) counts as 0.
inline int64_t ClampStep(int64_t step) { return std::max<int64_t>(step, 0); }

// One more occurrence, saturating instead of wrapping: a hot key must
// never fall back below the CounterFilter's threshold.
inline void CountOccurrence(int64_t* freq) {
  if (*freq < std::numeric_limits<int64_t>::max()) ++*freq;
}

// Key, occurrence count and last-update step of a row, side by side: a
// lookup (key compare, freq count) or an update (version stamp) touches
// one cache line for them instead of three.
struct KeyMeta {
  int64_t key;
  int64_t freq;
  int64_t version;
};

struct EVConfig {
  std::string name;
  int64_t dim = 0;
  int64_t filter_freq = 0;      // 0: no admission filter
  // CBFFilter: a counting Bloom filter of `cbf_counters` counters of
  // `cbf_counter_bytes` bytes, `cbf_hashes` hashes per key; 0 counters
  // means the filter (if any) is a CounterFilter.
  int64_t cbf_counters = 0;
  int64_t cbf_hashes = 0;
  int cbf_counter_bytes = 8;
  int64_t max_rows = kMaxRows;  // lowered only by tests
  float no_permission = 0.0f;   // value read by keys not admitted
  int64_t steps_to_live = 0;    // 0: no GlobalStepEvict
  float l2_threshold = -1.0f;   // < 0: no L2WeightEvict
  // SSD tier: a folder owned by this EV alone ("" = DRAM only), the DRAM
  // budget in bytes (rows, slots and the tier's index) and the policy.
  std::string tier_dir;
  int64_t dram_bytes = 0;
  bool tier_lru = false;        // false: LFU
};

// Per DRAM row beyond its key, counters, value and slots: its hash bucket
// (5 bytes at load >= 0.4, up to 12.5), two change bits, and the 16 bytes
// of the spill selection's candidate (ColdestRows: transient, but at the
// tier's peak), rounded up.
constexpr int64_t kDramRowOverheadBytes = 29;

// The tier folders of the live EVs of this process: two EVs writing one
// folder would overwrite each other's rows.
inline std::mutex& TierDirsMu() {
  static std::mutex mu;
  return mu;
}
inline std::map<std::string, std::string>& TierDirs() {
  static std::map<std::string, std::string> dirs;  // folder -> EV name
  return dirs;
}

// A counting Bloom filter whose counter array would take more than this
// keeps only its non-zero counters, in a hash map: DeepRec's model zoo
// sizes filters for 2**30 keys (about 10**10 counters, 82 GB of uint64)
// that a run touches a tiny part of. Same counters, same counts, same
// admissions as the array; memory follows the keys counted (about
// `cbf_hashes` map entries per key) instead of the array's size.
constexpr int64_t kDenseCbfMaxBytes = int64_t{256} << 20;

class EVStorage : public tensorflow::ResourceBase {
 public:
  explicit EVStorage(const EVConfig& config)
      : config_(config),
        sparse_cbf_on_(config.cbf_counters >
                       kDenseCbfMaxBytes /
                           std::max(config.cbf_counter_bytes, 1)),
        values_(config.dim) {
    buckets_.assign(64, kEmptyBucket);
    if (!sparse_cbf_on_) {
      cbf_.assign(config.cbf_counters * config.cbf_counter_bytes, 0);
    }
  }

  ~EVStorage() override {
    // The tier file is of no use to anyone after this EV (a new one
    // starts empty): its disk space goes back now.
    if (tier_) tier_->CloseAndRemove();
    if (!tier_dir_key_.empty()) {
      std::lock_guard<std::mutex> l(TierDirsMu());
      TierDirs().erase(tier_dir_key_);
    }
  }

  std::string DebugString() const override {
    return "EmbeddingVariable " + config_.name;
  }
  int64_t MemoryUsed() const override { return Bytes(); }

  tensorflow::mutex* mu() { return &mu_; }
  const EVConfig& config() const { return config_; }
  int64_t dim() const { return config_.dim; }
  // Keys in both tiers.
  int64_t size() const {
    return size_ + (tier_ ? static_cast<int64_t>(tier_->size()) : 0);
  }
  // Rows ever allocated (live + free): row indices lie in [0, num_rows).
  int64_t num_rows() const { return num_rows_; }
  int64_t current_step() const { return current_step_; }
  void AdvanceStep(int64_t step) {
    current_step_ = std::max(current_step_, step);
  }

  // The hash of `key` that Find*/Prefetch*Hashed take: callers that
  // visit a key several times (prefetch, find, partition) mix it once.
  static uint64_t Hash(int64_t key) { return Mix(static_cast<uint64_t>(key)); }

  // Row of `key`, or -1.
  int64_t Find(int64_t key) const { return FindHashed(key, Hash(key)); }
  // The same, `hash` being Hash(key).
  int64_t FindHashed(int64_t key, uint64_t hash) const {
    uint64_t h = hash & mask();
    for (uint64_t i = 0;; ++i) {
      const Bucket b = buckets_[h];
      if (b.row == kEmpty) return -1;
      if (b.hint == HintOf(i, hash) && meta_.Row(b.row)->key == key) {
        return b.row;
      }
      h = (h + 1) & mask();
    }
  }

  // Prefetch hints for a batch of lookups of random keys, whose cost is
  // two dependent DRAM misses each: the bucket (issue this some keys
  // ahead), then the key row it points to (issue it once the bucket is
  // cached, a few keys later).
  void PrefetchBucket(int64_t key) const { PrefetchBucketHashed(Hash(key)); }
  void PrefetchKeyRow(int64_t key) const { PrefetchKeyRowHashed(Hash(key)); }
  void PrefetchBucketHashed(uint64_t hash) const {
    __builtin_prefetch(&buckets_[hash & mask()]);
  }
  // Returns the row of the first bucket of the probe whose tag matches
  // (among the few that share the home bucket's cache line; -1: none),
  // whose value row a caller about to copy it can prefetch too
  // (GroupEmbeddingEVGather; a tag shared by another key wastes the hint,
  // nothing worse).
  int64_t PrefetchKeyRowHashed(uint64_t hash) const {
    uint64_t h = hash & mask();
    for (uint64_t i = 0; i < 4; ++i) {
      const Bucket b = buckets_[h];
      if (b.row == kEmpty) return -1;
      if (b.hint == HintOf(i, hash)) {
        __builtin_prefetch(meta_.Row(b.row));
        return b.row;
      }
      h = (h + 1) & mask();
    }
    return -1;
  }

  // Hint for a run of inserts: loads the rows that the `ahead`-th next
  // AllocateRow reuses (freed by spills and evictions, so scattered) for
  // writing. A wrong guess (a key found, not inserted) wastes the hint.
  void PrefetchFreeRow(int64_t ahead) const {
    const int64_t i = static_cast<int64_t>(free_rows_.size()) - 1 - ahead;
    if (i < 0) return;
    const uint32_t r = free_rows_[i];
    __builtin_prefetch(meta_.Row(r), 1);
    __builtin_prefetch(values_.Row(r), 1);
    for (const auto& slot : slots_) __builtin_prefetch(slot.Row(r), 1);
  }

  // Row of `key`, inserted (initialised from `defaults`, a
  // [default_rows, D] matrix, row key mod default_rows) if new; -1 when
  // the table is full (see kMaxRows and FullError).
  int64_t FindOrInsert(int64_t key, const float* defaults,
                       int64_t default_rows) {
    int64_t r = Find(key);
    if (r >= 0) return r;
    r = InsertRow(key);
    if (r < 0) return -1;
    *meta_.Row(r) = {key, 0, ClampStep(current_step_)};
    MarkChangedExclusive(r);
    // Re-inserted: the delta carries its row, not its removal.
    if (!removed_.empty()) removed_.erase(key);
    std::memcpy(values_.Row(r), DefaultRowOf(key, defaults, default_rows, dim()),
                sizeof(float) * dim());
    for (size_t s = 0; s < slots_.size(); ++s) {
      std::fill(slots_[s].Row(r), slots_[s].Row(r) + dim(), slot_inits_[s]);
    }
    return r;
  }

  // Removes `key` from whichever tier holds it (eviction).
  void Erase(int64_t key) {
    const uint64_t h = BucketOf(key);
    const uint32_t r = buckets_[h].row;
    if (r == kEmpty) {
      if (tier_ && tier_->Erase(key)) RecordRemoval(key);
      return;
    }
    // A free row is in no delta; its key is, as removed.
    const uint64_t bit = uint64_t{1} << (r & 63);
    changed_[r >> 6] &= ~bit;
    exported_[r >> 6] &= ~bit;
    RecordRemoval(key);
    FreeBucket(h);
  }

  Status FullError() const {
    return tensorflow::errors::ResourceExhausted(
        config_.name, ": EmbeddingVariable is full, it holds ",
        num_rows_, " rows, the most its uint32 row index allows (",
        config_.max_rows, "); evict keys or split the table.");
  }

  // ------------------------------------------------------------------
  // SSD tier (see the top of this file). All of it needs the exclusive
  // lock except TierKeys and ReadTier (const reads: pread).
  // ------------------------------------------------------------------
  bool has_tier() const { return tier_ != nullptr; }
  // The tier's file ("" without a tier).
  std::string tier_path() const { return tier_ ? tier_->path() : ""; }
  int64_t tier_size() const {
    return tier_ ? static_cast<int64_t>(tier_->size()) : 0;
  }
  // Rows moved so far: disk -> DRAM (misses of the DRAM tier) and back.
  int64_t promotions() const { return promotions_; }
  int64_t spills() const { return spills_; }
  // Time spent in promotions and in spills (compactions included), and
  // the compactions: where a step's tier overhead goes (benchmarks).
  int64_t promote_ns() const { return promote_ns_; }
  int64_t spill_ns() const { return spill_ns_; }
  int64_t compactions() const { return compactions_; }
  int64_t tier_index_bytes() const {
    return tier_ ? static_cast<int64_t>(tier_->IndexBytes()) : 0;
  }

  // Claims `tier_dir` for this EV and creates its tier file; called once,
  // right after construction. Fails (naming the EV) when another live EV
  // of the process owns the folder, when the file cannot be created, or
  // when the DRAM budget cannot hold one row.
  Status OpenTier() {
    if (config_.tier_dir.empty()) return Status();
    char resolved[PATH_MAX];
    if (::realpath(config_.tier_dir.c_str(), resolved) == nullptr) {
      return InvalidArgument("EmbeddingVariable '", config_.name,
                             "': storage_path '", config_.tier_dir,
                             "' is not an existing folder: ",
                             std::strerror(errno));
    }
    {
      std::lock_guard<std::mutex> l(TierDirsMu());
      auto it = TierDirs().find(resolved);
      if (it != TierDirs().end()) {
        return InvalidArgument(
            "EmbeddingVariable '", config_.name, "': storage_path '",
            config_.tier_dir, "' is already used by EmbeddingVariable '",
            it->second, "'; give each EmbeddingVariable its own folder.");
      }
      TierDirs()[resolved] = config_.name;
      tier_dir_key_ = resolved;
    }
    TF_RETURN_IF_ERROR(CheckBudget(slot_names_.size()));
    std::string file = config_.name;
    for (char& c : file) {
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' &&
          c != '.') {
        c = '_';
      }
    }
    // A file name has at most 255 bytes: a long EV name (deep scopes)
    // keeps its first characters and a hash of the whole name.
    constexpr size_t kNameChars = 180;
    if (file.size() > kNameChars) {
      uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
      for (unsigned char c : config_.name) h = (h ^ c) * 0x100000001b3ull;
      char tag[18];
      std::snprintf(tag, sizeof(tag), "-%016llx",
                    static_cast<unsigned long long>(h));
      file = file.substr(0, kNameChars) + tag;
    }
    // Processes that share the folder (workers of one host, two jobs)
    // each take the first name no live process holds: NAME.tier, then
    // NAME.1.tier, ... (SsdTierFile::Open locks it).
    constexpr int kNames = 4096;
    for (int i = 0; i < kNames; ++i) {
      tier_.reset(new SsdTierFile(
          config_.name,
          std::string(resolved) + "/" + file +
              (i == 0 ? "" : "." + std::to_string(i)) + ".tier",
          static_cast<uint32_t>(dim()), 0));
      bool busy = false;
      const std::string err = tier_->Open(&busy);
      if (!busy) return TierStatus(err);
    }
    tier_.reset();
    return InvalidArgument("EmbeddingVariable '", config_.name,
                           "': storage_path '", config_.tier_dir, "': ",
                           kNames, " processes hold its tier files ", file,
                           "[.N].tier; give this one another folder.");
  }

  // Spills the coldest DRAM rows to the tier down to the budget, then
  // brings the tier's rows of `keys` (n of them, duplicates allowed) back
  // into DRAM: after it, every stored key of `keys` has a DRAM row, until
  // the next PrepareTier. A failed spill (disk full) leaves the row in
  // DRAM, a failed read (corruption) changes nothing: nothing is lost.
  // `spill` false: only the promotion (the caller spilled already).
  // With `rows`, rows[j] is set to keys[j]'s DRAM row where the DRAM
  // probe found it (a promoted key's is left as it was: look it up).
  // With `pool`, the probes of the keys (reads only) run on its threads.
  Status PrepareTier(const int64_t* keys, int64_t n, bool spill = true,
                     int64_t* rows = nullptr,
                     const CpuWorkers* pool = nullptr) {
    if (spill) TF_RETURN_IF_ERROR(SpillToBudget(0, pool));
    return Promote(keys, n, rows, pool);
  }
  // PrepareTier without keys: only the spill (imports, slot creation).
  // With `slack`, only when DRAM holds more than `slack` rows over the
  // budget: an update right after its lookup (slack = its keys) finds
  // the lookup's rows still in DRAM, instead of spilling them (the
  // coldest by LFU: new keys) and reading them back at once. With
  // `pool`, the spilled records are encoded on its threads.
  Status SpillToBudget(int64_t slack = 0, const CpuWorkers* pool = nullptr) {
    const int64_t keep = DramRowBudget();
    if (size_ <= keep + std::max<int64_t>(slack, 0)) return Status();
    const TierTimer timer(&spill_ns_);
    // Spill an eighth of the budget more than needed, so that the scan
    // below runs once per keep/8 new keys, not once per op.
    const int64_t target = keep - keep / 8;
    const int64_t spill = size_ - target;
    const std::vector<uint32_t> rows = ColdestRows(spill);
    // Written in chunks of up to 4 MiB; a chunk that fails stays in DRAM
    // (the earlier ones are on disk, nothing is lost). A chunk's records
    // are encoded (rows gathered, checksummed) on the pool's threads. Its
    // write (one system call: the file's writes serialise in the kernel
    // anyway) is handed to a pool thread while this one indexes the
    // chunk before it and frees its rows, and the pool encodes the next:
    // the copy into the page cache is most of a large spill.
    const int64_t record = static_cast<int64_t>(tier_->record_bytes());
    const int64_t per_chunk = std::max<int64_t>(1, (4 << 20) / record);
    struct Chunk {
      int64_t begin = 0, end = 0;
      std::vector<char> buf;
      std::vector<int64_t> keys;
      std::vector<uint8_t> marks;
      std::string error;  // the write's
      std::unique_ptr<Handoff> write;
    };
    Chunk chunks[2];
    // Indexes chunk c (written) and frees its DRAM rows, or on its write's
    // error cuts the file back; either way the chunk is done.
    auto finish = [&](Chunk* c) -> Status {
      if (c->write) c->write->Wait();
      c->write.reset();
      if (!c->error.empty()) {
        return TierStatus(tier_->AbandonAppend(c->error));
      }
      tier_->IndexAppended(c->keys.data(), c->keys.size(), c->marks.data());
      for (int64_t i = c->begin; i < c->end; ++i) {
        // Scattered rows: their keys (for the bucket) and then their
        // buckets are loaded ahead, two stages.
        if (i + 16 < c->end) __builtin_prefetch(meta_.Row(rows[i + 16]));
        if (i + 8 < c->end) PrefetchBucket(Key(rows[i + 8]));
        DetachRow(rows[i]);
      }
      spills_ += c->end - c->begin;
      c->begin = c->end = 0;
      return Status();
    };
    Status status;
    int64_t pending = 0;  // records written or being written, not indexed
    for (int64_t begin = 0, n = 0; begin < spill; begin += per_chunk, ++n) {
      Chunk& c = chunks[n & 1];
      c.begin = begin;
      c.end = std::min(spill, begin + per_chunk);
      const int64_t count = c.end - begin;
      status = TierStatus(tier_->CheckAppend(pending + count));
      if (!status.ok()) break;
      c.buf.resize(count * record);
      c.keys.resize(count);
      c.marks.resize(count);
      c.error.clear();
      auto encode = [&](int64_t b, int64_t e) {
        TierRecord rec;
        rec.row.resize(dim());
        rec.slots.resize(slots_.size() * dim());
        for (int64_t i = begin + b; i < begin + e; ++i) {
          if (i + 8 < begin + e) {  // rows in random order: load ahead
            const uint32_t a = rows[i + 8];
            __builtin_prefetch(meta_.Row(a));
            __builtin_prefetch(values_.Row(a));
            for (const auto& slot : slots_) __builtin_prefetch(slot.Row(a));
          }
          const uint32_t r = rows[i];
          const KeyMeta* m = meta_.Row(r);
          rec.key = m->key;
          rec.freq = m->freq;
          rec.version = m->version;
          std::memcpy(rec.row.data(), values_.Row(r), sizeof(float) * dim());
          for (size_t s = 0; s < slots_.size(); ++s) {
            std::memcpy(rec.slots.data() + s * dim(), slots_[s].Row(r),
                        sizeof(float) * dim());
          }
          tier_->Encode(rec, c.buf.data() + (i - begin) * record);
          c.keys[i - begin] = rec.key;
          c.marks[i - begin] = RowMarks(r);
        }
      };
      if (pool != nullptr) {
        tensorflow::Shard(pool->num_threads, pool->workers, count,
                          record * 4, encode);
      } else {
        encode(0, count);
      }
      // The write goes past the chunk still in flight (not indexed yet);
      // its offset is fixed now, before that chunk moves the file's end.
      const uint64_t offset = tier_->AppendOffset(pending);
      auto write = [this, &c, offset, count]() {
        c.error = tier_->WriteAppended(c.buf.data(), count, offset);
      };
      if (pool != nullptr) {
        c.write = std::make_unique<Handoff>(pool, write);
      } else {
        write();
      }
      pending += count;
      Chunk& before = chunks[(n + 1) & 1];
      if (before.end > before.begin) {
        pending -= before.end - before.begin;
        status = finish(&before);
        if (!status.ok()) break;
      }
    }
    // The last chunk in flight: after an error, only waited for (its
    // bytes past the file's end are cut back, never indexed).
    for (Chunk& c : chunks) {
      if (c.end == c.begin) continue;
      if (status.ok()) {
        status = finish(&c);
      } else if (c.write) {
        c.write->Wait();
        tier_->AbandonAppend("");
      }
    }
    TF_RETURN_IF_ERROR(status);
    if (tier_->WantsCompaction()) {
      ++compactions_;
      TF_RETURN_IF_ERROR(TierStatus(tier_->Compact()));
    }
    // The index grows with the keys on disk and takes its bytes from
    // the rows': give the memory of rows no longer paid for back.
    // An eighth of slack: the rows freed by a spill (to keep - keep/8)
    // are reused by the next inserts before any new row is allocated.
    if (num_rows_ > keep + keep / 8 + 1024) PackRows();
    return Status();
  }

  // The keys in the tier, sorted (export, eviction scans).
  std::vector<int64_t> TierKeys() const {
    std::vector<int64_t> keys;
    if (!tier_) return keys;
    keys.reserve(tier_->size());
    tier_->ForEachKey([&keys](int64_t k) { keys.push_back(k); });
    std::sort(keys.begin(), keys.end());
    return keys;
  }
  // Keys in the tier whose rows an incremental export must write (as
  // ExportedRows for DRAM rows), sorted.
  std::vector<int64_t> ExportedTierKeys() const {
    std::vector<int64_t> keys;
    if (!tier_) return keys;
    tier_->ForEachMarks([&keys](int64_t key, uint8_t& m) {
      if (m & kTierExported) keys.push_back(key);
    });
    std::sort(keys.begin(), keys.end());
    return keys;
  }
  // `key`'s record in the tier (a key TierKeys listed).
  Status ReadTier(int64_t key, TierRecord* out) const {
    bool found = false;
    TF_RETURN_IF_ERROR(TierStatus(tier_->Get(key, out, &found)));
    if (!found) {
      return tensorflow::errors::Internal(config_.name, ": key ", key,
                                          " is not in the SSD tier.");
    }
    return Status();
  }
  // Empties the tier (a restore replaces the whole content).
  Status ClearTier() {
    if (!tier_) return Status();
    // In place: the file stays locked (see OpenTier).
    return TierStatus(
        tier_->Clear(static_cast<uint32_t>(slots_.size() * dim())));
  }

 private:
  // Adds the nanoseconds of its scope to *total.
  class TierTimer {
   public:
    explicit TierTimer(int64_t* total)
        : total_(total), start_(std::chrono::steady_clock::now()) {}
    ~TierTimer() {
      *total_ += std::chrono::duration_cast<std::chrono::nanoseconds>(
                     std::chrono::steady_clock::now() - start_).count();
    }

   private:
    int64_t* total_;
    std::chrono::steady_clock::time_point start_;
  };

  static constexpr uint8_t kTierChanged = 1;
  static constexpr uint8_t kTierExported = 2;

  Status TierStatus(const std::string& err) const {
    if (err.empty()) return Status();
    return tensorflow::errors::Internal(err);
  }

  // Rows the DRAM budget holds besides the tier's index (0: only the
  // current op's keys stay in DRAM, SSDHASH).
  int64_t DramRowBudget() const {
    const int64_t row =
        static_cast<int64_t>(sizeof(KeyMeta)) + kDramRowOverheadBytes +
        static_cast<int64_t>(sizeof(float)) * dim() *
            static_cast<int64_t>(1 + slots_.size());
    const int64_t left = config_.dram_bytes -
                         static_cast<int64_t>(tier_->IndexBytes());
    return left > 0 ? left / row : 0;
  }

  // A DRAM_SSDHASH budget must hold at least one row with `slots` slots.
  Status CheckBudget(size_t slots) const {
    if (config_.dram_bytes == 0) return Status();  // SSDHASH
    const int64_t row =
        static_cast<int64_t>(sizeof(KeyMeta)) + kDramRowOverheadBytes +
        static_cast<int64_t>(sizeof(float)) * dim() *
            static_cast<int64_t>(1 + slots);
    if (config_.dram_bytes >= row) return Status();
    return InvalidArgument(
        "EmbeddingVariable '", config_.name, "': `storage_size[0]` of ",
        config_.dram_bytes, " bytes cannot hold one row (", row,
        " bytes with dim ", dim(), " and ", slots,
        " optimizer slots); give the DRAM tier at least that.");
  }

  // Moves the live rows past the first ChunkEnd(size_) rows into free
  // rows below it and frees the chunks past it (and, with glibc, gives
  // the freed pages back to the system). Rows move only here, between
  // ops' row work: every caller of SpillToBudget resolves rows after it.
  void PackRows() {
    const int64_t end = ChunkedArray<KeyMeta>::ChunkEnd(size_);
    if (end >= num_rows_) return;
    std::vector<uint32_t> holes;  // free rows below `end`
    for (uint32_t r : free_rows_) {
      if (r < end) holes.push_back(r);
    }
    for (Bucket& bucket : buckets_) {
      const uint32_t b = bucket.row;  // a packed member: no reference
      if (b == kEmpty || b < end) continue;
      const uint32_t to = holes.back();  // there are enough: see ChunkEnd
      holes.pop_back();
      *meta_.Row(to) = *meta_.Row(b);
      std::memcpy(values_.Row(to), values_.Row(b), sizeof(float) * dim());
      for (auto& slot : slots_) {
        std::memcpy(slot.Row(to), slot.Row(b), sizeof(float) * dim());
      }
      const uint64_t from_bit = uint64_t{1} << (b & 63);
      const uint64_t to_bit = uint64_t{1} << (to & 63);
      changed_[to >> 6] &= ~to_bit;
      exported_[to >> 6] &= ~to_bit;
      if (changed_[b >> 6] & from_bit) changed_[to >> 6] |= to_bit;
      if (exported_[b >> 6] & from_bit) exported_[to >> 6] |= to_bit;
      bucket.row = to;
    }
    free_rows_.swap(holes);
    free_rows_.shrink_to_fit();
    num_rows_ = end;
    meta_.Shrink(end);
    values_.Shrink(end);
    for (auto& slot : slots_) slot.Shrink(end);
    changed_.resize((end + 63) / 64);
    exported_.resize((end + 63) / 64);
    changed_.shrink_to_fit();
    exported_.shrink_to_fit();
    // The bits of the rows dropped past `end` in the last word.
    if (end % 64 != 0) {
      const uint64_t keep_bits = (uint64_t{1} << (end % 64)) - 1;
      changed_.back() &= keep_bits;
      exported_.back() &= keep_bits;
    }
#ifdef __GLIBC__
    malloc_trim(0);
#endif
  }

  // DRAM row `r`'s change marks, as the tier's index keeps them.
  uint8_t RowMarks(uint32_t r) const {
    const uint64_t bit = uint64_t{1} << (r & 63);
    uint8_t marks = 0;
    if (changed_[r >> 6] & bit) marks |= kTierChanged;
    if (exported_[r >> 6] & bit) marks |= kTierExported;
    return marks;
  }

  // Moves DRAM row `r` out (its record and RowMarks are in the tier): it
  // is no removal.
  void DetachRow(uint32_t r) {
    ++moves_out_;
    const uint64_t bit = uint64_t{1} << (r & 63);
    changed_[r >> 6] &= ~bit;
    exported_[r >> 6] &= ~bit;
    FreeBucket(BucketOf(Key(r)));
  }

  // Brings the tier's rows of `keys` into DRAM, exactly as spilled.
  // Most keys of a batch are in DRAM (the hot ones) or new: they cost a
  // DRAM probe (prefetched, as the lookup's) and a probe of the tier's
  // index. The rest are read in batches of up to kPromoteBatch records,
  // each deduplicated and sorted by file offset (SsdTierFile::ReadMany),
  // all checked before any is moved: a bad record changes nothing of its
  // batch, and the earlier batches are in DRAM, whole.
  static constexpr size_t kPromoteBatch = 2048;
  Status Promote(const int64_t* keys, int64_t n, int64_t* rows = nullptr,
                 const CpuWorkers* pool = nullptr) {
    if (tier_->size() == 0) return Status();
    // The update after its lookup promotes the same keys again: while no
    // row has left DRAM since (a spill), they are all still there. Only
    // an exact repeat of the last call's keys is skipped.
    if (rows == nullptr && promoted_moves_ == moves_out_ &&
        static_cast<size_t>(n) == promoted_keys_.size() &&
        std::memcmp(keys, promoted_keys_.data(), sizeof(int64_t) * n) == 0) {
      return Status();
    }
    const TierTimer timer(&promote_ns_);
    // 1. Probes, in parallel: they only read (the caller holds the
    // exclusive lock, and the work items take none), and on a batch of
    // mostly known keys they are most of the pass.
    std::vector<int64_t> record_of(n, -1);
    auto probe = [&](int64_t begin, int64_t end) {
      constexpr int64_t kAhead = 8;
      // The DRAM probes first, then the tier index's only for the keys
      // DRAM lacks (new or cold, a minority): loading the index's two
      // lines for every key cost the hot keys' probes as much again.
      std::vector<int64_t> absent;
      for (int64_t j = begin; j < end; ++j) {
        if (j + 2 * kAhead < end) PrefetchBucket(keys[j + 2 * kAhead]);
        if (j + kAhead < end) PrefetchKeyRow(keys[j + kAhead]);
        const int64_t row = Find(keys[j]);
        if (row < 0) {
          absent.push_back(j);
        } else if (rows != nullptr) {
          rows[j] = row;
        }
      }
      const size_t m = absent.size();
      for (size_t i = 0; i < m; ++i) {
        if (i + kAhead < m) tier_->PrefetchKey(keys[absent[i + kAhead]]);
        record_of[absent[i]] = tier_->RecordOf(keys[absent[i]]);
      }
    };
    if (pool != nullptr) {
      // ~3 cache misses a key.
      tensorflow::Shard(pool->num_threads, pool->workers, n, 300, probe);
    } else {
      probe(0, n);
    }
    // 2. Reads and inserts, serially (they change the hash map).
    std::vector<std::pair<uint32_t, int64_t>> want;  // (record, key)
    for (int64_t j = 0; j < n; ++j) {
      if (record_of[j] >= 0) {
        want.emplace_back(static_cast<uint32_t>(record_of[j]), keys[j]);
      }
    }
    if (want.empty()) {
      RememberPromoted(keys, n);
      return Status();
    }
    std::sort(want.begin(), want.end());
    want.erase(std::unique(want.begin(), want.end()), want.end());
    const int64_t record = static_cast<int64_t>(tier_->record_bytes());
    std::vector<uint32_t> recs(want.size());
    std::vector<int64_t> want_keys(want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      recs[i] = want[i].first;
      want_keys[i] = want[i].second;
    }
    // Batches of kPromoteBatch records, each read whole and checked
    // before any of it is inserted. The inserts (this thread: they change
    // the hash map) of one batch overlap the reads of the next, which a
    // pool thread starts and this thread joins once its inserts are done:
    // a scattered record's read (~0.5 us, the kernel's page-cache lookup
    // and copy more than the system call) is most of the pass. The first
    // error of a batch is kept; its records stay on disk.
    struct ReadJob {
      size_t begin = 0, end = 0;
      std::atomic<size_t> cursor{0};
      char* out = nullptr;
      std::mutex mu;  // taken by readers only, for `error`
      std::string error;
    };
    auto drain = [&](ReadJob* job) {
      constexpr size_t kPart = 64;
      for (;;) {
        const size_t b = job->cursor.fetch_add(kPart);
        if (b >= job->end) return;
        const size_t e = std::min(job->end, b + kPart);
        std::string err = tier_->ReadMany(
            recs.data() + b, want_keys.data() + b, e - b,
            job->out + (b - job->begin) * record);
        if (err.empty()) continue;
        std::lock_guard<std::mutex> l(job->mu);
        if (job->error.empty()) job->error = std::move(err);
      }
    };
    std::vector<char> bufs[2];
    ReadJob jobs[2];
    auto start = [&](int which, size_t begin) {
      ReadJob& job = jobs[which];
      job.begin = begin;
      job.end = std::min(want.size(), begin + kPromoteBatch);
      job.cursor.store(begin);
      job.error.clear();
      bufs[which].resize((job.end - begin) * record);
      job.out = bufs[which].data();
    };
    // Pool threads that read beside this one (each a Handoff: one that
    // has not started when this thread is done is run, finding nothing
    // left, by this thread: no wait on a busy pool).
    const int helpers = pool == nullptr ? 0 : std::max(1, std::min(
        pool->num_threads - 1, 7));
    auto help = [&](int which) {
      std::vector<std::unique_ptr<Handoff>> out;
      for (int h = 0; h < helpers; ++h) {
        out.push_back(std::make_unique<Handoff>(
            pool, [&, which] { drain(&jobs[which]); }));
      }
      return out;
    };
    start(0, 0);
    {
      auto first = help(0);
      drain(&jobs[0]);
    }
    TierRecord rec;
    for (int cur = 0;; cur ^= 1) {
      const ReadJob& job = jobs[cur];
      TF_RETURN_IF_ERROR(TierStatus(job.error));
      const bool more = job.end < want.size();
      std::vector<std::unique_ptr<Handoff>> next;
      if (more) {
        start(cur ^ 1, job.end);
        next = help(cur ^ 1);
      }
      const size_t count = job.end - job.begin;
      const int64_t* batch_keys = want_keys.data() + job.begin;
      for (size_t i = 0; i < count; ++i) {
        // Each insert misses on its bucket, its (reused, scattered) row
        // and the tier index's slot: loaded a few records ahead.
        if (i + 8 < count) {
          PrefetchBucket(batch_keys[i + 8]);
          tier_->PrefetchKey(batch_keys[i + 8]);
          PrefetchFreeRow(8);
        }
        tier_->Decode(job.out + i * record, &rec);
        const int64_t r = InsertRow(rec.key);
        if (r < 0) return FullError();
        *meta_.Row(r) = {rec.key, rec.freq, rec.version};
        std::memcpy(values_.Row(r), rec.row.data(), sizeof(float) * dim());
        for (size_t s = 0; s < slots_.size(); ++s) {
          std::memcpy(slots_[s].Row(r), rec.slots.data() + s * dim(),
                      sizeof(float) * dim());
        }
        uint8_t marks = 0;
        tier_->Erase(rec.key, &marks);
        const uint64_t bit = uint64_t{1} << (r & 63);
        if (marks & kTierChanged) changed_[r >> 6] |= bit;
        if (marks & kTierExported) exported_[r >> 6] |= bit;
        ++promotions_;
      }
      if (!more) break;
      drain(&jobs[cur ^ 1]);  // the reads the helpers have not claimed
      next.clear();           // waits for their parts
    }
    RememberPromoted(keys, n);
    return Status();
  }

  void RememberPromoted(const int64_t* keys, int64_t n) {
    promoted_keys_.assign(keys, keys + n);
    promoted_moves_ = moves_out_;
  }

  // The `count` coldest live DRAM rows (0 < count <= size_): least score
  // (LFU: freq; LRU: version, the last step seen), ties by key. The live
  // rows' scores and keys are read in row order (sequential memory, the
  // free rows skipped by a bitmap) into one array that the selection
  // sorts in place: comparing through the rows' scattered KeyMeta cost a
  // cache miss per comparison. That array is the spill's peak memory
  // (one entry per DRAM row), so when the scores span less than 2^32 an
  // entry is 16 bytes (score offset and row in one word) instead of 24.
  std::vector<uint32_t> ColdestRows(int64_t count) const {
    std::vector<uint64_t> free_bits((num_rows_ + 63) / 64, 0);
    for (uint32_t r : free_rows_) free_bits[r >> 6] |= uint64_t{1} << (r & 63);
    auto score = [this](int64_t r) {
      const KeyMeta* m = meta_.Row(r);
      return config_.tier_lru ? m->version : m->freq;
    };
    auto for_live = [&](auto visit) {
      for (int64_t r = 0; r < num_rows_; ++r) {
        if (!(free_bits[r >> 6] >> (r & 63) & 1)) visit(r);
      }
    };
    int64_t lo = std::numeric_limits<int64_t>::max();
    int64_t hi = std::numeric_limits<int64_t>::min();
    for_live([&](int64_t r) {
      lo = std::min(lo, score(r));
      hi = std::max(hi, score(r));
    });
    std::vector<uint32_t> out(count);
    auto select = [&](auto entry, auto key_of, auto rank, auto row_of) {
      std::vector<decltype(entry(0))> c;
      c.reserve(size_);
      for_live([&](int64_t r) { c.push_back(entry(r)); });
      std::nth_element(c.begin(), c.begin() + (count - 1), c.end(),
                       [&](const auto& a, const auto& b) {
                         return rank(a) != rank(b) ? rank(a) < rank(b)
                                                   : key_of(a) < key_of(b);
                       });
      for (int64_t i = 0; i < count; ++i) out[i] = row_of(c[i]);
    };
    if (static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo) <=
        0xffffffffu) {
      struct Packed {
        uint64_t rank_row;  // (score - lo) << 32 | row
        int64_t key;
      };
      static_assert(sizeof(Packed) == 16, "a spill candidate is 16 bytes");
      select([&](int64_t r) {
               const uint64_t off = static_cast<uint64_t>(score(r)) -
                                    static_cast<uint64_t>(lo);
               return Packed{off << 32 | static_cast<uint64_t>(r),
                             meta_.Row(r)->key};
             },
             [](const Packed& e) { return e.key; },
             [](const Packed& e) { return e.rank_row >> 32; },
             [](const Packed& e) {
               return static_cast<uint32_t>(e.rank_row & 0xffffffffu);
             });
    } else {
      struct Wide {
        int64_t score;
        int64_t key;
        uint32_t row;
      };
      select([&](int64_t r) {
               return Wide{score(r), meta_.Row(r)->key,
                           static_cast<uint32_t>(r)};
             },
             [](const Wide& e) { return e.key; },
             [](const Wide& e) { return e.score; },
             [](const Wide& e) { return e.row; });
    }
    return out;
  }

  // A fresh DRAM row for `key` (not stored), linked into the hash map;
  // the caller fills it. -1 when the table is full.
  int64_t InsertRow(int64_t key) {
    if (free_rows_.empty() && num_rows_ >= config_.max_rows) return -1;
    if ((size_ + 1) * 5 > static_cast<int64_t>(buckets_.size()) * 4) {
      Rehash(buckets_.size() * 2);
    }
    const int64_t r = AllocateRow();
    Place(static_cast<uint32_t>(r), Mix(static_cast<uint64_t>(key)));
    ++size_;
    return r;
  }

  // The bucket holding `key`, or the empty bucket ending its probe.
  uint64_t BucketOf(int64_t key) const {
    const uint64_t hash = Mix(static_cast<uint64_t>(key));
    uint64_t h = hash & mask();
    for (uint64_t i = 0; buckets_[h].row != kEmpty; ++i) {
      const Bucket b = buckets_[h];
      if (b.hint == HintOf(i, hash) && meta_.Row(b.row)->key == key) break;
      h = (h + 1) & mask();
    }
    return h;
  }

  // The hint byte of a key with hash `hash` at `distance` buckets from
  // its home (see Bucket). The hash's top bits: the home uses the low
  // ones (capacity < 2^60).
  static uint8_t HintOf(uint64_t distance, uint64_t hash) {
    return MakeHint(distance, static_cast<uint8_t>(hash >> 60));
  }
  static uint8_t MakeHint(uint64_t distance, uint8_t nibble) {
    return static_cast<uint8_t>((std::min(distance, kFarHint) << 4) |
                                (nibble & 15));
  }

  // Puts row `r` (of a key with hash `hash`, not in the table) in the
  // first free bucket of its probe.
  void Place(uint32_t r, uint64_t hash) {
    uint64_t h = hash & mask();
    uint64_t i = 0;
    while (buckets_[h].row != kEmpty) {
      h = (h + 1) & mask();
      ++i;
    }
    buckets_[h] = {r, HintOf(i, hash)};
  }

  // The home of the key in bucket `j`: from its distance, unless that is
  // 15 or more (rare: then from its key).
  uint64_t HomeAt(uint64_t j) const {
    const uint64_t d = buckets_[j].hint >> 4;
    if (d < kFarHint) return (j - d) & mask();
    return Mix(static_cast<uint64_t>(meta_.Row(buckets_[j].row)->key)) &
           mask();
  }

  void RecordRemoval(int64_t key) {
    if (tracking_removals_) {
      removed_[key] = exports_ + 1;
    } else {
      delta_base_ = 0;
    }
  }

  // Frees bucket h's row (backward-shift deletion keeps probes
  // tombstone-free).
  void FreeBucket(uint64_t h) {
    free_rows_.push_back(buckets_[h].row);
    buckets_[h] = kEmptyBucket;
    --size_;
    uint64_t hole = h;
    uint64_t j = (h + 1) & mask();
    while (buckets_[j].row != kEmpty) {
      const uint64_t home = HomeAt(j);
      // Move j into the hole if its home is not in (hole, j] cyclically.
      const bool stays = hole <= j ? (home > hole && home <= j)
                                   : (home > hole || home <= j);
      if (!stays) {
        buckets_[hole] = {buckets_[j].row,
                          MakeHint((hole - home) & mask(), buckets_[j].hint)};
        buckets_[j] = kEmptyBucket;
        hole = j;
      }
      j = (j + 1) & mask();
    }
  }

 public:
  bool has_cbf() const { return config_.cbf_counters > 0; }

  // Whether a stored row may be read and updated. A CBFFilter stores a
  // key only once admitted; a CounterFilter stores it on first sight.
  bool Admitted(int64_t row) const {
    return has_cbf() || meta_.Row(row)->freq >= config_.filter_freq;
  }

  // Records one sighting of `key` in the counting Bloom filter (a key
  // not stored yet) and returns its estimated count, the least of its
  // counters. Counters stop at filter_freq (as DeepRec's): that is all
  // admission needs, and it keeps small counter types from wrapping.
  // Collisions only raise counters, so the estimate is never low: a key
  // whose counters other keys have raised is admitted early (a false
  // positive, probability about false_positive_probability while at most
  // max_element_size keys are counted), never late.
  int64_t CountUnstored(int64_t key) {
    const uint64_t h1 = Mix(static_cast<uint64_t>(key));
    const uint64_t h2 = Mix(h1 ^ 0x9e3779b97f4a7c15ULL) | 1;
    const uint64_t m = config_.cbf_counters;
    const int64_t cap = config_.filter_freq;
    int64_t least = std::numeric_limits<int64_t>::max();
    for (int64_t i = 0; i < config_.cbf_hashes; ++i) {
      const uint64_t at = (h1 + i * h2) % m;
      int64_t c = Counter(at);
      if (c < cap) SetCounter(at, ++c);
      least = std::min(least, c);
    }
    return least;
  }

  // Marks `row` as seen at the current step (versions never go back).
  // Under the exclusive lock, one thread per variable (ev_lookup_ops.cc:
  // a variable whose keys are not split, and its inserts).
  void Touch(int64_t row) {
    int64_t* v = &meta_.Row(row)->version;
    *v = std::max(*v, ClampStep(current_step_));
    MarkChangedExclusive(row);
  }
  // The same for threads that share the variable, each touching its own
  // rows (whose change bits may share a word with other threads' rows).
  void TouchShared(int64_t row) {
    int64_t* v = &meta_.Row(row)->version;
    *v = std::max(*v, ClampStep(current_step_));
    MarkChanged(row);
  }

  // Records a write to `row` (the version, a value, a slot, the freq)
  // for the next incremental checkpoint. Atomic: the sharded optimizer
  // updates write distinct rows, but neighbours share a word. Tested
  // first: between two exports a row is written again and again (hot
  // keys, every step's update), and a plain load that finds the bit set
  // skips the locked read-modify-write (a full barrier on x86). Exports
  // move the marks under the exclusive lock, so no mark is lost.
  void MarkChanged(int64_t row) {
    uint64_t* word = &changed_[row >> 6];
    const uint64_t bit = uint64_t{1} << (row & 63);
    if ((__atomic_load_n(word, __ATOMIC_RELAXED) & bit) == 0) {
      __atomic_fetch_or(word, bit, __ATOMIC_RELAXED);
    }
  }
  // The same for a caller that is the only writer of the marks (the
  // variable's exclusive lock held, no sharded loop: inserts, Touch):
  // a plain OR. Touch runs once per key of every training lookup: a
  // locked RMW there made the criteo-like EV lookup ~17% slower.
  void MarkChangedExclusive(int64_t row) {
    changed_[row >> 6] |= uint64_t{1} << (row & 63);
  }

  // The export the next delta is relative to (0: none, save in full).
  int64_t delta_base() const { return delta_base_; }
  // Starts export number exports() + 1 (returned): the rows changed
  // since the last confirmed save are those of ExportedRows() until the
  // next StartExport or ConfirmSave.
  int64_t StartExport() {
    tracking_removals_ = true;
    for (size_t w = 0; w < changed_.size(); ++w) {
      exported_[w] |= changed_[w];
      changed_[w] = 0;
    }
    if (tier_) {
      tier_->ForEachMarks([](int64_t, uint8_t& m) {
        if (m & kTierChanged) m = kTierExported;
      });
    }
    return ++exports_;
  }
  std::vector<int64_t> ExportedRows() const {
    std::vector<int64_t> rows;
    for (size_t w = 0; w < exported_.size(); ++w) {
      for (uint64_t bits = exported_[w]; bits != 0; bits &= bits - 1) {
        rows.push_back(static_cast<int64_t>(w) * 64 +
                       __builtin_ctzll(bits));
      }
    }
    return rows;
  }
  // Keys evicted since the last confirmed save (still absent).
  std::vector<int64_t> RemovedKeys() const {
    std::vector<int64_t> keys;
    keys.reserve(removed_.size());
    for (const auto& kv : removed_) keys.push_back(kv.first);
    std::sort(keys.begin(), keys.end());
    return keys;
  }
  // Export `id`'s files are durable: the next delta is relative to it.
  // An export since (`id` is not the latest) leaves no base: its marks
  // and those of `id` are mixed in `exported`.
  void ConfirmSave(int64_t id) {
    if (id != exports_) {
      delta_base_ = 0;
      return;
    }
    std::fill(exported_.begin(), exported_.end(), 0);
    if (tier_) {
      tier_->ForEachMarks([](int64_t, uint8_t& m) { m &= ~kTierExported; });
    }
    for (auto it = removed_.begin(); it != removed_.end();) {
      it = it->second <= id ? removed_.erase(it) : std::next(it);
    }
    delta_base_ = id;
  }
  // The content was just restored from a checkpoint with these slots: it
  // is the base of the next delta (returned), or, when the variable's
  // slots are others (it kept slots the checkpoint lacks), there is none
  // (0: the next save is full).
  int64_t MarkRestored(const std::vector<std::string>& checkpoint_slots) {
    std::fill(changed_.begin(), changed_.end(), 0);
    std::fill(exported_.begin(), exported_.end(), 0);
    if (tier_) tier_->ForEachMarks([](int64_t, uint8_t& m) { m = 0; });
    removed_.clear();
    tracking_removals_ = true;
    delta_base_ = checkpoint_slots == slot_names_ ? ++exports_ : 0;
    return delta_base_;
  }

  int64_t Key(int64_t r) const { return meta_.Row(r)->key; }
  int64_t* Freq(int64_t r) { return &meta_.Row(r)->freq; }
  int64_t* Version(int64_t r) { return &meta_.Row(r)->version; }
  const void* Meta(int64_t r) const { return meta_.Row(r); }
  float* Value(int64_t r) { return values_.Row(r); }
  float* Slot(int s, int64_t r) { return slots_[s].Row(r); }

  // Sets *index to slot `name`, created (existing rows set to `init`,
  // in both tiers) if new; an existing slot only takes the new initial
  // value for future rows. With a tier, fails when the DRAM budget
  // cannot hold one row with the new slot or the tier cannot be
  // rewritten (then nothing changed).
  Status EnsureSlot(const std::string& name, float init, int* index) {
    for (size_t s = 0; s < slot_names_.size(); ++s) {
      if (slot_names_[s] == name) {
        slot_inits_[s] = init;
        *index = static_cast<int>(s);
        return Status();
      }
    }
    if (tier_) {
      TF_RETURN_IF_ERROR(CheckBudget(slot_names_.size() + 1));
      TF_RETURN_IF_ERROR(TierStatus(tier_->Rewrite(
          static_cast<uint32_t>((slots_.size() + 1) * dim()), init)));
    }
    // A delta cannot add a slot column to the rows it leaves out.
    delta_base_ = 0;
    slot_names_.push_back(name);
    slot_inits_.push_back(init);
    slots_.emplace_back(dim());
    slots_.back().Reserve(num_rows_);
    for (int64_t r = 0; r < num_rows_; ++r) {
      std::fill(slots_.back().Row(r), slots_.back().Row(r) + dim(), init);
    }
    *index = static_cast<int>(slots_.size() - 1);
    return Status();
  }

  int SlotIndex(const std::string& name) const {
    for (size_t s = 0; s < slot_names_.size(); ++s) {
      if (slot_names_[s] == name) return static_cast<int>(s);
    }
    return -1;
  }
  const std::vector<std::string>& slot_names() const { return slot_names_; }
  const std::vector<float>& slot_inits() const { return slot_inits_; }

  // Live rows in bucket order.
  std::vector<uint32_t> LiveRows() const {
    std::vector<uint32_t> rows;
    rows.reserve(size_);
    for (const Bucket& b : buckets_) {
      if (b.row != kEmpty) rows.push_back(b.row);
    }
    return rows;
  }

  void Clear() {
    ++moves_out_;
    promoted_keys_.clear();
    promoted_keys_.shrink_to_fit();
    buckets_.assign(64, kEmptyBucket);
    size_ = 0;
    num_rows_ = 0;
    free_rows_.clear();
    meta_.Clear();
    values_.Clear();
    for (auto& s : slots_) s.Clear();
    current_step_ = 0;
    // The content is replaced wholesale: no delta reaches across.
    removed_.clear();
    // The tier itself (and its marks): ClearTier.
    changed_.clear();
    exported_.clear();
    delta_base_ = 0;
    // Counts of keys not admitted yet are not checkpointed either.
    std::fill(cbf_.begin(), cbf_.end(), 0);
    sparse_cbf_.clear();
  }

  void Reserve(int64_t keys) {
    int64_t cap = static_cast<int64_t>(buckets_.size());
    while (keys * 5 > cap * 4) cap *= 2;
    if (cap != static_cast<int64_t>(buckets_.size())) Rehash(cap);
  }

  int64_t Bytes() const {
    int64_t b = static_cast<int64_t>(buckets_.size()) * sizeof(Bucket) +
                meta_.Bytes() +
                values_.Bytes() +
                static_cast<int64_t>(free_rows_.capacity()) *
                    sizeof(uint32_t) +
                static_cast<int64_t>(promoted_keys_.capacity()) *
                    sizeof(int64_t);
    for (const auto& s : slots_) b += s.Bytes();
    // A node of the sparse map: key, count, next pointer, cached hash.
    const int64_t sparse = static_cast<int64_t>(
        sparse_cbf_.size() * 32 + sparse_cbf_.bucket_count() * 8);
    // Evicted keys awaiting the next incremental save: key, export,
    // next pointer, cached hash.
    const int64_t removed = static_cast<int64_t>(removed_.size() * 32);
    const int64_t bits = static_cast<int64_t>(
        (changed_.capacity() + exported_.capacity()) * sizeof(uint64_t));
    const int64_t tier =
        tier_ ? static_cast<int64_t>(tier_->IndexBytes()) : 0;
    return b + static_cast<int64_t>(cbf_.size()) + sparse + removed + bits +
           tier;
  }

 private:
  uint64_t mask() const { return buckets_.size() - 1; }

  int64_t Counter(uint64_t at) const {
    if (sparse_cbf_on_) {
      auto it = sparse_cbf_.find(at);
      return it == sparse_cbf_.end() ? 0 : it->second;
    }
    const uint8_t* p = cbf_.data() + at * config_.cbf_counter_bytes;
    switch (config_.cbf_counter_bytes) {
      case 1: return *p;
      case 2: { uint16_t c; std::memcpy(&c, p, 2); return c; }
      case 4: { uint32_t c; std::memcpy(&c, p, 4); return c; }
      default: {
        uint64_t c;
        std::memcpy(&c, p, 8);
        return static_cast<int64_t>(
            std::min<uint64_t>(c, std::numeric_limits<int64_t>::max()));
      }
    }
  }
  // `c` <= filter_freq, which the caller checked fits the counter type.
  void SetCounter(uint64_t at, int64_t c) {
    if (sparse_cbf_on_) {
      sparse_cbf_[at] = c;
      return;
    }
    uint8_t* p = cbf_.data() + at * config_.cbf_counter_bytes;
    const uint64_t u = static_cast<uint64_t>(c);
    switch (config_.cbf_counter_bytes) {
      case 1: *p = static_cast<uint8_t>(u); break;
      case 2: { const uint16_t x = u; std::memcpy(p, &x, 2); break; }
      case 4: { const uint32_t x = u; std::memcpy(p, &x, 4); break; }
      default: std::memcpy(p, &u, 8);
    }
  }

  int64_t AllocateRow() {
    if (!free_rows_.empty()) {
      const int64_t r = free_rows_.back();
      free_rows_.pop_back();
      return r;
    }
    const int64_t r = num_rows_++;
    if ((r >> 6) >= static_cast<int64_t>(changed_.size())) {
      changed_.resize((r >> 6) + 1, 0);
      exported_.resize((r >> 6) + 1, 0);
    }
    meta_.Reserve(num_rows_);
    values_.Reserve(num_rows_);
    for (auto& s : slots_) s.Reserve(num_rows_);
    return r;
  }

  void Rehash(uint64_t capacity) {
    std::vector<Bucket> old;
    old.swap(buckets_);
    buckets_.assign(capacity, kEmptyBucket);
    for (const Bucket& b : old) {
      if (b.row == kEmpty) continue;
      // The new home needs a bit more of the hash than the old one.
      Place(b.row, Mix(static_cast<uint64_t>(meta_.Row(b.row)->key)));
    }
  }

  EVConfig config_;
  // The counting Bloom filter keeps only touched counters (see
  // kDenseCbfMaxBytes); fixed at creation.
  const bool sparse_cbf_on_;
  tensorflow::mutex mu_;
  std::vector<Bucket> buckets_;
  // Rows moved out of DRAM (spills; Clear), and the keys of the last
  // Promote with the count it saw (see Promote).
  uint64_t moves_out_ = 0;
  uint64_t promoted_moves_ = ~uint64_t{0};
  std::vector<int64_t> promoted_keys_;
  int64_t size_ = 0;
  int64_t num_rows_ = 0;
  std::vector<uint32_t> free_rows_;
  ChunkedArray<KeyMeta> meta_;
  ChunkedArray<float> values_;
  std::vector<std::string> slot_names_;
  std::vector<float> slot_inits_;
  std::vector<ChunkedArray<float>> slots_;
  int64_t current_step_ = 0;
  // Change tracking (see the top of this file): one bit per row each.
  std::vector<uint64_t> changed_;   // written since the last export
  std::vector<uint64_t> exported_;  // exported, not confirmed durable
  int64_t exports_ = 0;             // exports so far
  int64_t delta_base_ = 0;          // confirmed export; 0: none
  bool tracking_removals_ = false;
  std::unordered_map<int64_t, int64_t> removed_;  // key -> export
  std::vector<uint8_t> cbf_;  // counting Bloom filter (CBFFilter only)
  // The same counters when the array would be too large:
  // counter index -> count, zero counters absent.
  std::unordered_map<uint64_t, int64_t> sparse_cbf_;
  // SSD tier (DRAM_SSDHASH / SSDHASH): the record file (its index holds
  // the change marks of its keys, kTierChanged / kTierExported) and the
  // folder claimed in TierDirs().
  std::unique_ptr<SsdTierFile> tier_;
  int64_t promotions_ = 0;
  int64_t spills_ = 0;
  int64_t promote_ns_ = 0;
  int64_t spill_ns_ = 0;
  int64_t compactions_ = 0;
  std::string tier_dir_key_;
};


inline Status GetEV(OpKernelContext* ctx, int input,
                    RefCountPtr<EVStorage>* ev) {
  return LookupResource(ctx, HandleFromInput(ctx, input), ev);
}

}  // namespace ev
}  // namespace group_embedding

#endif  // GROUP_EMBEDDING_OPS_KERNELS_EV_STORAGE_H_

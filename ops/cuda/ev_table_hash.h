#ifndef GROUP_EMBEDDING_OPS_CUDA_EV_TABLE_HASH_H_
#define GROUP_EMBEDDING_OPS_CUDA_EV_TABLE_HASH_H_

// Where a key lives in the GPU EV table, which key a full bucket gives
// up, and the host checks of a table call: compiled for the device
// (ev_table_kernels.cu) and the host stand-in (ev_table_host.cc), and
// restated by the numpy model (tests/ops/ev_table_parity.py), so that all
// three place, pin and evict the same keys.

#include <stdint.h>

#include <limits>
#include <vector>

#include "core_checks.h"
#include "embedding_math.h"
#include "ev_table.h"
#include "../kernels/hash_mix.h"

namespace ge_ev {

// Keys hash with the CPU kernels' one mixer (a bijection of uint64, so
// distinct keys never share a hash).
using group_embedding::Mix;

// Bucket from the high half, digest from the low byte: independent bits,
// so the keys of one bucket still spread over 255 digests. Digest 0 is
// kept for free slots.
GE_HD int64_t BucketOf(uint64_t h, int64_t num_buckets) {
  return static_cast<int64_t>((h >> 32) &
                              static_cast<uint64_t>(num_buckets - 1));
}
GE_HD uint8_t DigestOf(uint64_t h) {
  const uint8_t d = static_cast<uint8_t>(h & 0xff);
  return d == 0 ? 1 : d;
}

// Row `key mod rows` (non-negative) of the default matrix.
GE_HD int64_t DefaultRow(int64_t key, int64_t rows) {
  int64_t m = key % rows;
  return m < 0 ? m + rows : m;
}

// Whether a stored key with `freq` occurrences counted is admitted.
GE_HD bool Admitted(int64_t freq, int64_t filter_freq) {
  return filter_freq <= 0 || freq >= filter_freq;
}

// The eviction order of a full bucket: true when entry a should go
// before entry b. LRU: older version first; LFU: smaller freq first,
// then older version; then the lower slot (placement is deterministic,
// so the slot order is a fact of the table the model can follow, and the
// victim is chosen without reading keys). Pinned entries (version >= the
// current step) are never candidates; the caller skips them.
GE_HD bool EvictsBefore(int policy, int64_t freq_a, int64_t version_a,
                        int64_t slot_a, int64_t freq_b, int64_t version_b,
                        int64_t slot_b) {
  if (policy == GE_EV_LFU && freq_a != freq_b) return freq_a < freq_b;
  if (version_a != version_b) return version_a < version_b;
  return slot_a < slot_b;
}

// freq and version of slot s in the meta pairs.
GE_HD int64_t* FreqOf(int64_t* meta, int64_t s) { return meta + 2 * s; }
GE_HD int64_t* VersionOf(int64_t* meta, int64_t s) { return meta + 2 * s + 1; }

// Buckets are numbered in uint32 by the insert's sort (one more for "no
// insert"), occurrences in int32.
constexpr int64_t kMaxBuckets = int64_t{1} << 30;
constexpr int64_t kMaxKeys = (int64_t{1} << 31) - 1;
constexpr int64_t kMaxSlots = 8;

inline bool IsPowerOfTwo(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

// Host checks of a table descriptor, shared by every call.
inline int CheckTable(const GeEvTable* t) {
  if (t == nullptr || t->keys == nullptr || t->digests == nullptr ||
      t->meta == nullptr || t->values == nullptr) {
    return GE_ERR_ARGUMENT;
  }
  // The probes read digests and meta pairs as 16-byte words.
  if ((reinterpret_cast<uintptr_t>(t->digests) & 15) != 0 ||
      (reinterpret_cast<uintptr_t>(t->meta) & 15) != 0) {
    return GE_ERR_ARGUMENT;
  }
  if (!IsPowerOfTwo(t->num_buckets) || t->num_buckets > kMaxBuckets ||
      t->dim < 1 || t->dim > ge_core::kMaxDimVec4 || t->num_slots < 0 ||
      t->num_slots > kMaxSlots || (t->num_slots > 0 && t->slots == nullptr) ||
      (t->num_slots > 0 && t->slot_inits == nullptr) ||
      (t->policy != GE_EV_LRU && t->policy != GE_EV_LFU) ||
      t->filter_freq < 0 || t->defaults == nullptr || t->default_rows < 1) {
    return GE_ERR_ARGUMENT;
  }
  return GE_OK;
}

inline int CheckBatch(const GeEvTable* t, const int64_t* keys, int64_t n) {
  const int s = CheckTable(t);
  if (s != GE_OK) return s;
  if (n < 0 || (n > 0 && keys == nullptr)) return GE_ERR_ARGUMENT;
  if (n > kMaxKeys) return GE_ERR_TOO_LARGE;
  return GE_OK;
}

// An evicted output must hold every key a call can evict (n for an
// insert), else a key could be dropped.
inline int CheckEvicted(const GeEvTable* t, const GeEvEvicted* e,
                        int64_t n) {
  if (e == nullptr) return GE_OK;
  if (e->keys == nullptr || e->values == nullptr || e->freq == nullptr ||
      e->version == nullptr || e->count == nullptr || e->capacity < n ||
      (t->num_slots > 0 && e->slots == nullptr)) {
    return GE_ERR_ARGUMENT;
  }
  return GE_OK;
}

// Device bytes of a table's arrays: key 8, digest 1, meta 16, row and
// slots 4 x dim each, per slot; 0 for bad arguments.
inline size_t TableBytes(int64_t num_buckets, int64_t dim, int num_slots) {
  if (!IsPowerOfTwo(num_buckets) || num_buckets > kMaxBuckets || dim < 1 ||
      dim > ge_core::kMaxDimVec4 || num_slots < 0 || num_slots > kMaxSlots) {
    return 0;
  }
  const size_t cap = static_cast<size_t>(num_buckets) * GE_EV_BUCKET;
  return cap * (8 + 1 + 16 + 4 * static_cast<size_t>(dim) * (1 + num_slots));
}

// Host checks of a group call: distinct valid tables (their buckets are
// numbered one after the other in uint32, one more for "no insert"),
// batches naming one of them, at most kMaxKeys keys in all. Fills the
// occurrence prefix `occ_base` [num_batches + 1] and bucket prefix
// `bucket_base` [num_tables + 1].
inline int CheckGroup(const GeEvTable* tables, int num_tables,
                      const GeEvBatch* batches, int num_batches,
                      const GeEvEvicted* evicted, int64_t* occ_base,
                      int64_t* bucket_base) {
  if (tables == nullptr || batches == nullptr || num_tables < 1 ||
      num_batches < 1) {
    return GE_ERR_ARGUMENT;
  }
  bucket_base[0] = 0;
  for (int t = 0; t < num_tables; ++t) {
    const int s = CheckTable(&tables[t]);
    if (s != GE_OK) return s;
    for (int u = 0; u < t; ++u) {
      if (tables[u].keys == tables[t].keys) return GE_ERR_ARGUMENT;
    }
    bucket_base[t + 1] = bucket_base[t] + tables[t].num_buckets;
    if (bucket_base[t + 1] > kMaxBuckets) return GE_ERR_TOO_LARGE;
  }
  occ_base[0] = 0;
  for (int b = 0; b < num_batches; ++b) {
    const GeEvBatch& x = batches[b];
    if (x.table < 0 || x.table >= num_tables || x.n < 0 ||
        (x.n > 0 && x.keys == nullptr)) {
      return GE_ERR_ARGUMENT;
    }
    occ_base[b + 1] = occ_base[b] + x.n;
    if (occ_base[b + 1] > kMaxKeys) return GE_ERR_TOO_LARGE;
  }
  for (int t = 0; evicted != nullptr && t < num_tables; ++t) {
    if (evicted[t].count == nullptr) continue;
    int64_t n = 0;  // every key of the table's batches may evict one
    for (int b = 0; b < num_batches; ++b) {
      if (batches[b].table == t) n += batches[b].n;
    }
    const int s = CheckEvicted(&tables[t], &evicted[t], n);
    if (s != GE_OK) return s;
  }
  return GE_OK;
}

// A group call's prefixes, as CheckGroup fills them: occurrences
// [num_batches + 1] and buckets [num_tables + 1].
struct GroupBases {
  std::vector<int64_t> occ, bucket;
  int64_t keys() const { return occ.back(); }
};

// The first checks of a group call of the CUDA table and of its stand-in
// alike: CheckGroup into `bases`, then the counters.
inline int CheckGroupCall(const GeEvTable* tables, int num_tables,
                          const GeEvBatch* batches, int num_batches,
                          const GeEvEvicted* evicted,
                          const unsigned long long* counters,
                          GroupBases* bases) {
  bases->occ.assign(num_batches + 1 > 0 ? num_batches + 1 : 1, 0);
  bases->bucket.assign(num_tables + 1 > 0 ? num_tables + 1 : 1, 0);
  const int status = CheckGroup(tables, num_tables, batches, num_batches,
                                evicted, bases->occ.data(),
                                bases->bucket.data());
  if (status != GE_OK) return status;
  return counters == nullptr ? GE_ERR_ARGUMENT : GE_OK;
}

// The host checks of ge_ev_init (it needs only the keys and digests),
// ge_ev_evict and ge_ev_export, shared by the CUDA table and its stand-in.
inline int CheckInit(const GeEvTable* t) {
  if (t == nullptr || t->keys == nullptr || t->digests == nullptr ||
      !IsPowerOfTwo(t->num_buckets) || t->num_buckets > kMaxBuckets) {
    return GE_ERR_ARGUMENT;
  }
  return GE_OK;
}
inline int CheckEvict(const GeEvTable* t, const GeEvEvicted* evicted,
                      const unsigned long long* counters,
                      int64_t steps_to_live) {
  const int s = CheckTable(t);
  if (s != GE_OK) return s;
  if (CheckEvicted(t, evicted, 0) != GE_OK || counters == nullptr ||
      steps_to_live < 0) {
    return GE_ERR_ARGUMENT;
  }
  return GE_OK;
}
inline int CheckExport(const GeEvTable* t, const int64_t* keys,
                       int64_t capacity, const unsigned long long* count) {
  const int s = CheckTable(t);
  if (s != GE_OK) return s;
  if (count == nullptr || capacity < 0 || (capacity > 0 && keys == nullptr)) {
    return GE_ERR_ARGUMENT;
  }
  return GE_OK;
}

inline int64_t Capacity(const GeEvTable* t) {
  return t->num_buckets * GE_EV_BUCKET;
}

}  // namespace ge_ev

#endif  // GROUP_EMBEDDING_OPS_CUDA_EV_TABLE_HASH_H_

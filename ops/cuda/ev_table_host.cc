// Host-memory stand-in of the GPU EV table (ev_table.h): the same C
// interface, argument checks, placement and eviction rules
// (ev_table_hash.h), computed with plain loops in the order the CUDA
// kernels settle on (missing keys inserted bucket by bucket, in key
// order within a bucket: the radix sort is stable). CPU-only CI runs the
// table's parity cases through it; the GPU machine runs them on the CUDA
// kernels. A test double, not a backend.

#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "ev_table_hash.h"

namespace ge_host_ev {
namespace {

using ge_ev::Admitted;
using ge_ev::BucketOf;
using ge_ev::DefaultRow;
using ge_ev::DigestOf;
using ge_ev::Mix;

int64_t Find(const GeEvTable& t, int64_t key) {
  const uint64_t h = Mix(static_cast<uint64_t>(key));
  const int64_t base = BucketOf(h, t.num_buckets) * GE_EV_BUCKET;
  const uint8_t d = DigestOf(h);
  for (int i = 0; i < GE_EV_BUCKET; ++i) {
    if (t.digests[base + i] == d && t.keys[base + i] == key) return base + i;
  }
  return -1;
}

void CopyRow(float* dst, const float* src, int64_t dim) {
  memcpy(dst, src, sizeof(float) * dim);
}

void AbsentRow(const GeEvTable& t, int64_t key, float* dst) {
  if (t.filter_freq > 0) {
    std::fill(dst, dst + t.dim, t.no_permission);
  } else {
    CopyRow(dst, t.defaults + DefaultRow(key, t.default_rows) * t.dim, t.dim);
  }
}

struct ImportRows {
  bool on;
  const float* rows;
  const float* slots;
  const int64_t* freq;
  const int64_t* version;
  int64_t n;
};

// A new or imported entry's row, slots and freq; its version is `now`
// (an import's own versions are written when the call ends: until then
// its keys are pinned like those of a training step).
void WriteEntry(const GeEvTable& t, int64_t s, int64_t key, int64_t j,
                int64_t now, const ImportRows& in) {
  const int64_t cap = ge_ev::Capacity(&t);
  CopyRow(t.values + s * t.dim,
          in.on ? in.rows + j * t.dim
                : t.defaults + DefaultRow(key, t.default_rows) * t.dim,
          t.dim);
  for (int k = 0; k < t.num_slots; ++k) {
    float* dst = t.slots + (k * cap + s) * t.dim;
    if (in.on && in.slots != nullptr) {
      CopyRow(dst, in.slots + (k * in.n + j) * t.dim, t.dim);
    } else {
      std::fill(dst, dst + t.dim, t.slot_inits[k]);
    }
  }
  *ge_ev::FreqOf(t.meta, s) = in.on && in.freq != nullptr ? in.freq[j] : 0;
  *ge_ev::VersionOf(t.meta, s) = now;
}

// Moves entry s to the evicted output; false when it has no room.
bool Evict(const GeEvTable& t, int64_t s, const GeEvEvicted* ev,
           unsigned long long* counters) {
  if (ev != nullptr) {
    const unsigned long long at = (*ev->count)++;
    if (at >= static_cast<unsigned long long>(ev->capacity)) {
      ++counters[GE_EV_FULL];
      return false;
    }
    const int64_t a = static_cast<int64_t>(at);
    const int64_t cap = ge_ev::Capacity(&t);
    ev->keys[a] = t.keys[s];
    ev->freq[a] = *ge_ev::FreqOf(t.meta, s);
    ev->version[a] = *ge_ev::VersionOf(t.meta, s);
    CopyRow(ev->values + a * t.dim, t.values + s * t.dim, t.dim);
    for (int k = 0; k < t.num_slots; ++k) {
      CopyRow(ev->slots + (k * ev->capacity + a) * t.dim,
              t.slots + (k * cap + s) * t.dim, t.dim);
    }
  }
  ++counters[GE_EV_EVICTED];
  return true;
}

// The slot a new key of bucket `base` takes: the first free one, else
// the least valuable unpinned key's (evicted); -1 when none.
int64_t Place(const GeEvTable& t, int64_t base, int64_t now,
              const GeEvEvicted* ev, unsigned long long* counters) {
  for (int i = 0; i < GE_EV_BUCKET; ++i) {
    if (t.keys[base + i] == GE_EV_EMPTY_KEY) return base + i;
  }
  int64_t best = -1;
  for (int i = 0; i < GE_EV_BUCKET; ++i) {
    const int64_t s = base + i;
    const int64_t version = *ge_ev::VersionOf(t.meta, s);
    if (version >= now) continue;  // pinned
    if (best < 0 ||
        ge_ev::EvictsBefore(t.policy, *ge_ev::FreqOf(t.meta, s), version, s,
                            *ge_ev::FreqOf(t.meta, best),
                            *ge_ev::VersionOf(t.meta, best), best)) {
      best = s;
    }
  }
  if (best < 0) {
    ++counters[GE_EV_FULL];
    return -1;
  }
  return Evict(t, best, ev, counters) ? best : -1;
}

// A group call (a single-table call is a group of one): the probe over
// every occurrence, then the missing keys by call-wide bucket number and
// occurrence, then (training) the counts.
int Upsert(const GeEvTable* tables, int nt, const GeEvBatch* batches,
           int nb, int64_t step, const GeEvEvicted* evicted,
           const ImportRows& in, void* scratch, size_t scratch_bytes,
           unsigned long long* counters) {
  ge_ev::GroupBases bases;
  const int status = ge_ev::CheckGroupCall(tables, nt, batches, nb, evicted,
                                           counters, &bases);
  if (status != GE_OK) return status;
  const int64_t n = bases.keys();
  if (n == 0) return GE_OK;
  if (scratch == nullptr ||
      scratch_bytes < ge_ev_group_scratch_bytes(tables, nt, batches, nb)) {
    return GE_ERR_SCRATCH;
  }
  const int64_t now = step < 0 ? 0 : step;
  struct Occ {
    const GeEvBatch* batch;
    int64_t jl;
    const GeEvTable* table;
    int64_t key;
    float* out;
  };
  std::vector<Occ> occ(n);
  std::vector<int64_t> slot(n, -1);
  for (int b = 0; b < nb; ++b) {
    const GeEvBatch& x = batches[b];
    const GeEvTable& t = tables[x.table];
    for (int64_t jl = 0; jl < x.n; ++jl) {
      occ[bases.occ[b] + jl] = {&x, jl, &t, x.keys[jl],
                                 x.out != nullptr && !in.on
                                     ? x.out + jl * t.dim
                                     : nullptr};
    }
  }
  auto evicted_of = [&](const GeEvTable* t) -> const GeEvEvicted* {
    if (evicted == nullptr) return nullptr;
    const GeEvEvicted& e = evicted[t - tables];
    return e.count != nullptr ? &e : nullptr;
  };
  // (call-wide bucket, occurrence) of each missing key, in the sort's
  // order.
  std::vector<std::pair<int64_t, int64_t>> missing;
  for (int64_t j = 0; j < n; ++j) {
    const Occ& o = occ[j];
    const GeEvTable& t = *o.table;
    if (o.key == GE_EV_EMPTY_KEY) {
      ++counters[GE_EV_BAD_KEYS];
      if (o.out != nullptr) AbsentRow(t, o.key, o.out);
      continue;
    }
    const int64_t s = Find(t, o.key);
    slot[j] = s;
    if (s < 0) {
      missing.emplace_back(
          bases.bucket[o.table - tables] +
              BucketOf(Mix(static_cast<uint64_t>(o.key)), t.num_buckets),
          j);
      continue;
    }
    if (in.on) {
      WriteEntry(t, s, o.key, o.jl, now, in);
      continue;
    }
    int64_t* version = ge_ev::VersionOf(t.meta, s);
    *version = std::max(*version, now);
    if (o.out == nullptr) continue;
    if (Admitted(*ge_ev::FreqOf(t.meta, s), t.filter_freq)) {
      CopyRow(o.out, t.values + s * t.dim, t.dim);
    } else {
      std::fill(o.out, o.out + t.dim, t.no_permission);
    }
  }
  std::sort(missing.begin(), missing.end());
  for (const auto& m : missing) {
    const int64_t j = m.second;
    const Occ& o = occ[j];
    const GeEvTable& t = *o.table;
    int64_t s = Find(t, o.key);  // a repeat inserted just before
    if (s < 0) {
      const int64_t base =
          (m.first - bases.bucket[o.table - tables]) * GE_EV_BUCKET;
      s = Place(t, base, now, evicted_of(o.table), counters);
      if (s >= 0) {
        WriteEntry(t, s, o.key, o.jl, now, in);
        t.keys[s] = o.key;
        t.digests[s] = DigestOf(Mix(static_cast<uint64_t>(o.key)));
        ++counters[GE_EV_INSERTED];
      }
    }
    slot[j] = s;
    if (o.out != nullptr) {
      if (s >= 0 && t.filter_freq <= 0) {
        CopyRow(o.out, t.values + s * t.dim, t.dim);
      } else {
        AbsentRow(t, o.key, o.out);
      }
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    const Occ& o = occ[j];
    if (in.on) {
      if (slot[j] >= 0 && in.version != nullptr) {
        *ge_ev::VersionOf(o.table->meta, slot[j]) = in.version[o.jl];
      }
      continue;
    }
    if (slot[j] >= 0) ++*ge_ev::FreqOf(o.table->meta, slot[j]);
    if (o.batch->out_slots != nullptr) o.batch->out_slots[o.jl] = slot[j];
  }
  return GE_OK;
}

}  // namespace
}  // namespace ge_host_ev

using namespace ge_host_ev;  // NOLINT: the C entry points below

extern "C" {

size_t ge_ev_table_bytes(int64_t num_buckets, int64_t dim, int num_slots) {
  return ge_ev::TableBytes(num_buckets, dim, num_slots);
}

int ge_ev_init(const GeEvTable* table, void* stream) {
  (void)stream;
  const int status = ge_ev::CheckInit(table);
  if (status != GE_OK) return status;
  const int64_t cap = ge_ev::Capacity(table);
  std::fill(table->keys, table->keys + cap, GE_EV_EMPTY_KEY);
  memset(table->digests, 0, cap);
  return GE_OK;
}

size_t ge_ev_scratch_bytes(const GeEvTable* table, int64_t n) {
  const GeEvBatch batch{0, 0, nullptr, n, nullptr, nullptr};
  if (n < 0) return 0;
  return ge_ev_group_scratch_bytes(table, 1, &batch, 1);
}

size_t ge_ev_group_scratch_bytes(const GeEvTable* tables, int num_tables,
                                 const GeEvBatch* batches, int num_batches) {
  (void)tables;
  if (batches == nullptr || num_tables < 1 || num_batches < 1) return 0;
  int64_t n = 0;
  for (int b = 0; b < num_batches; ++b) {
    n += batches[b].n > 0 ? batches[b].n : 0;
  }
  if (n > ge_ev::kMaxKeys) return 0;
  // What the CUDA layout takes besides the sort's temporary storage (the
  // stand-in asks as much, so that callers size the scratch alike).
  return static_cast<size_t>(n) * 24 + 1024 +
         static_cast<size_t>(num_tables + num_batches) * 256;
}

int ge_ev_find_or_insert_group(const GeEvTable* tables, int num_tables,
                               const GeEvBatch* batches, int num_batches,
                               int64_t step, const GeEvEvicted* evicted,
                               void* scratch, size_t scratch_bytes,
                               unsigned long long* counters, void* stream) {
  (void)stream;
  const ImportRows none{false, nullptr, nullptr, nullptr, nullptr, 0};
  return Upsert(tables, num_tables, batches, num_batches, step, evicted,
                none, scratch, scratch_bytes, counters);
}

int ge_ev_find(const GeEvTable* table, const int64_t* keys, int64_t n,
               float* out, int64_t* out_slots, unsigned long long* counters,
               void* stream) {
  (void)stream;
  const int status = ge_ev::CheckBatch(table, keys, n);
  if (status != GE_OK) return status;
  if (counters == nullptr) return GE_ERR_ARGUMENT;
  const GeEvTable& t = *table;
  for (int64_t j = 0; j < n; ++j) {
    const bool bad = keys[j] == GE_EV_EMPTY_KEY;
    if (bad) ++counters[GE_EV_BAD_KEYS];
    const int64_t s = bad ? -1 : Find(t, keys[j]);
    const bool admitted =
        s >= 0 && Admitted(*ge_ev::FreqOf(t.meta, s), t.filter_freq);
    if (out_slots != nullptr) out_slots[j] = admitted ? s : -1;
    if (out == nullptr) continue;
    if (admitted) {
      CopyRow(out + j * t.dim, t.values + s * t.dim, t.dim);
    } else {
      AbsentRow(t, keys[j], out + j * t.dim);
    }
  }
  return GE_OK;
}

int ge_ev_stamp(const GeEvTable* table, const int64_t* keys, int64_t n,
                int64_t step, int64_t* out_slots,
                unsigned long long* counters, void* stream) {
  (void)stream;
  const int status = ge_ev::CheckBatch(table, keys, n);
  if (status != GE_OK) return status;
  if (counters == nullptr || (n > 0 && out_slots == nullptr)) {
    return GE_ERR_ARGUMENT;
  }
  const GeEvTable& t = *table;
  const int64_t version = step > 0 ? step : 0;
  for (int64_t j = 0; j < n; ++j) {
    const bool bad = keys[j] == GE_EV_EMPTY_KEY;
    if (bad) ++counters[GE_EV_BAD_KEYS];
    const int64_t s = bad ? -1 : Find(t, keys[j]);
    if (s >= 0) *ge_ev::VersionOf(t.meta, s) = version;
    const bool admitted =
        s >= 0 && Admitted(*ge_ev::FreqOf(t.meta, s), t.filter_freq);
    out_slots[j] = admitted ? s : -1;
  }
  return GE_OK;
}

int ge_ev_swap_versions(const GeEvTable* table, const int64_t* keys,
                        int64_t n, int64_t* versions,
                        unsigned long long* counters, void* stream) {
  (void)stream;
  const int status = ge_ev::CheckBatch(table, keys, n);
  if (status != GE_OK) return status;
  if (counters == nullptr || (n > 0 && versions == nullptr)) {
    return GE_ERR_ARGUMENT;
  }
  const GeEvTable& t = *table;
  for (int64_t j = 0; j < n; ++j) {
    if (keys[j] == GE_EV_EMPTY_KEY) {
      ++counters[GE_EV_BAD_KEYS];
      continue;
    }
    const int64_t s = Find(t, keys[j]);
    if (s >= 0) std::swap(*ge_ev::VersionOf(t.meta, s), versions[j]);
  }
  return GE_OK;
}

int ge_ev_find_or_insert(const GeEvTable* table, const int64_t* keys,
                         int64_t n, int64_t step, float* out, int64_t* out_slots,
                         const GeEvEvicted* evicted, void* scratch,
                         size_t scratch_bytes, unsigned long long* counters,
                         void* stream) {
  (void)stream;
  const ImportRows none{false, nullptr, nullptr, nullptr, nullptr, n};
  const GeEvBatch batch{0, 0, keys, n, out, out_slots};
  return Upsert(table, 1, &batch, 1, step, evicted, none, scratch,
                scratch_bytes, counters);
}

int ge_ev_insert(const GeEvTable* table, const int64_t* keys, int64_t n,
                 const float* rows, const float* slots, const int64_t* freq,
                 const int64_t* version, int64_t step,
                 const GeEvEvicted* evicted, void* scratch,
                 size_t scratch_bytes, unsigned long long* counters,
                 void* stream) {
  (void)stream;
  if (n > 0 && rows == nullptr) return GE_ERR_ARGUMENT;
  const ImportRows in{true, rows, slots, freq, version, n};
  const GeEvBatch batch{0, 0, keys, n, nullptr, nullptr};
  return Upsert(table, 1, &batch, 1, step, evicted, in, scratch,
                scratch_bytes, counters);
}

int ge_ev_evict(const GeEvTable* table, int64_t step, int64_t steps_to_live,
                float l2_threshold, const GeEvEvicted* evicted,
                unsigned long long* counters, void* stream) {
  (void)stream;
  const int status =
      ge_ev::CheckEvict(table, evicted, counters, steps_to_live);
  if (status != GE_OK) return status;
  if (steps_to_live == 0 && !(l2_threshold >= 0.0f)) return GE_OK;
  const GeEvTable& t = *table;
  const int64_t now = step < 0 ? 0 : step;
  for (int64_t s = 0; s < ge_ev::Capacity(table); ++s) {
    if (t.keys[s] == GE_EV_EMPTY_KEY) continue;
    bool doomed;
    if (steps_to_live > 0) {
      doomed = now - *ge_ev::VersionOf(t.meta, s) > steps_to_live;
    } else {
      double ss = 0.0;
      for (int64_t d = 0; d < t.dim; ++d) {
        ss += double(t.values[s * t.dim + d]) * t.values[s * t.dim + d];
      }
      doomed = 0.5 * ss < l2_threshold;
    }
    if (doomed && Evict(t, s, evicted, counters)) {
      t.keys[s] = GE_EV_EMPTY_KEY;
      t.digests[s] = 0;
    }
  }
  return GE_OK;
}

int ge_ev_size(const GeEvTable* table, unsigned long long* count,
               void* stream) {
  (void)stream;
  const int status = ge_ev::CheckTable(table);
  if (status != GE_OK) return status;
  if (count == nullptr) return GE_ERR_ARGUMENT;
  for (int64_t s = 0; s < ge_ev::Capacity(table); ++s) {
    if (table->keys[s] != GE_EV_EMPTY_KEY) ++*count;
  }
  return GE_OK;
}

size_t ge_ev_export_scratch_bytes(const GeEvTable* table) {
  if (ge_ev::CheckTable(table) != GE_OK) return 0;
  return static_cast<size_t>(table->num_buckets) * 16 + 256;
}

int ge_ev_export(const GeEvTable* table, int64_t* keys, float* values,
                 float* slots, int64_t* freq, int64_t* version,
                 int64_t capacity, unsigned long long* count, void* scratch,
                 size_t scratch_bytes, void* stream) {
  (void)stream;
  const int status = ge_ev::CheckExport(table, keys, capacity, count);
  if (status != GE_OK) return status;
  if (scratch == nullptr ||
      scratch_bytes < ge_ev_export_scratch_bytes(table)) {
    return GE_ERR_SCRATCH;
  }
  const GeEvTable& t = *table;
  const int64_t cap = ge_ev::Capacity(table);
  int64_t a = 0;
  for (int64_t s = 0; s < cap; ++s) {
    if (t.keys[s] == GE_EV_EMPTY_KEY) continue;
    if (a < capacity) {
      keys[a] = t.keys[s];
      if (freq) freq[a] = *ge_ev::FreqOf(t.meta, s);
      if (version) version[a] = *ge_ev::VersionOf(t.meta, s);
      if (values) CopyRow(values + a * t.dim, t.values + s * t.dim, t.dim);
      for (int k = 0; slots && k < t.num_slots; ++k) {
        CopyRow(slots + (k * capacity + a) * t.dim,
                t.slots + (k * cap + s) * t.dim, t.dim);
      }
    }
    ++a;
  }
  *count += static_cast<unsigned long long>(a);
  return GE_OK;
}

}  // extern "C"

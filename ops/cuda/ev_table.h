#ifndef GROUP_EMBEDDING_OPS_CUDA_EV_TABLE_H_
#define GROUP_EMBEDDING_OPS_CUDA_EV_TABLE_H_

// The GPU EmbeddingVariable table of the CUDA core: int64 keys -> a row,
// its optimizer slots, an occurrence count (freq) and a version (the
// last step the key was seen), in device memory the caller owns. Same interface rules as
// group_embedding_cuda.h: device pointers, a stream, caller scratch,
// nothing allocated, bad input counted on the device (`counters`, 64-bit,
// ADDED to), host argument errors returned as GE_ERR_*.
//
// Layout: `num_buckets` (a power of two) buckets of GE_EV_BUCKET slots;
// slot s = bucket * GE_EV_BUCKET + i. A key lives only in its own bucket
// (bucket = bits 32.. of Mix(key), see ev_table_hash.h), so a find reads
// one bucket's 128 one-byte digests and the keys whose digest matches,
// and a delete is a plain store (no probe chains, no tombstones). A
// bucket that is full when a new key arrives evicts its least valuable
// unpinned key: LRU the oldest version, LFU the smallest freq, then the
// oldest version; ties go to the lower slot (a new key takes the lowest
// free slot and the missing keys of a call go in bucket by bucket in
// batch order, so where every key lands is deterministic). Keys seen at
// the current step (version >= step) are pinned: a row handed out in a
// step keeps its key until the step's update, whatever other lookups of
// the step bring. Inserts therefore never fail up to load factor 1.0,
// unless one step brings more distinct keys into one bucket than it has
// unpinned slots (counted in GE_EV_FULL; those keys are not stored and
// read as not admitted). Steps must advance for keys to leave.
//
// Semantics are the CPU EmbeddingVariable's (ops/kernels/ev_storage.h,
// ReadKeys, CountStoredKeys and InsertMissingKeys in ev_lookup_ops.cc):
// * a new key's row is row `key mod default_rows` of `defaults`, its
//   slots `slot_inits[s]`, freq 0, version max(step, 0);
// * CounterFilter (filter_freq > 0): keys are stored on first sight, and
//   every occurrence counts; a key reads `no_permission` in every column
//   until freq >= filter_freq BEFORE this call counted it, so all
//   occurrences of a key in one call read the same row;
// * find (inference) of an absent key: `no_permission` when filtered,
//   else its default row; nothing is stored or counted.
// The key INT64_MIN marks free slots and is refused (GE_EV_BAD_KEYS).

#include <stddef.h>
#include <stdint.h>

#include "group_embedding_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GE_EV_BUCKET 128
#define GE_EV_EMPTY_KEY INT64_MIN

enum GeEvPolicy { GE_EV_LRU = 0, GE_EV_LFU = 1 };
// Device counters of a table call (unsigned 64-bit, added to).
enum GeEvCounter {
  GE_EV_BAD_KEYS = 0,  // the reserved key
  GE_EV_FULL = 1,      // keys not stored: bucket pinned full / no room
                       // in the evicted output
  GE_EV_INSERTED = 2,  // keys inserted
  GE_EV_EVICTED = 3,   // keys evicted (capacity or evict rules)
  GE_EV_NUM_COUNTERS = 4,
};

typedef struct GeEvTable {
  // Device arrays of capacity = num_buckets * GE_EV_BUCKET entries.
  int64_t* keys;      // GE_EV_EMPTY_KEY: free (ge_ev_init sets all)
  uint8_t* digests;   // one byte of the key's hash, 0 for free slots;
                      // 16-byte aligned
  // [capacity, 2]: occurrences counted (freq), last step seen (version),
  // side by side: a hit touches one 16-byte pair. 16-byte aligned.
  int64_t* meta;
  float* values;      // [capacity, dim]
  float* slots;       // [num_slots, capacity, dim]; NULL if num_slots = 0
  int64_t num_buckets;
  int64_t dim;
  int32_t num_slots;
  int32_t policy;       // GeEvPolicy
  int64_t filter_freq;  // CounterFilter threshold, 0: no filter
  float no_permission;  // what keys not admitted read
  float reserved;
  const float* defaults;     // [default_rows, dim], device
  int64_t default_rows;
  const float* slot_inits;   // [num_slots], device; NULL if no slots
} GeEvTable;

// Where keys leaving the table go (capacity evictions, evict rules), or
// NULL to drop them. Entry i = atomicAdd(count, 1); a key that finds no
// room (i >= capacity) is not evicted (counted in GE_EV_FULL).
typedef struct GeEvEvicted {
  int64_t* keys;      // [capacity]
  float* values;      // [capacity, dim]
  float* slots;       // [num_slots, capacity, dim] or NULL
  int64_t* freq;      // [capacity]
  int64_t* version;   // [capacity]
  int64_t capacity;
  unsigned long long* count;  // device counter the caller zeroes
} GeEvEvicted;

// Device bytes of a table's arrays (keys .. slots), for the caller's
// allocation; 0 for bad arguments.
GE_API
size_t ge_ev_table_bytes(int64_t num_buckets, int64_t dim, int num_slots);
// Marks every slot free.
GE_API
int ge_ev_init(const GeEvTable* table, void* stream);

// Scratch of ge_ev_find_or_insert / ge_ev_insert for up to n keys.
GE_API
size_t ge_ev_scratch_bytes(const GeEvTable* table, int64_t n);

// Inference read of n keys: out [n, dim] (or NULL) gets each key's row
// if stored and admitted, else no_permission (filtered) or its default
// row; out_slots [n] (or NULL) its slot, -1 if absent or not admitted.
// Reads only: nothing is inserted, counted or stamped.
GE_API
int ge_ev_find(const GeEvTable* table, const int64_t* keys, int64_t n,
               float* out, int64_t* out_slots, unsigned long long* counters,
               void* stream);

// The keys of an optimizer step (duplicates allowed): out_slots [n] gets
// each key's slot if stored and admitted, else -1 (the rows to update,
// as the CPU EV's sparse updates skip absent and unadmitted keys), and
// every stored key, admitted or not, gets version max(step, 0) (it was
// seen). Nothing is inserted, read or counted.
GE_API
int ge_ev_stamp(const GeEvTable* table, const int64_t* keys, int64_t n,
                int64_t step, int64_t* out_slots,
                unsigned long long* counters, void* stream);

// Swaps each stored key's version with versions[i] ([n], device); absent
// keys leave versions[i] as it is. Keys must be distinct. A second call
// with the same arrays restores the versions: the adaptor pins keys
// (version INT64_MAX: no insert evicts them) for the length of an import
// and puts their versions back. Nothing else is read or written.
GE_API
int ge_ev_swap_versions(const GeEvTable* table, const int64_t* keys,
                        int64_t n, int64_t* versions,
                        unsigned long long* counters, void* stream);

// Training read of n keys (duplicates allowed): absent keys are inserted
// (evicting by the policy when their bucket is full), out [n, dim] (or
// NULL) gets what each key reads (see the top), out_slots [n] (or NULL)
// each key's slot (-1 if not stored); every stored key's version becomes
// max(version, step) and its freq grows by its occurrences.
GE_API
int ge_ev_find_or_insert(const GeEvTable* table, const int64_t* keys,
                         int64_t n, int64_t step, float* out, int64_t* out_slots,
                         const GeEvEvicted* evicted, void* scratch,
                         size_t scratch_bytes, unsigned long long* counters,
                         void* stream);

// One feature's keys of a group call: which table (an index into the
// call's `tables`; features sharing a table name the same one), its n
// keys, and where its rows [n, dim of the table] and slots [n] go (either
// may be NULL).
typedef struct GeEvBatch {
  int32_t table;
  int32_t reserved;
  const int64_t* keys;
  int64_t n;
  float* out;
  int64_t* out_slots;
} GeEvBatch;

// Scratch of ge_ev_find_or_insert_group for these batches.
GE_API
size_t ge_ev_group_scratch_bytes(const GeEvTable* tables, int num_tables,
                                 const GeEvBatch* batches, int num_batches);

// ge_ev_find_or_insert for every feature of a group at once: ONE probe,
// ONE sort and ONE insert launch for all tables (a training step's EV
// lookups), with the semantics of calling ge_ev_find_or_insert once per
// distinct table on the concatenation of its features' keys in batch
// order. `tables` must be distinct tables; `evicted` is NULL or one
// GeEvEvicted per table (an entry with count NULL drops that table's).
GE_API
int ge_ev_find_or_insert_group(const GeEvTable* tables, int num_tables,
                               const GeEvBatch* batches, int num_batches,
                               int64_t step, const GeEvEvicted* evicted,
                               void* scratch, size_t scratch_bytes,
                               unsigned long long* counters, void* stream);

// Import of n DISTINCT keys with all their state: rows [n, dim], slots
// [num_slots, n, dim] (NULL: slot_inits), freq, version [n] (NULL: 0,
// max(step, 0)); keys present are overwritten, absent ones inserted
// (evicting as above; the call's own keys are pinned until it ends).
GE_API
int ge_ev_insert(const GeEvTable* table, const int64_t* keys, int64_t n,
                 const float* rows, const float* slots, const int64_t* freq,
                 const int64_t* version, int64_t step,
                 const GeEvEvicted* evicted, void* scratch,
                 size_t scratch_bytes, unsigned long long* counters,
                 void* stream);

// Evicts by rule: GlobalStepEvict when steps_to_live > 0 (step - version
// > steps_to_live), else L2WeightEvict when l2_threshold >= 0 (half the
// squared L2 norm of the row, in double, below it).
GE_API
int ge_ev_evict(const GeEvTable* table, int64_t step, int64_t steps_to_live,
                float l2_threshold, const GeEvEvicted* evicted,
                unsigned long long* counters, void* stream);

// Adds the number of stored keys to *count (device).
GE_API
int ge_ev_size(const GeEvTable* table, unsigned long long* count,
               void* stream);

// Every stored key with its state, in slot order, into arrays of
// `capacity` entries (slots [num_slots, capacity, dim], may be NULL);
// *count (device, zeroed by the caller) gets the number of keys; keys
// past `capacity` are counted, not written.
GE_API
size_t ge_ev_export_scratch_bytes(const GeEvTable* table);
GE_API
int ge_ev_export(const GeEvTable* table, int64_t* keys, float* values,
                 float* slots, int64_t* freq, int64_t* version,
                 int64_t capacity, unsigned long long* count, void* scratch,
                 size_t scratch_bytes, void* stream);

#ifdef __cplusplus
}
#endif

#endif  // GROUP_EMBEDDING_OPS_CUDA_EV_TABLE_H_

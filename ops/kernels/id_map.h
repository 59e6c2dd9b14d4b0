#ifndef GROUP_EMBEDDING_OPS_KERNELS_ID_MAP_H_
#define GROUP_EMBEDDING_OPS_KERNELS_ID_MAP_H_

// The id -> slot maps of the kernels and their one hash mixer. Every
// backward, sparse update and router that deduplicates ids numbers the
// distinct ids by first occurrence (slot 0 = the first id seen), so the
// outputs do not depend on which map ran.
//
//   HashedIds     open addressing, any int64 id; grows as ids arrive.
//   DirectIds     one int32 slot per possible id, for ids in a small
//                 [0, bound): no hashing or probing.
//   WithIdMap     picks one of the two for n ids in [0, bound).
//   DuplicateSums the distinct ids of a batch of rows and their summed
//                 gradient rows (the first step of a sparse update).
//
// Not thread-safe: one map per thread (the kernels shard over tables).

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "hash_mix.h"
#include "tensorflow/core/platform/mutex.h"

namespace group_embedding {

// Open-addressing id -> slot map; slots are dense, in first-occurrence
// order. The buckets start small and double as ids arrive: sized for the
// id count up front, the map of a large multi-hot table (22k ids, 7.7k
// distinct) took 1 MB, more than L2, and was initialised every call.
class HashedIds {
 public:
  // `expected`: an upper bound on the distinct ids (e.g. the id count).
  explicit HashedIds(int64_t expected) {
    int64_t cap = 16;
    while (cap < 2 * std::min<int64_t>(expected, kInitialIds)) cap <<= 1;
    Reset(cap);
    keys_.reserve(std::min<int64_t>(expected, kInitialIds));
  }

  // Fetches the cache lines `Insert(id)` will probe first.
  void Prefetch(int64_t id) const {
    const uint64_t h = Mix(static_cast<uint64_t>(id)) & mask_;
    __builtin_prefetch(&bucket_keys_[h]);
    __builtin_prefetch(&bucket_slots_[h]);
  }

  // Returns the slot of `id`, assigning the next free slot if new.
  int64_t Insert(int64_t id) {
    uint64_t h = Mix(static_cast<uint64_t>(id)) & mask_;
    while (true) {
      const int64_t s = bucket_slots_[h];
      if (s < 0) break;
      if (bucket_keys_[h] == id) return s;
      h = (h + 1) & mask_;
    }
    const int64_t s = size();
    bucket_keys_[h] = id;
    bucket_slots_[h] = s;
    keys_.push_back(id);
    // Load at most 1/2: short probes.
    if (2 * size() > static_cast<int64_t>(mask_ + 1)) Grow();
    return s;
  }

  int64_t size() const { return static_cast<int64_t>(keys_.size()); }
  // The distinct ids, by slot (first-occurrence order).
  const std::vector<int64_t>& keys() const { return keys_; }
  // The same, moved out; the map is spent.
  std::vector<int64_t> TakeKeys() { return std::move(keys_); }

 private:
  static constexpr int64_t kInitialIds = 1024;

  void Reset(int64_t cap) {
    mask_ = static_cast<uint64_t>(cap - 1);
    bucket_keys_.assign(cap, 0);
    bucket_slots_.assign(cap, -1);
  }
  void Grow() {
    Reset(2 * static_cast<int64_t>(mask_ + 1));
    for (int64_t s = 0; s < size(); ++s) {
      uint64_t h = Mix(static_cast<uint64_t>(keys_[s])) & mask_;
      while (bucket_slots_[h] >= 0) h = (h + 1) & mask_;
      bucket_keys_[h] = keys_[s];
      bucket_slots_[h] = s;
    }
  }

  uint64_t mask_;
  std::vector<int64_t> bucket_keys_;
  std::vector<int64_t> bucket_slots_;  // slot, or -1 when free
  std::vector<int64_t> keys_;          // id of each slot
};

// The same for ids known to lie in [0, bound) with a small bound: one
// int32 slot per possible id. The slot array is scratch kept by the kernel
// across steps (all -1 between uses: TakeKeys resets only the touched
// entries), so a step neither allocates nor clears `bound` entries.
class DirectIds {
 public:
  DirectIds(std::vector<int32_t>* scratch, int64_t bound, int64_t expected)
      : slot_of_(scratch) {
    if (static_cast<int64_t>(slot_of_->size()) < bound) {
      slot_of_->resize(bound, -1);
    }
    keys_.reserve(expected);
  }

  void Prefetch(int64_t id) const { __builtin_prefetch(&(*slot_of_)[id]); }

  int64_t Insert(int64_t id) {
    int32_t& s = (*slot_of_)[id];
    if (s < 0) {
      s = static_cast<int32_t>(keys_.size());
      keys_.push_back(id);
    }
    return s;
  }

  // The distinct ids, in first-occurrence order; the map is spent.
  std::vector<int64_t> TakeKeys() {
    for (int64_t id : keys_) (*slot_of_)[id] = -1;
    return std::move(keys_);
  }

 private:
  std::vector<int32_t>* slot_of_;
  std::vector<int64_t> keys_;
};

// Whether `DirectIds` suits n ids in [0, bound): its 4-byte slots beat
// hashing up to a bound of about 64 ids' worth (plus 1 MiB); slots must
// fit int32.
inline bool UseDirect(int64_t bound, int64_t n) {
  return n < std::numeric_limits<int32_t>::max() &&
         bound <= 64 * n + (int64_t{1} << 18);
}

// Per-kernel scratch of DirectIds, one slot array per table. A kernel
// may run concurrently (two steps in flight): the first run takes the
// scratch, any other allocates its own.
class IdScratch {
 public:
  // Holds the slot arrays of `k` tables for one run, if free.
  class Lease {
   public:
    Lease(IdScratch* owner, int k) : owner_(owner) {
      if (!owner_->mu_.try_lock()) return;
      if (static_cast<int>(owner_->slots_.size()) < k) {
        owner_->slots_.resize(k);
      }
      slots_ = &owner_->slots_;
    }
    ~Lease() {
      if (slots_ != nullptr) owner_->mu_.unlock();
    }
    // Table t's slot array, or nullptr (use a fresh one).
    std::vector<int32_t>* For(int64_t t) const {
      return slots_ ? &(*slots_)[t] : nullptr;
    }

   private:
    IdScratch* owner_;
    std::vector<std::vector<int32_t>>* slots_ = nullptr;
  };

 private:
  ::tensorflow::mutex mu_;
  std::vector<std::vector<int32_t>> slots_;
};

// Calls `f(map)` with the map that suits `n` ids in [0, bound); `scratch`
// (nullptr: a fresh array) backs a DirectIds.
template <typename F>
void WithIdMap(int64_t bound, int64_t n, std::vector<int32_t>* scratch,
               F&& f) {
  if (UseDirect(bound, n)) {
    std::vector<int32_t> own;
    DirectIds map(scratch ? scratch : &own, bound, n);
    f(map);
  } else {
    HashedIds map(n);
    f(map);
  }
}

// Numbers `n` ids by first occurrence (slot[j]: the slot of ids[j]);
// returns the distinct ids, by slot. The dedup of every per-unique-id
// backward.
inline std::vector<int64_t> NumberIds(const int64_t* ids, int64_t n,
                                      std::vector<int64_t>* slot) {
  HashedIds map(n);
  slot->resize(n);
  for (int64_t j = 0; j < n; ++j) (*slot)[j] = map.Insert(ids[j]);
  return map.TakeKeys();
}

// The distinct ids of `n` gradient rows ([n, dim] at `grad`) and one
// gradient per distinct id, duplicates summed in position order, so that
// a sparse update applied per distinct id equals the dense one.
class DuplicateSums {
 public:
  DuplicateSums(const int64_t* ids, int64_t n, const float* grad,
                int64_t dim)
      : grad_(grad), dim_(dim) {
    HashedIds map(n);
    std::vector<int64_t> slot(n);
    for (int64_t j = 0; j < n; ++j) {
      slot[j] = map.Insert(ids[j]);
      if (slot[j] == static_cast<int64_t>(first_.size())) first_.push_back(j);
    }
    if (size() != n) {
      summed_.assign(size() * dim, 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        float* dst = summed_.data() + slot[j] * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] += grad[j * dim + d];
      }
    }
  }
  // Distinct ids.
  int64_t size() const { return static_cast<int64_t>(first_.size()); }
  // Position of the first occurrence of the u-th distinct id.
  int64_t first(int64_t u) const { return first_[u]; }
  // Its gradient row (`dim` floats).
  const float* grad(int64_t u) const {
    return summed_.empty() ? grad_ + first_[u] * dim_
                           : summed_.data() + u * dim_;
  }

 private:
  std::vector<int64_t> first_;
  std::vector<float> summed_;  // empty when no id repeats
  const float* grad_;
  int64_t dim_;
};

}  // namespace group_embedding

#endif  // GROUP_EMBEDDING_OPS_KERNELS_ID_MAP_H_

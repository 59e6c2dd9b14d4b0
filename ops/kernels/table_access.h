#ifndef GROUP_EMBEDDING_OPS_KERNELS_TABLE_ACCESS_H_
#define GROUP_EMBEDDING_OPS_KERNELS_TABLE_ACCESS_H_

// Helpers shared by the kernels that read plain resource-variable tables
// (group_embedding_ops.cc, sequence_ops.cc): locking a group of variables
// and deduplicating ids for the per-unique-row gradients.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "tensorflow/core/framework/resource_var.h"

namespace group_embedding {

using ::tensorflow::Var;

// Shared locks on several variables, taken once each in address order so
// that they cannot deadlock with writers that lock in the same order.
class SharedVarLocks {
 public:
  explicit SharedVarLocks(const std::vector<Var*>& vars) {
    for (Var* v : vars) mus_.push_back(v->mu());
    std::sort(mus_.begin(), mus_.end());
    mus_.erase(std::unique(mus_.begin(), mus_.end()), mus_.end());
    for (auto* m : mus_) m->lock_shared();
  }
  ~SharedVarLocks() {
    for (auto it = mus_.rbegin(); it != mus_.rend(); ++it) {
      (*it)->unlock_shared();
    }
  }

 private:
  std::vector<tensorflow::mutex*> mus_;
};

// Open-addressing id -> slot map used to deduplicate ids in O(nnz).
class IdSlotMap {
 public:
  explicit IdSlotMap(int64_t expected) {
    int64_t cap = 16;
    while (cap < 2 * expected) cap <<= 1;
    mask_ = cap - 1;
    keys_.resize(cap);
    slots_.assign(cap, -1);
  }
  // Returns the slot of `id`, assigning the next free slot if new.
  int64_t Insert(int64_t id) {
    uint64_t h = Mix(static_cast<uint64_t>(id)) & mask_;
    while (true) {
      if (slots_[h] < 0) {
        keys_[h] = id;
        slots_[h] = size_;
        return size_++;
      }
      if (keys_[h] == id) return slots_[h];
      h = (h + 1) & mask_;
    }
  }
  int64_t size() const { return size_; }

 private:
  static uint64_t Mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return x;
  }
  uint64_t mask_;
  std::vector<int64_t> keys_;
  std::vector<int64_t> slots_;
  int64_t size_ = 0;
};

}  // namespace group_embedding

#endif  // GROUP_EMBEDDING_OPS_KERNELS_TABLE_ACCESS_H_

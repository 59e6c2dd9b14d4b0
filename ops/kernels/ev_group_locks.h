#ifndef GROUP_EMBEDDING_OPS_KERNELS_EV_GROUP_LOCKS_H_
#define GROUP_EMBEDDING_OPS_KERNELS_EV_GROUP_LOCKS_H_

// The locks of a group op over EmbeddingVariables (the lookups of
// ev_lookup_ops.cc, the fused backward-apply of ev_backward_apply_op.cc).
// Locking rule: such an op takes every lock it needs BEFORE handing work
// to the intra-op pool, and work items never lock.

#include <algorithm>
#include <vector>

#include "ev_storage.h"

namespace group_embedding {
namespace ev {

// Locks of the distinct variables of a group (one variable may serve
// several tables, e.g. shared embedding columns), taken in address order
// so that two groups cannot deadlock; exclusive when keys are inserted or
// a variable has an SSD tier (PrepareTier moves rows).
class EVGroupLocks {
 public:
  EVGroupLocks(std::vector<EVStorage*> evs, bool exclusive)
      : evs_(std::move(evs)), exclusive_(exclusive) {
    std::sort(evs_.begin(), evs_.end());
    evs_.erase(std::unique(evs_.begin(), evs_.end()), evs_.end());
    for (EVStorage* ev : evs_) exclusive_ = exclusive_ || ev->has_tier();
    for (EVStorage* ev : evs_) {
      if (exclusive_) {
        ev->mu()->lock();
      } else {
        ev->mu()->lock_shared();
      }
    }
  }
  ~EVGroupLocks() {
    for (auto it = evs_.rbegin(); it != evs_.rend(); ++it) {
      if (exclusive_) {
        (*it)->mu()->unlock();
      } else {
        (*it)->mu()->unlock_shared();
      }
    }
  }
  const std::vector<EVStorage*>& distinct() const { return evs_; }

 private:
  std::vector<EVStorage*> evs_;
  bool exclusive_;
};

}  // namespace ev
}  // namespace group_embedding

#endif  // GROUP_EMBEDDING_OPS_KERNELS_EV_GROUP_LOCKS_H_

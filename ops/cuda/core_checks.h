#ifndef GROUP_EMBEDDING_OPS_CUDA_CORE_CHECKS_H_
#define GROUP_EMBEDDING_OPS_CUDA_CORE_CHECKS_H_

// Host-side checks of the core's arguments and the per-group prefix
// arrays every kernel reads, shared by the CUDA core and its host
// stand-in so that both accept and refuse exactly the same calls.
// Only sizes the caller states are checked here; what lives in device
// memory (ids, row_splits, positions) is checked by the kernels.

#include <stdint.h>

#include <cmath>
#include <limits>
#include <vector>

#include "embedding_math.h"
#include "group_embedding_cuda.h"

namespace ge_core {

// Widest row: 32 lanes x 8 chunks x 4 floats (1024) on the vectorised
// path, 32 x 8 floats (256) on the scalar one (rows not 16-byte aligned).
constexpr int64_t kMaxDimVec4 = 1024;
constexpr int64_t kMaxDimScalar = 256;
// Occurrences of one call are numbered in 32 bits (cub's item count).
constexpr int64_t kMaxOccurrences = (int64_t{1} << 31) - 1;

enum Need : unsigned {
  kOut = 1,         // forward output
  kGrad = 2,        // backward input
  kSequence = 4,    // positions / seq_len
  kWeightGrad = 8,  // pooled + weight_grad of weighted tables
  kTableRows = 16,  // reads table rows
  kRowsByPosition = 32,  // GE_ROWS_BY_POSITION is allowed
  kPlainRows = 64,  // one id per row, no positions (ge_clip_grads)
};

// Prefix arrays of a group: table t's units (output rows) are
// [unit_base[t], unit_base[t + 1]), its occurrences (ids) are
// [occ_base[t], occ_base[t + 1]) of the call's numbering and its rows
// are keys [row_base[t], row_base[t + 1]) of the deduplication.
struct GroupPlan {
  std::vector<int64_t> unit_base, occ_base, row_base;
  int64_t units() const { return unit_base.back(); }
  int64_t occurrences() const { return occ_base.back(); }
  int64_t rows() const { return row_base.back(); }
};

inline bool AddChecked(int64_t a, int64_t b, int64_t* out) {
  if (b > std::numeric_limits<int64_t>::max() - a) return false;
  *out = a + b;
  return true;
}

// Validates the tables of a call and fills `plan`; GE_OK or a GE_ERR_*.
inline int CheckTables(const GeTable* tables, int n, int64_t dim,
                       unsigned need, GroupPlan* plan) {
  if (tables == nullptr || n < 1 || dim < 0) return GE_ERR_ARGUMENT;
  if (dim > kMaxDimVec4) return GE_ERR_TOO_LARGE;
  plan->unit_base.assign(n + 1, 0);
  plan->occ_base.assign(n + 1, 0);
  plan->row_base.assign(n + 1, 0);
  for (int t = 0; t < n; ++t) {
    const GeTable& x = tables[t];
    if (x.vocab < 0 || x.nnz < 0 || x.batch < 0) return GE_ERR_ARGUMENT;
    if (x.combiner < GE_SUM || x.combiner > GE_SQRTN) return GE_ERR_ARGUMENT;
    const int32_t allowed = (need & kRowsByPosition) ? GE_ROWS_BY_POSITION : 0;
    if ((x.flags & ~allowed) != 0) return GE_ERR_ARGUMENT;
    // Rows by position: one row per id (the row count is `vocab`).
    if ((x.flags & GE_ROWS_BY_POSITION) && x.weights != nullptr &&
        x.vocab < x.nnz) {
      return GE_ERR_ARGUMENT;
    }
    if ((need & kPlainRows) &&
        (x.splits != nullptr || x.positions != nullptr)) {
      return GE_ERR_ARGUMENT;
    }
    if (x.nnz > 0 && x.ids == nullptr) return GE_ERR_ARGUMENT;
    if (x.splits == nullptr ? x.batch != x.nnz
                            : (x.batch == 0 && x.nnz != 0)) {
      return GE_ERR_ARGUMENT;
    }
    const bool rows_read = x.nnz > 0 && dim > 0 && x.vocab > 0;
    if ((need & kTableRows) && rows_read && x.table == nullptr) {
      return GE_ERR_ARGUMENT;
    }
    // Backward calls take pooled and sequence tables (positions set).
    const bool sequence =
        (need & kSequence) ||
        ((need & (kGrad | kWeightGrad)) && x.positions != nullptr);
    int64_t block = dim;  // floats of one row of out / grad
    if (sequence) {
      if (x.seq_len < 0 || (x.nnz > 0 && x.positions == nullptr)) {
        return GE_ERR_ARGUMENT;
      }
      if (x.seq_len > 0 && dim > std::numeric_limits<int64_t>::max() /
                                     x.seq_len) {
        return GE_ERR_TOO_LARGE;
      }
      block = x.seq_len * dim;
    }
    const bool has_rows = x.batch > 0 && block > 0;
    if ((need & kOut) && has_rows &&
        (x.out == nullptr || x.out_stride < block)) {
      return GE_ERR_ARGUMENT;
    }
    if ((need & kGrad) && has_rows &&
        (x.grad == nullptr || x.grad_stride < block)) {
      return GE_ERR_ARGUMENT;
    }
    if ((need & kWeightGrad) && x.weights != nullptr && x.nnz > 0) {
      if (x.weight_grad == nullptr || x.grad == nullptr) {
        return GE_ERR_ARGUMENT;
      }
      if (!sequence && x.combiner != GE_SUM && x.batch > 0 &&
          dim > 0 && x.pooled == nullptr) {
        return GE_ERR_ARGUMENT;
      }
    }
    // Gradient rows are numbered in 32 bits in the sorted payload.
    if ((need & kGrad) &&
        (x.batch > (int64_t{1} << 32) ||
         (sequence && x.seq_len > 0 &&
          x.batch > ((int64_t{1} << 32) - 1) / x.seq_len))) {
      return GE_ERR_TOO_LARGE;
    }
    if (!AddChecked(plan->unit_base[t], x.batch, &plan->unit_base[t + 1]) ||
        !AddChecked(plan->occ_base[t], x.nnz, &plan->occ_base[t + 1]) ||
        !AddChecked(plan->row_base[t], x.vocab, &plan->row_base[t + 1])) {
      return GE_ERR_TOO_LARGE;
    }
  }
  if (plan->occurrences() > kMaxOccurrences) return GE_ERR_TOO_LARGE;
  // The all-ones sentinel key must stay above every row key.
  if (plan->rows() >= std::numeric_limits<int64_t>::max()) {
    return GE_ERR_TOO_LARGE;
  }
  return GE_OK;
}

// Slot pointers an optimizer needs, on every table it updates.
inline int CheckOptimizer(const GeTable* tables, int n,
                          const GeOptimizerConfig* o) {
  if (o == nullptr || o->kind < GE_OPT_SGD || o->kind > GE_OPT_ADAGRAD_DECAY) {
    return GE_ERR_ARGUMENT;
  }
  const int slots = ge_math::SlotsOf(o->kind);
  for (int t = 0; t < n; ++t) {
    if (tables[t].nnz == 0) continue;
    if ((slots >= 1 && tables[t].slot0 == nullptr) ||
        (slots >= 2 && tables[t].slot1 == nullptr)) {
      return GE_ERR_ARGUMENT;
    }
  }
  return GE_OK;
}

// The checks of ge_check_ids before its scratch size: the ids' layout
// alone (dim 0: no row is read or written), and a seq_len wherever there
// are positions.
inline int CheckIdsCall(const GeTable* tables, int n,
                        const unsigned long long* errors, GroupPlan* plan) {
  const int status = CheckTables(tables, n, 0, 0u, plan);
  if (status != GE_OK) return status;
  for (int t = 0; t < n; ++t) {
    if (tables[t].positions != nullptr && tables[t].seq_len < 0) {
      return GE_ERR_ARGUMENT;
    }
  }
  return errors == nullptr ? GE_ERR_ARGUMENT : GE_OK;
}

// The checks of a lookup call before its scratch size.
inline int CheckLookup(const GeTable* tables, int n, int64_t dim,
                       float max_norm, bool sequence,
                       const unsigned long long* errors, GroupPlan* plan) {
  const unsigned need = kOut | kTableRows | (sequence ? kSequence : 0u);
  const int status = CheckTables(tables, n, dim, need, plan);
  if (status != GE_OK) return status;
  if (errors == nullptr || !std::isfinite(max_norm)) return GE_ERR_ARGUMENT;
  return GE_OK;
}

// The checks of a backward call (optimizer != NULL: the fused apply)
// before its scratch size.
inline int CheckBackward(const GeTable* tables, int n, int64_t dim,
                         float max_norm, const GeOptimizerConfig* optimizer,
                         const int64_t* unique_ids, const float* unique_grads,
                         const int64_t* offsets,
                         const unsigned long long* errors, GroupPlan* plan) {
  unsigned need = kGrad;
  if (max_norm >= 0.0f || optimizer) need |= kTableRows;
  int status = CheckTables(tables, n, dim, need, plan);
  if (status != GE_OK) return status;
  if (optimizer) {
    status = CheckOptimizer(tables, n, optimizer);
  } else if (unique_ids == nullptr || offsets == nullptr ||
             (unique_grads == nullptr && dim > 0 &&
              plan->occurrences() > 0)) {
    status = GE_ERR_ARGUMENT;
  }
  if (status != GE_OK) return status;
  if (errors == nullptr || !std::isfinite(max_norm)) return GE_ERR_ARGUMENT;
  return GE_OK;
}

// The checks of a weight-gradient call before its scratch size: the
// gradient of each weighted table must cover its rows.
inline int CheckWeightGrads(const GeTable* tables, int n, int64_t dim,
                            float max_norm, const unsigned long long* errors,
                            GroupPlan* plan) {
  const int status = CheckTables(
      tables, n, dim, kWeightGrad | kTableRows | kRowsByPosition, plan);
  if (status != GE_OK) return status;
  for (int t = 0; t < n; ++t) {
    const GeTable& x = tables[t];
    const int64_t block = x.positions ? x.seq_len * dim : dim;
    if (x.weights && x.batch > 0 && block > 0 && x.grad_stride < block) {
      return GE_ERR_ARGUMENT;
    }
  }
  if (errors == nullptr || !std::isfinite(max_norm)) return GE_ERR_ARGUMENT;
  return GE_OK;
}

// The checks of a ge_clip_grads call before its scratch size: per table
// `nnz` ids, one gradient row each in, one out.
inline int CheckClipGrads(const GeTable* tables, int n, int64_t dim,
                          float max_norm, const unsigned long long* errors,
                          GroupPlan* plan) {
  const int status =
      CheckTables(tables, n, dim, kGrad | kOut | kTableRows | kPlainRows,
                  plan);
  if (status != GE_OK) return status;
  if (errors == nullptr || !std::isfinite(max_norm)) return GE_ERR_ARGUMENT;
  return GE_OK;
}

// The last check of the calls whose only scratch is their descriptors
// (the lookups, the ids check, the weight and clip gradients): `status`
// of their other checks when it is an error, else GE_ERR_SCRATCH when
// `scratch` holds fewer than ge_lookup_scratch_bytes(n) bytes. One
// helper, so that the CUDA core and its host stand-in refuse alike.
inline int CheckLookupScratch(int status, const void* scratch,
                              size_t scratch_bytes, int n) {
  if (status != GE_OK) return status;
  if (scratch == nullptr || scratch_bytes < ge_lookup_scratch_bytes(n)) {
    return GE_ERR_SCRATCH;
  }
  return GE_OK;
}

// Carves aligned blocks out of a scratch buffer; with a null base it
// only measures, so that *_scratch_bytes and the call use one layout.
class ScratchLayout {
 public:
  explicit ScratchLayout(void* base) : base_(static_cast<char*>(base)) {}
  template <typename T>
  T* Take(int64_t count) {
    used_ = (used_ + 255) & ~size_t{255};
    T* p = base_ ? reinterpret_cast<T*>(base_ + used_) : nullptr;
    used_ += static_cast<size_t>(count < 0 ? 0 : count) * sizeof(T);
    return p;
  }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

}  // namespace ge_core

#endif  // GROUP_EMBEDDING_OPS_CUDA_CORE_CHECKS_H_

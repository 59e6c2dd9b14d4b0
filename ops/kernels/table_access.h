#ifndef GROUP_EMBEDDING_OPS_KERNELS_TABLE_ACCESS_H_
#define GROUP_EMBEDDING_OPS_KERNELS_TABLE_ACCESS_H_

// Helpers shared by the kernels that read plain resource-variable tables
// (lookup, sequence, weight-gradient, clip and collective kernels): locking
// a group of variables, reading a table or its snapshot, and the
// per-unique-row gradients of a lookup's backward.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/util/work_sharder.h"
#include "id_map.h"
#include "op_checks.h"
#include "pooling.h"
#include "work_queue.h"

namespace group_embedding {

using ::tensorflow::Var;

// The table a weight-gradient kernel reads: a resource variable (held
// under its shared lock while this object lives), or the output of
// GroupEmbeddingTableSnapshot: the whole table (`by_position` false) or
// the rows of the ids, one per id (true). The snapshot form exists for
// graphs: TF's automatic control dependencies order every op that takes
// a resource before the next write to it, which makes it run every step;
// an op reading a snapshot is pruned when no weight gradient is wanted.
class TableRead {
 public:
  // `flag_input` < 0: `table_input` is a resource.
  ::tensorflow::Status Open(::tensorflow::OpKernelContext* ctx,
                            int table_input, int flag_input) {
    if (flag_input >= 0) {
      const ::tensorflow::Tensor& flag = ctx->input(flag_input);
      if (flag.dims() != 0 || flag.dtype() != ::tensorflow::DT_BOOL) {
        return ::tensorflow::errors::InvalidArgument(
            "by_position must be a bool scalar, got shape ",
            flag.shape().DebugString(), ".");
      }
      by_position_ = flag.scalar<bool>()();
      tensor_ = &ctx->input(table_input);
      return ::tensorflow::Status();
    }
    TF_RETURN_IF_ERROR(::tensorflow::LookupResource(
        ctx, ::tensorflow::HandleFromInput(ctx, table_input), &var_));
    // One table at a time and no thread pool: nothing waits on the lock.
    lock_.emplace(*var_->mu());
    tensor_ = var_->tensor();
    return ::tensorflow::Status();
  }
  const ::tensorflow::Tensor* tensor() const { return tensor_; }

  // Checks that every id has a row: in range of the table, or one row
  // per id for a snapshot by position.
  ::tensorflow::Status CheckIds(const std::string& name,
                                const ::tensorflow::Tensor& ids) const {
    const int64_t rows = tensor_->dim_size(0);
    if (by_position_) {
      if (rows != ids.NumElements()) {
        return ::tensorflow::errors::InvalidArgument(
            name, ": the snapshot has ", rows, " rows for ",
            ids.NumElements(), " ids.");
      }
      return ::tensorflow::Status();
    }
    const auto v = ids.flat<int64_t>();
    for (int64_t j = 0; j < v.size(); ++j) {
      if (v(j) < 0 || v(j) >= rows) {
        return ::tensorflow::errors::InvalidArgument(
            name, ": id ", v(j), " is out of range [0, ", rows,
            ") for this table.");
      }
    }
    return ::tensorflow::Status();
  }

  // The row id j reads (`v`: the ids).
  const float* Row(const int64_t* v, int64_t j) const {
    // Per id: `data()` skips the dtype check of `flat()` (callers checked
    // a float32 matrix once).
    const int64_t dim = tensor_->dim_size(1);
    return static_cast<const float*>(tensor_->data()) +
           (by_position_ ? j : v[j]) * dim;
  }

 private:
  ::tensorflow::core::RefCountPtr<Var> var_;
  std::optional<::tensorflow::tf_shared_lock> lock_;
  const ::tensorflow::Tensor* tensor_ = nullptr;
  bool by_position_ = false;
};

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

// The variables of inputs [0, k) (a group's tables), held under shared
// locks (SharedVarLocks: address order) from Open() until this object
// goes: what every kernel reading a group of tables takes first, before
// it hands work to the intra-op pool (work items never lock).
class LockedTables {
 public:
  ::tensorflow::Status Open(::tensorflow::OpKernelContext* ctx, int k) {
    refs_.resize(k);
    vars_.resize(k);
    for (int t = 0; t < k; ++t) {
      TF_RETURN_IF_ERROR(::tensorflow::LookupResource(
          ctx, ::tensorflow::HandleFromInput(ctx, t), &refs_[t]));
      vars_[t] = refs_[t].get();
    }
    locks_.emplace(vars_);
    return ::tensorflow::Status();
  }
  const std::vector<Var*>& vars() const { return vars_; }

 private:
  std::vector<::tensorflow::core::RefCountPtr<Var>> refs_;
  std::vector<Var*> vars_;
  std::optional<SharedVarLocks> locks_;  // released before refs_
};

// How a lookup kernel over a group of plain tables starts (the CPU
// pooled, concat and sequence kernels): `names` holds one name per table
// (k of them); the group's ragged inputs are read and checked
// (ReadRaggedGroup with `lists`), then the tables locked for reading and
// each checked to be float32 [vocab, dim], all before any row is read.
inline ::tensorflow::Status OpenPlainLookup(
    ::tensorflow::OpKernelContext* ctx, const std::vector<std::string>& names,
    int k, unsigned lists, int64_t dim, RaggedGroup* in,
    LockedTables* locked) {
  if (static_cast<int>(names.size()) != k) {
    return ::tensorflow::errors::InvalidArgument(
        "table_names must have ", k, " entries, got ", names.size(), ".");
  }
  TF_RETURN_IF_ERROR(ReadRaggedGroup(
      ctx, "ids", lists, dim, [&names](int t) { return names[t]; }, in));
  TF_RETURN_IF_ERROR(locked->Open(ctx, k));
  for (int t = 0; t < k; ++t) {
    TF_RETURN_IF_ERROR(
        CheckFloatTable(names[t], *locked->vars()[t]->tensor(), dim));
  }
  return ::tensorflow::Status();
}

// How every per-unique-row backward starts, for one table: the slot of
// each of the `nnz` ids `v` (first-occurrence order) into `slot`; output
// `t` of `uniq_out` allocated and holding the distinct ids; output `t` of
// `grad_out` allocated `[distinct, dim]` at `*sums`, for the caller to
// fill.
inline ::tensorflow::Status DedupToGradOutputs(
    const int64_t* v, int64_t nnz, int64_t dim, int t,
    ::tensorflow::OpOutputList* uniq_out,
    ::tensorflow::OpOutputList* grad_out, std::vector<int64_t>* slot,
    float** sums) {
  const std::vector<int64_t> keys = NumberIds(v, nnz, slot);
  const int64_t u = keys.size();
  ::tensorflow::Tensor* uo = nullptr;
  ::tensorflow::Tensor* go = nullptr;
  TF_RETURN_IF_ERROR(
      uniq_out->allocate(t, ::tensorflow::TensorShape({u}), &uo));
  TF_RETURN_IF_ERROR(
      grad_out->allocate(t, ::tensorflow::TensorShape({u, dim}), &go));
  std::copy(keys.begin(), keys.end(), uo->flat<int64_t>().data());
  *sums = go->flat<float>().data();
  return ::tensorflow::Status();
}

// The per-unique-id backward of a lookup of K tables: for table t, its
// distinct ids into output t of `unique_ids` and their summed gradients
// into output t of `id_grads` ([distinct, dim]), summed by the one
// gradient loop (SumIdGrads, pooling.h) over `grad_table(t)`, a GradTable.
// Sharded over tables, which write disjoint outputs.
template <typename GradTableOf>
::tensorflow::Status SumIdGradsOfTables(::tensorflow::OpKernelContext* ctx,
                                        const ::tensorflow::OpInputList& ids,
                                        int64_t dim, GradTableOf grad_table) {
  ::tensorflow::OpOutputList uniq_out, grad_out;
  TF_RETURN_IF_ERROR(ctx->output_list("unique_ids", &uniq_out));
  TF_RETURN_IF_ERROR(ctx->output_list("id_grads", &grad_out));
  const int k = ids.size();
  std::vector<::tensorflow::Status> status(k);  // one writer per entry
  // Tables by their id counts (criteo-like: 4k one-hot ids next to 40k
  // multi-hot), largest first.
  std::vector<int64_t> costs(k);
  for (int t = 0; t < k; ++t) costs[t] = ids[t].NumElements() * (dim + 8);
  RunUneven(ctx, costs, [&](int64_t t) {
    std::vector<int64_t> slot;
    float* sums = nullptr;
    status[t] = DedupToGradOutputs(ids[t].flat<int64_t>().data(),
                                   ids[t].NumElements(), dim, t, &uniq_out,
                                   &grad_out, &slot, &sums);
    if (!status[t].ok()) return;
    SumIdGrads(grad_table(static_cast<int>(t)), slot.data(),
               grad_out[t]->dim_size(0), dim, sums);
  });
  for (const auto& st : status) TF_RETURN_IF_ERROR(st);
  return ::tensorflow::Status();
}

// The inputs of GroupEmbeddingTableSnapshot, read alike by its CPU kernel
// (weight_grad_ops.cc) and its GPU kernel (cuda/tf_gpu_kernels.cc): the
// variable of input 0 and the ids of input 1, which must be a vector. The
// caller takes the variable's lock.
inline ::tensorflow::Status SnapshotInputs(
    ::tensorflow::OpKernelContext* ctx, const std::string& name,
    ::tensorflow::core::RefCountPtr<Var>* var, const ::tensorflow::Tensor** ids) {
  TF_RETURN_IF_ERROR(::tensorflow::LookupResource(
      ctx, ::tensorflow::HandleFromInput(ctx, 0), var));
  *ids = &ctx->input(1);
  if ((*ids)->dims() != 1) {
    return ::tensorflow::errors::InvalidArgument(
        name, ": ids must be a vector, got shape ",
        (*ids)->shape().DebugString(), ".");
  }
  return ::tensorflow::Status();
}

// The inputs of GroupEmbeddingClipGrad (the max_norm clip's backward),
// read alike by its CPU kernel (clip_grad_ops.cc) and its GPU kernel
// (cuda/tf_gpu_kernels.cc): each table's distinct ids and their summed
// gradients, the tables locked for reading from Open() on.
class ClipGradInputs {
 public:
  ::tensorflow::Status Open(::tensorflow::OpKernelContext* ctx) {
    TF_RETURN_IF_ERROR(ctx->input_list("unique_ids", &uniq_));
    TF_RETURN_IF_ERROR(ctx->input_list("id_grads", &grads_));
    return locked_.Open(ctx, uniq_.size());
  }
  int size() const { return uniq_.size(); }
  const ::tensorflow::Tensor& unique_ids(int t) const { return uniq_[t]; }
  const ::tensorflow::Tensor& id_grads(int t) const { return grads_[t]; }

  // Table t ("table t" in errors): a float32 [vocab, dim] table of the
  // group's dim (*dim, set by the first table), distinct ids in a vector,
  // gradients [distinct, dim]. Output t is where the clipped gradients go:
  // the incoming ones' buffer when TF lets us rewrite it (they are dead
  // after this op), else a new tensor (`*copied` false: the caller copies
  // the gradients in first).
  ::tensorflow::Status Table(::tensorflow::OpKernelContext* ctx, int t,
                             int64_t* dim, const ::tensorflow::Tensor** table,
                             ::tensorflow::Tensor** out) const {
    const std::string name = absl::StrCat("table ", t);
    *table = locked_.vars()[t]->tensor();
    TF_RETURN_IF_ERROR(CheckFloatTable(name, **table, *dim));
    *dim = (*table)->dim_size(1);
    if (uniq_[t].dims() != 1) {
      return ::tensorflow::errors::InvalidArgument(
          name, ": unique_ids must be a vector, got shape ",
          uniq_[t].shape().DebugString(), ".");
    }
    TF_RETURN_IF_ERROR(CheckMatrix(name + ": id_grads", grads_[t],
                                   uniq_[t].NumElements(), *dim));
    return ctx->forward_input_or_allocate_output({2 * size() + t}, t,
                                                 grads_[t].shape(), out);
  }

 private:
  ::tensorflow::OpInputList uniq_, grads_;
  LockedTables locked_;
};

}  // namespace group_embedding

#endif  // GROUP_EMBEDDING_OPS_KERNELS_TABLE_ACCESS_H_

// CPU kernels of the fused pooled lookup of a group of plain resource-
// variable tables (GroupEmbeddingPooledLookup; GroupEmbeddingConcatLookup
// writes the K pooled tables side by side into one [B, K * D] output) and
// of its backward, per-unique-id gradients ready for IndexedSlices.
// Python: ops/lookup_kernels.py (calls) and ops/lookup_gradients.py.
//
// Why custom kernels: stock TF has no op that gathers from several resource
// variables at once, and its per-table chain (unique, gather, gather,
// segment reduce) materialises [nnz, D] tensors several times. These
// kernels pool straight from the tables into [B, D] outputs (the pooling
// core of pooling.h) and shard the work over TF's intra-op thread pool.
//
// Locking: the lookup takes shared locks on all its tables (address order,
// SharedVarLocks) before handing work to the pool; work items never lock.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"
#include "pooling.h"
#include "table_access.h"
#include "op_registration.h"

namespace group_embedding {
namespace {

// ---------------------------------------------------------------------------
// Forward: pooled lookup of K ragged id batches from K tables.
// ---------------------------------------------------------------------------
GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingPooledLookup", "GroupEmbeddingVariableLookup",
    .Input("tables: num_tables * resource")
    .Input("ids: num_tables * int64")
    .Input("row_splits: num_tables * int64")
    .Input("weights: num_tables * float")
    .Output("pooled: num_tables * float")
    .Attr("num_tables: int >= 1")
    .Attr("combiners: list(string)")
    .Attr("table_names: list(string)")
    // 0 is allowed: a [vocab, 0] table pools to [B, 0], as stock does.
    .Attr("embedding_dim: int >= 0")
    // Rows are clipped to this L2 norm before pooling; < 0: no clipping.
    .Attr("max_norm: float = -1")
    // ids_checked: see IdsCheckedAttr (op_checks.h); here, a
    // GroupEmbeddingCheckIds of the same step checked these ids.
    .Attr("ids_checked: bool = false")
    .SetShapeFn([](InferenceContext* c) {
      int n;
      int64_t dim;
      TF_RETURN_IF_ERROR(GetGroupAttrs(c, &n, &dim));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 0, n, 0));
      TF_RETURN_IF_ERROR(InputsWithRank(c, n, 3 * n, 1));
      for (int i = 0; i < n; ++i) {
        TF_RETURN_IF_ERROR(SetPooledShape(c, i, 2 * n + i, dim));
      }
      return Status();
    }));

// The same lookup writing all K tables side by side into ONE [B, K * D]
// output (table t in columns [t * D, (t + 1) * D)), i.e. what
// `tf.concat(outputs, 1)` would give, without that copy nor the split of
// its gradient. All tables must have the same batch size.
REGISTER_OP("GroupEmbeddingConcatLookup")
    .Input("tables: num_tables * resource")
    .Input("ids: num_tables * int64")
    .Input("row_splits: num_tables * int64")
    .Input("weights: num_tables * float")
    .Output("pooled: float")
    .Attr("num_tables: int >= 1")
    .Attr("combiners: list(string)")
    .Attr("table_names: list(string)")
    .Attr("embedding_dim: int >= 0")
    .Attr("max_norm: float = -1")
    .Attr("ids_checked: bool = false")
    .SetShapeFn([](InferenceContext* c) {
      int n;
      int64_t dim;
      TF_RETURN_IF_ERROR(GetGroupAttrs(c, &n, &dim));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 0, n, 0));
      TF_RETURN_IF_ERROR(InputsWithRank(c, n, 3 * n, 1));
      return SetPooledShape(c, 0, 2 * n, n * dim);
    });

class GroupEmbeddingPooledLookupOp : public OpKernel {
 public:
  explicit GroupEmbeddingPooledLookupOp(OpKernelConstruction* ctx)
      : OpKernel(ctx),
        concat_(ctx->def().op() == "GroupEmbeddingConcatLookup") {
    OP_REQUIRES_OK(ctx, ParseCombiners(ctx, &combiners_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table_names", &table_names_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("embedding_dim", &dim_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_tables", &num_tables_));
    OP_REQUIRES_OK(ctx, GetMaxNorm(ctx, &max_norm_));
  }

  void Compute(OpKernelContext* ctx) override {
    const int k = num_tables_;
    OP_REQUIRES(ctx, static_cast<int>(combiners_.size()) == k,
                InvalidArgument("combiners must have ", k, " entries."));
    // Ids are range-checked by the (parallel) pooling below, before any
    // row is read: a serial pass over every id cost ~15% of the op.
    RaggedGroup in;
    LockedTables locked;
    OP_REQUIRES_OK(ctx, OpenPlainLookup(ctx, table_names_, k, kWithWeights,
                                        dim_, &in, &locked));
    const std::vector<Var*>& vars = locked.vars();

    // Tables may have different batch sizes (dense lookups of any shape);
    // `first_row[t]` numbers the output rows of all tables consecutively.
    std::vector<int64_t> vocabs(k);
    std::vector<int64_t> first_row(k + 1, 0);
    std::vector<PooledTable<TableRows>> pooled(k);
    int64_t total_nnz = 0;
    for (int t = 0; t < k; ++t) {
      const Tensor* table = vars[t]->tensor();
      first_row[t + 1] = first_row[t] + in.batch(t);
      total_nnz += in.nnz(t);
      vocabs[t] = table->dim_size(0);
      pooled[t].rows = {table->flat<float>().data(),
                        in.ids[t].flat<int64_t>().data(),
                        static_cast<uint64_t>(vocabs[t]), dim_};
      pooled[t].splits = in.splits[t].flat<int64_t>().data();
      pooled[t].weights = in.weight_data(t);
      pooled[t].nnz = in.nnz(t);
      pooled[t].dim = dim_;
      pooled[t].combiner = combiners_[t];
    }
    if (concat_) {
      OP_REQUIRES_OK(ctx, CheckSameBatch(table_names_, in.splits));
      Tensor* o = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(
                              0, TensorShape({first_row[1], k * dim_}), &o));
      for (int t = 0; t < k; ++t) {
        pooled[t].out = o->flat<float>().data() + t * dim_;
        pooled[t].stride = k * dim_;
      }
    } else {
      OpOutputList out;
      OP_REQUIRES_OK(ctx, ctx->output_list("pooled", &out));
      for (int t = 0; t < k; ++t) {
        Tensor* o = nullptr;
        const int64_t batch = first_row[t + 1] - first_row[t];
        OP_REQUIRES_OK(ctx, out.allocate(t, TensorShape({batch, dim_}), &o));
        pooled[t].out = o->flat<float>().data();
        pooled[t].stride = dim_;
      }
    }
    const int64_t total_rows = first_row[k];
    if (total_rows == 0) return;

    // An out-of-range id is skipped (never read) and reported.
    const int64_t avg = total_nnz / total_rows + 1;
    const Refused bad = PoolTables(ctx, pooled, first_row, max_norm_,
                                   avg * dim_ * 4 + 20);
    if (bad.any()) {
      const int t = bad.table;
      const int64_t j = bad.pos;
      ctx->SetStatus(InvalidArgument(
          table_names_[t], ": id ", in.ids[t].flat<int64_t>()(j),
          " is out of range [0, ", vocabs[t], ") for this table."));
    }
  }

 private:
  const bool concat_;
  std::vector<Combiner> combiners_;
  std::vector<std::string> table_names_;
  int64_t dim_;
  int num_tables_;
  float max_norm_;
};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingPooledLookup", "GroupEmbeddingVariableLookup",
    GroupEmbeddingPooledLookupOp);
REGISTER_KERNEL_BUILDER(Name("GroupEmbeddingConcatLookup").Device(DEVICE_CPU),
                        GroupEmbeddingPooledLookupOp);

// ---------------------------------------------------------------------------
// Backward: per table, unique ids (first-occurrence order) and the summed
// gradient of each, ready to be returned as IndexedSlices.
// ---------------------------------------------------------------------------
GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingPooledLookupGrad", "GroupEmbeddingVariableLookupGrad",
    .Input("grads: num_tables * float")
    .Input("ids: num_tables * int64")
    .Input("row_splits: num_tables * int64")
    .Input("weights: num_tables * float")
    .Output("unique_ids: num_tables * int64")
    .Output("id_grads: num_tables * float")
    .Attr("num_tables: int >= 1")
    .Attr("combiners: list(string)")
    .Attr("embedding_dim: int >= 0")
    // ids_checked: see IdsCheckedAttr (op_checks.h).
    .Attr("ids_checked: bool = false")
    .SetShapeFn([](InferenceContext* c) {
      int n;
      int64_t dim;
      TF_RETURN_IF_ERROR(GetGroupAttrs(c, &n, &dim));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 0, n, 2));
      TF_RETURN_IF_ERROR(InputsWithRank(c, n, 3 * n, 1));
      UniqueGradOutputShapes(c, n, dim);
      return Status();
    }));

// The backward of GroupEmbeddingConcatLookup: the same outputs from the
// gradient of the concatenated [B, K * D] output.
REGISTER_OP("GroupEmbeddingConcatLookupGrad")
    .Input("grads: float")
    .Input("ids: num_tables * int64")
    .Input("row_splits: num_tables * int64")
    .Input("weights: num_tables * float")
    .Output("unique_ids: num_tables * int64")
    .Output("id_grads: num_tables * float")
    .Attr("num_tables: int >= 1")
    .Attr("combiners: list(string)")
    .Attr("embedding_dim: int >= 0")
    // ids_checked: see IdsCheckedAttr (op_checks.h).
    .Attr("ids_checked: bool = false")
    .SetShapeFn([](InferenceContext* c) {
      int n;
      int64_t dim;
      TF_RETURN_IF_ERROR(GetGroupAttrs(c, &n, &dim));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 0, 1, 2));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 1, 3 * n, 1));
      UniqueGradOutputShapes(c, n, dim);
      return Status();
    });

class GroupEmbeddingPooledLookupGradOp : public OpKernel {
 public:
  explicit GroupEmbeddingPooledLookupGradOp(OpKernelConstruction* ctx)
      : OpKernel(ctx),
        concat_(ctx->def().op() == "GroupEmbeddingConcatLookupGrad") {
    OP_REQUIRES_OK(ctx, ParseCombiners(ctx, &combiners_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("embedding_dim", &dim_));
  }

  void Compute(OpKernelContext* ctx) override {
    RaggedGroup in;
    OP_REQUIRES_OK(ctx, ReadRaggedGroup(ctx, "ids", kWithWeights, dim_, &in));
    const int k = in.size();
    OP_REQUIRES(ctx, static_cast<int>(combiners_.size()) == k,
                InvalidArgument("combiners must have ", k, " entries, got ",
                                combiners_.size(), "."));
    // Per table, where its gradient rows are (read only here).
    std::vector<PooledGrads> grad_rows(k);
    if (concat_) {
      OP_REQUIRES_OK(ctx, CheckSameBatch({}, in.splits));
      const Tensor& g = ctx->input(0);
      OP_REQUIRES_OK(ctx, CheckMatrix("grads", g, in.batch(0), k * dim_));
      for (int t = 0; t < k; ++t) {
        grad_rows[t] = {g.flat<float>().data() + t * dim_, k * dim_};
      }
    } else {
      OpInputList grads;
      OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
      for (int t = 0; t < k; ++t) {
        OP_REQUIRES_OK(ctx, CheckMatrix(absl::StrCat("table ", t, ": grads"),
                                        grads[t], in.batch(t), dim_));
        grad_rows[t] = {grads[t].flat<float>().data(), dim_};
      }
    }
    OP_REQUIRES_OK(ctx, SumIdGradsOfTables(ctx, in.ids, dim_, [&](int t) {
                     return MakeGradTable(grad_rows[t], in.splits[t],
                                          in.weights[t], in.nnz(t),
                                          combiners_[t]);
                   }));
  }

 private:
  const bool concat_;
  std::vector<Combiner> combiners_;
  int64_t dim_;
};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingPooledLookupGrad", "GroupEmbeddingVariableLookupGrad",
    GroupEmbeddingPooledLookupGradOp);
REGISTER_KERNEL_BUILDER(Name("GroupEmbeddingConcatLookupGrad")
                            .Device(DEVICE_CPU),
                        GroupEmbeddingPooledLookupGradOp);

}  // namespace
}  // namespace group_embedding

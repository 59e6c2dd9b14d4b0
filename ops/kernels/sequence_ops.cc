// CPU kernels of the unpooled (is_sequence=True) fused lookup of a group of
// plain resource-variable tables: each id's row lands at [row, position]
// of a padded [B, T, D] output, times its weight, clipped to max_norm when
// asked. The backward returns per-unique-id gradients (IndexedSlices), so
// neither direction materialises [nnz, D] (stock would gather [nnz, D]
// rows and scatter them into the padded output).
//
// Gradients are registered in fused_lookup.py; max_norm's backward is the
// GroupEmbeddingClipGrad op of clip_grad_ops.cc; the weights' gradients
// are in weight_grad_ops.cc.

#include <algorithm>
#include <cstdint>
#include <cstring>
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

namespace group_embedding {
namespace {

// ---------------------------------------------------------------------------
// Forward: out[t][b, positions[j], :] += w_j * clip(table_t[ids[j]]) for
// every id j of row b; zeros elsewhere.
// ---------------------------------------------------------------------------
REGISTER_OP("GroupEmbeddingSequenceLookup")
    .Input("tables: num_tables * resource")
    .Input("ids: num_tables * int64")
    .Input("row_splits: num_tables * int64")
    .Input("positions: num_tables * int64")
    .Input("max_lens: num_tables * int64")
    .Input("weights: num_tables * float")
    .Output("sequences: num_tables * float")
    .Attr("num_tables: int >= 1")
    .Attr("table_names: list(string)")
    .Attr("embedding_dim: int >= 0")
    // Rows are clipped to this L2 norm before weighting; < 0: no clipping.
    .Attr("max_norm: float = -1")
    // ids_checked: see IdsCheckedAttr (op_checks.h).
    .Attr("ids_checked: bool = false")
    .SetShapeFn([](InferenceContext* c) {
      int n;
      int64_t dim;
      TF_RETURN_IF_ERROR(GetGroupAttrs(c, &n, &dim));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 0, n, 0));      // tables
      TF_RETURN_IF_ERROR(InputsWithRank(c, n, 3 * n, 1));  // ids..positions
      TF_RETURN_IF_ERROR(InputsWithRank(c, 4 * n, n, 0));  // max_lens
      TF_RETURN_IF_ERROR(InputsWithRank(c, 5 * n, n, 1));  // weights
      return SequenceOutputShapes(c, n, dim);
    });

class GroupEmbeddingSequenceLookupOp : public OpKernel {
 public:
  explicit GroupEmbeddingSequenceLookupOp(OpKernelConstruction* ctx)
      : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table_names", &table_names_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("embedding_dim", &dim_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_tables", &num_tables_));
    OP_REQUIRES_OK(ctx, GetMaxNorm(ctx, &max_norm_));
  }

  void Compute(OpKernelContext* ctx) override {
    const int k = num_tables_;
    RaggedGroup in;
    LockedTables locked;
    OP_REQUIRES_OK(ctx, OpenPlainLookup(ctx, table_names_, k,
                                        kWithWeights | kWithMaxLens, dim_,
                                        &in, &locked));
    const std::vector<Var*>& vars = locked.vars();

    std::vector<int64_t> first_row(k + 1, 0);
    int64_t total_nnz = 0, total_slots = 0;
    OpOutputList out;
    OP_REQUIRES_OK(ctx, ctx->output_list("sequences", &out));
    std::vector<SequenceTable<TableRows>> sequences(k);
    for (int t = 0; t < k; ++t) {
      const std::string& name = table_names_[t];
      const Tensor* table = vars[t]->tensor();
      // Every id is read: range-checked here, before any row is.
      const int64_t* ids = in.ids[t].flat<int64_t>().data();
      OP_REQUIRES_OK(ctx, CheckIdRange(name, ids, in.nnz(t),
                                       table->dim_size(0)));
      Tensor* o = nullptr;
      OP_REQUIRES_OK(ctx, out.allocate(t, in.sequence_shapes[t], &o));
      const int64_t batch = in.batch(t);
      first_row[t + 1] = first_row[t] + batch;
      total_nnz += in.nnz(t);
      total_slots += batch * in.lens[t];
      sequences[t] = {{table->flat<float>().data(), ids,
                       static_cast<uint64_t>(table->dim_size(0)), dim_},
                      in.splits[t].flat<int64_t>().data(),
                      in.positions[t].flat<int64_t>().data(),
                      in.weight_data(t),
                      in.nnz(t),
                      in.lens[t],
                      o->flat<float>().data()};
    }
    const int64_t total_rows = first_row[k];
    if (total_rows == 0 || dim_ == 0) return;
    ScatterSequences(ctx, sequences, first_row, dim_, max_norm_,
                     ((total_slots + total_nnz) / total_rows + 1) * dim_ * 3);
  }

 private:
  std::vector<std::string> table_names_;
  int64_t dim_;
  int num_tables_;
  float max_norm_;
};

REGISTER_KERNEL_BUILDER(Name("GroupEmbeddingSequenceLookup")
                            .Device(DEVICE_CPU),
                        GroupEmbeddingSequenceLookupOp);

// ---------------------------------------------------------------------------
// Backward: per table, the unique ids (first-occurrence order) and, for
// each, sum_j w_j * grads[b_j, positions[j], :] over its occurrences j:
// the gradient of the (clipped) rows, [unique, D], never [nnz, D].
// ---------------------------------------------------------------------------
REGISTER_OP("GroupEmbeddingSequenceLookupGrad")
    .Input("grads: num_tables * float")
    .Input("ids: num_tables * int64")
    .Input("row_splits: num_tables * int64")
    .Input("positions: num_tables * int64")
    .Input("weights: num_tables * float")
    .Output("unique_ids: num_tables * int64")
    .Output("id_grads: num_tables * float")
    .Attr("num_tables: int >= 1")
    .Attr("embedding_dim: int >= 0")
    // ids_checked: see IdsCheckedAttr (op_checks.h).
    .Attr("ids_checked: bool = false")
    .SetShapeFn([](InferenceContext* c) {
      int n;
      int64_t dim;
      TF_RETURN_IF_ERROR(GetGroupAttrs(c, &n, &dim));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 0, n, 3));
      TF_RETURN_IF_ERROR(InputsWithRank(c, n, 4 * n, 1));
      UniqueGradOutputShapes(c, n, dim);
      return Status();
    });

class GroupEmbeddingSequenceLookupGradOp : public OpKernel {
 public:
  explicit GroupEmbeddingSequenceLookupGradOp(OpKernelConstruction* ctx)
      : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("embedding_dim", &dim_));
  }

  void Compute(OpKernelContext* ctx) override {
    RaggedGroup in;
    OP_REQUIRES_OK(ctx, ReadRaggedGroup(ctx, "ids",
                                        kWithWeights | kWithPositions, dim_,
                                        &in));
    OpInputList grads;
    OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
    const int k = in.size();
    std::vector<int64_t> lens(k);
    for (int t = 0; t < k; ++t) {
      // T is the gradient's: the positions are checked against it.
      const std::string name = absl::StrCat("table ", t);
      OP_REQUIRES_OK(ctx, CheckSequenceGrad(name, grads[t], in.batch(t), dim_,
                                            &lens[t]));
      OP_REQUIRES_OK(ctx, CheckPositions(name, in.positions[t], in.nnz(t),
                                         lens[t]));
    }
    // No combiner (kSum: every factor is the id's weight).
    OP_REQUIRES_OK(ctx, SumIdGradsOfTables(ctx, in.ids, dim_, [&](int t) {
                     const SequenceGrads g{
                         grads[t].flat<float>().data(),
                         in.positions[t].flat<int64_t>().data(), lens[t],
                         dim_};
                     return MakeGradTable(g, in.splits[t], in.weights[t],
                                          in.nnz(t), kSum);
                   }));
  }

 private:
  int64_t dim_;
};

REGISTER_KERNEL_BUILDER(Name("GroupEmbeddingSequenceLookupGrad")
                            .Device(DEVICE_CPU),
                        GroupEmbeddingSequenceLookupGradOp);

}  // namespace
}  // namespace group_embedding

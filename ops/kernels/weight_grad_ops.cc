// Gradients w.r.t. the per-id weights of the plain-variable lookups,
// pooled (GroupEmbeddingWeightGrad*) and sequence
// (GroupEmbeddingSequenceWeightGrad*), and GroupEmbeddingTableSnapshot,
// the consistent view of a table they read. Python: the gradient functions
// of ops/lookup_gradients.py build the *FromSnapshots forms.
//
// The forms that read the resource variables directly have no library
// caller since the snapshot forms replaced them; they stay registered
// because training graphs saved before (TF1 MetaGraphs) name them, and
// they are tested (tests/group_embedding/test_kernel_hardening.py,
// tests/group_embedding/test_weight_grad_pruning.py, and as the CPU oracle
// of tests/ops/test_cuda_core.py).

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
#include "weight_grad.h"

namespace group_embedding {
namespace {

// The shape function of the weight-gradient ops: the tables (rank-0
// resources; or, for the snapshot forms, rank-2 snapshots then their rank-0
// by_position flags), then kVectors rank-1 lists (ids .. weights, weights
// last), then kGradLists lists of rank kGradRank; output i has the shape
// of table i's weights.
template <bool kSnapshots, int kVectors, int kGradLists, int kGradRank>
Status WeightGradShapes(InferenceContext* c) {
  int n;
  TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &n));
  int at = n;
  if (kSnapshots) {
    TF_RETURN_IF_ERROR(InputsWithRank(c, 0, n, 2));
    TF_RETURN_IF_ERROR(InputsWithRank(c, n, n, 0));
    at = 2 * n;
  } else {
    TF_RETURN_IF_ERROR(InputsWithRank(c, 0, n, 0));
  }
  TF_RETURN_IF_ERROR(InputsWithRank(c, at, kVectors * n, 1));
  TF_RETURN_IF_ERROR(
      InputsWithRank(c, at + kVectors * n, kGradLists * n, kGradRank));
  const int weights = at + (kVectors - 1) * n;
  for (int i = 0; i < n; ++i) c->set_output(i, c->input(weights + i));
  return Status();
}

// ---------------------------------------------------------------------------
// Gradient w.r.t. the per-id weights (only for weighted tables):
//   pooled_b = sum_j w_j e_j / n_b,  n_b = 1 | sum_j w_j | sqrt(sum_j w_j^2)
//   d/dw_j = (e_j.g_b - pooled_b.g_b * dn_b/dw_j) / n_b
// Not marked stateful on purpose: when nothing differentiates the weights,
// graph pruning drops it instead of running a gather every step.
// ---------------------------------------------------------------------------
REGISTER_OP("GroupEmbeddingWeightGrad")
    .Input("tables: num_tables * resource")
    .Input("ids: num_tables * int64")
    .Input("row_splits: num_tables * int64")
    .Input("weights: num_tables * float")
    .Input("grads: num_tables * float")
    .Input("pooled: num_tables * float")
    .Output("weight_grads: num_tables * float")
    .Attr("num_tables: int >= 1")
    .Attr("combiners: list(string)")
    .Attr("max_norm: float = -1")
    .SetShapeFn(WeightGradShapes</*kSnapshots=*/false, 3, 2, 2>);

// The same reading GroupEmbeddingTableSnapshot outputs instead of the
// variables (see TableRead): what the gradient functions build.
REGISTER_OP("GroupEmbeddingWeightGradFromSnapshots")
    .Input("tables: num_tables * float")
    .Input("by_position: num_tables * bool")
    .Input("ids: num_tables * int64")
    .Input("row_splits: num_tables * int64")
    .Input("weights: num_tables * float")
    .Input("grads: num_tables * float")
    .Input("pooled: num_tables * float")
    .Output("weight_grads: num_tables * float")
    .Attr("num_tables: int >= 1")
    .Attr("combiners: list(string)")
    .Attr("max_norm: float = -1")
    // ids_checked: see IdsCheckedAttr (op_checks.h).
    .Attr("ids_checked: bool = false")
    .SetShapeFn(WeightGradShapes</*kSnapshots=*/true, 3, 2, 2>);

// A consistent view of a table for the weight-gradient ops, taken where
// the forward read it (before any optimizer write): the table itself,
// aliased as ReadVariableOp does (by_position false), unless the variable
// is in copy-on-read mode (stock sparse ops such as tf.gather or Keras'
// scatter updates use it); then aliasing would see later in-place writes
// and a full copy could cost far more than the step, so only the rows of
// `ids` are copied, one per id (by_position true).
REGISTER_OP("GroupEmbeddingTableSnapshot")
    .Input("table: resource")
    .Input("ids: int64")
    .Output("rows: float")
    .Output("by_position: bool")
    .Attr("table_name: string")
    // ids_checked: see IdsCheckedAttr (op_checks.h).
    .Attr("ids_checked: bool = false")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &unused));
      c->set_output(0, c->Matrix(c->UnknownDim(), c->UnknownDim()));
      c->set_output(1, c->Scalar());
      return Status();
    });

class GroupEmbeddingTableSnapshotOp : public OpKernel {
 public:
  explicit GroupEmbeddingTableSnapshotOp(OpKernelConstruction* ctx)
      : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table_name", &name_));
  }

  void Compute(OpKernelContext* ctx) override {
    RefCountPtr<Var> var;
    const Tensor* ids_in = nullptr;
    OP_REQUIRES_OK(ctx, SnapshotInputs(ctx, name_, &var, &ids_in));
    const Tensor& ids = *ids_in;
    tensorflow::tf_shared_lock lock(*var->mu());
    const Tensor* table = var->tensor();
    OP_REQUIRES_OK(ctx, CheckFloatTable(name_, *table));
    Tensor* flag = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &flag));
    const bool by_position = var->copy_on_read_mode.load();
    flag->scalar<bool>()() = by_position;
    if (!by_position) {
      ctx->set_output(0, *table);
      return;
    }
    const int64_t vocab = table->dim_size(0);
    const int64_t dim = table->dim_size(1);
    const int64_t n = ids.NumElements();
    const int64_t* v = ids.flat<int64_t>().data();
    OP_REQUIRES_OK(ctx, CheckIdRange(name_, v, n, vocab));
    Tensor* rows = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, dim}), &rows));
    const float* src = table->flat<float>().data();
    float* dst = rows->flat<float>().data();
    for (int64_t j = 0; j < n; ++j) {
      std::memcpy(dst + j * dim, src + v[j] * dim, sizeof(float) * dim);
    }
  }

 private:
  std::string name_;
};

REGISTER_KERNEL_BUILDER(Name("GroupEmbeddingTableSnapshot").Device(DEVICE_CPU),
                        GroupEmbeddingTableSnapshotOp);

// What the two weight-gradient kernels share: the attrs that tell the
// snapshot forms and max_norm, and the per-table loop around the table read.
class WeightGradKernel : public OpKernel {
 public:
  WeightGradKernel(OpKernelConstruction* ctx, const char* snapshot_op)
      : OpKernel(ctx), snapshots_(ctx->def().op() == snapshot_op) {
    OP_REQUIRES_OK(ctx, GetMaxNorm(ctx, &max_norm_));
  }

 protected:
  // Per table t of `in`: output t shaped like its weights, left empty for
  // an unweighted table; for a weighted one, its table (input t) or its
  // snapshot (inputs t and k + t) is read, checked as a float32 matrix
  // whose rows every id has, and `fill(t, name, read, dim, dw)` writes
  // the gradient into `dw`.
  template <typename Fill>
  void ForEachWeightedTable(OpKernelContext* ctx, const RaggedGroup& in,
                            Fill&& fill) {
    OpOutputList out;
    OP_REQUIRES_OK(ctx, ctx->output_list("weight_grads", &out));
    const int k = in.size();
    for (int t = 0; t < k; ++t) {
      const std::string name = absl::StrCat("table ", t);
      Tensor* o = nullptr;
      OP_REQUIRES_OK(ctx, out.allocate(t, in.weights[t].shape(), &o));
      if (in.weights[t].NumElements() == 0) continue;
      TableRead read;
      OP_REQUIRES_OK(ctx, read.Open(ctx, t, snapshots_ ? k + t : -1));
      OP_REQUIRES_OK(ctx, CheckFloatTable(name, *read.tensor()));
      // Ids index the table: range-checked under the lock.
      OP_REQUIRES_OK(ctx, read.CheckIds(name, in.ids[t]));
      OP_REQUIRES_OK(ctx, fill(t, name, read, read.tensor()->dim_size(1),
                               o->flat<float>().data()));
    }
  }

  const bool snapshots_;
  float max_norm_;
};

class GroupEmbeddingWeightGradOp : public WeightGradKernel {
 public:
  explicit GroupEmbeddingWeightGradOp(OpKernelConstruction* ctx)
      : WeightGradKernel(ctx, "GroupEmbeddingWeightGradFromSnapshots") {
    OP_REQUIRES_OK(ctx, ParseCombiners(ctx, &combiners_));
  }

  void Compute(OpKernelContext* ctx) override {
    RaggedGroup in;
    OP_REQUIRES_OK(ctx, ReadRaggedGroup(ctx, "ids", kWithWeights,
                                        /*dim=*/0, &in));
    OpInputList grads, pooled;
    OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
    OP_REQUIRES_OK(ctx, ctx->input_list("pooled", &pooled));
    const int k = in.size();
    OP_REQUIRES(ctx, static_cast<int>(combiners_.size()) == k,
                InvalidArgument("combiners must have ", k, " entries, got ",
                                combiners_.size(), "."));
    ForEachWeightedTable(ctx, in, [&](int t, const std::string& name,
                                      const TableRead& read, int64_t dim,
                                      float* dw) {
      const int64_t* v = in.ids[t].flat<int64_t>().data();
      return PooledWeightGrad(
          name, in, t, grads[t], pooled[t], combiners_[t], dim,
          [&read, v](int64_t j) { return read.Row(v, j); }, dw, max_norm_);
    });
  }

 private:
  std::vector<Combiner> combiners_;
};

REGISTER_KERNEL_BUILDER(Name("GroupEmbeddingWeightGrad").Device(DEVICE_CPU),
                        GroupEmbeddingWeightGradOp);
REGISTER_KERNEL_BUILDER(
    Name("GroupEmbeddingWeightGradFromSnapshots").Device(DEVICE_CPU),
    GroupEmbeddingWeightGradOp);

// ---------------------------------------------------------------------------
// Gradient w.r.t. the per-id weights of a sequence lookup:
//   d/dw_j = clip(e_j) . grads[b_j, positions[j], :]
// Not stateful: pruned from graphs that do not differentiate the weights.
// Empty output for an unweighted table.
// ---------------------------------------------------------------------------
REGISTER_OP("GroupEmbeddingSequenceWeightGrad")
    .Input("tables: num_tables * resource")
    .Input("ids: num_tables * int64")
    .Input("row_splits: num_tables * int64")
    .Input("positions: num_tables * int64")
    .Input("weights: num_tables * float")
    .Input("grads: num_tables * float")
    .Output("weight_grads: num_tables * float")
    .Attr("num_tables: int >= 1")
    .Attr("max_norm: float = -1")
    .SetShapeFn(WeightGradShapes</*kSnapshots=*/false, 4, 1, 3>);

// The same reading GroupEmbeddingTableSnapshot outputs instead of the
// variables (see TableRead in table_access.h): what the gradient
// functions build.
REGISTER_OP("GroupEmbeddingSequenceWeightGradFromSnapshots")
    .Input("tables: num_tables * float")
    .Input("by_position: num_tables * bool")
    .Input("ids: num_tables * int64")
    .Input("row_splits: num_tables * int64")
    .Input("positions: num_tables * int64")
    .Input("weights: num_tables * float")
    .Input("grads: num_tables * float")
    .Output("weight_grads: num_tables * float")
    .Attr("num_tables: int >= 1")
    .Attr("max_norm: float = -1")
    // ids_checked: see IdsCheckedAttr (op_checks.h).
    .Attr("ids_checked: bool = false")
    .SetShapeFn(WeightGradShapes</*kSnapshots=*/true, 4, 1, 3>);

class GroupEmbeddingSequenceWeightGradOp : public WeightGradKernel {
 public:
  explicit GroupEmbeddingSequenceWeightGradOp(OpKernelConstruction* ctx)
      : WeightGradKernel(ctx,
                         "GroupEmbeddingSequenceWeightGradFromSnapshots") {}

  void Compute(OpKernelContext* ctx) override {
    // Positions are checked below against T, the gradient's.
    RaggedGroup in;
    OP_REQUIRES_OK(ctx, ReadRaggedGroup(ctx, "ids",
                                        kWithWeights | kWithPositions,
                                        /*dim=*/0, &in));
    OpInputList grads;
    OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
    ForEachWeightedTable(ctx, in, [&](int t, const std::string& name,
                                      const TableRead& read, int64_t dim,
                                      float* dw) {
      int64_t len = 0;
      TF_RETURN_IF_ERROR(
          CheckSequenceGrad(name, grads[t], in.batch(t), dim, &len));
      TF_RETURN_IF_ERROR(
          CheckPositions(name, in.positions[t], in.nnz(t), len));
      const int64_t* v = in.ids[t].flat<int64_t>().data();
      const auto grad_table = MakeGradTable(
          SequenceGrads{grads[t].flat<float>().data(),
                        in.positions[t].flat<int64_t>().data(), len, dim},
          in.splits[t], in.weights[t], in.nnz(t), kSum);
      WeightGradRows(grad_table, dim, /*pooled=*/nullptr,
                     [&read, v](int64_t j) { return read.Row(v, j); }, dw,
                     max_norm_);
      return Status();
    });
  }
};

REGISTER_KERNEL_BUILDER(Name("GroupEmbeddingSequenceWeightGrad")
                            .Device(DEVICE_CPU),
                        GroupEmbeddingSequenceWeightGradOp);
REGISTER_KERNEL_BUILDER(Name("GroupEmbeddingSequenceWeightGradFromSnapshots")
                            .Device(DEVICE_CPU),
                        GroupEmbeddingSequenceWeightGradOp);

}  // namespace
}  // namespace group_embedding

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

namespace group_embedding {
namespace {

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
    .SetShapeFn([](InferenceContext* c) {
      int n;
      TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &n));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 0, n, 0));
      TF_RETURN_IF_ERROR(InputsWithRank(c, n, 3 * n, 1));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 4 * n, 2 * n, 2));
      for (int i = 0; i < n; ++i) c->set_output(i, c->input(3 * n + i));
      return Status();
    });

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
    .SetShapeFn([](InferenceContext* c) {
      int n;
      TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &n));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 0, n, 2));
      TF_RETURN_IF_ERROR(InputsWithRank(c, n, n, 0));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 2 * n, 3 * n, 1));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 5 * n, 2 * n, 2));
      for (int i = 0; i < n; ++i) c->set_output(i, c->input(4 * n + i));
      return Status();
    });

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
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &var));
    const Tensor& ids = ctx->input(1);
    OP_REQUIRES(ctx, ids.dims() == 1,
                InvalidArgument(name_, ": ids must be a vector, got shape ",
                                ids.shape().DebugString(), "."));
    tensorflow::tf_shared_lock lock(*var->mu());
    const Tensor* table = var->tensor();
    OP_REQUIRES(ctx, table->dtype() == tensorflow::DT_FLOAT &&
                         table->dims() == 2,
                InvalidArgument(name_, ": expected a float32 [vocab, dim] "
                                "table, got ", table->shape().DebugString()));
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
    for (int64_t j = 0; j < n; ++j) {
      OP_REQUIRES(ctx, v[j] >= 0 && v[j] < vocab,
                  InvalidArgument(name_, ": id ", v[j], " is out of range [0, ",
                                  vocab, ") for this table."));
    }
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

class GroupEmbeddingWeightGradOp : public OpKernel {
 public:
  explicit GroupEmbeddingWeightGradOp(OpKernelConstruction* ctx)
      : OpKernel(ctx),
        snapshots_(ctx->def().op() == "GroupEmbeddingWeightGradFromSnapshots") {
    std::vector<std::string> names;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("combiners", &names));
    OP_REQUIRES_OK(ctx, ParseCombiners(names, &combiners_));
    OP_REQUIRES_OK(ctx, GetMaxNorm(ctx, &max_norm_));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList ids, splits, weights, grads, pooled;
    OP_REQUIRES_OK(ctx, ctx->input_list("ids", &ids));
    OP_REQUIRES_OK(ctx, ctx->input_list("row_splits", &splits));
    OP_REQUIRES_OK(ctx, ctx->input_list("weights", &weights));
    OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
    OP_REQUIRES_OK(ctx, ctx->input_list("pooled", &pooled));
    OpOutputList out;
    OP_REQUIRES_OK(ctx, ctx->output_list("weight_grads", &out));
    const int k = ids.size();
    OP_REQUIRES(ctx, static_cast<int>(combiners_.size()) == k,
                InvalidArgument("combiners must have ", k, " entries, got ",
                                combiners_.size(), "."));
    for (int t = 0; t < k; ++t) {
      const std::string name = absl::StrCat("table ", t);
      Tensor* o = nullptr;
      OP_REQUIRES_OK(ctx, CheckRagged(name, ids[t], splits[t], weights[t],
                                      /*vocab=*/-1));
      OP_REQUIRES_OK(ctx, out.allocate(t, weights[t].shape(), &o));
      if (weights[t].NumElements() == 0) continue;
      TableRead read;
      OP_REQUIRES_OK(ctx, read.Open(ctx, t, snapshots_ ? k + t : -1));
      const Tensor* table = read.tensor();
      OP_REQUIRES(ctx, table->dtype() == tensorflow::DT_FLOAT &&
                           table->dims() == 2,
                  InvalidArgument(name, ": expected a float32 [vocab, dim] "
                                  "table, got ",
                                  table->shape().DebugString()));
      const int64_t dim = table->dim_size(1);
      const int64_t batch = splits[t].NumElements() - 1;
      // Ids index the table: range-check them under the lock.
      OP_REQUIRES_OK(ctx, read.CheckIds(name, ids[t]));
      OP_REQUIRES_OK(ctx, CheckMatrix(name + ": grads", grads[t], batch,
                                      dim));
      OP_REQUIRES_OK(ctx, CheckMatrix(name + ": pooled", pooled[t], batch,
                                      dim));
      const int64_t* v = ids[t].flat<int64_t>().data();
      const auto grad_table =
          MakeGradTable(PooledGrads{grads[t].flat<float>().data(), dim},
                        splits[t], weights[t], ids[t].NumElements(),
                        combiners_[t]);
      WeightGradRows(grad_table, dim, pooled[t].flat<float>().data(),
                     [&read, v](int64_t j) { return read.Row(v, j); },
                     o->flat<float>().data(), max_norm_);
    }
  }

 private:
  const bool snapshots_;
  std::vector<Combiner> combiners_;
  float max_norm_;
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
    .SetShapeFn([](InferenceContext* c) {
      int n;
      TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &n));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 0, n, 0));
      TF_RETURN_IF_ERROR(InputsWithRank(c, n, 4 * n, 1));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 5 * n, n, 3));
      for (int i = 0; i < n; ++i) c->set_output(i, c->input(4 * n + i));
      return Status();
    });

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
    .SetShapeFn([](InferenceContext* c) {
      int n;
      TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &n));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 0, n, 2));
      TF_RETURN_IF_ERROR(InputsWithRank(c, n, n, 0));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 2 * n, 4 * n, 1));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 6 * n, n, 3));
      for (int i = 0; i < n; ++i) c->set_output(i, c->input(5 * n + i));
      return Status();
    });

class GroupEmbeddingSequenceWeightGradOp : public OpKernel {
 public:
  explicit GroupEmbeddingSequenceWeightGradOp(OpKernelConstruction* ctx)
      : OpKernel(ctx),
        snapshots_(ctx->def().op() ==
                   "GroupEmbeddingSequenceWeightGradFromSnapshots") {
    OP_REQUIRES_OK(ctx, GetMaxNorm(ctx, &max_norm_));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList ids, splits, positions, weights, grads;
    OP_REQUIRES_OK(ctx, ctx->input_list("ids", &ids));
    OP_REQUIRES_OK(ctx, ctx->input_list("row_splits", &splits));
    OP_REQUIRES_OK(ctx, ctx->input_list("positions", &positions));
    OP_REQUIRES_OK(ctx, ctx->input_list("weights", &weights));
    OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
    OpOutputList out;
    OP_REQUIRES_OK(ctx, ctx->output_list("weight_grads", &out));
    const int k = ids.size();
    for (int t = 0; t < k; ++t) {
      const std::string name = absl::StrCat("table ", t);
      OP_REQUIRES_OK(ctx, CheckRagged(name, ids[t], splits[t], weights[t],
                                      /*vocab=*/-1));
      Tensor* o = nullptr;
      OP_REQUIRES_OK(ctx, out.allocate(t, weights[t].shape(), &o));
      if (weights[t].NumElements() == 0) continue;
      TableRead read;
      OP_REQUIRES_OK(ctx, read.Open(ctx, t, snapshots_ ? k + t : -1));
      const Tensor* table = read.tensor();
      OP_REQUIRES(ctx, table->dtype() == tensorflow::DT_FLOAT &&
                           table->dims() == 2,
                  InvalidArgument(name, ": expected a float32 [vocab, dim] "
                                  "table, got ",
                                  table->shape().DebugString()));
      const int64_t dim = table->dim_size(1);
      const int64_t batch = splits[t].NumElements() - 1;
      int64_t len = 0;
      OP_REQUIRES_OK(ctx, read.CheckIds(name, ids[t]));
      OP_REQUIRES_OK(ctx, CheckSequenceGrad(name, grads[t], batch, dim,
                                            &len));
      OP_REQUIRES_OK(ctx, CheckPositions(name, positions[t],
                                         ids[t].NumElements(), len));
      const int64_t* v = ids[t].flat<int64_t>().data();
      const auto grad_table = MakeGradTable(
          SequenceGrads{grads[t].flat<float>().data(),
                        positions[t].flat<int64_t>().data(), len, dim},
          splits[t], weights[t], ids[t].NumElements(), kSum);
      WeightGradRows(grad_table, dim, /*pooled=*/nullptr,
                     [&read, v](int64_t j) { return read.Row(v, j); },
                     o->flat<float>().data(), max_norm_);
    }
  }

 private:
  const bool snapshots_;
  float max_norm_;
};

REGISTER_KERNEL_BUILDER(Name("GroupEmbeddingSequenceWeightGrad")
                            .Device(DEVICE_CPU),
                        GroupEmbeddingSequenceWeightGradOp);
REGISTER_KERNEL_BUILDER(Name("GroupEmbeddingSequenceWeightGradFromSnapshots")
                            .Device(DEVICE_CPU),
                        GroupEmbeddingSequenceWeightGradOp);

}  // namespace
}  // namespace group_embedding

// CPU kernels of group-embedding: the fused multi-table lookup, its
// backward, the SparseTensor -> ragged conversion and a duplicate-safe
// multithreaded sparse Adagrad update.
//
// Why custom kernels: stock TF has no op that gathers from several resource
// variables at once, and its per-table chain (unique, gather, gather,
// segment reduce) materialises [nnz, D] tensors several times.  These
// kernels pool straight from the tables into [B, D] outputs and shard the
// work over TF's intra-op thread pool.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
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

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::errors::InvalidArgument;
using ::tensorflow::OpInputList;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::OpOutputList;
using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::Var;
using ::tensorflow::core::RefCountPtr;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// ---------------------------------------------------------------------------
// Forward: pooled lookup of K ragged id batches from K tables.
// ---------------------------------------------------------------------------
REGISTER_OP("GroupEmbeddingVariableLookup")
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
    .SetShapeFn([](InferenceContext* c) {
      int n;
      int64_t dim;
      TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &n));
      TF_RETURN_IF_ERROR(c->GetAttr("embedding_dim", &dim));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 0, n, 0));
      TF_RETURN_IF_ERROR(InputsWithRank(c, n, 3 * n, 1));
      for (int i = 0; i < n; ++i) {
        auto splits = c->input(2 * n + i);
        auto rows = c->Dim(splits, 0);
        tensorflow::shape_inference::DimensionHandle b;
        TF_RETURN_IF_ERROR(c->Subtract(rows, 1, &b));
        c->set_output(i, c->MakeShape({b, c->MakeDim(dim)}));
      }
      return Status();
    });

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
    .SetShapeFn([](InferenceContext* c) {
      int n;
      int64_t dim;
      TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &n));
      TF_RETURN_IF_ERROR(c->GetAttr("embedding_dim", &dim));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 0, n, 0));
      TF_RETURN_IF_ERROR(InputsWithRank(c, n, 3 * n, 1));
      tensorflow::shape_inference::DimensionHandle b;
      TF_RETURN_IF_ERROR(c->Subtract(c->Dim(c->input(2 * n), 0), 1, &b));
      c->set_output(0, c->MakeShape({b, c->MakeDim(n * dim)}));
      return Status();
    });

// Where table t's rows of a pooled [B, D] block live: `base` + b * `stride`
// (per-table outputs: stride D; the concatenated layout: stride K * D).
template <typename T>
struct RowBlock {
  T* base;
  int64_t stride;
};

class GroupEmbeddingVariableLookupOp : public OpKernel {
 public:
  explicit GroupEmbeddingVariableLookupOp(OpKernelConstruction* ctx)
      : OpKernel(ctx),
        concat_(ctx->def().op() == "GroupEmbeddingConcatLookup") {
    std::vector<std::string> names;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("combiners", &names));
    OP_REQUIRES_OK(ctx, ParseCombiners(names, &combiners_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table_names", &table_names_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("embedding_dim", &dim_));
    OP_REQUIRES_OK(ctx, GetMaxNorm(ctx, &max_norm_));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList ids, splits, weights;
    OP_REQUIRES_OK(ctx, ctx->input_list("ids", &ids));
    OP_REQUIRES_OK(ctx, ctx->input_list("row_splits", &splits));
    OP_REQUIRES_OK(ctx, ctx->input_list("weights", &weights));
    const int k = ids.size();
    OP_REQUIRES(ctx, static_cast<int>(combiners_.size()) == k &&
                         static_cast<int>(table_names_.size()) == k,
                InvalidArgument("combiners/table_names must have ", k,
                                " entries."));

    std::vector<RefCountPtr<Var>> refs(k);
    std::vector<Var*> vars(k);
    for (int t = 0; t < k; ++t) {
      OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, t),
                                         &refs[t]));
      vars[t] = refs[t].get();
    }
    SharedVarLocks locks(vars);

    // Tables may have different batch sizes (dense lookups of any shape);
    // `first_row[t]` numbers the output rows of all tables consecutively.
    std::vector<const float*> tables(k);
    std::vector<int64_t> vocabs(k);
    std::vector<int64_t> first_row(k + 1, 0);
    int64_t total_nnz = 0;
    for (int t = 0; t < k; ++t) {
      const Tensor* table = vars[t]->tensor();
      OP_REQUIRES(ctx, table->dtype() == tensorflow::DT_FLOAT &&
                           table->dims() == 2 && table->dim_size(1) == dim_,
                  InvalidArgument(table_names_[t],
                                  ": expected a float32 [vocab, ", dim_,
                                  "] table, got ",
                                  table->shape().DebugString()));
      // Ids are range-checked by the (parallel) pooling below, before any
      // row is read: a serial pass over every id cost ~15% of the op.
      OP_REQUIRES_OK(ctx, CheckRagged(table_names_[t], ids[t], splits[t],
                                      weights[t], /*vocab=*/-1));
      first_row[t + 1] = first_row[t] + splits[t].NumElements() - 1;
      total_nnz += ids[t].NumElements();
      tables[t] = table->flat<float>().data();
      vocabs[t] = table->dim_size(0);
    }

    std::vector<PooledTable<TableRows>> pooled(k);
    for (int t = 0; t < k; ++t) {
      pooled[t].rows = {tables[t], ids[t].flat<int64_t>().data(),
                        static_cast<uint64_t>(vocabs[t]), dim_};
      pooled[t].splits = splits[t].flat<int64_t>().data();
      pooled[t].weights = weights[t].NumElements()
                              ? weights[t].flat<float>().data()
                              : nullptr;
      pooled[t].nnz = ids[t].NumElements();
      pooled[t].dim = dim_;
      pooled[t].combiner = combiners_[t];
    }
    if (concat_) {
      OP_REQUIRES_OK(ctx, CheckSameBatch(table_names_, splits));
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

    // The first out-of-range id found, as (table, position); any one is
    // reported (shards race), never read.
    std::atomic<bool> bad(false);
    std::atomic<int64_t> bad_table(-1), bad_pos(-1);
    const int64_t avg = total_nnz / total_rows + 1;
    PoolTables(ctx, pooled, first_row, max_norm_, avg * dim_ * 4 + 20,
               [&](int t, int64_t j) {
                 if (!bad.exchange(true)) {
                   bad_table = t;
                   bad_pos = j;
                 }
               });
    if (bad) {
      const int64_t t = bad_table, j = bad_pos;
      ctx->SetStatus(InvalidArgument(
          table_names_[t], ": id ", ids[t].flat<int64_t>()(j),
          " is out of range [0, ", vocabs[t], ") for this table."));
    }
  }

 private:
  const bool concat_;
  std::vector<Combiner> combiners_;
  std::vector<std::string> table_names_;
  int64_t dim_;
  float max_norm_;
};

REGISTER_KERNEL_BUILDER(Name("GroupEmbeddingVariableLookup")
                            .Device(DEVICE_CPU),
                        GroupEmbeddingVariableLookupOp);
REGISTER_KERNEL_BUILDER(Name("GroupEmbeddingConcatLookup").Device(DEVICE_CPU),
                        GroupEmbeddingVariableLookupOp);

// ---------------------------------------------------------------------------
// Backward: per table, unique ids (first-occurrence order) and the summed
// gradient of each, ready to be returned as IndexedSlices.
// ---------------------------------------------------------------------------
REGISTER_OP("GroupEmbeddingVariableLookupGrad")
    .Input("grads: num_tables * float")
    .Input("ids: num_tables * int64")
    .Input("row_splits: num_tables * int64")
    .Input("weights: num_tables * float")
    .Output("unique_ids: num_tables * int64")
    .Output("id_grads: num_tables * float")
    .Attr("num_tables: int >= 1")
    .Attr("combiners: list(string)")
    .Attr("embedding_dim: int >= 0")
    .SetShapeFn([](InferenceContext* c) {
      int n;
      int64_t dim;
      TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &n));
      TF_RETURN_IF_ERROR(c->GetAttr("embedding_dim", &dim));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 0, n, 2));
      TF_RETURN_IF_ERROR(InputsWithRank(c, n, 3 * n, 1));
      for (int i = 0; i < n; ++i) {
        c->set_output(i, c->Vector(c->UnknownDim()));
        c->set_output(n + i,
                      c->MakeShape({c->UnknownDim(), c->MakeDim(dim)}));
      }
      return Status();
    });

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
    .SetShapeFn([](InferenceContext* c) {
      int n;
      int64_t dim;
      TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &n));
      TF_RETURN_IF_ERROR(c->GetAttr("embedding_dim", &dim));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 0, 1, 2));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 1, 3 * n, 1));
      for (int i = 0; i < n; ++i) {
        c->set_output(i, c->Vector(c->UnknownDim()));
        c->set_output(n + i,
                      c->MakeShape({c->UnknownDim(), c->MakeDim(dim)}));
      }
      return Status();
    });

// Above this size, a table's gradient sums are built one by one instead
// of by scattered adds (half the 1 MiB L2 of the machine measured; below
// it the scattered adds were as fast and skip a counting sort).
constexpr int64_t kCachedSumBytes = 512 << 10;

class GroupEmbeddingVariableLookupGradOp : public OpKernel {
 public:
  explicit GroupEmbeddingVariableLookupGradOp(OpKernelConstruction* ctx)
      : OpKernel(ctx),
        concat_(ctx->def().op() == "GroupEmbeddingConcatLookupGrad") {
    std::vector<std::string> names;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("combiners", &names));
    OP_REQUIRES_OK(ctx, ParseCombiners(names, &combiners_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("embedding_dim", &dim_));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList ids, splits, weights;
    OP_REQUIRES_OK(ctx, ctx->input_list("ids", &ids));
    OP_REQUIRES_OK(ctx, ctx->input_list("row_splits", &splits));
    OP_REQUIRES_OK(ctx, ctx->input_list("weights", &weights));
    const int k = ids.size();
    OP_REQUIRES(ctx, static_cast<int>(combiners_.size()) == k,
                InvalidArgument("combiners must have ", k, " entries, got ",
                                combiners_.size(), "."));
    for (int t = 0; t < k; ++t) {
      OP_REQUIRES_OK(ctx, CheckRagged(absl::StrCat("table ", t), ids[t],
                                      splits[t], weights[t], /*vocab=*/-1));
    }
    // Per table, where its gradient rows are (read only here).
    std::vector<RowBlock<const float>> grad_rows(k);
    if (concat_) {
      OP_REQUIRES_OK(ctx, CheckSameBatch({}, splits));
      const Tensor& g = ctx->input(0);
      OP_REQUIRES_OK(ctx, CheckMatrix("grads", g,
                                      splits[0].NumElements() - 1, k * dim_));
      for (int t = 0; t < k; ++t) {
        grad_rows[t] = {g.flat<float>().data() + t * dim_, k * dim_};
      }
    } else {
      OpInputList grads;
      OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
      for (int t = 0; t < k; ++t) {
        OP_REQUIRES_OK(ctx, CheckMatrix(absl::StrCat("table ", t, ": grads"),
                                        grads[t], splits[t].NumElements() - 1,
                                        dim_));
        grad_rows[t] = {grads[t].flat<float>().data(), dim_};
      }
    }
    OpOutputList uniq_out, grad_out;
    OP_REQUIRES_OK(ctx, ctx->output_list("unique_ids", &uniq_out));
    OP_REQUIRES_OK(ctx, ctx->output_list("id_grads", &grad_out));
    int64_t total = 0;
    for (int t = 0; t < k; ++t) total += ids[t].NumElements();

    std::vector<Status> status(k);
    const int64_t dim = dim_;
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
    WithStaticDim(dim, [&](auto static_dim) {
      constexpr int64_t kDim = decltype(static_dim)::value;
      const int64_t width = kDim > 0 ? kDim : dim;
      using Sums = float[kDim > 0 ? kDim : 1];
      // Tables are independent, so shard over tables: no write conflicts.
      auto work = [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const int64_t nnz = ids[t].NumElements();
          const int64_t batch = splits[t].NumElements() - 1;
          const int64_t* v = ids[t].flat<int64_t>().data();
          const int64_t* s = splits[t].flat<int64_t>().data();
          const float* w = weights[t].NumElements()
                               ? weights[t].flat<float>().data()
                               : nullptr;
          const float* g = grad_rows[t].base;
          const int64_t g_stride = grad_rows[t].stride;
          std::vector<int64_t> slot;
          float* gsum = nullptr;
          status[t] = DedupToGradOutputs(v, nnz, dim, t, &uniq_out,
                                         &grad_out, &slot, &gsum);
          if (!status[t].ok()) continue;
          const int64_t u = grad_out[t]->dim_size(0);
          if (u * width * sizeof(float) <= kCachedSumBytes) {
            // The sums stay in cache: add each gradient row to its id's.
            std::fill(gsum, gsum + u * width, 0.0f);
            for (int64_t b = 0; b < batch; ++b) {
              const int64_t lo = s[b], hi = s[b + 1];
              if (lo == hi) continue;
              const float scale = RowScale(combiners_[t], w, lo, hi);
              const float* gb = g + b * g_stride;
              for (int64_t j = lo; j < hi; ++j) {
                const float f = scale * (w ? w[j] : 1.0f);
                AddScaledRow(gsum + slot[j] * width, gb, f, width);
              }
            }
            continue;
          }
          // Larger: adding every occurrence's gradient straight into its
          // sum missed the cache at most adds (most of this op's time at
          // dim 64). Instead group the occurrences by slot, in position
          // order (a counting sort), and build each sum in registers,
          // written once. Both ways add in the same order.
          std::vector<int64_t> start(u + 1, 0);
          for (int64_t j = 0; j < nnz; ++j) ++start[slot[j] + 1];
          for (int64_t i = 0; i < u; ++i) start[i + 1] += start[i];
          std::vector<int64_t> next(start.begin(), start.end() - 1);
          std::vector<int64_t> occ_row(nnz);
          std::vector<float> occ_factor(nnz);
          for (int64_t b = 0; b < batch; ++b) {
            const int64_t lo = s[b], hi = s[b + 1];
            if (lo == hi) continue;
            const float scale = RowScale(combiners_[t], w, lo, hi);
            for (int64_t j = lo; j < hi; ++j) {
              const int64_t at = next[slot[j]]++;
              occ_row[at] = b;
              occ_factor[at] = scale * (w ? w[j] : 1.0f);
            }
          }
          Sums sums;
          for (int64_t i = 0; i < u; ++i) {
            float* dst = gsum + i * width;
            float* acc = kDim > 0 ? sums : dst;
            std::fill(acc, acc + width, 0.0f);
            for (int64_t at = start[i]; at < start[i + 1]; ++at) {
              if (at + kPrefetchDistance < nnz) {
                PrefetchRow(g + occ_row[at + kPrefetchDistance] * g_stride,
                            width);
              }
              const float f = occ_factor[at];
              const float* gb = g + occ_row[at] * g_stride;
              for (int64_t d = 0; d < width; ++d) acc[d] += f * gb[d];
            }
            if (kDim > 0) std::copy(acc, acc + width, dst);
          }
        }
      };
      tensorflow::Shard(pool->num_threads, pool->workers, k,
                        (total / k + 1) * (dim + 1) * 8, work);
    });
    for (const auto& st : status) OP_REQUIRES_OK(ctx, st);
  }

 private:
  const bool concat_;
  std::vector<Combiner> combiners_;
  int64_t dim_;
};

REGISTER_KERNEL_BUILDER(Name("GroupEmbeddingVariableLookupGrad")
                            .Device(DEVICE_CPU),
                        GroupEmbeddingVariableLookupGradOp);
REGISTER_KERNEL_BUILDER(Name("GroupEmbeddingConcatLookupGrad")
                            .Device(DEVICE_CPU),
                        GroupEmbeddingVariableLookupGradOp);

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
      const int64_t* s = splits[t].flat<int64_t>().data();
      const float* w = weights[t].flat<float>().data();
      const float* g = grads[t].flat<float>().data();
      const float* p = pooled[t].flat<float>().data();
      WeightGradRows(combiners_[t], dim, splits[t].NumElements() - 1, s, w,
                     g, p, [&read, v](int64_t j) { return read.Row(v, j); },
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
// Backward of max_norm clipping: the per-unique-id gradients of the
// clipped rows (from the lookup grads) -> those of the table rows, read
// again here (the forward keeps no [nnz, D] copy of them).
// ---------------------------------------------------------------------------
REGISTER_OP("GroupEmbeddingClipGrad")
    .Input("tables: num_tables * resource")
    .Input("unique_ids: num_tables * int64")
    .Input("id_grads: num_tables * float")
    .Output("clipped_grads: num_tables * float")
    .Attr("num_tables: int >= 1")
    .Attr("max_norm: float")
    .SetShapeFn([](InferenceContext* c) {
      int n;
      TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &n));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 0, n, 0));
      TF_RETURN_IF_ERROR(InputsWithRank(c, n, n, 1));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 2 * n, n, 2));
      for (int i = 0; i < n; ++i) c->set_output(i, c->input(2 * n + i));
      return Status();
    });

class GroupEmbeddingClipGradOp : public OpKernel {
 public:
  explicit GroupEmbeddingClipGradOp(OpKernelConstruction* ctx)
      : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, GetMaxNorm(ctx, &max_norm_));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList uniq, grads;
    OP_REQUIRES_OK(ctx, ctx->input_list("unique_ids", &uniq));
    OP_REQUIRES_OK(ctx, ctx->input_list("id_grads", &grads));
    const int k = uniq.size();
    std::vector<RefCountPtr<Var>> refs(k);
    std::vector<Var*> vars(k);
    for (int t = 0; t < k; ++t) {
      OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, t),
                                         &refs[t]));
      vars[t] = refs[t].get();
    }
    SharedVarLocks locks(vars);
    std::vector<const float*> tables(k);
    std::vector<const int64_t*> ids(k);
    std::vector<float*> outs(k);
    std::vector<int64_t> first(k + 1, 0);
    int64_t dim = -1;
    for (int t = 0; t < k; ++t) {
      const std::string name = absl::StrCat("table ", t);
      const Tensor* table = vars[t]->tensor();
      OP_REQUIRES(ctx, table->dtype() == tensorflow::DT_FLOAT &&
                           table->dims() == 2 &&
                           (dim < 0 || table->dim_size(1) == dim),
                  InvalidArgument(name, ": expected a float32 [vocab, dim] "
                                  "table of the group's dim, got ",
                                  table->shape().DebugString()));
      dim = table->dim_size(1);
      OP_REQUIRES(ctx, uniq[t].dims() == 1,
                  InvalidArgument(name, ": unique_ids must be a vector, got "
                                  "shape ", uniq[t].shape().DebugString()));
      const int64_t u = uniq[t].NumElements();
      OP_REQUIRES_OK(ctx, CheckMatrix(name + ": id_grads", grads[t], u, dim));
      const int64_t* v = uniq[t].flat<int64_t>().data();
      const int64_t vocab = table->dim_size(0);
      for (int64_t j = 0; j < u; ++j) {
        OP_REQUIRES(ctx, v[j] >= 0 && v[j] < vocab,
                    InvalidArgument(name, ": unique_ids ", v[j],
                                    " is out of range [0, ", vocab, ")."));
      }
      Tensor* o = nullptr;
      // The incoming gradients are dead after this op: rewrite them in
      // place when TF lets us.
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output(
                              {2 * k + t}, t, grads[t].shape(), &o));
      if (o->data() != grads[t].data() && u * dim > 0) {
        std::memcpy(o->data(), grads[t].data(), grads[t].TotalBytes());
      }
      tables[t] = table->flat<float>().data();
      ids[t] = v;
      outs[t] = o->flat<float>().data();
      first[t + 1] = first[t] + u;
    }
    if (first[k] == 0 || dim <= 0) return;
    const float max_norm = max_norm_;
    auto work = [&](int64_t begin, int64_t end) {
      int t = static_cast<int>(
          std::upper_bound(first.begin(), first.end(), begin) -
          first.begin() - 1);
      for (int64_t r = begin; r < end; ++r) {
        while (r >= first[t + 1]) ++t;
        const int64_t j = r - first[t];
        ClipGradRow(tables[t] + ids[t][j] * dim, dim, max_norm,
                    outs[t] + j * dim);
      }
    };
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
    // Locks are held across the shard, but work items take none.
    tensorflow::Shard(pool->num_threads, pool->workers, first[k], dim * 6,
                      work);
  }

 private:
  float max_norm_;
};

REGISTER_KERNEL_BUILDER(Name("GroupEmbeddingClipGrad").Device(DEVICE_CPU),
                        GroupEmbeddingClipGradOp);

// ---------------------------------------------------------------------------
// SparseTensor ids -> ragged (values grouped by row, row_splits) with a
// stable counting sort on the row index: O(nnz), any index order.
// ---------------------------------------------------------------------------
REGISTER_OP("GroupSparseToRagged")
    .Input("indices: num_features * int64")
    .Input("ids: num_features * int64")
    .Input("dense_shapes: num_features * int64")
    .Input("weights: num_features * float")
    .Output("values: num_features * int64")
    .Output("row_splits: num_features * int64")
    .Output("row_weights: num_features * float")
    .Output("weight_positions: num_features * int64")
    // Each value's column (its slot in a sequence), in the order of
    // `values`; empty unless `with_positions`.
    .Output("positions: num_features * int64")
    .Attr("num_features: int >= 1")
    .Attr("feature_names: list(string)")
    // Also require one batch size (dense_shape[0]) for all features: one
    // check here instead of a few ops per feature in the graph.
    .Attr("same_batch: bool = false")
    // Also output the columns, checked to lie in [0, dense_shape[1]).
    .Attr("with_positions: bool = false")
    .SetShapeFn([](InferenceContext* c) {
      int n;
      bool with_positions;
      TF_RETURN_IF_ERROR(c->GetAttr("num_features", &n));
      TF_RETURN_IF_ERROR(c->GetAttr("with_positions", &with_positions));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 0, n, 2));   // indices
      TF_RETURN_IF_ERROR(InputsWithRank(c, n, 3 * n, 1));  // ids, shapes, w
      for (int i = 0; i < n; ++i) {
        c->set_output(i, c->input(n + i));
        c->set_output(n + i, c->Vector(c->UnknownDim()));
        c->set_output(2 * n + i, c->input(3 * n + i));
        c->set_output(3 * n + i, c->Vector(c->UnknownDim()));
        c->set_output(4 * n + i, with_positions ? c->input(n + i)
                                                : c->Vector(0));
      }
      return Status();
    });

// Largest batch (dense_shape[0]) accepted: the lookups return [batch, D]
// tensors and row_splits of batch + 1 entries, so a larger one can never
// be allocated; rejecting it also keeps batch + 1 from overflowing.
constexpr int64_t kMaxBatch = int64_t{1} << 48;

class GroupSparseToRaggedOp : public OpKernel {
 public:
  explicit GroupSparseToRaggedOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("feature_names", &names_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("same_batch", &same_batch_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("with_positions", &with_positions_));
  }

  // Phases: checks and row_splits allocation (serial, cheap); row counts
  // and column checks (parallel over features); the outputs of features
  // already in row order are forwarded and the others allocated (serial:
  // no allocation from the pool's threads); the counting-sort scatter of
  // those others, and the columns (parallel over features).
  void Compute(OpKernelContext* ctx) override {
    OpInputList indices, ids, shapes, weights;
    OP_REQUIRES_OK(ctx, ctx->input_list("indices", &indices));
    OP_REQUIRES_OK(ctx, ctx->input_list("ids", &ids));
    OP_REQUIRES_OK(ctx, ctx->input_list("dense_shapes", &shapes));
    OP_REQUIRES_OK(ctx, ctx->input_list("weights", &weights));
    // weight_positions[f][j] = where input weight j went (for the
    // gradient); empty when nothing moved or there are no weights.
    OpOutputList vals_out, splits_out, w_out, pos_out, cols_out;
    OP_REQUIRES_OK(ctx, ctx->output_list("values", &vals_out));
    OP_REQUIRES_OK(ctx, ctx->output_list("row_splits", &splits_out));
    OP_REQUIRES_OK(ctx, ctx->output_list("row_weights", &w_out));
    OP_REQUIRES_OK(ctx, ctx->output_list("weight_positions", &pos_out));
    OP_REQUIRES_OK(ctx, ctx->output_list("positions", &cols_out));
    const int n = ids.size();
    OP_REQUIRES(ctx, static_cast<int>(names_.size()) == n,
                InvalidArgument("feature_names must have ", n,
                                " entries, got ", names_.size(), "."));
    std::vector<Tensor*> splits(n), cols(n);
    int64_t total = 0;
    for (int f = 0; f < n; ++f) {
      const std::string& name = names_[f];
      const Tensor& ind = indices[f];
      OP_REQUIRES(ctx, shapes[f].dims() == 1 && shapes[f].NumElements() == 2,
                  InvalidArgument(name, ": SparseTensor ids must have rank "
                                  "2 ([batch, ids per row]), got dense_shape "
                                  "of shape ",
                                  shapes[f].shape().DebugString(), "."));
      OP_REQUIRES(ctx, ids[f].dims() == 1,
                  InvalidArgument(name, ": values must be a vector, got "
                                  "shape ", ids[f].shape().DebugString(),
                                  "."));
      const int64_t nnz = ids[f].NumElements();
      // Columns are read as in(j, 0) and in(j, 1): indices must be exactly
      // [nnz, 2], whatever shape inference could tell.
      OP_REQUIRES(ctx, ind.dims() == 2 && ind.dim_size(0) == nnz &&
                           ind.dim_size(1) == 2,
                  InvalidArgument(name, ": indices must have shape [", nnz,
                                  ", 2] (one [row, column] per value), got ",
                                  ind.shape().DebugString(), "."));
      OP_REQUIRES(ctx, weights[f].dims() == 1,
                  InvalidArgument(name, ": weights must be a vector, got "
                                  "shape ", weights[f].shape().DebugString(),
                                  "."));
      OP_REQUIRES(ctx, weights[f].NumElements() == 0 ||
                           weights[f].NumElements() == nnz,
                  InvalidArgument(name, ": weights have ",
                                  weights[f].NumElements(),
                                  " values but ids have ", nnz, "."));
      const int64_t batch = shapes[f].flat<int64_t>()(0);
      OP_REQUIRES(ctx, batch >= 0 && batch <= kMaxBatch,
                  InvalidArgument(name, ": dense_shape[0] (the batch size) "
                                  "must lie in [0, ", kMaxBatch, "], got ",
                                  batch, "."));
      if (same_batch_ && f > 0) {
        const int64_t first = shapes[0].flat<int64_t>()(0);
        OP_REQUIRES(ctx, batch == first,
                    InvalidArgument(name, " has a different batch size "
                                    "than ", names_[0], " (", batch, " vs ",
                                    first, "); all features of one lookup "
                                    "must share the batch."));
      }
      OP_REQUIRES_OK(ctx, splits_out.allocate(f, TensorShape({batch + 1}),
                                              &splits[f]));
      OP_REQUIRES_OK(ctx, cols_out.allocate(
                              f, TensorShape({with_positions_ ? nnz : 0}),
                              &cols[f]));
      total += nnz + batch;
    }

    std::vector<Status> status(n);  // one writer per entry
    std::vector<char> sorted(n, 1);
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
    auto count = [&](int64_t begin, int64_t end) {
      for (int64_t f = begin; f < end; ++f) {
        const auto in = indices[f].matrix<int64_t>();
        const int64_t nnz = ids[f].NumElements();
        auto sp = splits[f]->flat<int64_t>();
        const int64_t batch = sp.size() - 1;
        std::fill(sp.data(), sp.data() + batch + 1, 0);
        for (int64_t j = 0; j < nnz; ++j) {
          const int64_t r = in(j, 0);
          if (r < 0 || r >= batch) {
            status[f] = InvalidArgument(names_[f], ": row index ", r,
                                        " is outside the batch [0, ", batch,
                                        ").");
            break;
          }
          if (j > 0 && r < in(j - 1, 0)) sorted[f] = 0;
          ++sp(r + 1);
        }
        if (with_positions_ && status[f].ok()) {
          // A column outside [0, width) would land in another row's slots.
          const int64_t width = shapes[f].flat<int64_t>()(1);
          for (int64_t j = 0; j < nnz; ++j) {
            const int64_t c = in(j, 1);
            if (c < 0 || c >= width) {
              status[f] = InvalidArgument(
                  names_[f], ": column index ", c, " is outside [0, "
                  "dense_shape[1]) = [0, ", width, ").");
              break;
            }
          }
        }
        for (int64_t b = 0; b < batch; ++b) sp(b + 1) += sp(b);
      }
    };
    const int64_t per_feature = total / n + 1;
    tensorflow::Shard(pool->num_threads, pool->workers, n, per_feature * 4,
                      count);
    for (const Status& st : status) OP_REQUIRES_OK(ctx, st);

    std::vector<Tensor*> vals(n, nullptr), ws(n, nullptr), pos(n, nullptr);
    for (int f = 0; f < n; ++f) {
      const bool weighted = weights[f].NumElements() != 0;
      const int64_t nnz = ids[f].NumElements();
      const int64_t npos = (sorted[f] || !weighted) ? 0 : nnz;
      OP_REQUIRES_OK(ctx, pos_out.allocate(f, TensorShape({npos}), &pos[f]));
      if (sorted[f]) {
        // Already row-major: forward the buffers, no copy.
        vals_out.set(f, ids[f]);
        w_out.set(f, weights[f]);
        continue;
      }
      OP_REQUIRES_OK(ctx, vals_out.allocate(f, TensorShape({nnz}), &vals[f]));
      OP_REQUIRES_OK(ctx, w_out.allocate(f, weights[f].shape(), &ws[f]));
    }
    auto scatter = [&](int64_t begin, int64_t end) {
      for (int64_t f = begin; f < end; ++f) {
        const auto in = indices[f].matrix<int64_t>();
        const int64_t nnz = ids[f].NumElements();
        int64_t* col = with_positions_ ? cols[f]->flat<int64_t>().data()
                                       : nullptr;
        if (sorted[f]) {
          if (col != nullptr) {
            for (int64_t j = 0; j < nnz; ++j) col[j] = in(j, 1);
          }
          continue;
        }
        const auto sp = splits[f]->flat<int64_t>();
        const bool weighted = weights[f].NumElements() != 0;
        std::vector<int64_t> next(sp.data(), sp.data() + sp.size() - 1);
        const auto iv = ids[f].flat<int64_t>();
        auto ov = vals[f]->flat<int64_t>();
        for (int64_t j = 0; j < nnz; ++j) {
          const int64_t dst = next[in(j, 0)]++;
          ov(dst) = iv(j);
          if (col != nullptr) col[dst] = in(j, 1);
          if (weighted) {
            ws[f]->flat<float>()(dst) = weights[f].flat<float>()(j);
            pos[f]->flat<int64_t>()(j) = dst;
          }
        }
      }
    };
    tensorflow::Shard(pool->num_threads, pool->workers, n, per_feature * 8,
                      scatter);
  }

 private:
  std::vector<std::string> names_;
  bool same_batch_;
  bool with_positions_;
};

REGISTER_KERNEL_BUILDER(Name("GroupSparseToRagged").Device(DEVICE_CPU),
                        GroupSparseToRaggedOp);

// ---------------------------------------------------------------------------
// Sparse Adagrad on a resource variable and its accumulator, with duplicate
// indices summed first (so the result equals the dense update) and rows
// updated in parallel:
//   accum += g^2;  var -= lr * g / sqrt(accum + epsilon)   (Keras' rule)
// ---------------------------------------------------------------------------
REGISTER_OP("GroupSparseApplyAdagrad")
    .Input("var: resource")
    .Input("accum: resource")
    .Input("lr: float")
    .Input("epsilon: float")
    .Input("indices: int64")
    .Input("grad: float")
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(InputsWithRank(c, 2, 2, 0));  // lr, epsilon
      TF_RETURN_IF_ERROR(InputsWithRank(c, 4, 1, 1));  // indices
      return InputsWithRank(c, 5, 1, 2);               // grad
    });

// Gives `var` a buffer of its own before an in-place write, so that
// tensors handed out by earlier reads keep their values (copy on write).
Status PrepareInPlaceWrite(OpKernelContext* ctx, Var* var) {
  Tensor* t = var->tensor();
  if (t->RefCountIsOne()) return Status();
  Tensor copy;
  TF_RETURN_IF_ERROR(ctx->allocate_temp(t->dtype(), t->shape(), &copy));
  std::memcpy(copy.data(), t->data(), t->TotalBytes());
  *t = copy;
  return Status();
}

class GroupSparseApplyAdagradOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    RefCountPtr<Var> var, accum;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &var));
    OP_REQUIRES_OK(ctx,
                   LookupResource(ctx, HandleFromInput(ctx, 1), &accum));
    OP_REQUIRES_OK(ctx, CheckScalar(ctx->input(2), "lr"));
    OP_REQUIRES_OK(ctx, CheckScalar(ctx->input(3), "epsilon"));
    const float lr = ctx->input(2).scalar<float>()();
    const float eps = ctx->input(3).scalar<float>()();
    const Tensor& indices = ctx->input(4);
    const Tensor& grad = ctx->input(5);
    OP_REQUIRES(ctx, indices.dims() == 1,
                InvalidArgument("indices must be a vector, got shape ",
                                indices.shape().DebugString(), "."));
    // Exclusive locks in address order (TF's own convention).
    tensorflow::mutex* m1 = var->mu();
    tensorflow::mutex* m2 = accum->mu();
    if (m2 < m1) std::swap(m1, m2);
    tensorflow::mutex_lock l1(*m1);
    tensorflow::mutex_lock l2(*m2);
    // Checked before the copy-on-write: an uninitialised variable has no
    // buffer to copy.
    OP_REQUIRES(ctx, var->tensor()->dims() == 2 &&
                         accum->tensor()->shape() == var->tensor()->shape() &&
                         var->tensor()->dtype() == tensorflow::DT_FLOAT &&
                         accum->tensor()->dtype() == tensorflow::DT_FLOAT,
                InvalidArgument("var and accum must be float32 [rows, dim] "
                                "of one shape, got ",
                                var->tensor()->shape().DebugString(), " and ",
                                accum->tensor()->shape().DebugString()));
    OP_REQUIRES_OK(ctx, PrepareInPlaceWrite(ctx, var.get()));
    OP_REQUIRES_OK(ctx, PrepareInPlaceWrite(ctx, accum.get()));
    Tensor* vt = var->tensor();
    Tensor* at = accum->tensor();
    const int64_t rows = vt->dim_size(0);
    const int64_t dim = vt->dim_size(1);
    const int64_t n = indices.NumElements();
    OP_REQUIRES_OK(ctx, CheckMatrix("grad", grad, n, dim));
    const int64_t* idx = indices.flat<int64_t>().data();
    const float* g = grad.flat<float>().data();
    // Gradients of the fused lookups come with unique indices: a bitmap
    // over the rows (when it is small next to the indices) proves it in
    // one cheap pass, and only duplicates pay for the hash map below.
    const bool use_bitmap = rows / 64 <= 4 * n + 1024;
    bool duplicates = !use_bitmap;
    std::vector<uint64_t> seen(use_bitmap ? (rows + 63) / 64 : 0, 0);
    for (int64_t j = 0; j < n; ++j) {
      OP_REQUIRES(ctx, idx[j] >= 0 && idx[j] < rows,
                  InvalidArgument("index ", idx[j], " is out of range [0, ",
                                  rows, ")."));
      if (!duplicates) {
        uint64_t& word = seen[idx[j] >> 6];
        const uint64_t bit = uint64_t{1} << (idx[j] & 63);
        duplicates = (word & bit) != 0;
        word |= bit;
      }
    }
    std::optional<DuplicateSums> sums;
    if (duplicates) sums.emplace(idx, n, g, dim);
    const int64_t u = sums ? sums->size() : n;
    float* vp = vt->flat<float>().data();
    float* ap = at->flat<float>().data();
    // Position of the first occurrence of the s-th distinct index.
    auto first_of = [&](int64_t s) { return sums ? sums->first(s) : s; };
    auto work = [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s) {
        if (s + kPrefetchDistance < end) {
          const int64_t ahead = idx[first_of(s + kPrefetchDistance)];
          PrefetchRow(vp + ahead * dim, dim);
          PrefetchRow(ap + ahead * dim, dim);
        }
        const int64_t r = idx[first_of(s)];
        const float* gr = sums ? sums->grad(s) : g + s * dim;
        float* vr = vp + r * dim;
        float* ar = ap + r * dim;
        for (int64_t d = 0; d < dim; ++d) {
          ar[d] += gr[d] * gr[d];
          vr[d] -= lr * gr[d] / std::sqrt(ar[d] + eps);
        }
      }
    };
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
    tensorflow::Shard(pool->num_threads, pool->workers, u, dim * 20, work);
  }
};

REGISTER_KERNEL_BUILDER(Name("GroupSparseApplyAdagrad").Device(DEVICE_CPU),
                        GroupSparseApplyAdagradOp);

}  // namespace group_embedding

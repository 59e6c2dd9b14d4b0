// Id conversion and packing, the kernels that turn a batch's ids into the
// ragged per-feature ids / row_splits / weights the fused lookups take
// (op names without their GroupEmbedding prefix):
//   UnpackIds     unpacks what `ge.pack_ids` packed in the input pipeline
//                 (Python: group_embedding/packed_ids.py). Each feature
//                 starts on a 64-byte boundary in the packed buffers, so
//                 its tensors are views of them: no copy (an unaligned
//                 start, possible only for hand-made inputs, is copied).
//   SparseToRagged  SparseTensor ids -> ragged, any index order (Python:
//                 ops/ragged_ids.py).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"
#include "op_checks.h"
#include "op_registration.h"

namespace group_embedding {
namespace {

GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingUnpackIds", "GroupUnpackIds",
    .Input("values: int64")
    .Input("row_splits: int64")
    .Input("offsets: int64")
    .Input("batch: int64")
    .Input("weights: float")
    .Output("ids: num_features * int64")
    .Output("splits: num_features * int64")
    // Empty tensors when the packed ids have no weights.
    .Output("feature_weights: num_features * float")
    .Attr("num_features: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      int n;
      TF_RETURN_IF_ERROR(c->GetAttr("num_features", &n));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 0, 1, 1));  // values
      TF_RETURN_IF_ERROR(InputsWithRank(c, 1, 1, 2));  // row_splits
      TF_RETURN_IF_ERROR(InputsWithRank(c, 2, 1, 1));  // offsets
      TF_RETURN_IF_ERROR(InputsWithRank(c, 3, 1, 0));  // batch
      TF_RETURN_IF_ERROR(InputsWithRank(c, 4, 1, 1));  // weights
      for (int i = 0; i < 3 * n; ++i) {
        c->set_output(i, c->Vector(c->UnknownDim()));
      }
      return Status();
    }));

// `source[begin, begin + size)` as a view, or as a copy when the view
// would not start on the alignment TF's kernels require.
Tensor SliceOrCopy(OpKernelContext* ctx, const Tensor& source, int64_t begin,
                   int64_t size, Status* status) {
  Tensor view = source.Slice(begin, begin + size);
  if (view.IsAligned()) return view;
  Tensor copy;
  *status = ctx->allocate_temp(source.dtype(), TensorShape({size}), &copy);
  if (status->ok() && size > 0) {
    std::memcpy(copy.data(), view.data(), view.TotalBytes());
  }
  return copy;
}

class UnpackIdsOp : public OpKernel {
 public:
  explicit UnpackIdsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_features", &k_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& values = ctx->input(0);
    const Tensor& splits = ctx->input(1);
    const Tensor& offsets = ctx->input(2);
    const Tensor& weights = ctx->input(4);
    OP_REQUIRES(ctx, values.dims() == 1 && splits.dims() == 2 &&
                         offsets.dims() == 1 && weights.dims() == 1,
                InvalidArgument("packed ids: values, offsets and weights "
                                "must be vectors and row_splits a matrix, "
                                "got shapes ", values.shape().DebugString(),
                                ", ", offsets.shape().DebugString(), ", ",
                                weights.shape().DebugString(), ", ",
                                splits.shape().DebugString(), "."));
    OP_REQUIRES_OK(ctx, CheckScalar(ctx->input(3), "packed ids: batch"));
    const int64_t n = values.NumElements();
    const int64_t batch = ctx->input(3).scalar<int64_t>()();
    const int64_t width = splits.dim_size(1);
    OP_REQUIRES(ctx, offsets.NumElements() == k_ && splits.dim_size(0) == k_,
                InvalidArgument("packed ids hold ", offsets.NumElements(),
                                " features (row_splits ", splits.dim_size(0),
                                ") but the lookup has ", k_, " tables."));
    OP_REQUIRES(ctx, batch >= 0 && batch < width,
                InvalidArgument("packed ids: batch ", batch,
                                " does not fit row_splits of width ", width,
                                "."));
    const bool weighted = weights.NumElements() != 0;
    OP_REQUIRES(ctx, !weighted || weights.NumElements() == n,
                InvalidArgument("packed ids: ", weights.NumElements(),
                                " weights for ", n, " values."));
    OpOutputList ids_out, splits_out, weights_out;
    OP_REQUIRES_OK(ctx, ctx->output_list("ids", &ids_out));
    OP_REQUIRES_OK(ctx, ctx->output_list("splits", &splits_out));
    OP_REQUIRES_OK(ctx, ctx->output_list("feature_weights", &weights_out));
    const int64_t* off = offsets.flat<int64_t>().data();
    Tensor flat_splits;  // the [K * width] vector, same buffer
    OP_REQUIRES_OK(ctx, flat_splits.BitcastFrom(splits, tensorflow::DT_INT64,
                                                TensorShape({k_ * width})));
    int64_t start = 0;  // where the previous feature's ids end
    for (int f = 0; f < k_; ++f) {
      const int64_t* s = splits.flat<int64_t>().data() + f * width;
      OP_REQUIRES(ctx, s[0] == 0,
                  InvalidArgument("packed ids: feature ", f,
                                  ": row_splits must start at 0, got ", s[0],
                                  "."));
      for (int64_t b = 1; b <= batch; ++b) {
        OP_REQUIRES(ctx, s[b] >= s[b - 1],
                    InvalidArgument("packed ids: feature ", f,
                                    ": row_splits must be non-decreasing."));
      }
      const int64_t count = s[batch];
      // Features in order, none overlapping the one before (the layout
      // `ge.pack_ids` makes, and the one the pure-TF path splits).
      OP_REQUIRES(ctx, off[f] >= start && off[f] <= n && count <= n - off[f],
                  InvalidArgument("packed ids: feature ", f, ": its ", count,
                                  " ids at offset ", off[f],
                                  " overflow the ", n, " packed values or "
                                  "overlap the previous feature (which ends "
                                  "at ", start, ")."));
      start = off[f] + count;
      Status status;
      ids_out.set(f, SliceOrCopy(ctx, values, off[f], count, &status));
      OP_REQUIRES_OK(ctx, status);
      // Row f of the matrix; a view when rows stay aligned (`ge.pack_ids`
      // pads them to a multiple of 8 splits).
      splits_out.set(f, SliceOrCopy(ctx, flat_splits, f * width, batch + 1,
                                    &status));
      OP_REQUIRES_OK(ctx, status);
      if (weighted) {
        weights_out.set(f, SliceOrCopy(ctx, weights, off[f], count, &status));
        OP_REQUIRES_OK(ctx, status);
      } else {
        Tensor* empty = nullptr;
        OP_REQUIRES_OK(ctx, weights_out.allocate(f, TensorShape({0}), &empty));
      }
    }
  }

 private:
  int k_;
};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingUnpackIds", "GroupUnpackIds",
    UnpackIdsOp);

// ---------------------------------------------------------------------------
// SparseTensor ids -> ragged (values grouped by row, row_splits) with a
// stable counting sort on the row index: O(nnz), any index order.
// ---------------------------------------------------------------------------
GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingSparseToRagged", "GroupSparseToRagged",
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
    }));

// Largest batch (dense_shape[0]) accepted: the lookups return [batch, D]
// tensors and row_splits of batch + 1 entries, so a larger one can never
// be allocated; rejecting it also keeps batch + 1 from overflowing.
constexpr int64_t kMaxBatch = int64_t{1} << 48;

class SparseToRaggedOp : public OpKernel {
 public:
  explicit SparseToRaggedOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
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

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingSparseToRagged", "GroupSparseToRagged",
    SparseToRaggedOp);

}  // namespace
}  // namespace group_embedding

// Unpacks the ids that `ge.pack_ids` packed in the input pipeline into the
// per-feature ids / row_splits / weights the fused lookups take. Each
// feature starts on a 64-byte boundary in the packed buffers, so its
// tensors are views of them: no copy (an unaligned start, possible only
// for hand-made inputs, is copied).

#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "pooling.h"

namespace group_embedding {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::errors::InvalidArgument;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::OpOutputList;
using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::shape_inference::InferenceContext;

REGISTER_OP("GroupUnpackIds")
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
    });

namespace {

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

}  // namespace

class GroupUnpackIdsOp : public OpKernel {
 public:
  explicit GroupUnpackIdsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
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

REGISTER_KERNEL_BUILDER(Name("GroupUnpackIds").Device(DEVICE_CPU),
                        GroupUnpackIdsOp);

}  // namespace group_embedding

// Duplicate-safe multithreaded sparse Adagrad on a plain resource variable
// and its accumulator. Python: ops/sparse_apply.py.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"
#include "id_map.h"
#include "pooling.h"
#include "op_registration.h"

namespace group_embedding {
namespace {

// ---------------------------------------------------------------------------
// Sparse Adagrad on a resource variable and its accumulator, with duplicate
// indices summed first (so the result equals the dense update) and rows
// updated in parallel:
//   accum += g^2;  var -= lr * g / sqrt(accum + epsilon)   (Keras' rule)
// ---------------------------------------------------------------------------
GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingSparseApplyAdagrad", "GroupSparseApplyAdagrad",
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
    }));

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

class SparseApplyAdagradOp : public OpKernel {
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

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingSparseApplyAdagrad", "GroupSparseApplyAdagrad",
    SparseApplyAdagradOp);

}  // namespace
}  // namespace group_embedding

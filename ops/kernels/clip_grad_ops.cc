// Backward of max_norm clipping for the plain-variable lookups (pooled and
// sequence): per-unique-id gradients of the clipped rows -> those of the
// table rows, read again here (the forward keeps no [nnz, D] copy).
// Python: ops/lookup_gradients.py.

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
    // ids_checked: see IdsCheckedAttr (op_checks.h).
    .Attr("ids_checked: bool = false")
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
    ClipGradInputs in;
    OP_REQUIRES_OK(ctx, in.Open(ctx));
    const int k = in.size();
    std::vector<const float*> tables(k);
    std::vector<const int64_t*> ids(k);
    std::vector<float*> outs(k);
    std::vector<int64_t> first(k + 1, 0);
    int64_t dim = -1;
    for (int t = 0; t < k; ++t) {
      const Tensor* table = nullptr;
      Tensor* o = nullptr;
      OP_REQUIRES_OK(ctx, in.Table(ctx, t, &dim, &table, &o));
      const Tensor& grads = in.id_grads(t);
      const int64_t u = in.unique_ids(t).NumElements();
      const int64_t* v = in.unique_ids(t).flat<int64_t>().data();
      const int64_t vocab = table->dim_size(0);
      for (int64_t j = 0; j < u; ++j) {
        OP_REQUIRES(ctx, v[j] >= 0 && v[j] < vocab,
                    InvalidArgument("table ", t, ": unique_ids ", v[j],
                                    " is out of range [0, ", vocab, ")."));
      }
      if (o->data() != grads.data() && u * dim > 0) {
        std::memcpy(o->data(), grads.data(), grads.TotalBytes());
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

}  // namespace
}  // namespace group_embedding

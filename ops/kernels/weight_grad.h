#ifndef GROUP_EMBEDDING_OPS_KERNELS_WEIGHT_GRAD_H_
#define GROUP_EMBEDDING_OPS_KERNELS_WEIGHT_GRAD_H_

// The gradient w.r.t. the per-id weights of one pooled table, with the
// checks of its inputs: shared by the plain-variable kernels
// (weight_grad_ops.cc) and the collective one (collective_ops.cc), which
// differ only in where an id's row is read from.

#include <cstdint>
#include <string>

#include "tensorflow/core/framework/op_kernel.h"
#include "op_checks.h"
#include "pooling.h"

namespace group_embedding {

// Table t of `in` (weighted, ragged inputs checked): checks its `grads` and
// `pooled` ([batch, dim]) and writes d/dw of its ids into `dw` ([nnz]);
// `row_of(j)` is id j's row (inlined per id).
template <typename RowOf>
Status PooledWeightGrad(const std::string& name, const RaggedGroup& in,
                        int t, const Tensor& grads, const Tensor& pooled,
                        Combiner combiner, int64_t dim, RowOf row_of,
                        float* dw, float max_norm = -1.0f) {
  const int64_t batch = in.batch(t);
  TF_RETURN_IF_ERROR(CheckMatrix(name + ": grads", grads, batch, dim));
  TF_RETURN_IF_ERROR(CheckMatrix(name + ": pooled", pooled, batch, dim));
  const auto grad_table =
      MakeGradTable(PooledGrads{grads.flat<float>().data(), dim},
                    in.splits[t], in.weights[t], in.nnz(t), combiner);
  WeightGradRows(grad_table, dim, pooled.flat<float>().data(), row_of, dw,
                 max_norm);
  return Status();
}

}  // namespace group_embedding

#endif  // GROUP_EMBEDDING_OPS_KERNELS_WEIGHT_GRAD_H_

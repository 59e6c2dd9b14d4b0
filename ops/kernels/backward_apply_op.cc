// GroupEmbeddingBackwardApply: a group's backward and its optimizer step
// as one op (issue 35.2), what `ge.optimizers` builds on a GPU in place of
// the gradient op's IndexedSlices and a sparse apply per table: the
// gradients of each table's distinct ids are summed and applied to the
// table and its slots in place, with no gradient written anywhere and
// one sort for the whole group.
//
// Only the interface is here: the kernel is the GPU adaptor's
// (ops/cuda/tf_gpu_kernels.cc, calling the core's ge_backward_apply),
// also built on the host stand-in under the "ge_host_core" label. The CPU
// path keeps the gradient op and ops/sparse_apply.py.

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace group_embedding {
namespace {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::InferenceContext;

REGISTER_OP("GroupEmbeddingBackwardApply")
    // The group's tables, in the lookup's order, updated in place.
    .Input("tables: num_tables * resource")
    // The optimizer's slots, slot-major: slot 0 of every table, then
    // slot 1 (Adagrad: accumulator; Adam: m, v; FTRL: accumulator,
    // linear; SGD: none). Each the shape of its table.
    .Input("slots: num_slots * resource")
    // The gradient of the lookup's outputs: pooled, [B, D] per table;
    // concat, one [B, K * D]; sequence, [B, T, D] per table.
    .Input("grads: num_grads * float")
    .Input("ids: num_tables * int64")
    .Input("row_splits: num_tables * int64")
    // Sequence lookups: each id's column; else none.
    .Input("positions: num_positions * int64")
    // Per-id weights, or an empty vector for a table without.
    .Input("weights: num_tables * float")
    // [lr, epsilon, beta_1, beta_2, l1, l2, l2_shrinkage, lr_power]; lr is
    // Adam's bias-corrected step size alpha. Read on the host.
    .Input("hyper: float")
    .Attr("num_tables: int >= 1")
    .Attr("num_slots: int >= 0")
    .Attr("num_grads: int >= 1")
    .Attr("num_positions: int >= 0")
    .Attr("layout: {'pooled', 'concat', 'sequence'}")
    .Attr("optimizer: {'sgd', 'adagrad', 'adam', 'ftrl'}")
    // Pooled and concat layouts: one per table; sequence: unused.
    .Attr("combiners: list(string) = []")
    .Attr("embedding_dim: int >= 1")
    .Attr("max_norm: float = -1")
    .Attr("table_names: list(string)")
    // ids_checked: see IdsCheckedAttr (op_checks.h); the forward of the
    // same step checked these ids.
    .Attr("ids_checked: bool = false")
    .SetShapeFn([](InferenceContext* c) {
      ::tensorflow::shape_inference::ShapeHandle hyper;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(c->num_inputs() - 1), 1,
                                     &hyper));
      return Status();
    });

}  // namespace
}  // namespace group_embedding

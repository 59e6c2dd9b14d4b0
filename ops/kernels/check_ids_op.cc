// GroupEmbeddingCheckIds: the ids of every group of a lookup call checked
// by ONE op (issue 35.3), so that a training step of several groups on
// the GPU kernels waits for its stream once: the forward ops, built after
// it with `ids_checked`, do not read their own error counts. It checks
// what the lookups check on the device (ids in [0, rows of the table),
// row_splits from 0 to the ids' count without decreasing, positions in
// [0, max_len)) and names the table and the id of an error as they do.
//
// Only the interface is here: the kernel is the GPU adaptor's
// (ops/cuda/tf_gpu_kernels.cc, the core's ge_check_ids), also built on
// the host stand-in under the "ge_host_core" label. The CPU kernels check
// their input without a wait and need no such op.

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"

namespace group_embedding {
namespace {

REGISTER_OP("GroupEmbeddingCheckIds")
    // The tables the ids index (their row counts bound the ids).
    .Input("tables: num_tables * resource")
    .Input("ids: num_tables * int64")
    .Input("row_splits: num_tables * int64")
    // A sequence table's id columns, else an empty vector.
    .Input("positions: num_tables * int64")
    // A sequence table's padded length T (a scalar, read on the host);
    // not read where positions are empty.
    .Input("max_lens: num_tables * int64")
    .Attr("num_tables: int >= 1")
    .Attr("table_names: list(string)")
    // Nothing consumes it: the lookups depend on it through control
    // edges, and it must never be pruned or merged with another.
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::NoOutputs);

}  // namespace
}  // namespace group_embedding

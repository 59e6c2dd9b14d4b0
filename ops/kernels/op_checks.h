#ifndef GROUP_EMBEDDING_OPS_KERNELS_OP_CHECKS_H_
#define GROUP_EMBEDDING_OPS_KERNELS_OP_CHECKS_H_

// Input checks and shape helpers shared by the kernels of ops/kernels/
// (and the TF adaptor of ops/cuda/): every kernel validates the rank and
// sizes of its inputs with these before it reads them, and every shape
// function refuses known wrong ranks at graph construction. No
// arithmetic here (that is pooling.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace group_embedding {

// The TF names every kernel file uses, for all of namespace
// group_embedding and the namespaces nested in it.
using ::tensorflow::core::RefCountPtr;
using ::tensorflow::DEVICE_CPU;
using ::tensorflow::errors::InvalidArgument;
using ::tensorflow::OpInputList;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::OpOutputList;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;
using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::Var;

// Reads the `max_norm` attr of a kernel: < 0 means no clipping.
inline Status GetMaxNorm(::tensorflow::OpKernelConstruction* ctx,
                         float* max_norm) {
  TF_RETURN_IF_ERROR(ctx->GetAttr("max_norm", max_norm));
  if (!std::isfinite(*max_norm)) {
    return InvalidArgument("max_norm must be finite, got ", *max_norm, ".");
  }
  return Status();
}

// The `ids_checked` attr of the ops a lookup's gradient function builds
// (its backward, the clip's backward, the table snapshot, the weight
// gradients): true when their ids, row_splits and positions are those of
// the forward lookup of the same step (or distinct ids of them), which
// checked them against the same tables and raised the error naming the
// table. The GPU kernels then do not wait for their stream to read their
// error counts again (issue 35.3: one host wait per training step, the
// forward's); the CPU kernels check anyway (their checks cost no wait).
// The forward lookups have it too: set when one GroupEmbeddingCheckIds
// checked the ids of all groups of the step (check_ids_op.cc).
// Default false: an op built by hand checks its own input.
inline Status IdsCheckedAttr(::tensorflow::OpKernelConstruction* ctx,
                             bool* checked) {
  if (!ctx->HasAttr("ids_checked")) {
    *checked = false;
    return Status();
  }
  return ctx->GetAttr("ids_checked", checked);
}

// The data of each tensor of an input list (null for an empty one, which
// is how unweighted tables pass their weights), taken once before the
// parallel loops: `Tensor::flat()` checks the dtype at every call, and
// called per output row it cost as much as the gathers themselves.
template <typename T>
std::vector<const T*> DataOf(const ::tensorflow::OpInputList& list) {
  std::vector<const T*> out(list.size());
  for (int i = 0; i < list.size(); ++i) {
    out[i] = list[i].NumElements() ? list[i].flat<T>().data() : nullptr;
  }
  return out;
}

// The first of v[0..n) outside [0, end), or nullptr. One unsigned compare
// per value (it also catches negatives) and no early exit, so the pass
// vectorises; the bad value is looked for only when there is one.
inline const int64_t* FirstOutside(const int64_t* v, int64_t n,
                                   uint64_t end) {
  bool bad = false;
  for (int64_t j = 0; j < n; ++j) bad |= static_cast<uint64_t>(v[j]) >= end;
  if (!bad) return nullptr;
  return std::find_if(v, v + n, [end](int64_t x) {
    return static_cast<uint64_t>(x) >= end;
  });
}

// Checks that every id of v[0..n) addresses a row of a table with
// `vocab` (>= 0) rows.
inline Status CheckIdRange(const std::string& name, const int64_t* v,
                           int64_t n, int64_t vocab) {
  const int64_t* bad = FirstOutside(v, n, static_cast<uint64_t>(vocab));
  if (bad == nullptr) return Status();
  return InvalidArgument(name, ": id ", *bad, " is out of range [0, ", vocab,
                         ") for this table.");
}

// Checks that ids/row_splits/weights of table `t` describe a ragged batch
// and that every id addresses a row of a table with `vocab` rows (any id
// when `vocab` < 0, as for EmbeddingVariable keys).
// `ids_arg` is how errors call the ids ("keys" for EmbeddingVariables).
inline Status CheckRagged(const std::string& name, const Tensor& ids,
                          const Tensor& splits,
                          const Tensor& weights, int64_t vocab,
                          const char* ids_arg = "ids") {
  if (ids.dims() != 1) {
    return InvalidArgument(name, ": ", ids_arg, " must be a vector, got shape ",
                           ids.shape().DebugString(), ".");
  }
  if (weights.dims() != 1) {
    return InvalidArgument(name, ": weights must be a vector, got shape ",
                           weights.shape().DebugString(), ".");
  }
  if (splits.dims() != 1 || splits.NumElements() < 1) {
    return InvalidArgument(name, ": row_splits must be a non-empty vector, "
                           "got shape ", splits.shape().DebugString(), ".");
  }
  const auto s = splits.flat<int64_t>();
  const int64_t nnz = ids.NumElements();
  if (s(0) != 0 || s(s.size() - 1) != nnz) {
    return InvalidArgument(name, ": row_splits must start at 0 and end at ",
                           nnz, " (number of ids), got ", s(0), "..",
                           s(s.size() - 1), ".");
  }
  for (int64_t b = 1; b < s.size(); ++b) {
    if (s(b) < s(b - 1)) {
      return InvalidArgument(name, ": row_splits must be non-decreasing.");
    }
  }
  if (weights.NumElements() != 0 && weights.NumElements() != nnz) {
    return InvalidArgument(name, ": has ", nnz, " ids but ",
                           weights.NumElements(), " weights.");
  }
  if (vocab >= 0) {
    return CheckIdRange(name, ids.flat<int64_t>().data(), nnz, vocab);
  }
  return Status();
}

// Shape functions: inputs [first, first + n) must all have rank `rank`
// (known ranks are checked at graph construction, before any kernel runs).
inline Status InputsWithRank(::tensorflow::shape_inference::InferenceContext* c,
                             int first, int n, int rank) {
  ::tensorflow::shape_inference::ShapeHandle unused;
  for (int i = first; i < first + n; ++i) {
    TF_RETURN_IF_ERROR(c->WithRank(c->input(i), rank, &unused));
  }
  return Status();
}

// Shape functions of the group lookups: their `num_tables` (n) and
// `embedding_dim` attrs.
inline Status GetGroupAttrs(::tensorflow::shape_inference::InferenceContext* c,
                            int* n, int64_t* dim) {
  TF_RETURN_IF_ERROR(c->GetAttr("num_tables", n));
  return c->GetAttr("embedding_dim", dim);
}

// Shape functions of the pooled lookups: output `output` is
// [rows of row_splits input `splits` - 1, width].
inline Status SetPooledShape(::tensorflow::shape_inference::InferenceContext* c,
                             int output, int splits, int64_t width) {
  ::tensorflow::shape_inference::DimensionHandle b;
  TF_RETURN_IF_ERROR(c->Subtract(c->Dim(c->input(splits), 0), 1, &b));
  c->set_output(output, c->MakeShape({b, c->MakeDim(width)}));
  return Status();
}

// Shape functions of the sequence lookups: output i is
// [rows of row_splits input (2n + i) - 1, max_lens input (4n + i), dim];
// both ops put row_splits and max_lens at those input positions.
inline Status SequenceOutputShapes(
    ::tensorflow::shape_inference::InferenceContext* c, int n, int64_t dim) {
  for (int i = 0; i < n; ++i) {
    ::tensorflow::shape_inference::DimensionHandle b, t;
    TF_RETURN_IF_ERROR(c->Subtract(c->Dim(c->input(2 * n + i), 0), 1, &b));
    TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(4 * n + i, &t));
    c->set_output(i, c->MakeShape({b, t, c->MakeDim(dim)}));
  }
  return Status();
}

// Shape functions of the per-unique-id backwards (pooled, concat,
// sequence): outputs [0, n) are the distinct ids of each table, [n, 2n)
// their gradient rows [distinct ids, dim].
inline void UniqueGradOutputShapes(
    ::tensorflow::shape_inference::InferenceContext* c, int n, int64_t dim) {
  for (int i = 0; i < n; ++i) {
    c->set_output(i, c->Vector(c->UnknownDim()));
    c->set_output(n + i, c->MakeShape({c->UnknownDim(), c->MakeDim(dim)}));
  }
}

// Checks that `t` is a scalar (rank 0); `what` names it.
inline Status CheckScalar(const Tensor& t, absl::string_view what) {
  if (t.dims() != 0) {
    return InvalidArgument(what, " must be a scalar, got shape ",
                           t.shape().DebugString(), ".");
  }
  return Status();
}

// Checks that `t` is a [rows, dim] matrix; `what` names it.
inline Status CheckMatrix(const std::string& what, const Tensor& t,
                          int64_t rows, int64_t dim) {
  if (t.dims() != 2 || t.dim_size(0) != rows || t.dim_size(1) != dim) {
    return InvalidArgument(what, " must have shape [", rows, ", ", dim,
                           "], got ", t.shape().DebugString(), ".");
  }
  return Status();
}

// Checks that `table` is a float32 [vocab, dim] matrix whose rows have
// `dim` floats (any width when `dim` < 0), before a kernel reads its rows.
inline Status CheckFloatTable(const std::string& name, const Tensor& table,
                              int64_t dim = -1) {
  if (table.dtype() == ::tensorflow::DT_FLOAT && table.dims() == 2 &&
      (dim < 0 || table.dim_size(1) == dim)) {
    return Status();
  }
  if (dim < 0) {
    return InvalidArgument(name, ": expected a float32 [vocab, dim] table, "
                           "got ", table.shape().DebugString());
  }
  return InvalidArgument(name, ": expected a float32 [vocab, ", dim,
                         "] table, got ", table.shape().DebugString());
}

// Checks that `positions` holds one slot in [0, max_len) per id.
inline Status CheckPositions(const std::string& name,
                             const Tensor& positions,
                             int64_t nnz, int64_t max_len) {
  if (positions.dims() != 1 || positions.NumElements() != nnz) {
    return InvalidArgument(name, ": positions must be a vector of ", nnz,
                           " entries (one per id), got shape ",
                           positions.shape().DebugString(), ".");
  }
  const int64_t* p = positions.flat<int64_t>().data();
  for (int64_t j = 0; j < nnz; ++j) {
    if (p[j] < 0 || p[j] >= max_len) {
      return InvalidArgument(name, ": position ", p[j], " of id ", j,
                             " is outside the padded length [0, ", max_len,
                             ").");
    }
  }
  return Status();
}

// Checks a sequence lookup's padded length `max_len_t` (a scalar >= 0)
// and `positions`; gives the length and the [batch, T, dim] output shape,
// refused when its size overflows int64.
inline Status SequenceShape(const std::string& name, const Tensor& max_len_t,
                            const Tensor& positions, int64_t nnz,
                            int64_t batch, int64_t dim, int64_t* len,
                            TensorShape* shape) {
  TF_RETURN_IF_ERROR(CheckScalar(max_len_t, "max_lens"));
  *len = max_len_t.scalar<int64_t>()();
  if (*len < 0) {
    return InvalidArgument(name, ": max_lens (the padded length) must be "
                           ">= 0, got ", *len, ".");
  }
  TF_RETURN_IF_ERROR(CheckPositions(name, positions, nnz, *len));
  return TensorShape::BuildTensorShape({batch, *len, dim}, shape);
}

// Checks that every table has the batch size of table 0 (a concatenated
// layout has one row per example for all tables); `names` may be empty.
inline Status CheckSameBatch(const std::vector<std::string>& names,
                             const ::tensorflow::OpInputList& splits) {
  const int64_t batch = splits[0].NumElements() - 1;
  for (int t = 1; t < splits.size(); ++t) {
    if (splits[t].NumElements() - 1 != batch) {
      return InvalidArgument(
          names.empty() ? absl::StrCat("table ", t) : names[t], ": has ",
          splits[t].NumElements() - 1, " rows but ",
          names.empty() ? std::string("table 0") : names[0], " has ", batch,
          "; a concatenated output needs equal batch sizes.");
    }
  }
  return Status();
}

// Checks that `grads` is the [batch, T, dim] gradient of a sequence
// output; gives T.
inline Status CheckSequenceGrad(const std::string& name, const Tensor& grads,
                                int64_t batch, int64_t dim, int64_t* len) {
  if (grads.dims() != 3 || grads.dim_size(0) != batch ||
      grads.dim_size(2) != dim) {
    return InvalidArgument(name, ": grads must have shape [", batch,
                           ", max_len, ", dim, "], got ",
                           grads.shape().DebugString(), ".");
  }
  *len = grads.dim_size(1);
  return Status();
}

// The ragged id inputs of a group op, one tensor per table in each list,
// read and checked once by ReadRaggedGroup. Lists the op does not have
// stay empty.
struct RaggedGroup {
  ::tensorflow::OpInputList ids;        // [nnz] ("ids", or "keys" of EVs)
  ::tensorflow::OpInputList splits;     // [batch + 1], 0 .. nnz
  ::tensorflow::OpInputList weights;    // [nnz], or [0]: unweighted
  ::tensorflow::OpInputList positions;  // [nnz] column of each id
  ::tensorflow::OpInputList max_lens;   // scalar padded length T
  // With max_lens: each table's T and its [batch, T, dim] output shape.
  std::vector<int64_t> lens;
  std::vector<TensorShape> sequence_shapes;

  int size() const { return ids.size(); }
  int64_t nnz(int t) const { return ids[t].NumElements(); }
  int64_t batch(int t) const { return splits[t].NumElements() - 1; }
  // Table t's weights: an empty tensor (unweighted) for an op without.
  const Tensor& weights_of(int t) const {
    static const Tensor* const kNone =
        new Tensor(::tensorflow::DT_FLOAT, TensorShape({0}));
    return weights.size() ? weights[t] : *kNone;
  }
  // Its data, nullptr when unweighted (how the pooling reads weights).
  const float* weight_data(int t) const {
    const Tensor& w = weights_of(t);
    return w.NumElements() ? w.flat<float>().data() : nullptr;
  }
};

// Which lists ReadRaggedGroup reads besides ids and row_splits.
enum RaggedLists : unsigned {
  kWithWeights = 1,    // "weights"
  kWithPositions = 2,  // "positions", checked by the caller (its T comes
                       // from elsewhere, e.g. the gradient's shape)
  kWithMaxLens = 4,    // "positions" and "max_lens", checked here
};

// Reads a group op's ragged inputs: lists `ids_arg` ("ids", or "keys"
// for EmbeddingVariables) and "row_splits", plus those `lists` names, and
// checks every table's before any is read: ids, row_splits and weights
// (CheckRagged; ids are not range-checked here, `vocab` is the caller's),
// positions and max_lens with kWithMaxLens (SequenceShape: T >= 0, every
// position in [0, T), the output size within int64). Errors name table t
// as `name_of(t)`.
template <typename NameOf>
Status ReadRaggedGroup(::tensorflow::OpKernelContext* ctx,
                       const char* ids_arg, unsigned lists, int64_t dim,
                       NameOf&& name_of, RaggedGroup* g) {
  TF_RETURN_IF_ERROR(ctx->input_list(ids_arg, &g->ids));
  TF_RETURN_IF_ERROR(ctx->input_list("row_splits", &g->splits));
  if (lists & kWithWeights) {
    TF_RETURN_IF_ERROR(ctx->input_list("weights", &g->weights));
  }
  if (lists & (kWithPositions | kWithMaxLens)) {
    TF_RETURN_IF_ERROR(ctx->input_list("positions", &g->positions));
  }
  if (lists & kWithMaxLens) {
    TF_RETURN_IF_ERROR(ctx->input_list("max_lens", &g->max_lens));
  }
  const int k = g->size();
  g->lens.assign(k, 0);
  g->sequence_shapes.assign(k, TensorShape());
  for (int t = 0; t < k; ++t) {
    const std::string name = name_of(t);
    TF_RETURN_IF_ERROR(CheckRagged(name, g->ids[t], g->splits[t],
                                   g->weights_of(t), /*vocab=*/-1, ids_arg));
    if (lists & kWithMaxLens) {
      TF_RETURN_IF_ERROR(SequenceShape(name, g->max_lens[t], g->positions[t],
                                       g->nnz(t), g->batch(t), dim,
                                       &g->lens[t], &g->sequence_shapes[t]));
    }
  }
  return Status();
}

// ReadRaggedGroup naming table t "table t" (ops without table names).
inline Status ReadRaggedGroup(::tensorflow::OpKernelContext* ctx,
                              const char* ids_arg, unsigned lists,
                              int64_t dim, RaggedGroup* g) {
  return ReadRaggedGroup(ctx, ids_arg, lists, dim,
                         [](int t) { return absl::StrCat("table ", t); }, g);
}

}  // namespace group_embedding

#endif  // GROUP_EMBEDDING_OPS_KERNELS_OP_CHECKS_H_

#ifndef GROUP_EMBEDDING_OPS_KERNELS_POOLING_H_
#define GROUP_EMBEDDING_OPS_KERNELS_POOLING_H_

// Pooling helpers shared by the fused lookups of plain variables
// (group_embedding_ops.cc) and of EmbeddingVariables (ev_lookup_ops.cc),
// so that both pool with exactly the same arithmetic.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace group_embedding {

using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::errors::InvalidArgument;

enum Combiner { kSum = 0, kMean = 1, kSqrtn = 2 };

inline Status ParseCombiners(const std::vector<std::string>& names,
                             std::vector<Combiner>* out) {
  for (const auto& n : names) {
    if (n == "sum") {
      out->push_back(kSum);
    } else if (n == "mean") {
      out->push_back(kMean);
    } else if (n == "sqrtn") {
      out->push_back(kSqrtn);
    } else {
      return InvalidArgument("Invalid combiner '", n,
                             "', use one of sum, mean, sqrtn.");
    }
  }
  return Status();
}

// Factor applied to every id of a row so that the pooled row equals
// stock tf.nn.embedding_lookup_sparse; 0 for an empty row (stock would
// divide 0 by 0, we return zeros).
inline float RowScale(Combiner c, const float* w, int64_t begin,
                      int64_t end) {
  if (c == kSum || end == begin) return 1.0f;
  double s = 0.0;
  if (w == nullptr) {
    s = static_cast<double>(end - begin);
    if (c == kSqrtn) s = std::sqrt(s);
  } else if (c == kMean) {
    for (int64_t j = begin; j < end; ++j) s += w[j];
  } else {
    for (int64_t j = begin; j < end; ++j) s += double(w[j]) * w[j];
    s = std::sqrt(s);
  }
  return s == 0.0 ? 0.0f : static_cast<float>(1.0 / s);
}

// Reads the `max_norm` attr of a kernel: < 0 means no clipping.
inline Status GetMaxNorm(::tensorflow::OpKernelConstruction* ctx,
                         float* max_norm) {
  TF_RETURN_IF_ERROR(ctx->GetAttr("max_norm", max_norm));
  if (!std::isfinite(*max_norm)) {
    return InvalidArgument("max_norm must be finite, got ", *max_norm, ".");
  }
  return Status();
}

// max_norm clipping, as stock embedding_lookup(max_norm=c) applies it to
// each looked-up row e before pooling (clip_by_norm):
//   clip(e) = e * c / max(|e|, c)
// Returns that factor c / max(|e|, c); 1 when clipping is off (c < 0).
// float32 sums of squares, as stock's reduce_sum.
inline float ClipFactor(const float* row, int64_t dim, float max_norm) {
  if (max_norm < 0.0f) return 1.0f;
  float ss = 0.0f;
  for (int64_t d = 0; d < dim; ++d) ss += row[d] * row[d];
  return max_norm / std::max(std::sqrt(ss), max_norm);
}

// Backward of the clip for one row e with incoming gradient g (the sum of
// its occurrences' gradients: the clip is linear in g), differentiating
// as stock does through e * c / maximum(|e|, c). TF's Maximum gradient
// goes to |e| when |e| >= c, so there
//   g' = (c / n) * (g - e * (e.g) / n^2),  n = |e|,
// and below it the clip is the identity (g' = g). Rewrites g in place.
inline void ClipGradRow(const float* e, int64_t dim, float max_norm,
                        float* g) {
  if (max_norm < 0.0f) return;
  float ss = 0.0f, eg = 0.0f;
  for (int64_t d = 0; d < dim; ++d) {
    ss += e[d] * e[d];
    eg += e[d] * g[d];
  }
  const float n = std::sqrt(ss);
  // A zero row (n = 0 < c) takes the identity branch, as stock's.
  if (!(n >= max_norm) || n == 0.0f) return;
  const float a = max_norm / n;
  const float b = eg / ss;
  for (int64_t d = 0; d < dim; ++d) g[d] = a * (g[d] - e[d] * b);
}

// Issues prefetches for every cache line of a `dim`-float row. Lookups
// and updates touch rows at random in tables far larger than the caches;
// fetching a few ids ahead overlaps those DRAM misses.
inline void PrefetchRow(const float* row, int64_t dim) {
  for (int64_t d = 0; d < dim; d += 16) __builtin_prefetch(row + d);
  // Rows need not start on a cache line: fetch the line of the last one.
  __builtin_prefetch(row + dim - 1);
}
// 16 ids ahead measured faster than 8 on the criteo-like step (rows at
// random, ~25 ns each per thread: 8 ahead was not enough to hide DRAM).
constexpr int64_t kPrefetchDistance = 16;

// dst[0, n) += f * src[0, n), for rows that do not overlap. With a
// compile-time `n` of 16 (one vector), GCC 12 unrolled a plain loop first
// and then left it scalar (16 scalar FMAs per row, seen in the backward's
// disassembly); kept a loop, it becomes one vector operation per vector.
inline void AddScaledRow(float* __restrict dst, const float* __restrict src,
                         float f, int64_t n) {
#pragma GCC unroll 1
  for (int64_t d = 0; d < n; ++d) dst[d] += f * src[d];
}

// Calls `f(std::integral_constant<int64_t, D>())` with D = `dim` for the
// usual embedding widths, so that loops over a row unroll and keep their
// sums in registers; with D = 0 (width read at run time) for the others.
template <typename F>
inline void WithStaticDim(int64_t dim, F&& f) {
  switch (dim) {
    case 8:
      return f(std::integral_constant<int64_t, 8>());
    case 16:
      return f(std::integral_constant<int64_t, 16>());
    case 32:
      return f(std::integral_constant<int64_t, 32>());
    case 64:
      return f(std::integral_constant<int64_t, 64>());
    case 128:
      return f(std::integral_constant<int64_t, 128>());
    default:
      return f(std::integral_constant<int64_t, 0>());
  }
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
    const auto v = ids.flat<int64_t>();
    for (int64_t j = 0; j < nnz; ++j) {
      if (v(j) < 0 || v(j) >= vocab) {
        return InvalidArgument(name, ": id ", v(j),
                               " is out of range [0, ", vocab,
                               ") for this table.");
      }
    }
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

// Checks that `t` is a scalar (rank 0); `what` names it.
inline Status CheckScalar(const Tensor& t, const char* what) {
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

// d loss / d w_j of one weighted table, given the gradient `g` of the
// pooled rows `p` ([B, dim] each) and `row_of(j)`, the row id j read:
//   pooled_b = sum_j w_j e_j / n_b,  n_b = 1 | sum_j w_j | sqrt(sum_j w_j^2)
//   d/dw_j = (e_j.g_b - pooled_b.g_b * dn_b/dw_j) / n_b
// With max_norm >= 0, e_j is the clipped row (as pooled), and so is the
// row it multiplies here.
template <typename RowOf>
void WeightGradRows(Combiner c, int64_t dim, int64_t batch,
                    const int64_t* s, const float* w, const float* g,
                    const float* p, RowOf row_of, float* dw,
                    float max_norm = -1.0f) {
  for (int64_t b = 0; b < batch; ++b) {
    const float* gb = g + b * dim;
    const float scale = RowScale(c, w, s[b], s[b + 1]);
    float pg = 0.0f;
    for (int64_t d = 0; d < dim; ++d) pg += p[b * dim + d] * gb[d];
    for (int64_t j = s[b]; j < s[b + 1]; ++j) {
      const float* row = row_of(j);
      float eg = 0.0f;
      for (int64_t d = 0; d < dim; ++d) eg += row[d] * gb[d];
      eg *= ClipFactor(row, dim, max_norm);
      switch (c) {
        case kSum:
          dw[j] = eg;
          break;
        case kMean:
          dw[j] = (eg - pg) * scale;
          break;
        case kSqrtn:
          dw[j] = (eg - pg * w[j] * scale) * scale;
          break;
      }
    }
  }
}

}  // namespace group_embedding

#endif  // GROUP_EMBEDDING_OPS_KERNELS_POOLING_H_

#ifndef GROUP_EMBEDDING_OPS_KERNELS_POOLING_H_
#define GROUP_EMBEDDING_OPS_KERNELS_POOLING_H_

// Pooling helpers shared by the fused lookups of plain variables
// (group_embedding_ops.cc) and of EmbeddingVariables (ev_lookup_ops.cc),
// so that both pool with exactly the same arithmetic.

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace group_embedding {

using ::tensorflow::Status;
using ::tensorflow::Tensor;
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

// Issues prefetches for every cache line of a `dim`-float row. Lookups
// and updates touch rows at random in tables far larger than the caches;
// fetching a few ids ahead overlaps those DRAM misses.
inline void PrefetchRow(const float* row, int64_t dim) {
  for (int64_t d = 0; d < dim; d += 16) __builtin_prefetch(row + d);
  // Rows need not start on a cache line: fetch the line of the last one.
  __builtin_prefetch(row + dim - 1);
}
constexpr int64_t kPrefetchDistance = 8;

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

// Checks that `t` is a scalar (rank 0); `what` names it. (rank 0); `what` names it.
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

// d loss / d w_j of one weighted table, given the gradient `g` of the
// pooled rows `p` ([B, dim] each) and `row_of(j)`, the row id j read:
//   pooled_b = sum_j w_j e_j / n_b,  n_b = 1 | sum_j w_j | sqrt(sum_j w_j^2)
//   d/dw_j = (e_j.g_b - pooled_b.g_b * dn_b/dw_j) / n_b
template <typename RowOf>
void WeightGradRows(Combiner c, int64_t dim, int64_t batch,
                    const int64_t* s, const float* w, const float* g,
                    const float* p, RowOf row_of, float* dw) {
  for (int64_t b = 0; b < batch; ++b) {
    const float* gb = g + b * dim;
    const float scale = RowScale(c, w, s[b], s[b + 1]);
    float pg = 0.0f;
    for (int64_t d = 0; d < dim; ++d) pg += p[b * dim + d] * gb[d];
    for (int64_t j = s[b]; j < s[b + 1]; ++j) {
      const float* row = row_of(j);
      float eg = 0.0f;
      for (int64_t d = 0; d < dim; ++d) eg += row[d] * gb[d];
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

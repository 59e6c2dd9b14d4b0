#ifndef GROUP_EMBEDDING_OPS_KERNELS_COMBINER_MATH_H_
#define GROUP_EMBEDDING_OPS_KERNELS_COMBINER_MATH_H_

// The combiner and max_norm arithmetic of every lookup, without any
// framework header: the CPU kernels (pooling.h) and the CUDA core
// (../cuda/embedding_math.h, on the device and in the host stand-in)
// compute a pooled row's scale, a row's clip, the clip's backward and a
// weight's gradient with these functions, so the paths cannot drift.
//
// NaN and inf follow stock TF (tf.nn.embedding_lookup_sparse with
// max_norm, i.e. tf.clip_by_norm: t * c / maximum(|t|, c), and its
// gradient): a row with a NaN pools to NaN in every column when clipped,
// and its clip gradient is NaN; a row with an inf clips to 0 (NaN where
// the inf was) and its clip gradient is NaN.

#include <math.h>
#include <stdint.h>

// Forced inline on the host too: these run per id and per row in the
// kernels' hot loops, and left to GCC's heuristics the clipped mean /
// sqrtn pooling at dim 16 lost 25% (measured against the copies these
// replace, which were inlined).
#if !defined(GE_HD)
#if defined(__CUDACC__)
#define GE_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define GE_HD inline __attribute__((always_inline))
#else
#define GE_HD inline
#endif
#endif

namespace group_embedding {

// The combiners, numbered as the CUDA core's GeCombiner.
enum Combiner { kSum = 0, kMean = 1, kSqrtn = 2 };

// Factor applied to every id of a row so that the pooled row equals
// stock tf.nn.embedding_lookup_sparse, from the row's id count and weight
// sums (double: float sums of many weights drift): 1 for sum, 0 for an
// empty row or a zero sum (stock would divide 0 by 0, we return zeros).
// `wsum` is read for a weighted mean only, `w2sum` (the sum of squares)
// for a weighted sqrtn only.
GE_HD float RowScale(int combiner, bool weighted, int64_t count, double wsum,
                     double w2sum) {
  if (combiner == kSum || count == 0) return 1.0f;
  double s;
  if (!weighted) {
    s = static_cast<double>(count);
    if (combiner == kSqrtn) s = sqrt(s);
  } else {
    s = combiner == kMean ? wsum : sqrt(w2sum);
  }
  return s == 0.0 ? 0.0f : static_cast<float>(1.0 / s);
}

// The same for ids [begin, end) with weights `w` (nullptr: unweighted),
// summing only what the combiner reads.
GE_HD float RowScale(int combiner, const float* w, int64_t begin,
                     int64_t end) {
  if (combiner == kSum || end == begin) return 1.0f;
  double wsum = 0.0, w2sum = 0.0;
  if (w != nullptr && combiner == kMean) {
    for (int64_t j = begin; j < end; ++j) wsum += w[j];
  } else if (w != nullptr) {
    for (int64_t j = begin; j < end; ++j) w2sum += double(w[j]) * w[j];
  }
  return RowScale(combiner, w != nullptr, end - begin, wsum, w2sum);
}

// max_norm clip of a row e with squared norm `ss` (float32, as stock's
// reduce_sum): clip(e) = e * c / max(|e|, c). Returns that factor;
// 1 when clipping is off (c < 0). The max is `n < c ? c : n`, not fmaxf:
// like tf.maximum it keeps a NaN norm, so a NaN row stays NaN in every
// column (fmaxf would return c and leave its other columns unclipped).
GE_HD float ClipFactor(float ss, float max_norm) {
  if (max_norm < 0.0f) return 1.0f;
  const float n = sqrtf(ss);
  return max_norm / (n < max_norm ? max_norm : n);
}

// Whether the clip's backward at a row of norm `n` is the identity: no
// clipping, a row below the bound (TF's Maximum gradient then goes to c),
// or a zero row. False for a NaN norm: stock's gradient is then NaN, and
// ClipGradOf gives NaN.
GE_HD bool ClipGradIsIdentity(float n, float max_norm) {
  return max_norm < 0.0f || n < max_norm || n == 0.0f;
}

// Backward of the clip for a row e (squared norm ss) and the gradient g
// of its clipped row (eg = e.g), differentiating as stock does through
// e * c / maximum(|e|, c):
//   g' = a * (g - e * b),  a = c / n, b = (e.g) / n^2,  n = |e| >= c,
// and the identity (a = 1, b = 0) where ClipGradIsIdentity.
struct ClipGrad {
  float a, b;
};
GE_HD ClipGrad ClipGradOf(float ss, float eg, float max_norm) {
  const float n = sqrtf(ss);
  if (ClipGradIsIdentity(n, max_norm)) return {1.0f, 0.0f};
  return {max_norm / n, eg / ss};
}

// d loss / d w_j of one weighted id, given eg = clip(e_j).g_b, the pooled
// row's pg = pooled_b.g_b, its weight w and its row's scale (RowScale):
//   pooled_b = sum_j w_j e_j / n_b,  n_b = 1 | sum_j w_j | sqrt(sum w_j^2)
//   d/dw_j = (e_j.g_b - pooled_b.g_b * dn_b/dw_j) / n_b
GE_HD float WeightGrad(int combiner, float eg, float pg, float w,
                       float scale) {
  switch (combiner) {
    case kMean:
      return (eg - pg) * scale;
    case kSqrtn:
      return (eg - pg * w * scale) * scale;
    default:
      return eg;
  }
}

}  // namespace group_embedding

#endif  // GROUP_EMBEDDING_OPS_KERNELS_COMBINER_MATH_H_

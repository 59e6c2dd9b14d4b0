#ifndef GROUP_EMBEDDING_OPS_CUDA_EMBEDDING_MATH_H_
#define GROUP_EMBEDDING_OPS_CUDA_EMBEDDING_MATH_H_

// Per-row and per-element arithmetic of the CUDA core, compiled for the
// device (lookup_kernels.cu) and for the host stand-in (host_core.cc), so
// that both compute exactly the same formulas. They restate those of the
// CPU kernels (ops/kernels/pooling.h, ev_apply_ops.cc): the parity tests
// compare all three.

#include <math.h>
#include <stdint.h>

#include "group_embedding_cuda.h"

#if defined(__CUDACC__)
#define GE_HD __host__ __device__ __forceinline__
#else
#define GE_HD inline
#endif

namespace ge_math {

// Combiner factor of a row from its id count and weight sums (double, as
// the CPU kernel sums them): 1 for sum, 0 for an empty row (stock would
// divide 0 by 0; we return zeros).
GE_HD float RowScale(int combiner, bool weighted, int64_t count,
                     double wsum, double w2sum) {
  if (combiner == GE_SUM || count == 0) return 1.0f;
  double s;
  if (!weighted) {
    s = static_cast<double>(count);
    if (combiner == GE_SQRTN) s = sqrt(s);
  } else {
    s = combiner == GE_MEAN ? wsum : sqrt(w2sum);
  }
  return s == 0.0 ? 0.0f : static_cast<float>(1.0 / s);
}

// max_norm clip of a row with squared norm `ss`: the factor
// c / max(|e|, c); 1 when clipping is off (c < 0).
GE_HD float ClipFactor(float ss, float max_norm) {
  if (max_norm < 0.0f) return 1.0f;
  return max_norm / fmaxf(sqrtf(ss), max_norm);
}

// Backward of the clip for row e (squared norm ss) and gradient g
// (eg = e.g): g' = a * (g - e * b). Below the norm the clip is the
// identity (a = 1, b = 0), as stock's Maximum gradient gives.
struct ClipGrad {
  float a, b;
};
GE_HD ClipGrad ClipGradOf(float ss, float eg, float max_norm) {
  const float n = sqrtf(ss);
  if (max_norm < 0.0f || !(n >= max_norm) || n == 0.0f) return {1.0f, 0.0f};
  return {max_norm / n, eg / ss};
}

// d loss / d w_j of a pooled row: eg = clip(e_j).g_b, pg = pooled_b.g_b.
GE_HD float WeightGrad(int combiner, float eg, float pg, float w,
                       float scale) {
  switch (combiner) {
    case GE_MEAN:
      return (eg - pg) * scale;
    case GE_SQRTN:
      return (eg - pg * w * scale) * scale;
    default:
      return eg;
  }
}

// x^(-lr_power), with the usual -0.5 as a square root (as TF's FTRL).
GE_HD float FtrlPow(float x, float lr_power) {
  return lr_power == -0.5f ? sqrtf(x) : powf(x, -lr_power);
}

// One element of a sparse optimizer update: value v, slots s0 / s1,
// summed gradient g. The rules of ops/kernels/ev_apply_ops.cc and
// ops/sparse_apply.py (Keras' Adagrad, TF's ApplyFtrlV2).
GE_HD void ApplyElement(const GeOptimizerConfig& o, float* v, float* s0,
                        float* s1, float g) {
  switch (o.kind) {
    case GE_OPT_SGD:
      *v -= o.lr * g;
      break;
    case GE_OPT_ADAGRAD:
      *s0 += g * g;
      *v -= o.lr * g / sqrtf(*s0 + o.epsilon);
      break;
    case GE_OPT_ADAM:
      *s0 += (g - *s0) * (1.0f - o.beta1);
      *s1 += (g * g - *s1) * (1.0f - o.beta2);
      *v -= o.lr * *s0 / (sqrtf(*s1) + o.epsilon);
      break;
    case GE_OPT_FTRL: {
      const float gs = g + 2.0f * o.l2_shrinkage * *v;
      const float na = *s0 + g * g;
      *s1 += gs - (FtrlPow(na, o.lr_power) - FtrlPow(*s0, o.lr_power)) /
                      o.lr * *v;
      const float clipped = fminf(fmaxf(*s1, -o.l1), o.l1);
      const float quad = FtrlPow(na, o.lr_power) / o.lr + 2.0f * o.l2;
      *v = (clipped - *s1) / quad;
      *s0 = na;
      break;
    }
    default:
      break;
  }
}

// Slots an optimizer needs (0, 1 or 2).
GE_HD int SlotsOf(int kind) {
  return kind == GE_OPT_SGD ? 0 : kind == GE_OPT_ADAGRAD ? 1 : 2;
}

// Bits of the radix-sort key of a group with `total_rows` rows: keys are
// row_base[t] + id < total_rows, and the all-ones key of that width
// marks an occurrence to skip (bad id), sorting after every valid one.
GE_HD int KeyBits(uint64_t total_rows) {
  int bits = 1;
  while (bits < 64 && ((uint64_t{1} << bits) - 1) < total_rows) ++bits;
  return bits;
}

}  // namespace ge_math

#endif  // GROUP_EMBEDDING_OPS_CUDA_EMBEDDING_MATH_H_

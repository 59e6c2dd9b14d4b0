#ifndef GROUP_EMBEDDING_OPS_CUDA_EMBEDDING_MATH_H_
#define GROUP_EMBEDDING_OPS_CUDA_EMBEDDING_MATH_H_

// Per-row and per-element arithmetic of the CUDA core, compiled for the
// device (lookup_kernels.cu, backward_kernels.cu) and for the host
// stand-in (host_core.cc). The combiner and clip formulas are the CPU
// kernels' own (../kernels/combiner_math.h, host and device clean); the
// optimizer rules restate ops/kernels/ev_apply_ops.cc. The parity tests
// compare all three.

#include <math.h>
#include <stdint.h>

#include "group_embedding_cuda.h"
#include "../kernels/combiner_math.h"  // defines GE_HD

static_assert(GE_SUM == group_embedding::kSum &&
                  GE_MEAN == group_embedding::kMean &&
                  GE_SQRTN == group_embedding::kSqrtn,
              "GeCombiner must number the combiners as combiner_math.h");

namespace ge_math {

using group_embedding::ClipFactor;
using group_embedding::ClipGrad;
using group_embedding::ClipGradOf;
using group_embedding::RowScale;
using group_embedding::WeightGrad;

// x^(-lr_power), with the usual -0.5 as a square root (as TF's FTRL).
GE_HD float FtrlPow(float x, float lr_power) {
  return lr_power == -0.5f ? sqrtf(x) : powf(x, -lr_power);
}

// Whether a row's AdagradDecay update decays its accumulator first: its
// decay power (element 0 of its slot1 row, `power_row`) is behind the
// period. Every element of the row must see the power before the row's
// update adds one to it (the caller's job, after the row).
GE_HD bool DecaysRow(const GeOptimizerConfig& o, const float* power_row) {
  return o.kind == GE_OPT_ADAGRAD_DECAY && o.l1 > power_row[0];
}

// One element of a sparse optimizer update: value v, slots s0 / s1,
// summed gradient g; `decay`: DecaysRow of the element's row. The rules
// of ops/kernels/ev_apply_ops.cc and ops/sparse_apply.py (Keras'
// Adagrad, TF's ApplyFtrlV2).
GE_HD void ApplyElement(const GeOptimizerConfig& o, float* v, float* s0,
                        float* s1, float g, bool decay = false) {
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
    case GE_OPT_ADAGRAD_DECAY:
      // s1 (the power) is the row's, not the element's: left to the
      // caller.
      if (decay) *s0 = fmaxf(*s0 * o.beta1, o.beta2);
      *s0 += g * g;
      *v -= o.lr * g / sqrtf(*s0);
      break;
    default:
      break;
  }
}

// Slots an optimizer needs (0, 1 or 2; AdagradDecay's second holds the
// decay power).
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

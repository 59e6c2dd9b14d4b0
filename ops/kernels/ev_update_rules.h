#ifndef GROUP_EMBEDDING_OPS_KERNELS_EV_UPDATE_RULES_H_
#define GROUP_EMBEDDING_OPS_KERNELS_EV_UPDATE_RULES_H_

// The per-row optimizer updates of EmbeddingVariables, shared by the
// per-variable updates (ev_apply_ops.cc) and the fused backward-apply of a
// group (ev_backward_apply_op.cc), so that both paths give bitwise the
// same rows and slots. Each is called once per distinct admitted key as
// `update(value row, summed gradient row, slot rows, dim)`.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "ev_storage.h"
#include "pooling.h"

namespace group_embedding {
namespace ev {

// var -= lr * g
struct SgdUpdate {
  float lr;
  void operator()(float* v, const float* g, float* const*,
                  int64_t dim) const {
    for (int64_t d = 0; d < dim; ++d) v[d] -= lr * g[d];
  }
};

// accum += g^2; var -= lr * g / sqrt(accum + epsilon)  (Keras' rule)
struct AdagradUpdate {
  float lr;
  float eps;
  void operator()(float* v, const float* g, float* const* s,
                  int64_t dim) const {
    float* a = s[0];
    for (int64_t d = 0; d < dim; ++d) {
      a[d] += g[d] * g[d];
      v[d] -= lr * g[d] / std::sqrt(a[d] + eps);
    }
  }
};

// m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
// var -= alpha * m / (sqrt(v) + epsilon), alpha bias-corrected by caller.
struct AdamUpdate {
  float alpha;
  float b1;
  float b2;
  float eps;
  void operator()(float* v, const float* g, float* const* s,
                  int64_t dim) const {
    float* m = s[0];
    float* u = s[1];
    for (int64_t d = 0; d < dim; ++d) {
      m[d] += (g[d] - m[d]) * (1.0f - b1);
      u[d] += (g[d] * g[d] - u[d]) * (1.0f - b2);
      v[d] -= alpha * m[d] / (std::sqrt(u[d]) + eps);
    }
  }
};

// TF's ApplyFtrlV2 on one row (slots: accumulator, linear).
struct FtrlUpdate {
  float lr;
  float l1;
  float l2;
  float shrink;
  float power;
  float Pow(float x) const {
    return power == -0.5f ? std::sqrt(x) : std::pow(x, -power);
  }
  void operator()(float* v, const float* g, float* const* s,
                  int64_t dim) const {
    float* acc = s[0];
    float* lin = s[1];
    for (int64_t d = 0; d < dim; ++d) {
      const float gs = g[d] + 2.0f * shrink * v[d];
      const float na = acc[d] + g[d] * g[d];
      lin[d] += gs - (Pow(na) - Pow(acc[d])) / lr * v[d];
      const float clipped = std::min(std::max(lin[d], -l1), l1);
      const float quad = Pow(na) / lr + 2.0f * l2;
      v[d] = (clipped - lin[d]) / quad;
      acc[d] = na;
    }
  }
};

// Applies `update` to rows[u] (distinct rows of `ev`, admitted keys)
// with gradient row `grad_of(u)`, for u in [begin, end), and stamps each
// row's version: the update loop of both paths, one shard of it. The
// value, slot and key rows of a few rows ahead are prefetched. `slots`:
// the optimizer's slot indices (at most 4).
template <typename Update, typename GradOf>
void UpdateRows(EVStorage* ev, const int64_t* rows, GradOf&& grad_of,
                int64_t begin, int64_t end, const std::vector<int>& slots,
                int64_t version, const Update& update) {
  const int64_t dim = ev->dim();
  float* sp[4] = {nullptr, nullptr, nullptr, nullptr};
  for (int64_t u = begin; u < end; ++u) {
    if (u + kPrefetchDistance < end) {
      const int64_t ahead = rows[u + kPrefetchDistance];
      PrefetchRow(ev->Value(ahead), dim);
      for (int s : slots) PrefetchRow(ev->Slot(s, ahead), dim);
      __builtin_prefetch(ev->Meta(ahead));
    }
    const int64_t r = rows[u];
    for (size_t s = 0; s < slots.size(); ++s) sp[s] = ev->Slot(slots[s], r);
    update(ev->Value(r), grad_of(u), sp, dim);
    *ev->Version(r) = version;
    ev->MarkChanged(r);
  }
}

}  // namespace ev
}  // namespace group_embedding

#endif  // GROUP_EMBEDDING_OPS_KERNELS_EV_UPDATE_RULES_H_

// Host-memory stand-in of the CUDA core: the same C interface, the same
// argument checks (core_checks.h), formulas (embedding_math.h), output
// layouts and error counting, computed with plain loops on host pointers.
// CPU-only CI runs the GPU parity cases through it (ctypes + numpy), so
// that the bindings, descriptors, strides and layouts are checked on
// every run, and compares it with the C++ CPU kernels; the CUDA core runs
// the same cases on the GPU machine. It is a test double, not a backend.

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <utility>
#include <vector>

#include "core_checks.h"
#include "embedding_math.h"
#include "group_embedding_cuda.h"

namespace ge_host {

// ge_synchronize calls so far (ge_host_synchronize_calls).
std::atomic<long long> synchronize_calls{0};
// ge_backward / ge_backward_padded calls so far: gradients written out
// (ge_host_backward_calls).
std::atomic<long long> backward_calls{0};

namespace {

using ge_core::GroupPlan;

void RowRange(const GeTable& x, int64_t b, unsigned long long* errors,
              int64_t* lo, int64_t* hi) {
  if (x.splits == nullptr) {
    *lo = b;
    *hi = b + 1;
    return;
  }
  int64_t a = x.splits[b], e = x.splits[b + 1];
  if (a < 0 || e < a || e > x.nnz || (b == 0 && a != 0) ||
      (b == x.batch - 1 && e != x.nnz)) {
    ++errors[GE_BAD_LAYOUT];
    a = e = 0;
  }
  *lo = a;
  *hi = e;
}

float Dot(const float* a, const float* b, int64_t dim) {
  float s = 0.0f;
  for (int64_t d = 0; d < dim; ++d) s += a[d] * b[d];
  return s;
}

float ScaleOf(const GeTable& x, int64_t lo, int64_t hi) {
  double wsum = 0.0, w2sum = 0.0;
  if (x.weights) {
    for (int64_t j = lo; j < hi; ++j) {
      wsum += x.weights[j];
      w2sum += static_cast<double>(x.weights[j]) * x.weights[j];
    }
  }
  return ge_math::RowScale(x.combiner, x.weights != nullptr, hi - lo, wsum,
                           w2sum);
}

bool GoodId(const GeTable& x, int64_t id) {
  return static_cast<uint64_t>(id) < static_cast<uint64_t>(x.vocab);
}

int Lookup(bool sequence, const GeTable* tables, int n, int64_t dim,
           float max_norm, size_t scratch_bytes, void* scratch,
           unsigned long long* errors) {
  GroupPlan plan;
  int status = ge_core::CheckLookup(tables, n, dim, max_norm, sequence,
                                    errors, &plan);
  status = ge_core::CheckLookupScratch(status, scratch, scratch_bytes, n);
  if (status != GE_OK) return status;
  std::vector<float> acc(dim);
  for (int t = 0; t < n; ++t) {
    const GeTable& x = tables[t];
    for (int64_t b = 0; b < x.batch; ++b) {
      float* out = x.out + b * x.out_stride;
      if (sequence) {
        for (int64_t i = 0; i < x.seq_len * dim; ++i) out[i] = 0.0f;
      }
      int64_t lo, hi;
      RowRange(x, b, errors, &lo, &hi);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = lo; j < hi; ++j) {
        const int64_t id = x.ids[j];
        float* dst = acc.data();
        if (sequence) {
          const int64_t p = x.positions[j];
          if (p < 0 || p >= x.seq_len) {
            ++errors[GE_BAD_LAYOUT];
            continue;
          }
          dst = out + p * dim;
        }
        if (!GoodId(x, id)) {
          ++errors[GE_BAD_IDS];
          continue;
        }
        const float* row = x.table + id * dim;
        const float f =
            (x.weights ? x.weights[j] : 1.0f) *
            ge_math::ClipFactor(Dot(row, row, dim), max_norm);
        for (int64_t d = 0; d < dim; ++d) dst[d] += f * row[d];
      }
      if (!sequence) {
        const float scale = ScaleOf(x, lo, hi);
        for (int64_t d = 0; d < dim; ++d) out[d] = acc[d] * scale;
      }
    }
  }
  return GE_OK;
}

struct Occurrence {
  uint64_t key;
  int64_t grad_row;
  float factor;
};

// Scratch: the descriptors' blocks, then one Occurrence per id.
size_t BackwardScratch(int n, int64_t occurrences) {
  ge_core::ScratchLayout layout(nullptr);
  layout.Take<GeTable>(n);
  layout.Take<Occurrence>(occurrences);
  return layout.used();
}

int Backward(const GeTable* tables, int n, int64_t dim, float max_norm,
             const GeOptimizerConfig* optimizer, void* scratch,
             size_t scratch_bytes, int64_t* unique_ids, float* unique_grads,
             int64_t* offsets, unsigned long long* errors,
             bool padded = false) {
  GroupPlan plan;
  const int status = ge_core::CheckBackward(tables, n, dim, max_norm,
                                            optimizer, unique_ids,
                                            unique_grads, offsets, errors,
                                            &plan);
  if (status != GE_OK) return status;
  if (scratch == nullptr ||
      scratch_bytes < BackwardScratch(n, plan.occurrences())) {
    return GE_ERR_SCRATCH;
  }
  ge_core::ScratchLayout layout(scratch);
  layout.Take<GeTable>(n);
  Occurrence* occ = layout.Take<Occurrence>(plan.occurrences());
  int64_t count = 0;
  for (int t = 0; t < n; ++t) {
    const GeTable& x = tables[t];
    const bool sequence = x.positions != nullptr;
    for (int64_t b = 0; b < x.batch; ++b) {
      int64_t lo, hi;
      RowRange(x, b, errors, &lo, &hi);
      const float scale = sequence ? 1.0f : ScaleOf(x, lo, hi);
      for (int64_t j = lo; j < hi; ++j) {
        int64_t row = b;
        if (sequence) {
          const int64_t p = x.positions[j];
          if (p < 0 || p >= x.seq_len) {
            ++errors[GE_BAD_LAYOUT];
            continue;
          }
          row = b * x.seq_len + p;
        }
        if (!GoodId(x, x.ids[j])) {
          ++errors[GE_BAD_IDS];
          continue;
        }
        const float w = x.weights ? x.weights[j] : 1.0f;
        occ[count++] = {static_cast<uint64_t>(plan.row_base[t] + x.ids[j]),
                        row, sequence ? w : scale * w};
      }
    }
  }
  // Stable: each id's occurrences stay in position order, as on the GPU.
  std::stable_sort(occ, occ + count,
                   [](const Occurrence& a, const Occurrence& b) {
                     return a.key < b.key;
                   });
  std::vector<float> sum(dim);
  int64_t u = 0;
  int t = 0;
  if (!optimizer) offsets[0] = 0;
  for (int64_t i = 0; i < count;) {
    while (occ[i].key >= static_cast<uint64_t>(plan.row_base[t + 1])) {
      ++t;
      if (!optimizer) offsets[t] = u;
    }
    const GeTable& x = tables[t];
    const int64_t id = static_cast<int64_t>(occ[i].key) - plan.row_base[t];
    std::fill(sum.begin(), sum.end(), 0.0f);
    int64_t k = i;
    for (; k < count && occ[k].key == occ[i].key; ++k) {
      const int64_t r = occ[k].grad_row;
      const float* g =
          x.positions ? x.grad + r / x.seq_len * x.grad_stride +
                            r % x.seq_len * dim
                      : x.grad + r * x.grad_stride;
      for (int64_t d = 0; d < dim; ++d) sum[d] += occ[k].factor * g[d];
    }
    float* value = x.table ? x.table + id * dim : nullptr;
    if (max_norm >= 0.0f) {
      const ge_math::ClipGrad cg = ge_math::ClipGradOf(
          Dot(value, value, dim), Dot(value, sum.data(), dim), max_norm);
      for (int64_t d = 0; d < dim; ++d) {
        sum[d] = cg.a * (sum[d] - value[d] * cg.b);
      }
    }
    if (optimizer) {
      float dummy = 0.0f;
      float* power = x.slot1 ? x.slot1 + id * dim : nullptr;
      const bool decay = power && ge_math::DecaysRow(*optimizer, power);
      for (int64_t d = 0; d < dim; ++d) {
        ge_math::ApplyElement(*optimizer, value + d,
                              x.slot0 ? x.slot0 + id * dim + d : &dummy,
                              x.slot1 ? x.slot1 + id * dim + d : &dummy,
                              sum[d], decay);
      }
      if (decay) power[0] += 1.0f;
    } else {
      // ge_backward_padded: in table t's block of its occurrences.
      const int64_t slot = padded ? plan.occ_base[t] + (u - offsets[t]) : u;
      unique_ids[slot] = id;
      memcpy(unique_grads + slot * dim, sum.data(), sizeof(float) * dim);
    }
    ++u;
    i = k;
  }
  if (!optimizer) {
    while (t < n) offsets[++t] = u;
  }
  return GE_OK;
}

}  // namespace
}  // namespace ge_host

extern "C" {

size_t ge_lookup_scratch_bytes(int num_tables) {
  if (num_tables < 1) return 0;
  ge_core::ScratchLayout layout(nullptr);
  layout.Take<GeTable>(num_tables);
  return layout.used();
}

int ge_lookup_pooled(const GeTable* tables, int num_tables, int64_t dim,
                     float max_norm, void* scratch, size_t scratch_bytes,
                     unsigned long long* errors, void* /*stream*/) {
  return ge_host::Lookup(false, tables, num_tables, dim, max_norm,
                         scratch_bytes, scratch, errors);
}

int ge_lookup_sequence(const GeTable* tables, int num_tables, int64_t dim,
                       float max_norm, void* scratch, size_t scratch_bytes,
                       unsigned long long* errors, void* /*stream*/) {
  return ge_host::Lookup(true, tables, num_tables, dim, max_norm,
                         scratch_bytes, scratch, errors);
}

size_t ge_backward_scratch_bytes(const GeTable* tables, int num_tables,
                                 int64_t dim) {
  ge_core::GroupPlan plan;
  if (ge_core::CheckTables(tables, num_tables, dim, 0, &plan) != GE_OK) {
    return 0;
  }
  return ge_host::BackwardScratch(num_tables, plan.occurrences());
}

int ge_backward(const GeTable* tables, int num_tables, int64_t dim,
                float max_norm, void* scratch, size_t scratch_bytes,
                int64_t* unique_ids, float* unique_grads, int64_t* offsets,
                unsigned long long* errors, void* /*stream*/) {
  ge_host::backward_calls.fetch_add(1, std::memory_order_relaxed);
  return ge_host::Backward(tables, num_tables, dim, max_norm, nullptr,
                           scratch, scratch_bytes, unique_ids, unique_grads,
                           offsets, errors);
}

int ge_backward_padded(const GeTable* tables, int num_tables, int64_t dim,
                       float max_norm, void* scratch, size_t scratch_bytes,
                       int64_t* unique_ids, float* unique_grads,
                       int64_t* offsets, unsigned long long* errors,
                       void* /*stream*/) {
  ge_host::backward_calls.fetch_add(1, std::memory_order_relaxed);
  return ge_host::Backward(tables, num_tables, dim, max_norm, nullptr,
                           scratch, scratch_bytes, unique_ids, unique_grads,
                           offsets, errors, true);
}

int ge_backward_apply(const GeTable* tables, int num_tables, int64_t dim,
                      float max_norm, const GeOptimizerConfig* optimizer,
                      void* scratch, size_t scratch_bytes,
                      unsigned long long* errors, void* /*stream*/) {
  if (optimizer == nullptr) return GE_ERR_ARGUMENT;
  return ge_host::Backward(tables, num_tables, dim, max_norm, optimizer,
                           scratch, scratch_bytes, nullptr, nullptr, nullptr,
                           errors);
}

int ge_check_ids(const GeTable* tables, int num_tables, void* scratch,
                 size_t scratch_bytes, unsigned long long* errors,
                 void* /*stream*/) {
  ge_core::GroupPlan plan;
  int status = ge_core::CheckIdsCall(tables, num_tables, errors, &plan);
  status = ge_core::CheckLookupScratch(status, scratch, scratch_bytes,
                                       num_tables);
  if (status != GE_OK) return status;
  for (int t = 0; t < num_tables; ++t) {
    const GeTable& x = tables[t];
    for (int64_t j = 0; j < x.nnz; ++j) {
      if (!ge_host::GoodId(x, x.ids[j])) ++errors[GE_BAD_IDS];
      if (x.positions != nullptr &&
          static_cast<uint64_t>(x.positions[j]) >=
              static_cast<uint64_t>(x.seq_len)) {
        ++errors[GE_BAD_LAYOUT];
      }
    }
    for (int64_t b = 0; b < x.batch; ++b) {
      int64_t lo, hi;
      ge_host::RowRange(x, b, errors, &lo, &hi);
    }
  }
  return GE_OK;
}

int ge_weight_grads(const GeTable* tables, int num_tables, int64_t dim,
                    float max_norm, void* scratch, size_t scratch_bytes,
                    unsigned long long* errors, void* /*stream*/) {
  ge_core::GroupPlan plan;
  int status = ge_core::CheckWeightGrads(tables, num_tables, dim, max_norm,
                                         errors, &plan);
  status = ge_core::CheckLookupScratch(status, scratch, scratch_bytes,
                                       num_tables);
  if (status != GE_OK) return status;
  for (int t = 0; t < num_tables; ++t) {
    const GeTable& x = tables[t];
    if (x.weights == nullptr) continue;
    const bool sequence = x.positions != nullptr;
    const bool by_position = (x.flags & GE_ROWS_BY_POSITION) != 0;
    for (int64_t b = 0; b < x.batch; ++b) {
      int64_t lo, hi;
      ge_host::RowRange(x, b, errors, &lo, &hi);
      const float* gb = x.grad + b * x.grad_stride;
      float scale = 1.0f, pg = 0.0f;
      if (!sequence && x.combiner != GE_SUM) {
        scale = ge_host::ScaleOf(x, lo, hi);
        pg = ge_host::Dot(x.pooled + b * x.grad_stride, gb, dim);
      }
      for (int64_t j = lo; j < hi; ++j) {
        float dw = 0.0f;
        const bool good_id = by_position || ge_host::GoodId(x, x.ids[j]);
        bool ok = good_id;
        const float* g = gb;
        if (sequence) {
          const int64_t p = x.positions[j];
          if (p < 0 || p >= x.seq_len) {
            ++errors[GE_BAD_LAYOUT];
            ok = false;
          } else {
            g = gb + p * dim;
          }
        }
        if (!good_id) ++errors[GE_BAD_IDS];
        if (ok) {
          const float* e = x.table + (by_position ? j : x.ids[j]) * dim;
          const float eg = ge_host::Dot(e, g, dim) *
                           ge_math::ClipFactor(ge_host::Dot(e, e, dim),
                                               max_norm);
          dw = sequence ? eg
                        : ge_math::WeightGrad(x.combiner, eg, pg,
                                              x.weights[j], scale);
        }
        x.weight_grad[j] = dw;
      }
    }
  }
  return GE_OK;
}

int ge_clip_grads(const GeTable* tables, int num_tables, int64_t dim,
                  float max_norm, void* scratch, size_t scratch_bytes,
                  unsigned long long* errors, void* /*stream*/) {
  ge_core::GroupPlan plan;
  int status = ge_core::CheckClipGrads(tables, num_tables, dim, max_norm,
                                       errors, &plan);
  status = ge_core::CheckLookupScratch(status, scratch, scratch_bytes,
                                       num_tables);
  if (status != GE_OK) return status;
  std::vector<float> g(dim);
  for (int t = 0; t < num_tables; ++t) {
    const GeTable& x = tables[t];
    for (int64_t j = 0; j < x.nnz; ++j) {
      // Through a copy: `out` may be `grad`.
      memcpy(g.data(), x.grad + j * x.grad_stride, sizeof(float) * dim);
      float* out = x.out + j * x.out_stride;
      if (!ge_host::GoodId(x, x.ids[j])) {
        ++errors[GE_BAD_IDS];
        std::fill(out, out + dim, 0.0f);
        continue;
      }
      const float* e = x.table + x.ids[j] * dim;
      const ge_math::ClipGrad cg = ge_math::ClipGradOf(
          ge_host::Dot(e, e, dim), ge_host::Dot(e, g.data(), dim), max_norm);
      for (int64_t d = 0; d < dim; ++d) out[d] = cg.a * (g[d] - e[d] * cg.b);
    }
  }
  return GE_OK;
}

int ge_copy_async(void* dst, const void* src, size_t bytes, int /*to_host*/,
                  void* /*stream*/) {
  if (bytes) memcpy(dst, src, bytes);
  return GE_OK;
}

int ge_zero_async(void* dst, size_t bytes, void* /*stream*/) {
  if (bytes) memset(dst, 0, bytes);
  return GE_OK;
}

int ge_synchronize(void* /*stream*/) {
  ge_host::synchronize_calls.fetch_add(1, std::memory_order_relaxed);
  return GE_OK;
}

// Test hook of the stand-in alone (not in the C interface): how many
// times a caller waited for "the stream", so that CPU-only CI counts the
// host synchronisations an adaptor's training step would make on a GPU.
GE_API
long long ge_host_synchronize_calls(void) {
  return ge_host::synchronize_calls.load(std::memory_order_relaxed);
}

// Test hook, as above: how many backward calls wrote gradients out (the
// fused backward-apply writes none).
GE_API
long long ge_host_backward_calls(void) {
  return ge_host::backward_calls.load(std::memory_order_relaxed);
}

int ge_abi_version(void) { return GE_CUDA_ABI_VERSION; }

const char* ge_backend_name(void) { return "host"; }

}  // extern "C"

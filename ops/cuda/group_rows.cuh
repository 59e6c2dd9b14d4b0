#ifndef GROUP_EMBEDDING_OPS_CUDA_GROUP_ROWS_CUH_
#define GROUP_EMBEDDING_OPS_CUDA_GROUP_ROWS_CUH_

// Device-side building blocks shared by the lookup and backward kernels:
// how a launch maps lanes onto (table, row) units, row loads, group
// reductions, and the upload of a group's descriptors into the scratch.
//
// Mapping: a "group" of G lanes (G a power of two <= 32, lanes of one
// warp) owns one unit: an output row of one table (forward, weight
// gradients) or one distinct id (backward). Lane l holds columns
// (c * G + l) * VEC .. + VEC of chunk c < CH, VEC = 4 (float4 loads) when
// every row is 16-byte aligned, else 1. G and CH are chosen per call from
// the group's one `dim`, so a dim-16 group uses 4 lanes per row and a
// warp serves 8 rows at once: every kernel of a group is ONE launch,
// whatever the number of tables.

#include <cuda_runtime.h>
#include <stdint.h>

#include <vector>

#include "core_checks.h"
#include "embedding_math.h"
#include "group_embedding_cuda.h"

namespace ge_cuda {

constexpr int kBlock = 256;

// What every kernel of a call reads: descriptors and prefix arrays live
// in the scratch (device memory), copied there by UploadGroup.
struct DeviceGroup {
  const GeTable* tables;
  const int64_t* unit_base;
  const int64_t* occ_base;
  const int64_t* row_base;
  int n;
  int64_t dim;
  int64_t units;
  int64_t occurrences;
  int64_t rows;
  float max_norm;
  unsigned long long* errors;
};

// Reserves the descriptor blocks at the start of `layout`.
struct GroupBlocks {
  GeTable* tables;
  int64_t *unit_base, *occ_base, *row_base;
};
inline GroupBlocks TakeGroupBlocks(ge_core::ScratchLayout* layout, int n) {
  GroupBlocks b;
  b.tables = layout->Take<GeTable>(n);
  b.unit_base = layout->Take<int64_t>(n + 1);
  b.occ_base = layout->Take<int64_t>(n + 1);
  b.row_base = layout->Take<int64_t>(n + 1);
  return b;
}

// Copies the descriptors and prefix arrays into the scratch with ONE
// asynchronous copy (pageable host memory is staged at once, so the
// host vectors may go when this returns).
inline cudaError_t UploadGroup(const GeTable* tables, int n,
                               const ge_core::GroupPlan& plan, void* scratch,
                               cudaStream_t stream, DeviceGroup* out) {
  ge_core::ScratchLayout measure(nullptr);
  TakeGroupBlocks(&measure, n);
  std::vector<char> host(measure.used());
  ge_core::ScratchLayout staged(host.data());
  GroupBlocks h = TakeGroupBlocks(&staged, n);
  for (int t = 0; t < n; ++t) h.tables[t] = tables[t];
  for (int t = 0; t <= n; ++t) {
    h.unit_base[t] = plan.unit_base[t];
    h.occ_base[t] = plan.occ_base[t];
    h.row_base[t] = plan.row_base[t];
  }
  ge_core::ScratchLayout device(scratch);
  GroupBlocks d = TakeGroupBlocks(&device, n);
  out->tables = d.tables;
  out->unit_base = d.unit_base;
  out->occ_base = d.occ_base;
  out->row_base = d.row_base;
  out->n = n;
  out->units = plan.units();
  out->occurrences = plan.occurrences();
  out->rows = plan.rows();
  return cudaMemcpyAsync(scratch, host.data(), host.size(),
                         cudaMemcpyHostToDevice, stream);
}

template <int kVec_, int kG_, int kCh_>
struct Shape {
  static constexpr int kVec = kVec_;
  static constexpr int kG = kG_;
  static constexpr int kCh = kCh_;
};

// Calls f(Shape<VEC, G, CH>()) for a row of `dim` floats; GE_ERR_TOO_LARGE
// past the widest row.
template <typename F>
int WithShape(int64_t dim, bool vec4, F&& f) {
  if (vec4) {
    const int64_t lanes = (dim + 3) / 4;
    if (lanes <= 1) return f(Shape<4, 1, 1>());
    if (lanes <= 2) return f(Shape<4, 2, 1>());
    if (lanes <= 4) return f(Shape<4, 4, 1>());
    if (lanes <= 8) return f(Shape<4, 8, 1>());
    if (lanes <= 16) return f(Shape<4, 16, 1>());
    if (lanes <= 32) return f(Shape<4, 32, 1>());
    if (lanes <= 64) return f(Shape<4, 32, 2>());
    if (lanes <= 128) return f(Shape<4, 32, 4>());
    if (lanes <= 256) return f(Shape<4, 32, 8>());
    return GE_ERR_TOO_LARGE;
  }
  if (dim <= 32) return f(Shape<1, 32, 1>());
  if (dim <= 64) return f(Shape<1, 32, 2>());
  if (dim <= 128) return f(Shape<1, 32, 4>());
  if (dim <= 256) return f(Shape<1, 32, 8>());
  return GE_ERR_TOO_LARGE;
}

// Blocks of a kernel the current GPU holds at once, at `per_sm` blocks
// an SM: the grid of a launch that loops over work counted only on the
// device. A fixed guess (an H100's SMs) where the device cannot be asked.
inline unsigned ResidentBlocks(int per_sm) {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount,
                             device) != cudaSuccess ||
      sms <= 0) {
    sms = 132;
  }
  return static_cast<unsigned>(sms) * static_cast<unsigned>(per_sm);
}

// Blocks of kBlock threads for `units` groups of G lanes.
inline unsigned GridFor(int64_t units, int g) {
  const int64_t threads = units * g;
  return static_cast<unsigned>((threads + kBlock - 1) / kBlock);
}

inline bool Aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// float4 access needs dim % 4 == 0 and every row start 16-byte aligned:
// each base pointer aligned and each stride a multiple of 4 floats.
inline bool RowsVec4(const GeTable* tables, int n, int64_t dim) {
  if (dim % 4 != 0) return false;
  for (int t = 0; t < n; ++t) {
    const GeTable& x = tables[t];
    if (!Aligned16(x.table) || !Aligned16(x.out) || !Aligned16(x.grad) ||
        !Aligned16(x.pooled) || !Aligned16(x.slot0) || !Aligned16(x.slot1) ||
        x.out_stride % 4 != 0 || x.grad_stride % 4 != 0) {
      return false;
    }
  }
  return true;
}

// This thread's place in its group of G lanes.
template <int G>
struct Lanes {
  int lane;
  unsigned mask;  // the group's lanes, for shuffles
  int64_t unit;
  __device__ Lanes() {
    const int tid = threadIdx.x;
    lane = tid % G;
    const int first = (tid % 32) / G * G;
    mask = G == 32 ? 0xffffffffu : (((1u << G) - 1u) << first);
    unit = (static_cast<int64_t>(blockIdx.x) * blockDim.x + tid) / G;
  }
};

template <int G>
__device__ __forceinline__ float GroupSum(float x, unsigned mask) {
#pragma unroll
  for (int o = G / 2; o > 0; o /= 2) x += __shfl_xor_sync(mask, x, o);
  return x;
}

// First column of chunk c of `lane`.
template <int VEC, int G>
__device__ __forceinline__ int64_t ColumnOf(int c, int lane) {
  return (static_cast<int64_t>(c) * G + lane) * VEC;
}

// v = row[col .. col + VEC) (zeros past `dim`).
template <int VEC>
__device__ __forceinline__ void LoadChunk(const float* row, int64_t col,
                                          int64_t dim, float* v) {
  if (col < dim) {
    if (VEC == 4) {
      const float4 x = *reinterpret_cast<const float4*>(row + col);
      v[0] = x.x;
      v[1] = x.y;
      v[2] = x.z;
      v[3] = x.w;
    } else {
      v[0] = row[col];
    }
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = 0.0f;
  }
}

template <int VEC>
__device__ __forceinline__ void StoreChunk(float* row, int64_t col,
                                           int64_t dim, const float* v) {
  if (col >= dim) return;
  if (VEC == 4) {
    *reinterpret_cast<float4*>(row + col) = make_float4(v[0], v[1], v[2],
                                                        v[3]);
  } else {
    row[col] = v[0];
  }
}

// Largest t < n with base[t] <= x (base[0] = 0 <= x): the table of a
// unit, skipping tables with no units.
__device__ __forceinline__ int FindSegment(const int64_t* base, int n,
                                           int64_t x) {
  int lo = 0, hi = n;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (base[mid] <= x) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

__device__ __forceinline__ void CountError(unsigned long long* errors,
                                           int which) {
  atomicAdd(errors + which, 1ull);
}

// Ids [lo, hi) of row b. A row_splits entry that breaks 0 <= lo <= hi <=
// nnz (or a first / last entry other than 0 / nnz) is counted as a
// layout error and the row read as empty: every non-monotonic
// row_splits has such a row, so none is read out of bounds.
__device__ __forceinline__ void RowRange(const GeTable& x, int64_t b,
                                         bool count, unsigned long long* err,
                                         int64_t* lo, int64_t* hi) {
  if (x.splits == nullptr) {
    *lo = b;
    *hi = b + 1;
    return;
  }
  int64_t a = x.splits[b], e = x.splits[b + 1];
  const bool bad = a < 0 || e < a || e > x.nnz || (b == 0 && a != 0) ||
                   (b == x.batch - 1 && e != x.nnz);
  if (bad) {
    if (count) CountError(err, GE_BAD_LAYOUT);
    a = e = 0;
  }
  *lo = a;
  *hi = e;
}

// Squared norm of a whole row, summed over the group.
template <int VEC, int G, int CH>
__device__ __forceinline__ float RowSquaredNorm(const float (&v)[CH][VEC],
                                                unsigned mask) {
  float ss = 0.0f;
#pragma unroll
  for (int c = 0; c < CH; ++c) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) ss += v[c][k] * v[c][k];
  }
  return GroupSum<G>(ss, mask);
}

template <int VEC, int G, int CH>
__device__ __forceinline__ float RowDot(const float (&a)[CH][VEC],
                                        const float (&b)[CH][VEC],
                                        unsigned mask) {
  float s = 0.0f;
#pragma unroll
  for (int c = 0; c < CH; ++c) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) s += a[c][k] * b[c][k];
  }
  return GroupSum<G>(s, mask);
}

template <int VEC, int G, int CH>
__device__ __forceinline__ void LoadRow(const float* row, int64_t dim,
                                        int lane, float (&v)[CH][VEC]) {
#pragma unroll
  for (int c = 0; c < CH; ++c) {
    LoadChunk<VEC>(row, ColumnOf<VEC, G>(c, lane), dim, v[c]);
  }
}

template <int VEC, int G, int CH>
__device__ __forceinline__ void StoreRow(float* row, int64_t dim, int lane,
                                         const float (&v)[CH][VEC]) {
#pragma unroll
  for (int c = 0; c < CH; ++c) {
    StoreChunk<VEC>(row, ColumnOf<VEC, G>(c, lane), dim, v[c]);
  }
}

// Maps a host-side status to the return value: 0, GE_ERR_* or the
// launch's cudaError_t.
inline int LaunchStatus() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? GE_OK : static_cast<int>(e);
}

// Every call whose only scratch is its descriptors (the lookups, the
// weight gradients, the clip's backward), after its own check (`status`,
// GE_OK or its error, having filled `plan`): checks the scratch (of
// ge_lookup_scratch_bytes), uploads the descriptors into it and launches
// ONE kernel, kernel_of(Shape) for the group's dim, with a group of lanes
// per unit (per example row, or per id).
template <typename KernelOf>
int LaunchOnUnits(int status, const ge_core::GroupPlan& plan,
                  const GeTable* tables, int n, int64_t dim, float max_norm,
                  void* scratch, size_t scratch_bytes,
                  unsigned long long* errors, void* stream,
                  KernelOf&& kernel_of) {
  status = ge_core::CheckLookupScratch(status, scratch, scratch_bytes, n);
  if (status != GE_OK) return status;
  if (plan.units() == 0) return GE_OK;
  auto s = static_cast<cudaStream_t>(stream);
  DeviceGroup g;
  const cudaError_t e = UploadGroup(tables, n, plan, scratch, s, &g);
  if (e != cudaSuccess) return static_cast<int>(e);
  g.dim = dim;
  g.max_norm = max_norm;
  g.errors = errors;
  return WithShape(dim, RowsVec4(tables, n, dim), [&](auto shape) {
    const unsigned grid = GridFor(g.units, decltype(shape)::kG);
    kernel_of(shape)<<<grid, kBlock, 0, s>>>(g);
    return LaunchStatus();
  });
}

}  // namespace ge_cuda

#endif  // GROUP_EMBEDDING_OPS_CUDA_GROUP_ROWS_CUH_

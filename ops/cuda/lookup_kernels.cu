// Forward kernels of the CUDA core: the pooled and the sequence lookup of
// all tables of a group, each ONE launch. Rows go from the tables into
// registers and straight to the output: no [nnz, dim] intermediate.

#include <cuda_runtime.h>

#include <algorithm>

#include "core_checks.h"
#include "embedding_math.h"
#include "group_embedding_cuda.h"
#include "group_rows.cuh"

namespace ge_cuda {
namespace {

// Ids read ahead per step of the id loop, and the minimum resident
// blocks per SM of the pooled kernel (caps its registers at 48). Measured
// on an H200 (benchmarks/results/gpu/tune/, criteo-like forward): with
// 4 ahead and no cap (70 registers, 37% occupancy) the dim-16 forward
// took 0.255 ms; 2 ahead with 5 blocks 0.203 ms (dim 64: 0.82 -> 0.60).
// Occupancy hides the latency of random rows better than reading ahead.
#ifndef GE_POOLED_IDS_AHEAD
#define GE_POOLED_IDS_AHEAD 2
#endif
#ifndef GE_POOLED_MIN_BLOCKS
#define GE_POOLED_MIN_BLOCKS 5
#endif
// Wider rows (CH > 1) read fewer ahead: their registers would spill.
template <int CH>
struct IdsAhead {
  static constexpr int kValue = CH == 1 ? GE_POOLED_IDS_AHEAD
                                : CH == 2 ? 2 : 1;
};

// out[b] = scale_b * sum_j w_j clip(e_j): one group per output row.
template <int VEC, int G, int CH>
__global__ void __launch_bounds__(kBlock, CH == 1 ? GE_POOLED_MIN_BLOCKS : 1)
    PooledLookupKernel(DeviceGroup g) {
  const Lanes<G> me;
  if (me.unit >= g.units) return;
  const int t = FindSegment(g.unit_base, g.n, me.unit);
  const GeTable& x = g.tables[t];
  const int64_t b = me.unit - g.unit_base[t];
  int64_t lo, hi;
  RowRange(x, b, me.lane == 0, g.errors, &lo, &hi);
  const int64_t* __restrict__ ids = x.ids;
  const float* __restrict__ w = x.weights;
  const float* __restrict__ table = x.table;
  const uint64_t vocab = static_cast<uint64_t>(x.vocab);
  const int64_t dim = g.dim;
  constexpr int kAhead = IdsAhead<CH>::kValue;
  float acc[CH][VEC] = {};
  double wsum = 0.0, w2sum = 0.0;
  for (int64_t j = lo; j < hi; j += kAhead) {
    int64_t id[kAhead];
    float wj[kAhead];
    float rows[kAhead][CH][VEC];
#pragma unroll
    for (int k = 0; k < kAhead; ++k) {
      const bool in = j + k < hi;
      id[k] = in ? ids[j + k] : -1;
      wj[k] = in ? (w ? w[j + k] : 1.0f) : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < kAhead; ++k) {
      // One unsigned compare also catches negative ids.
      if (static_cast<uint64_t>(id[k]) < vocab) {
        LoadRow<VEC, G, CH>(table + id[k] * dim, dim, me.lane, rows[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < kAhead; ++k) {
      if (j + k >= hi) continue;
      wsum += wj[k];
      w2sum += static_cast<double>(wj[k]) * wj[k];
      if (static_cast<uint64_t>(id[k]) >= vocab) {
        if (me.lane == 0) CountError(g.errors, GE_BAD_IDS);
        continue;
      }
      float f = wj[k];
      if (g.max_norm >= 0.0f) {
        f *= ge_math::ClipFactor(
            RowSquaredNorm<VEC, G, CH>(rows[k], me.mask), g.max_norm);
      }
#pragma unroll
      for (int c = 0; c < CH; ++c) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[c][v] += f * rows[k][c][v];
      }
    }
  }
  const float scale =
      ge_math::RowScale(x.combiner, w != nullptr, hi - lo, wsum, w2sum);
#pragma unroll
  for (int c = 0; c < CH; ++c) {
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[c][v] *= scale;
  }
  StoreRow<VEC, G, CH>(x.out + b * x.out_stride, dim, me.lane, acc);
}

// out[b, positions[j]] += w_j clip(e_j), zeros elsewhere: one group per
// example row, which first clears its [seq_len, dim] block. Each lane
// only touches its own columns, so the adds need no synchronisation and
// a repeated position adds up (as the CPU kernel does).
template <int VEC, int G, int CH>
__global__ void __launch_bounds__(kBlock)
    SequenceLookupKernel(DeviceGroup g) {
  const Lanes<G> me;
  if (me.unit >= g.units) return;
  const int t = FindSegment(g.unit_base, g.n, me.unit);
  const GeTable& x = g.tables[t];
  const int64_t b = me.unit - g.unit_base[t];
  const int64_t dim = g.dim;
  const int64_t len = x.seq_len;
  float* out = x.out + b * x.out_stride;
  const float zeros[CH][VEC] = {};
  for (int64_t p = 0; p < len; ++p) {
    StoreRow<VEC, G, CH>(out + p * dim, dim, me.lane, zeros);
  }
  int64_t lo, hi;
  RowRange(x, b, me.lane == 0, g.errors, &lo, &hi);
  const uint64_t vocab = static_cast<uint64_t>(x.vocab);
  for (int64_t j = lo; j < hi; ++j) {
    const int64_t id = x.ids[j];
    const int64_t p = x.positions[j];
    if (p < 0 || p >= len) {
      if (me.lane == 0) CountError(g.errors, GE_BAD_LAYOUT);
      continue;
    }
    if (static_cast<uint64_t>(id) >= vocab) {
      if (me.lane == 0) CountError(g.errors, GE_BAD_IDS);
      continue;
    }
    float row[CH][VEC], dst[CH][VEC];
    LoadRow<VEC, G, CH>(x.table + id * dim, dim, me.lane, row);
    float f = x.weights ? x.weights[j] : 1.0f;
    if (g.max_norm >= 0.0f) {
      f *= ge_math::ClipFactor(RowSquaredNorm<VEC, G, CH>(row, me.mask),
                               g.max_norm);
    }
    float* o = out + p * dim;
    LoadRow<VEC, G, CH>(o, dim, me.lane, dst);
#pragma unroll
    for (int c = 0; c < CH; ++c) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) dst[c][v] += f * row[c][v];
    }
    StoreRow<VEC, G, CH>(o, dim, me.lane, dst);
  }
}

// ge_check_ids: a thread per id (its range, its position), then one per
// output row (its row_splits), over all tables of the call.
__global__ void __launch_bounds__(kBlock) CheckIdsKernel(DeviceGroup g) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) +
                   threadIdx.x;
       i < g.occurrences + g.units; i += stride) {
    if (i < g.occurrences) {
      const int t = FindSegment(g.occ_base, g.n, i);
      const GeTable& x = g.tables[t];
      const int64_t j = i - g.occ_base[t];
      if (static_cast<uint64_t>(x.ids[j]) >=
          static_cast<uint64_t>(x.vocab)) {
        CountError(g.errors, GE_BAD_IDS);
      }
      if (x.positions != nullptr &&
          static_cast<uint64_t>(x.positions[j]) >=
              static_cast<uint64_t>(x.seq_len)) {
        CountError(g.errors, GE_BAD_LAYOUT);
      }
    } else {
      const int64_t r = i - g.occurrences;
      const int t = FindSegment(g.unit_base, g.n, r);
      int64_t lo, hi;
      RowRange(g.tables[t], r - g.unit_base[t], true, g.errors, &lo, &hi);
    }
  }
}

template <bool kSequence>
int Lookup(const GeTable* tables, int n, int64_t dim, float max_norm,
           void* scratch, size_t scratch_bytes, unsigned long long* errors,
           void* stream) {
  ge_core::GroupPlan plan;
  const int status = ge_core::CheckLookup(tables, n, dim, max_norm,
                                          kSequence, errors, &plan);
  return LaunchOnUnits(
      status, plan, tables, n, dim, max_norm, scratch, scratch_bytes, errors,
      stream, [](auto shape) {
        using S = decltype(shape);
        return kSequence ? &SequenceLookupKernel<S::kVec, S::kG, S::kCh>
                         : &PooledLookupKernel<S::kVec, S::kG, S::kCh>;
      });
}

}  // namespace
}  // namespace ge_cuda

extern "C" {

size_t ge_lookup_scratch_bytes(int num_tables) {
  if (num_tables < 1) return 0;
  ge_core::ScratchLayout layout(nullptr);
  ge_cuda::TakeGroupBlocks(&layout, num_tables);
  return layout.used();
}

int ge_lookup_pooled(const GeTable* tables, int num_tables, int64_t dim,
                     float max_norm, void* scratch, size_t scratch_bytes,
                     unsigned long long* errors, void* stream) {
  return ge_cuda::Lookup<false>(tables, num_tables, dim, max_norm, scratch,
                                scratch_bytes, errors, stream);
}

int ge_lookup_sequence(const GeTable* tables, int num_tables, int64_t dim,
                       float max_norm, void* scratch, size_t scratch_bytes,
                       unsigned long long* errors, void* stream) {
  return ge_cuda::Lookup<true>(tables, num_tables, dim, max_norm, scratch,
                               scratch_bytes, errors, stream);
}

int ge_check_ids(const GeTable* tables, int num_tables, void* scratch,
                 size_t scratch_bytes, unsigned long long* errors,
                 void* stream) {
  ge_core::GroupPlan plan;
  int status = ge_core::CheckIdsCall(tables, num_tables, errors, &plan);
  status = ge_core::CheckLookupScratch(status, scratch, scratch_bytes,
                                       num_tables);
  if (status != GE_OK) return status;
  const int64_t work = plan.occurrences() + plan.units();
  if (work == 0) return GE_OK;
  auto s = static_cast<cudaStream_t>(stream);
  ge_cuda::DeviceGroup g;
  const cudaError_t copied =
      ge_cuda::UploadGroup(tables, num_tables, plan, scratch, s, &g);
  if (copied != cudaSuccess) return static_cast<int>(copied);
  g.errors = errors;
  // Grid-stride: a few blocks per SM cover any size.
  const int64_t blocks = std::min<int64_t>(
      (work + ge_cuda::kBlock - 1) / ge_cuda::kBlock, 4096);
  ge_cuda::CheckIdsKernel<<<static_cast<unsigned>(blocks), ge_cuda::kBlock,
                            0, s>>>(g);
  return static_cast<int>(cudaGetLastError());
}

int ge_copy_async(void* dst, const void* src, size_t bytes, int to_host,
                  void* stream) {
  if (bytes == 0) return GE_OK;
  return static_cast<int>(cudaMemcpyAsync(
      dst, src, bytes,
      to_host == 1   ? cudaMemcpyDeviceToHost
      : to_host == 2 ? cudaMemcpyHostToDevice
                     : cudaMemcpyDeviceToDevice,
      static_cast<cudaStream_t>(stream)));
}

int ge_zero_async(void* dst, size_t bytes, void* stream) {
  if (bytes == 0) return GE_OK;
  return static_cast<int>(
      cudaMemsetAsync(dst, 0, bytes, static_cast<cudaStream_t>(stream)));
}

int ge_synchronize(void* stream) {
  return static_cast<int>(
      cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
}

int ge_abi_version(void) { return GE_CUDA_ABI_VERSION; }

const char* ge_backend_name(void) { return "cuda"; }

}  // extern "C"

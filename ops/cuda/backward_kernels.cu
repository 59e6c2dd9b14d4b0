// Backward kernels of the CUDA core: the ids of all tables of a group are
// deduplicated on the device with ONE radix sort, each distinct id's
// gradient is summed in registers from its occurrences (no atomics: the
// result is deterministic and adds in the CPU kernel's order), and then
// either written out (IndexedSlices) or applied by a sparse optimizer in
// place (the fused training step). Also the per-id weight gradients.
//
// Steps of a backward call, all enqueued on the caller's stream:
//  1. Prepare: one thread per example row writes, for each of its ids,
//     key = row_base[t] + id (the all-ones key for a bad id, which sorts
//     last and is skipped) and payload = (gradient row << 32) | factor
//     bits, the factor being scale_b * w_j (pooled) or w_j (sequence).
//  2. cub radix sort of (key, payload) over the key's bits; the sort is
//     stable, so each id's occurrences stay in position order.
//  3. Heads (first of each key) are scanned into distinct-id numbers;
//     run starts and per-table offsets follow.
//  4. Sum: one group of lanes per distinct id adds its occurrences'
//     gradient rows, applies the max_norm clip's backward with the
//     table's row, and stores or applies the result.

#include <cuda_runtime.h>

#include <algorithm>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include "core_checks.h"
#include "embedding_math.h"
#include "group_embedding_cuda.h"
#include "group_rows.cuh"

namespace ge_cuda {
namespace {

// The scale of a pooled row's occurrences (mean / sqrtn; 1 for sums and
// sequences).
__device__ __forceinline__ float PrepareScale(const GeTable& x, int64_t lo,
                                              int64_t hi) {
  if (x.positions != nullptr || x.combiner == GE_SUM) return 1.0f;
  const float* w = x.weights;
  double wsum = 0.0, w2sum = 0.0;
  if (w) {
    for (int64_t j = lo; j < hi; ++j) {
      wsum += w[j];
      w2sum += static_cast<double>(w[j]) * w[j];
    }
  }
  return ge_math::RowScale(x.combiner, w != nullptr, hi - lo, wsum, w2sum);
}

// Occurrence j (of row b) of table t: its sort key (the group-wide row of
// its id) and payload (the gradient row it reads, its factor). A bad id
// or position is counted and keeps its all-ones key (skipped).
__device__ __forceinline__ void PrepareOccurrence(
    const DeviceGroup& g, const GeTable& x, int t, int64_t b, int64_t j,
    float scale, uint64_t* __restrict__ keys,
    uint64_t* __restrict__ payload) {
  const int64_t id = x.ids[j];
  int64_t row = b;
  float f = x.weights ? x.weights[j] : 1.0f;
  if (x.positions != nullptr) {
    const int64_t p = x.positions[j];
    if (p < 0 || p >= x.seq_len) {
      CountError(g.errors, GE_BAD_LAYOUT);
      return;
    }
    row = b * x.seq_len + p;
  } else {
    f *= scale;
  }
  if (static_cast<uint64_t>(id) >= static_cast<uint64_t>(x.vocab)) {
    CountError(g.errors, GE_BAD_IDS);
    return;
  }
  const int64_t at = g.occ_base[t] + j;
  keys[at] = static_cast<uint64_t>(g.row_base[t] + id);
  payload[at] = (static_cast<uint64_t>(row) << 32) | __float_as_uint(f);
}

// Sort keys and payloads of every occurrence. A block takes kBlock rows
// (units) in turn, table by table: each thread reads its row's range and
// scale, then the block walks the rows' occurrences together, one thread
// an occurrence (reads and writes in order; a thread per row walking its
// own occurrences touched a line per row and step). Rows whose ranges do
// not follow one another (a bad row_splits: its row reads as empty) are
// walked a thread per row instead.
__global__ void __launch_bounds__(kBlock)
    PrepareKernel(DeviceGroup g, uint64_t* __restrict__ keys,
                  uint64_t* __restrict__ payload) {
  __shared__ int64_t first[kBlock + 1];  // rows' ranges: [first[i], first[i+1])
  __shared__ float scales[kBlock];
  const int64_t u0 = static_cast<int64_t>(blockIdx.x) * kBlock;
  const int64_t u_end = min(u0 + kBlock, g.units);
  const int i = threadIdx.x;
  for (int64_t seg = u0; seg < u_end;) {
    // The rows of one table in this block: units [seg, seg_end).
    const int t = FindSegment(g.unit_base, g.n, seg);
    const int64_t seg_end = min(u_end, g.unit_base[t + 1]);
    const GeTable& x = g.tables[t];
    const int64_t b0 = seg - g.unit_base[t];
    const int rows = static_cast<int>(seg_end - seg);
    int64_t lo = 0, hi = 0;
    float scale = 1.0f;
    __syncthreads();  // the previous table's rows are walked
    if (i < rows) {
      RowRange(x, b0 + i, true, g.errors, &lo, &hi);
      scale = PrepareScale(x, lo, hi);
      first[i] = lo;
      scales[i] = scale;
      if (i == rows - 1) first[rows] = hi;
    }
    __syncthreads();
    const bool follows = i >= rows || hi == first[i + 1];
    if (__syncthreads_and(follows)) {
      const int64_t end = first[rows];
      for (int64_t j = first[0] + i; j < end; j += kBlock) {
        // The last row whose range starts at or before j (an empty row
        // shares its start with the row after it).
        int a = 0, z = rows;
        while (z - a > 1) {
          const int mid = (a + z) / 2;
          if (first[mid] <= j) {
            a = mid;
          } else {
            z = mid;
          }
        }
        PrepareOccurrence(g, x, t, b0 + a, j, scales[a], keys, payload);
      }
    } else if (i < rows) {
      for (int64_t j = lo; j < hi; ++j) {
        PrepareOccurrence(g, x, t, b0 + i, j, scale, keys, payload);
      }
    }
    seg = seg_end;
  }
}

// heads[i] = 1 for the first occurrence of each valid key.
__global__ void HeadsKernel(const uint64_t* __restrict__ keys, int64_t n,
                            uint64_t rows, int* __restrict__ heads) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x +
                    threadIdx.x;
  if (i >= n) return;
  heads[i] = keys[i] < rows && (i == 0 || keys[i] != keys[i - 1]);
}

// run_start[u] = sorted position of distinct id u.
__global__ void RunsKernel(const int* __restrict__ heads,
                           const int* __restrict__ number, int64_t n,
                           int64_t* __restrict__ run_start) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x +
                    threadIdx.x;
  if (i >= n || !heads[i]) return;
  run_start[number[i] - 1] = i;
}

// First sorted position whose key is >= v.
__device__ int64_t LowerBound(const uint64_t* keys, int64_t n, uint64_t v) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (keys[mid] < v) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// offsets[t] = distinct ids of the tables before t; offsets[n] = all of
// them (U), and run_start[U] = the end of the valid keys.
__global__ void OffsetsKernel(DeviceGroup g, const uint64_t* __restrict__ keys,
                              const int* __restrict__ number,
                              int64_t* __restrict__ offsets,
                              int64_t* __restrict__ run_start) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t > g.n) return;
  const int64_t pos = LowerBound(keys, g.occurrences,
                                 static_cast<uint64_t>(g.row_base[t]));
  offsets[t] = pos == 0 ? 0 : number[pos - 1];
  if (t == g.n) run_start[offsets[t]] = pos;
}

// A distinct id with more occurrences than this is summed in chunks of
// kChunk positions by many groups, then the chunks' partial sums by one
// block (the "long runs"). On the criteo-like step, ids of the tiny
// tables (3-30 rows) occur ~10^5 times each: summed by one group, such a
// run alone took ~50 ms of latency-bound loads.
constexpr int64_t kLongRun = 32;
constexpr int64_t kChunk = 32;
constexpr int kLongBlock = 256;

struct SumTargets {
  const uint64_t* keys;
  const uint64_t* payload;
  const int64_t* run_start;
  const int64_t* offsets;
  int64_t* unique_ids;    // store mode
  float* unique_grads;    // store mode
  // Store mode, ge_backward_padded: table t's distinct ids go to the
  // block of its occurrences (occ_base[t] ..), not after the tables
  // before it (offsets[t] ..).
  bool padded;
  bool apply;
  GeOptimizerConfig optimizer;
  // Long runs: counters [long runs, chunks] (zeroed), each long run's
  // (run, first chunk, chunk count), each chunk's (run, index), and the
  // chunks' partial sums [chunks, dim].
  unsigned long long* counters;
  int64_t* long_run;
  int64_t* long_first;
  int64_t* long_chunks;
  int64_t* chunk_run;
  int64_t* chunk_index;
  float* partials;
};

// acc += the gradient rows of sorted positions [i0, i1).
template <int VEC, int G, int CH>
__device__ __forceinline__ void AddOccurrences(const GeTable& x,
                                               const SumTargets& s,
                                               int64_t dim, int lane,
                                               int64_t i0, int64_t i1,
                                               float (&acc)[CH][VEC]) {
  const float* __restrict__ grad = x.grad;
  const int64_t stride = x.grad_stride;
  // Sequence rows are numbered b * seq_len + position; a block of
  // seq_len rows may be padded (grad_stride >= seq_len * dim).
  const int64_t len = x.positions ? x.seq_len : 0;
  constexpr int kAhead = CH == 1 ? 2 : 1;
  for (int64_t i = i0; i < i1; i += kAhead) {
    float rows[kAhead][CH][VEC];
    float f[kAhead];
#pragma unroll
    for (int k = 0; k < kAhead; ++k) {
      if (i + k < i1) {
        const uint64_t p = s.payload[i + k];
        f[k] = __uint_as_float(static_cast<uint32_t>(p));
        const int64_t r = static_cast<int64_t>(p >> 32);
        const float* row = len ? grad + r / len * stride + r % len * dim
                               : grad + r * stride;
        LoadRow<VEC, G, CH>(row, dim, lane, rows[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < kAhead; ++k) {
      if (i + k >= i1) continue;
#pragma unroll
      for (int c = 0; c < CH; ++c) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[c][v] += f[k] * rows[k][c][v];
      }
    }
  }
}

// The output row of distinct id u of table t (store mode).
__device__ __forceinline__ int64_t SlotOf(const DeviceGroup& g,
                                          const SumTargets& s, int t,
                                          int64_t u) {
  return s.padded ? g.occ_base[t] + (u - s.offsets[t]) : u;
}

// The max_norm clip's backward of gradient row `acc` with table row
// `row` (ge_math::ClipGradOf): acc = a (acc - row b). One helper for the
// fused backward and ge_clip_grads, so that both apply it alike.
template <int VEC, int G, int CH>
__device__ __forceinline__ void ClipBackwardRow(const float* row,
                                                int64_t dim,
                                                const Lanes<G>& me,
                                                float max_norm,
                                                float (&acc)[CH][VEC]) {
  float e[CH][VEC];
  LoadRow<VEC, G, CH>(row, dim, me.lane, e);
  const float ss = RowSquaredNorm<VEC, G, CH>(e, me.mask);
  const float eg = RowDot<VEC, G, CH>(e, acc, me.mask);
  const ge_math::ClipGrad cg = ge_math::ClipGradOf(ss, eg, max_norm);
#pragma unroll
  for (int c = 0; c < CH; ++c) {
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      acc[c][v] = cg.a * (acc[c][v] - e[c][v] * cg.b);
    }
  }
}

// The end of a distinct id's sum: the max_norm clip's backward with the
// table's row, then stored (IndexedSlices) at output row `slot` or
// applied by the optimizer.
template <int VEC, int G, int CH>
__device__ __forceinline__ void Finish(const DeviceGroup& g,
                                       const SumTargets& s, const GeTable& x,
                                       int64_t slot, int64_t id,
                                       const Lanes<G>& me,
                                       float (&acc)[CH][VEC]) {
  const int64_t dim = g.dim;
  float* value = x.table + id * dim;
  if (g.max_norm >= 0.0f) {
    ClipBackwardRow<VEC, G, CH>(value, dim, me, g.max_norm, acc);
  }
  if (!s.apply) {
    if (me.lane == 0) s.unique_ids[slot] = id;
    StoreRow<VEC, G, CH>(s.unique_grads + slot * dim, dim, me.lane, acc);
    return;
  }
  float* slot0 = x.slot0 ? x.slot0 + id * dim : nullptr;
  float* slot1 = x.slot1 ? x.slot1 + id * dim : nullptr;
  float dummy = 0.0f;
  // AdagradDecay: every lane reads the row's power before lane 0 adds
  // one to it, after the row.
  bool decay = false;
  if (s.optimizer.kind == GE_OPT_ADAGRAD_DECAY) {
    decay = slot1 != nullptr && ge_math::DecaysRow(s.optimizer, slot1);
    __syncwarp(me.mask);
  }
#pragma unroll
  for (int c = 0; c < CH; ++c) {
    const int64_t col = ColumnOf<VEC, G>(c, me.lane);
    if (col >= dim) continue;
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      ge_math::ApplyElement(s.optimizer, value + col + v,
                            slot0 ? slot0 + col + v : &dummy,
                            slot1 ? slot1 + col + v : &dummy, acc[c][v],
                            decay);
    }
  }
  if (decay && me.lane == 0) slot1[0] += 1.0f;
}

// Table, id and sorted positions of distinct id u.
struct Run {
  int t;
  int64_t id, i0, i1;
};
__device__ __forceinline__ Run RunOf(const DeviceGroup& g,
                                     const SumTargets& s, int64_t u) {
  Run r;
  r.t = FindSegment(s.offsets, g.n, u);
  r.i0 = s.run_start[u];
  r.i1 = s.run_start[u + 1];
  r.id = static_cast<int64_t>(s.keys[r.i0]) - g.row_base[r.t];
  return r;
}

// Distinct id u: summed and finished, or (a long run) cut into chunks.
template <int VEC, int G, int CH>
__device__ __forceinline__ void SumRun(const DeviceGroup& g,
                                       const SumTargets& s,
                                       const Lanes<G>& me, int64_t u) {
  const Run r = RunOf(g, s, u);
  const int64_t len = r.i1 - r.i0;
  if (len > kLongRun) {
    // Where the chunks go depends on the atomics' order, the sums do not.
    const int64_t chunks = (len + kChunk - 1) / kChunk;
    int64_t first = 0;
    if (me.lane == 0) {
      const int64_t l = static_cast<int64_t>(atomicAdd(s.counters, 1ull));
      first = static_cast<int64_t>(atomicAdd(
          s.counters + 1, static_cast<unsigned long long>(chunks)));
      s.long_run[l] = u;
      s.long_first[l] = first;
      s.long_chunks[l] = chunks;
    }
    first = __shfl_sync(me.mask, first, me.mask == 0xffffffffu
                                            ? 0 : __ffs(me.mask) - 1);
    for (int64_t c = me.lane; c < chunks; c += G) {
      s.chunk_run[first + c] = u;
      s.chunk_index[first + c] = c;
    }
    return;
  }
  const GeTable& x = g.tables[r.t];
  float acc[CH][VEC] = {};
  AddOccurrences<VEC, G, CH>(x, s, g.dim, me.lane, r.i0, r.i1, acc);
  Finish<VEC, G, CH>(g, s, x, SlotOf(g, s, r.t, u), r.id, me, acc);
}

// Groups of G lanes in the whole launch (the stride of the loops over
// work counted only on the device).
template <int G>
__device__ __forceinline__ int64_t GroupsInGrid() {
  return static_cast<int64_t>(gridDim.x) * (blockDim.x / G);
}

// One group per distinct id: short runs are summed and finished here,
// long ones are cut into chunks for ChunkKernel and FinishLongKernel.
// The distinct ids are counted only on the device: a bounded launch
// loops over them (a launch for the occurrence count, their upper bound,
// spent most of its time starting blocks that had nothing to do).
template <int VEC, int G, int CH>
__global__ void __launch_bounds__(kBlock)
    SumKernel(DeviceGroup g, SumTargets s) {
  const Lanes<G> me;
  for (int64_t u = me.unit; u < s.offsets[g.n]; u += GroupsInGrid<G>()) {
    SumRun<VEC, G, CH>(g, s, me, u);
  }
}

// One group per chunk of a long run: its partial sum (a bounded launch
// looping over the chunks, counted on the device).
template <int VEC, int G, int CH>
__global__ void __launch_bounds__(kBlock)
    ChunkKernel(DeviceGroup g, SumTargets s) {
  const Lanes<G> me;
  const int64_t chunks = static_cast<int64_t>(s.counters[1]);
  for (int64_t k = me.unit; k < chunks; k += GroupsInGrid<G>()) {
    const int64_t u = s.chunk_run[k];
    const int64_t c = s.chunk_index[k];
    const Run r = RunOf(g, s, u);
    const int64_t i0 = r.i0 + c * kChunk;
    const int64_t i1 = min(r.i1, i0 + kChunk);
    float acc[CH][VEC] = {};
    AddOccurrences<VEC, G, CH>(g.tables[r.t], s, g.dim, me.lane, i0, i1,
                               acc);
    StoreRow<VEC, G, CH>(s.partials + k * g.dim, g.dim, me.lane, acc);
  }
}

// Long run l of FinishLongKernel, by the whole block.
template <int VEC, int G, int CH>
__device__ __forceinline__ void FinishLongRun(const DeviceGroup& g,
                                              const SumTargets& s,
                                              int64_t l) {
  extern __shared__ float group_sums[];  // [kLongBlock / G, dim]
  const Lanes<G> me;
  const int q = threadIdx.x / G;
  constexpr int kGroups = kLongBlock / G;
  const int64_t dim = g.dim;
  const int64_t u = s.long_run[l];
  const int64_t first = s.long_first[l];
  const int64_t chunks = s.long_chunks[l];
  float acc[CH][VEC] = {};
  for (int64_t c = q; c < chunks; c += kGroups) {
    float part[CH][VEC];
    LoadRow<VEC, G, CH>(s.partials + (first + c) * dim, dim, me.lane, part);
#pragma unroll
    for (int i = 0; i < CH; ++i) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[i][v] += part[i][v];
    }
  }
  StoreRow<VEC, G, CH>(group_sums + q * dim, dim, me.lane, acc);
  for (int half = kGroups / 2; half > 0; half /= 2) {
    __syncthreads();
    if (q < half) {
      float other[CH][VEC];
      LoadRow<VEC, G, CH>(group_sums + (q + half) * dim, dim, me.lane,
                          other);
#pragma unroll
      for (int i = 0; i < CH; ++i) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[i][v] += other[i][v];
      }
      StoreRow<VEC, G, CH>(group_sums + q * dim, dim, me.lane, acc);
    }
  }
  if (q != 0) return;
  const Run r = RunOf(g, s, u);
  Finish<VEC, G, CH>(g, s, g.tables[r.t], SlotOf(g, s, r.t, u), r.id, me,
                     acc);
}

// One block per long run (a bounded launch: block b takes long runs b,
// b + blocks, ...): its groups add the chunks' partial sums (group q
// takes chunks q, q + groups, ...), a fixed tree in shared memory adds
// the groups' sums, and group 0 finishes the run. Fixed orders
// throughout, so the result does not depend on scheduling.
template <int VEC, int G, int CH>
__global__ void __launch_bounds__(kLongBlock)
    FinishLongKernel(DeviceGroup g, SumTargets s) {
  const int64_t runs = static_cast<int64_t>(s.counters[0]);
  for (int64_t l = blockIdx.x; l < runs; l += gridDim.x) {
    __syncthreads();  // the previous run's tree is read to the end
    FinishLongRun<VEC, G, CH>(g, s, l);
  }
}

// d loss / d w_j of the weighted tables: one group per example row.
template <int VEC, int G, int CH>
__global__ void __launch_bounds__(kBlock)
    WeightGradKernel(DeviceGroup g) {
  const Lanes<G> me;
  if (me.unit >= g.units) return;
  const int t = FindSegment(g.unit_base, g.n, me.unit);
  const GeTable& x = g.tables[t];
  if (x.weights == nullptr) return;
  const int64_t b = me.unit - g.unit_base[t];
  const int64_t dim = g.dim;
  int64_t lo, hi;
  RowRange(x, b, me.lane == 0, g.errors, &lo, &hi);
  const bool sequence = x.positions != nullptr;
  const float* w = x.weights;
  float gb[CH][VEC];
  float scale = 1.0f, pg = 0.0f;
  if (!sequence) {
    LoadRow<VEC, G, CH>(x.grad + b * x.grad_stride, dim, me.lane, gb);
    if (x.combiner != GE_SUM) {
      double wsum = 0.0, w2sum = 0.0;
      for (int64_t j = lo; j < hi; ++j) {
        wsum += w[j];
        w2sum += static_cast<double>(w[j]) * w[j];
      }
      scale = ge_math::RowScale(x.combiner, true, hi - lo, wsum, w2sum);
      float pooled[CH][VEC];
      LoadRow<VEC, G, CH>(x.pooled + b * x.grad_stride, dim, me.lane,
                          pooled);
      pg = RowDot<VEC, G, CH>(pooled, gb, me.mask);
    }
  }
  const uint64_t vocab = static_cast<uint64_t>(x.vocab);
  // A snapshot by position has row j for id j (checked when taken).
  const bool by_position = (x.flags & GE_ROWS_BY_POSITION) != 0;
  for (int64_t j = lo; j < hi; ++j) {
    const int64_t id = x.ids[j];
    float dw = 0.0f;
    const bool good_id = by_position || static_cast<uint64_t>(id) < vocab;
    bool ok = good_id;
    if (sequence) {
      const int64_t p = x.positions[j];
      if (p < 0 || p >= x.seq_len) {
        if (me.lane == 0) CountError(g.errors, GE_BAD_LAYOUT);
        ok = false;
      } else {
        LoadRow<VEC, G, CH>(x.grad + b * x.grad_stride + p * dim, dim,
                            me.lane, gb);
      }
    }
    if (!good_id && me.lane == 0) CountError(g.errors, GE_BAD_IDS);
    if (ok) {
      float e[CH][VEC];
      LoadRow<VEC, G, CH>(x.table + (by_position ? j : id) * dim, dim,
                          me.lane, e);
      float eg = RowDot<VEC, G, CH>(e, gb, me.mask);
      if (g.max_norm >= 0.0f) {
        eg *= ge_math::ClipFactor(RowSquaredNorm<VEC, G, CH>(e, me.mask),
                                  g.max_norm);
      }
      dw = sequence ? eg : ge_math::WeightGrad(x.combiner, eg, pg, w[j],
                                               scale);
    }
    if (me.lane == 0) x.weight_grad[j] = dw;
  }
}

// The clip's backward on per-id rows (ge_clip_grads): one group per id.
template <int VEC, int G, int CH>
__global__ void __launch_bounds__(kBlock)
    ClipGradKernel(DeviceGroup g) {
  const Lanes<G> me;
  if (me.unit >= g.units) return;
  const int t = FindSegment(g.unit_base, g.n, me.unit);
  const GeTable& x = g.tables[t];
  const int64_t j = me.unit - g.unit_base[t];
  const int64_t dim = g.dim;
  const int64_t id = x.ids[j];
  float acc[CH][VEC];
  // Read whole before any store: `out` may be `grad`.
  LoadRow<VEC, G, CH>(x.grad + j * x.grad_stride, dim, me.lane, acc);
  if (static_cast<uint64_t>(id) >= static_cast<uint64_t>(x.vocab)) {
    if (me.lane == 0) CountError(g.errors, GE_BAD_IDS);
#pragma unroll
    for (int c = 0; c < CH; ++c) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[c][v] = 0.0f;
    }
  } else {
    ClipBackwardRow<VEC, G, CH>(x.table + id * dim, dim, me, g.max_norm,
                                acc);
  }
  StoreRow<VEC, G, CH>(x.out + j * x.out_stride, dim, me.lane, acc);
}

// ge_weight_grads (kClip false) and ge_clip_grads (kClip true): their
// check, then one kernel on the units.
template <bool kClip>
int RowGrads(const GeTable* tables, int n, int64_t dim, float max_norm,
             void* scratch, size_t scratch_bytes, unsigned long long* errors,
             void* stream) {
  ge_core::GroupPlan plan;
  const int status =
      kClip ? ge_core::CheckClipGrads(tables, n, dim, max_norm, errors, &plan)
            : ge_core::CheckWeightGrads(tables, n, dim, max_norm, errors,
                                        &plan);
  return LaunchOnUnits(
      status, plan, tables, n, dim, max_norm, scratch, scratch_bytes, errors,
      stream, [](auto shape) {
        using S = decltype(shape);
        return kClip ? &ClipGradKernel<S::kVec, S::kG, S::kCh>
                     : &WeightGradKernel<S::kVec, S::kG, S::kCh>;
      });
}

// Scratch of a backward call, after the descriptors.
struct BackwardBlocks {
  uint64_t *keys_in, *keys_out, *payload_in, *payload_out;
  int *heads, *number;
  int64_t *run_start, *offsets;
  unsigned long long* counters;
  int64_t *long_run, *long_first, *long_chunks, *chunk_run, *chunk_index;
  float* partials;
  int64_t max_long, max_chunks;
  void* temp;
  size_t temp_bytes;
};

int TakeBackwardBlocks(ge_core::ScratchLayout* layout, int n, int64_t occ,
                       int64_t dim, int key_bits, BackwardBlocks* b) {
  TakeGroupBlocks(layout, n);
  b->keys_in = layout->Take<uint64_t>(occ);
  b->keys_out = layout->Take<uint64_t>(occ);
  b->payload_in = layout->Take<uint64_t>(occ);
  b->payload_out = layout->Take<uint64_t>(occ);
  b->heads = layout->Take<int>(occ);
  b->number = layout->Take<int>(occ);
  b->run_start = layout->Take<int64_t>(occ + 1);
  b->offsets = layout->Take<int64_t>(n + 1);
  // A long run has > kLongRun occurrences and at most one chunk shorter
  // than kChunk.
  b->max_long = occ / kLongRun + 1;
  b->max_chunks = occ / kChunk + b->max_long;
  b->counters = layout->Take<unsigned long long>(2);
  b->long_run = layout->Take<int64_t>(b->max_long);
  b->long_first = layout->Take<int64_t>(b->max_long);
  b->long_chunks = layout->Take<int64_t>(b->max_long);
  b->chunk_run = layout->Take<int64_t>(b->max_chunks);
  b->chunk_index = layout->Take<int64_t>(b->max_chunks);
  b->partials = layout->Take<float>(b->max_chunks * dim);
  size_t sort_bytes = 0, scan_bytes = 0;
  const int items = static_cast<int>(occ);
  cudaError_t e = cub::DeviceRadixSort::SortPairs(
      nullptr, sort_bytes, b->keys_in, b->keys_out, b->payload_in,
      b->payload_out, items, 0, key_bits);
  if (e != cudaSuccess) return static_cast<int>(e);
  e = cub::DeviceScan::InclusiveSum(nullptr, scan_bytes, b->heads,
                                    b->number, items);
  if (e != cudaSuccess) return static_cast<int>(e);
  b->temp_bytes = sort_bytes > scan_bytes ? sort_bytes : scan_bytes;
  b->temp = layout->Take<char>(static_cast<int64_t>(b->temp_bytes));
  return GE_OK;
}

// Steps 1-4 of the file comment; `targets` says where the sums go.
int Backward(const GeTable* tables, int n, int64_t dim, float max_norm,
             const GeOptimizerConfig* optimizer, void* scratch,
             size_t scratch_bytes, int64_t* unique_ids, float* unique_grads,
             int64_t* offsets, unsigned long long* errors, void* stream,
             bool padded) {
  ge_core::GroupPlan plan;
  int status = ge_core::CheckBackward(tables, n, dim, max_norm, optimizer,
                                     unique_ids, unique_grads, offsets,
                                     errors, &plan);
  if (status != GE_OK) return status;
  const size_t needed = ge_backward_scratch_bytes(tables, n, dim);
  if (needed == 0) return GE_ERR_ARGUMENT;
  if (scratch == nullptr || scratch_bytes < needed) return GE_ERR_SCRATCH;
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t occ = plan.occurrences();
  const int key_bits = ge_math::KeyBits(static_cast<uint64_t>(plan.rows()));
  ge_core::ScratchLayout layout(scratch);
  BackwardBlocks blocks;
  status = TakeBackwardBlocks(&layout, n, occ, dim, key_bits, &blocks);
  if (status != GE_OK) return status;
  int64_t* offs = optimizer ? blocks.offsets : offsets;
  if (occ == 0) {
    // Nothing to sort: every table has no distinct id.
    const cudaError_t e =
        cudaMemsetAsync(offs, 0, sizeof(int64_t) * (n + 1), s);
    return e == cudaSuccess ? GE_OK : static_cast<int>(e);
  }
  DeviceGroup g;
  cudaError_t e = UploadGroup(tables, n, plan, scratch, s, &g);
  if (e != cudaSuccess) return static_cast<int>(e);
  g.dim = dim;
  g.max_norm = max_norm;
  g.errors = errors;
  // All-ones keys: what a skipped occurrence (bad id) keeps.
  e = cudaMemsetAsync(blocks.keys_in, 0xff, sizeof(uint64_t) * occ, s);
  if (e != cudaSuccess) return static_cast<int>(e);
  if (g.units > 0) {
    PrepareKernel<<<GridFor(g.units, 1), kBlock, 0, s>>>(g, blocks.keys_in,
                                                         blocks.payload_in);
  }
  const int items = static_cast<int>(occ);
  size_t temp_bytes = blocks.temp_bytes;
  e = cub::DeviceRadixSort::SortPairs(
      blocks.temp, temp_bytes, blocks.keys_in, blocks.keys_out,
      blocks.payload_in, blocks.payload_out, items, 0, key_bits, s);
  if (e != cudaSuccess) return static_cast<int>(e);
  const unsigned grid = GridFor(occ, 1);
  HeadsKernel<<<grid, kBlock, 0, s>>>(blocks.keys_out, occ,
                                      static_cast<uint64_t>(plan.rows()),
                                      blocks.heads);
  temp_bytes = blocks.temp_bytes;
  e = cub::DeviceScan::InclusiveSum(blocks.temp, temp_bytes, blocks.heads,
                                    blocks.number, items, s);
  if (e != cudaSuccess) return static_cast<int>(e);
  RunsKernel<<<grid, kBlock, 0, s>>>(blocks.heads, blocks.number, occ,
                                     blocks.run_start);
  OffsetsKernel<<<(n + 1 + 63) / 64, 64, 0, s>>>(
      g, blocks.keys_out, blocks.number, offs, blocks.run_start);
  e = cudaMemsetAsync(blocks.counters, 0, 2 * sizeof(unsigned long long),
                      s);
  if (e != cudaSuccess) return static_cast<int>(e);
  SumTargets targets{blocks.keys_out, blocks.payload_out, blocks.run_start,
                     offs, unique_ids, unique_grads, padded,
                     optimizer != nullptr,
                     optimizer ? *optimizer : GeOptimizerConfig{},
                     blocks.counters, blocks.long_run, blocks.long_first,
                     blocks.long_chunks, blocks.chunk_run, blocks.chunk_index,
                     blocks.partials};
  bool vec4 = RowsVec4(tables, n, dim);
  if (!optimizer) {
    vec4 = vec4 && ge_cuda::Aligned16(unique_grads);
  }
  vec4 = vec4 && ge_cuda::Aligned16(blocks.partials);
  return WithShape(dim, vec4, [&](auto shape) {
    using S = decltype(shape);
    // The distinct ids, chunks and long runs are counted on the device:
    // each launch is bounded by what the GPU holds at once and loops.
    const unsigned cap = ResidentBlocks(2048 / kBlock);
    SumKernel<S::kVec, S::kG, S::kCh>
        <<<std::min(GridFor(occ, S::kG), cap), kBlock, 0, s>>>(g, targets);
    ChunkKernel<S::kVec, S::kG, S::kCh>
        <<<std::min(GridFor(blocks.max_chunks, S::kG), cap), kBlock, 0, s>>>(
            g, targets);
    const size_t shared = sizeof(float) * (kLongBlock / S::kG) * dim;
    FinishLongKernel<S::kVec, S::kG, S::kCh>
        <<<static_cast<unsigned>(std::min<int64_t>(blocks.max_long, cap)),
           kLongBlock, shared, s>>>(g, targets);
    return LaunchStatus();
  });
}

}  // namespace
}  // namespace ge_cuda

extern "C" {

size_t ge_backward_scratch_bytes(const GeTable* tables, int num_tables,
                                 int64_t dim) {
  ge_core::GroupPlan plan;
  if (ge_core::CheckTables(tables, num_tables, dim, 0, &plan) != GE_OK) {
    return 0;
  }
  ge_core::ScratchLayout layout(nullptr);
  ge_cuda::BackwardBlocks blocks;
  const int key_bits = ge_math::KeyBits(static_cast<uint64_t>(plan.rows()));
  if (ge_cuda::TakeBackwardBlocks(&layout, num_tables, plan.occurrences(),
                                  dim, key_bits, &blocks) != GE_OK) {
    return 0;
  }
  return layout.used();
}

int ge_backward(const GeTable* tables, int num_tables, int64_t dim,
                float max_norm, void* scratch, size_t scratch_bytes,
                int64_t* unique_ids, float* unique_grads, int64_t* offsets,
                unsigned long long* errors, void* stream) {
  return ge_cuda::Backward(tables, num_tables, dim, max_norm, nullptr,
                           scratch, scratch_bytes, unique_ids, unique_grads,
                           offsets, errors, stream, false);
}

int ge_backward_padded(const GeTable* tables, int num_tables, int64_t dim,
                       float max_norm, void* scratch, size_t scratch_bytes,
                       int64_t* unique_ids, float* unique_grads,
                       int64_t* offsets, unsigned long long* errors,
                       void* stream) {
  return ge_cuda::Backward(tables, num_tables, dim, max_norm, nullptr,
                           scratch, scratch_bytes, unique_ids, unique_grads,
                           offsets, errors, stream, true);
}

int ge_backward_apply(const GeTable* tables, int num_tables, int64_t dim,
                      float max_norm, const GeOptimizerConfig* optimizer,
                      void* scratch, size_t scratch_bytes,
                      unsigned long long* errors, void* stream) {
  if (optimizer == nullptr) return GE_ERR_ARGUMENT;
  return ge_cuda::Backward(tables, num_tables, dim, max_norm, optimizer,
                           scratch, scratch_bytes, nullptr, nullptr, nullptr,
                           errors, stream, false);
}

int ge_weight_grads(const GeTable* tables, int num_tables, int64_t dim,
                    float max_norm, void* scratch, size_t scratch_bytes,
                    unsigned long long* errors, void* stream) {
  return ge_cuda::RowGrads<false>(tables, num_tables, dim, max_norm, scratch,
                                  scratch_bytes, errors, stream);
}

int ge_clip_grads(const GeTable* tables, int num_tables, int64_t dim,
                  float max_norm, void* scratch, size_t scratch_bytes,
                  unsigned long long* errors, void* stream) {
  return ge_cuda::RowGrads<true>(tables, num_tables, dim, max_norm, scratch,
                                 scratch_bytes, errors, stream);
}

}  // extern "C"

#ifndef GROUP_EMBEDDING_OPS_KERNELS_POOLING_H_
#define GROUP_EMBEDDING_OPS_KERNELS_POOLING_H_

// The pooling arithmetic of every CPU lookup kernel, in one place so that
// the plain-variable (lookup_ops.cc), EmbeddingVariable (ev_lookup_ops.cc)
// and collective (collective_ops.cc) kernels give bitwise the same pooled
// rows: max_norm clipping of a row and its backward, the one static-width
// dispatcher, the weight gradient, the pooling core below, a template over
// where a row comes from, and its backward, the one gradient loop, a
// template over where an id's gradient slot is. The per-row formulas
// (combiner scale, clip factor, clip backward, weight gradient) are those
// of combiner_math.h, which the CUDA core compiles too.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/util/work_sharder.h"
#include "combiner_math.h"
#include "op_checks.h"

namespace group_embedding {

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

// The kernel's `combiners` attr, parsed.
inline Status ParseCombiners(::tensorflow::OpKernelConstruction* ctx,
                             std::vector<Combiner>* out) {
  std::vector<std::string> names;
  TF_RETURN_IF_ERROR(ctx->GetAttr("combiners", &names));
  return ParseCombiners(names, out);
}

// max_norm clipping of row e (`dim` floats) before pooling, as stock
// embedding_lookup(max_norm=c): the factor c / max(|e|, c) of ClipFactor
// (combiner_math.h); 1 when clipping is off (c < 0). float32 sums of
// squares, as stock's reduce_sum.
inline float ClipFactor(const float* row, int64_t dim, float max_norm) {
  if (max_norm < 0.0f) return 1.0f;
  float ss = 0.0f;
  for (int64_t d = 0; d < dim; ++d) ss += row[d] * row[d];
  return ClipFactor(ss, max_norm);
}

// Backward of the clip for one row e with incoming gradient g (the sum of
// its occurrences' gradients: the clip is linear in g), as ClipGradOf
// (combiner_math.h) differentiates it. Rewrites g in place; left as it
// is where the backward is the identity.
inline void ClipGradRow(const float* e, int64_t dim, float max_norm,
                        float* g) {
  if (max_norm < 0.0f) return;
  float ss = 0.0f, eg = 0.0f;
  for (int64_t d = 0; d < dim; ++d) {
    ss += e[d] * e[d];
    eg += e[d] * g[d];
  }
  if (ClipGradIsIdentity(std::sqrt(ss), max_norm)) return;
  const ClipGrad cg = ClipGradOf(ss, eg, max_norm);
  for (int64_t d = 0; d < dim; ++d) g[d] = cg.a * (g[d] - e[d] * cg.b);
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
// The one dispatcher of the kernels: every width a kernel specialises is
// here.
template <typename F>
inline void WithStaticDim(int64_t dim, F&& f) {
  switch (dim) {
    case 4:
      return f(std::integral_constant<int64_t, 4>());
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

// ---------------------------------------------------------------------------
// The pooling core. A row source tells, for position j of a table's ragged
// ids, which row it reads:
//   bool Has(j)            false for an id that addresses no row (the core
//                          skips it and reports it, see PoolExamples);
//   const float* Row(j)    the row (`dim` floats), read only when Has(j).
// Three sources: a plain table and its ids (TableRows), rows an
// EmbeddingVariable resolved beforehand (ResolvedRows), rows in a buffer
// exchanged between workers (BufferRows).
// ---------------------------------------------------------------------------

// Row ids[j] of a [vocab, dim] table; ids are range-checked here, in the
// (parallel) pooling, not in a serial pass before it.
struct TableRows {
  const float* table;
  const int64_t* ids;
  uint64_t vocab;
  int64_t dim;
  // One unsigned compare also catches negative ids.
  bool Has(int64_t j) const { return static_cast<uint64_t>(ids[j]) < vocab; }
  const float* Row(int64_t j) const { return table + ids[j] * dim; }
};

// Rows resolved before pooling (EmbeddingVariable keys: see ReadKeys).
struct ResolvedRows {
  const float* const* rows;
  static constexpr bool Has(int64_t) { return true; }
  const float* Row(int64_t j) const { return rows[j]; }
};

// Rows at float offsets of one buffer (the collective lookup's returned
// rows). Offsets are checked here, in the pooling (a separate pass over
// them cost as much as reading them again from memory): a row must lie
// inside the buffer, offset < `end` = buffer floats - dim + 1.
struct BufferRows {
  const float* buffer;
  const int64_t* offsets;
  uint64_t end;
  // One unsigned compare also catches negative offsets.
  bool Has(int64_t j) const {
    return static_cast<uint64_t>(offsets[j]) < end;
  }
  const float* Row(int64_t j) const { return buffer + offsets[j]; }
};

// BufferRows' `end` for rows of `dim` floats in a buffer of `elems`.
inline uint64_t BufferRowsEnd(int64_t elems, int64_t dim) {
  return elems >= dim ? static_cast<uint64_t>(elems - dim) + 1 : 0;
}

// One table of a pooled lookup: its rows, its ragged ids and where its
// pooled [batch, dim] rows go (row b at out + b * stride: stride `dim` for
// one output per table, K * dim for the concatenated layout).
template <typename Rows>
struct PooledTable {
  Rows rows;
  const int64_t* splits;
  const float* weights;  // nullptr: unweighted
  int64_t nnz;           // ids of the table (prefetches stop there)
  int64_t dim;
  Combiner combiner;
  float* out;
  int64_t stride;
};

// Pools examples [b0, b1) of one table, as stock embedding_lookup_sparse:
//   out_b = scale_b * sum_j w_j * clip(row_j)   (j in row b, in order)
// A row not Has() is skipped and passed to `on_bad(j)`. `kDim` > 0 is the
// width fixed at compile time (WithStaticDim): the sums then live in
// registers; a plain `o[d] +=` loop reloads and stores the output at
// every id (the compiler cannot tell the output from the rows).
template <int64_t kDim, typename Rows, typename OnBad>
inline void PoolExamples(const PooledTable<Rows>& p, float max_norm,
                         int64_t b0, int64_t b1, OnBad&& on_bad) {
  const int64_t width = kDim > 0 ? kDim : p.dim;
  const float* w = p.weights;
  float sums[kDim > 0 ? kDim : 1];
  for (int64_t b = b0; b < b1; ++b) {
    float* o = p.out + b * p.stride;
    float* acc = kDim > 0 ? sums : o;
    std::fill(acc, acc + width, 0.0f);
    const int64_t lo = p.splits[b], hi = p.splits[b + 1];
    for (int64_t j = lo; j < hi; ++j) {
      if (!p.rows.Has(j)) {
        on_bad(j);
        continue;
      }
      // Ahead across example boundaries: examples are often one id long.
      const int64_t ahead = j + kPrefetchDistance;
      if (ahead < p.nnz && p.rows.Has(ahead)) {
        PrefetchRow(p.rows.Row(ahead), width);
      }
      const float* row = p.rows.Row(j);
      const float wj = (w ? w[j] : 1.0f) * ClipFactor(row, width, max_norm);
      for (int64_t d = 0; d < width; ++d) acc[d] += wj * row[d];
    }
    const float scale = RowScale(p.combiner, w, lo, hi);
    if (kDim > 0) {
      for (int64_t d = 0; d < width; ++d) o[d] = acc[d] * scale;
    } else if (scale != 1.0f) {
      for (int64_t d = 0; d < width; ++d) o[d] *= scale;
    }
  }
}

// ---------------------------------------------------------------------------
// The backward of the pooling core, the one gradient loop of the plain,
// EV, sequence and collective kernels: every id j of example b adds
//   f_j * g_b,  f_j = scale_b * w_j   (as PoolExamples pooled it)
// into the gradient slot of its row, examples and ids in order, so that
// every kernel sums a row's occurrences in the same order with the same
// arithmetic (one fused multiply-add per float, AddScaledRow) and the
// collective lookup's gradient equals the single-process one bitwise.
// Sequences pass kSum (scale 1, f_j = w_j) and take g at the id's slot.
// Two template parameters say where things are:
//   Grads: const float* Row(b, j)  the gradient id j of example b gets;
//   Slots: float* Slot(j)          where id j's gradient adds up;
//          kPrefetch               whether slots are worth prefetching
//                                  (scattered over a large buffer).
// ---------------------------------------------------------------------------

// Pooled gradient row b at grads + b * stride (stride D for one output
// per table, K * D for the concatenated layout).
struct PooledGrads {
  const float* grads;
  int64_t stride;
  const float* Row(int64_t b, int64_t) const { return grads + b * stride; }
};

// A sequence's gradient [B, T, D]: id j of row b lands at [b, p_j].
struct SequenceGrads {
  const float* grads;
  const int64_t* positions;
  int64_t len;
  int64_t dim;
  const float* Row(int64_t b, int64_t j) const {
    return grads + (b * len + positions[j]) * dim;
  }
};

// Distinct ids numbered densely (slot[j], first occurrence = 0): a
// [distinct, width] block of sums, small enough to stay in cache.
struct DenseSlots {
  float* sums;
  const int64_t* slot;
  int64_t width;
  static constexpr bool kPrefetch = false;
  // Slots come from the kernel's own dedup: always in range.
  bool Has(int64_t) const { return true; }
  float* Slot(int64_t j) const { return sums + slot[j] * width; }
};

// Slots at float offsets of one buffer (the collective lookup's rows
// buffer: ids sharing a row share its offset). `end`: BufferRowsEnd of
// the buffer; an offset at or past it (or negative) is refused as the
// scatter reaches it, which costs less than a pass over the offsets first.
struct OffsetSlots {
  float* buffer;
  const int64_t* offsets;
  uint64_t end;
  static constexpr bool kPrefetch = true;
  bool Has(int64_t j) const {
    return static_cast<uint64_t>(offsets[j]) < end;
  }
  float* Slot(int64_t j) const { return buffer + offsets[j]; }
};

// One table of a pooled (or sequence) lookup's backward.
template <typename Grads>
struct GradTable {
  Grads grads;
  const int64_t* splits;
  const float* weights;  // nullptr: unweighted
  int64_t batch;
  int64_t nnz;
  Combiner combiner;  // kSum for sequences
};

// A table's GradTable from its kernel inputs: `splits` [B + 1], `weights`
// [nnz] or empty (unweighted).
template <typename Grads>
inline GradTable<Grads> MakeGradTable(const Grads& grads,
                                      const ::tensorflow::Tensor& splits,
                                      const ::tensorflow::Tensor& weights,
                                      int64_t nnz, Combiner combiner) {
  return {grads,
          splits.flat<int64_t>().data(),
          weights.NumElements() ? weights.flat<float>().data() : nullptr,
          splits.NumElements() - 1,
          nnz,
          combiner};
}

// Calls `visit(j, f_j, g)` for every id j, examples in order: the one
// place the backward's factors are computed.
template <typename Grads, typename Visit>
inline void ForEachIdGrad(const GradTable<Grads>& p, Visit&& visit) {
  const float* w = p.weights;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t lo = p.splits[b], hi = p.splits[b + 1];
    if (lo == hi) continue;
    const float scale = RowScale(p.combiner, w, lo, hi);
    for (int64_t j = lo; j < hi; ++j) {
      visit(j, scale * (w ? w[j] : 1.0f), p.grads.Row(b, j));
    }
  }
}

// Adds every id's gradient into its slot (slots zeroed by the caller).
// `kDim` > 0: the width fixed at compile time (WithStaticDim).
// Returns the first id whose slot `slots.Has` refuses (nothing is written
// for it), or -1.
template <int64_t kDim, typename Grads, typename Slots>
inline int64_t ScatterIdGrads(const GradTable<Grads>& p, const Slots& slots,
                              int64_t dim) {
  const int64_t width = kDim > 0 ? kDim : dim;
  int64_t refused = -1;
  ForEachIdGrad(p, [&](int64_t j, float f, const float* g) {
    // Prefetching a bad address is harmless: it never faults.
    if (Slots::kPrefetch && j + kPrefetchDistance < p.nnz) {
      PrefetchRow(slots.Slot(j + kPrefetchDistance), width);
    }
    if (__builtin_expect(!slots.Has(j), 0)) {
      if (refused < 0) refused = j;
      return;
    }
    AddScaledRow(slots.Slot(j), g, f, width);
  });
  return refused;
}

// d loss / d w_j of one weighted table, given the gradient of its pooled
// rows (`p.grads`) and the pooled rows themselves (`pooled`, [B, dim]),
// with `row_of(j)` the row id j read:
//   pooled_b = sum_j w_j e_j / n_b,  n_b = 1 | sum_j w_j | sqrt(sum_j w_j^2)
//   d/dw_j = (e_j.g_b - pooled_b.g_b * dn_b/dw_j) / n_b
// With max_norm >= 0, e_j is the clipped row (as pooled), and so is the
// row it multiplies here. A sequence (kSum, SequenceGrads, `pooled`
// nullptr) gives d/dw_j = clip(e_j).g[b, p_j]. Weighted tables only
// (`p.weights` not null).
template <typename Grads, typename RowOf>
void WeightGradRows(const GradTable<Grads>& p, int64_t dim,
                    const float* pooled, RowOf row_of, float* dw,
                    float max_norm = -1.0f) {
  const Combiner c = p.combiner;
  const float* w = p.weights;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t lo = p.splits[b], hi = p.splits[b + 1];
    const float scale = RowScale(c, w, lo, hi);
    float pg = 0.0f;
    if (c != kSum) {
      // One pooled gradient per example: Row(b, j) is the same for all j.
      const float* gb = p.grads.Row(b, lo);
      for (int64_t d = 0; d < dim; ++d) pg += pooled[b * dim + d] * gb[d];
    }
    for (int64_t j = lo; j < hi; ++j) {
      const float* row = row_of(j);
      const float* gj = p.grads.Row(b, j);
      float eg = 0.0f;
      for (int64_t d = 0; d < dim; ++d) eg += row[d] * gj[d];
      eg *= ClipFactor(row, dim, max_norm);
      dw[j] = WeightGrad(c, eg, pg, w[j], scale);
    }
  }
}

// Above this size, dense gradient sums are built one by one instead of by
// scattered adds (half the 1 MiB L2 of the machine measured; below it the
// scattered adds were as fast and skip a counting sort).
constexpr int64_t kCachedSumBytes = 512 << 10;

// The sums of `u` dense slots ([u, width] at `sums`), one slot at a time:
// adding every occurrence's gradient straight into its sum missed the
// cache at most adds for large tables (most of the backward's time at
// dim 64). The occurrences are grouped by slot in position order (a
// counting sort) and each sum is built in registers and written once;
// the adds are those of ScatterIdGrads, in the same order.
template <int64_t kDim, typename Grads>
void SumIdGradsBySlot(const GradTable<Grads>& p, const int64_t* slot,
                      int64_t u, int64_t dim, float* sums) {
  const int64_t width = kDim > 0 ? kDim : dim;
  std::vector<int64_t> start(u + 1, 0);
  for (int64_t j = 0; j < p.nnz; ++j) ++start[slot[j] + 1];
  for (int64_t i = 0; i < u; ++i) start[i + 1] += start[i];
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  std::vector<const float*> occ_grad(p.nnz);
  std::vector<float> occ_factor(p.nnz);
  ForEachIdGrad(p, [&](int64_t j, float f, const float* g) {
    const int64_t at = next[slot[j]]++;
    occ_grad[at] = g;
    occ_factor[at] = f;
  });
  float acc_regs[kDim > 0 ? kDim : 1];
  for (int64_t i = 0; i < u; ++i) {
    float* dst = sums + i * width;
    float* acc = kDim > 0 ? acc_regs : dst;
    std::fill(acc, acc + width, 0.0f);
    for (int64_t at = start[i]; at < start[i + 1]; ++at) {
      if (at + kPrefetchDistance < p.nnz) {
        PrefetchRow(occ_grad[at + kPrefetchDistance], width);
      }
      const float f = occ_factor[at];
      const float* g = occ_grad[at];
      for (int64_t d = 0; d < width; ++d) acc[d] += f * g[d];
    }
    if (kDim > 0) std::copy(acc, acc + width, dst);
  }
}

// The gradient of each of the `u` distinct ids of one table ([u, dim] at
// `sums`), ids numbered by `slot` (first occurrence = 0, DedupToGradOutputs).
template <typename Grads>
void SumIdGrads(const GradTable<Grads>& p, const int64_t* slot, int64_t u,
                int64_t dim, float* sums) {
  WithStaticDim(dim, [&](auto static_dim) {
    constexpr int64_t kDim = decltype(static_dim)::value;
    const int64_t width = kDim > 0 ? kDim : dim;
    if (u * width * static_cast<int64_t>(sizeof(float)) <= kCachedSumBytes) {
      std::fill(sums, sums + u * width, 0.0f);
      ScatterIdGrads<kDim>(p, DenseSlots{sums, slot, width}, dim);
    } else {
      SumIdGradsBySlot<kDim>(p, slot, u, dim, sums);
    }
  });
}

// Runs `f(t, b0, b1)` over the examples of K tables, numbered
// consecutively (`first_row[t]`: table t's first; K + 1 entries), sharded
// on the intra-op pool; `cost`: TF's cost estimate per example.
template <typename F>
inline void ShardExamples(::tensorflow::OpKernelContext* ctx,
                          const std::vector<int64_t>& first_row, int64_t cost,
                          F&& f) {
  const int k = static_cast<int>(first_row.size()) - 1;
  auto work = [&](int64_t begin, int64_t end) {
    int t = static_cast<int>(
        std::upper_bound(first_row.begin(), first_row.end(), begin) -
        first_row.begin() - 1);
    for (; t < k && first_row[t] < end; ++t) {
      const int64_t b0 = std::max(begin, first_row[t]) - first_row[t];
      const int64_t b1 = std::min(end, first_row[t + 1]) - first_row[t];
      if (b0 < b1) f(t, b0, b1);
    }
  };
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
  ::tensorflow::Shard(pool->num_threads, pool->workers, first_row[k], cost,
                      work);
}

// An id PoolTables refused (not Has()): table and position, or table -1.
struct Refused {
  int table = -1;
  int64_t pos = -1;
  bool any() const { return table >= 0; }
};

// Pools every example of every table (each at its own width). Returns an
// id it refused, the first found (any one when shards race); the others
// were skipped too, so the caller fails the op.
template <typename Rows>
Refused PoolTables(::tensorflow::OpKernelContext* ctx,
                   const std::vector<PooledTable<Rows>>& tables,
                   const std::vector<int64_t>& first_row, float max_norm,
                   int64_t cost) {
  std::atomic<bool> bad(false);
  std::atomic<int> bad_table(-1);
  std::atomic<int64_t> bad_pos(-1);
  ShardExamples(ctx, first_row, cost, [&](int t, int64_t b0, int64_t b1) {
    const PooledTable<Rows>& p = tables[t];
    // Clipped rows of width 4 keep the run-time width: unrolled at 4, GCC
    // contracts the clip's sum of squares otherwise (last-bit changes),
    // and the plain lookup clipped them at the run-time width before its
    // dispatcher took width 4.
    const int64_t static_width = max_norm >= 0.0f && p.dim == 4 ? -1 : p.dim;
    WithStaticDim(static_width, [&](auto static_dim) {
      PoolExamples<decltype(static_dim)::value>(
          p, max_norm, b0, b1, [&](int64_t j) {
            if (!bad.exchange(true)) {
              bad_table = t;
              bad_pos = j;
            }
          });
    });
  });
  // The shards have ended: their writes are visible.
  return bad ? Refused{bad_table, bad_pos} : Refused{};
}

// One table of a sequence (unpooled) lookup: row j lands at
// out[b, positions[j], :] of a padded [batch, len, dim] output.
template <typename Rows>
struct SequenceTable {
  Rows rows;  // every id must have a row (checked before)
  const int64_t* splits;
  const int64_t* positions;
  const float* weights;  // nullptr: unweighted
  int64_t nnz;
  int64_t len;
  float* out;
};

// Writes examples [b0, b1) of one sequence table: zeros, then
//   out[b, positions[j], :] += w_j * clip(row_j)
// `+=`: a malformed SparseTensor may repeat a [row, column]; its ids then
// add up, as in the pure-TF segment sum.
template <typename Rows>
inline void ScatterSequence(const SequenceTable<Rows>& p, int64_t dim,
                            float max_norm, int64_t b0, int64_t b1) {
  const float* w = p.weights;
  for (int64_t b = b0; b < b1; ++b) {
    float* o = p.out + b * p.len * dim;
    std::fill(o, o + p.len * dim, 0.0f);
    for (int64_t j = p.splits[b]; j < p.splits[b + 1]; ++j) {
      if (j + kPrefetchDistance < p.nnz) {
        PrefetchRow(p.rows.Row(j + kPrefetchDistance), dim);
      }
      const float* row = p.rows.Row(j);
      const float f = (w ? w[j] : 1.0f) * ClipFactor(row, dim, max_norm);
      float* dst = o + p.positions[j] * dim;
      for (int64_t d = 0; d < dim; ++d) dst[d] += f * row[d];
    }
  }
}

// Writes every example of every sequence table (all of width `dim`).
template <typename Rows>
void ScatterSequences(::tensorflow::OpKernelContext* ctx,
                      const std::vector<SequenceTable<Rows>>& tables,
                      const std::vector<int64_t>& first_row, int64_t dim,
                      float max_norm, int64_t cost) {
  ShardExamples(ctx, first_row, cost, [&](int t, int64_t b0, int64_t b1) {
    ScatterSequence(tables[t], dim, max_norm, b0, b1);
  });
}

}  // namespace group_embedding

#endif  // GROUP_EMBEDDING_OPS_KERNELS_POOLING_H_

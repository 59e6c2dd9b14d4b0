// The GPU EV table (ev_table.h) in CUDA.
//
// A find is one launch: a tile of 8 lanes per key reads the key's bucket
// digests (16 bytes a lane, one 128-byte line), checks the keys whose
// digest matches, and copies the row (float4 per lane where aligned).
// A find-or-insert is three: the same probe, which also stamps, counts
// and reads the keys it finds and writes the bucket of each missing key;
// a radix sort of those buckets (stable: a bucket's missing keys end up
// adjacent, in batch order); and warps that each insert one bucket's
// keys in turn (a warp alone writes its bucket in the launch: no locks,
// no lost insert, no key stored twice; repeats of a new key are found in
// the warp's copy of the bucket's digests), writing their rows. With a
// CounterFilter a fourth counts the hits once every read is done. A
// group call does the same for several tables at once: occurrences and
// buckets are numbered across its tables, so it is still one probe, one
// sort and one insert launch.

#include <cuda_runtime.h>

#include <algorithm>
#include <cooperative_groups.h>
#include <cub/cub.cuh>
#include <initializer_list>
#include <vector>

#include "ev_table_hash.h"
#include "group_rows.cuh"

namespace ge_cuda_ev {
namespace {

using ge_ev::Admitted;
using ge_ev::BucketOf;
using ge_ev::DefaultRow;
using ge_ev::DigestOf;
using ge_cuda::FindSegment;
using ge_ev::Mix;

constexpr int kTile = 8;    // lanes per key in the probes
constexpr int kBlock = 256;
constexpr unsigned kAll = 0xffffffffu;

__device__ __forceinline__ void Count(unsigned long long* counters, int which,
                                      unsigned long long v = 1) {
  atomicAdd(counters + which, v);
}

// Tile-cooperative row copies; `vec4`: every row 16-byte aligned.
__device__ __forceinline__ void CopyRow(float* dst, const float* src,
                                        int64_t dim, int lane, int lanes,
                                        bool vec4) {
  if (vec4) {
    for (int64_t d = 4 * lane; d < dim; d += 4 * lanes) {
      *reinterpret_cast<float4*>(dst + d) =
          *reinterpret_cast<const float4*>(src + d);
    }
  } else {
    for (int64_t d = lane; d < dim; d += lanes) dst[d] = src[d];
  }
}
__device__ __forceinline__ void FillRow(float* dst, float v, int64_t dim,
                                        int lane, int lanes) {
  for (int64_t d = lane; d < dim; d += lanes) dst[d] = v;
}

// The slot of `key` in its bucket or -1, in every lane of the tile. All
// 32 lanes of the warp call it (ballot and shuffle over the warp).
__device__ __forceinline__ int64_t TileFind(const GeEvTable& t, bool active,
                                            int64_t key, uint64_t h,
                                            int lane, int tile) {
  int64_t found = -1;
  if (active) {
    const int64_t base = BucketOf(h, t.num_buckets) * GE_EV_BUCKET;
    const uint4 d =
        reinterpret_cast<const uint4*>(t.digests + base)[lane];
    const unsigned want = DigestOf(h) * 0x01010101u;
    // Byte k of word w (slot 16 lane + 4 w + k) is 0xff where the digest
    // matches.
    auto scan = [&](unsigned word, int w) {
      for (unsigned bits = __vcmpeq4(word, want); bits != 0;) {
        const int byte = (__ffs(bits) - 1) >> 3;
        bits &= ~(0xffu << (8 * byte));
        const int64_t s = base + lane * 16 + w * 4 + byte;
        if (t.keys[s] == key) found = s;
      }
    };
    scan(d.x, 0);
    scan(d.y, 1);
    scan(d.z, 2);
    scan(d.w, 3);
  }
  const unsigned hits =
      (__ballot_sync(kAll, found >= 0) >> (tile * kTile)) & 0xffu;
  const int src = tile * kTile + (hits ? __ffs(hits) - 1 : 0);
  const int64_t s = __shfl_sync(kAll, found, src);
  return hits ? s : -1;
}

struct Tile {
  int64_t j;  // the key this tile serves
  int lane;   // 0 .. kTile - 1
  int tile;   // tile of the warp
};
__device__ __forceinline__ Tile MyTile() {
  const int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) +
                    threadIdx.x;
  return {g / kTile, static_cast<int>(threadIdx.x % kTile),
          static_cast<int>((threadIdx.x % 32) / kTile)};
}

// What an absent (or reserved) key reads.
__device__ __forceinline__ void AbsentRow(const GeEvTable& t, int64_t key,
                                          float* dst, int lane, bool vec4) {
  if (t.filter_freq > 0) {
    FillRow(dst, t.no_permission, t.dim, lane, kTile);
  } else {
    CopyRow(dst, t.defaults + DefaultRow(key, t.default_rows) * t.dim,
            t.dim, lane, kTile, vec4);
  }
}

__global__ void __launch_bounds__(kBlock)
    FindKernel(GeEvTable t, const int64_t* __restrict__ keys, int64_t n,
               float* out, int64_t* out_slots, unsigned long long* counters,
               bool vec4) {
  const Tile me = MyTile();
  const bool active = me.j < n;
  const int64_t key = active ? keys[me.j] : 0;
  const bool bad = key == GE_EV_EMPTY_KEY;
  const uint64_t h = Mix(static_cast<uint64_t>(key));
  const int64_t s = TileFind(t, active && !bad, key, h, me.lane, me.tile);
  if (!active) return;
  if (bad && me.lane == 0) Count(counters, GE_EV_BAD_KEYS);
  const bool admitted =
      s >= 0 && Admitted(*ge_ev::FreqOf(t.meta, s), t.filter_freq);
  if (out_slots != nullptr && me.lane == 0) {
    out_slots[me.j] = admitted ? s : -1;
  }
  if (out == nullptr) return;
  float* dst = out + me.j * t.dim;
  if (admitted) {
    CopyRow(dst, t.values + s * t.dim, t.dim, me.lane, kTile, vec4);
  } else {
    AbsentRow(t, key, dst, me.lane, vec4);
  }
}

// ge_ev_stamp: one tile per key; lane 0 stamps and writes the slot.
// Duplicates of a key all store the same version.
__global__ void __launch_bounds__(kBlock)
    StampKernel(GeEvTable t, const int64_t* __restrict__ keys, int64_t n,
                int64_t version, int64_t* out_slots,
                unsigned long long* counters) {
  const Tile me = MyTile();
  const bool active = me.j < n;
  const int64_t key = active ? keys[me.j] : 0;
  const bool bad = key == GE_EV_EMPTY_KEY;
  const uint64_t h = Mix(static_cast<uint64_t>(key));
  const int64_t s = TileFind(t, active && !bad, key, h, me.lane, me.tile);
  if (!active || me.lane != 0) return;
  if (bad) Count(counters, GE_EV_BAD_KEYS);
  if (s >= 0) *ge_ev::VersionOf(t.meta, s) = version;
  const bool admitted =
      s >= 0 && Admitted(*ge_ev::FreqOf(t.meta, s), t.filter_freq);
  out_slots[me.j] = admitted ? s : -1;
}

// ge_ev_swap_versions: one tile per (distinct) key; lane 0 swaps.
__global__ void __launch_bounds__(kBlock)
    SwapVersionsKernel(GeEvTable t, const int64_t* __restrict__ keys,
                       int64_t n, int64_t* versions,
                       unsigned long long* counters) {
  const Tile me = MyTile();
  const bool active = me.j < n;
  const int64_t key = active ? keys[me.j] : 0;
  const bool bad = key == GE_EV_EMPTY_KEY;
  const uint64_t h = Mix(static_cast<uint64_t>(key));
  const int64_t s = TileFind(t, active && !bad, key, h, me.lane, me.tile);
  if (!active || me.lane != 0) return;
  if (bad) Count(counters, GE_EV_BAD_KEYS);
  if (s < 0) return;
  int64_t* version = ge_ev::VersionOf(t.meta, s);
  const int64_t old = *version;
  *version = versions[me.j];
  versions[me.j] = old;
}

// What an import writes besides the key (NULL arrays: initial state).
struct ImportRows {
  bool on;
  const float* rows;
  const float* slots;  // [num_slots, n, dim]
  const int64_t* freq;
  const int64_t* version;
  int64_t n;
};

// Writes entry s's state (a new key or an import), `lanes` lanes
// together (`lane` of them). Its version is `now`: an import's own
// versions are written when the call ends, so that until then its keys
// are pinned like those of a training step.
__device__ __forceinline__ void WriteEntry(const GeEvTable& t, int64_t s,
                                           int64_t key, int64_t j,
                                           int64_t now,
                                           const ImportRows& in, int lane,
                                           int lanes, bool vec4) {
  const int64_t dim = t.dim;
  const int64_t cap = t.num_buckets * GE_EV_BUCKET;
  const float* row =
      in.on ? in.rows + j * dim
            : t.defaults + DefaultRow(key, t.default_rows) * dim;
  CopyRow(t.values + s * dim, row, dim, lane, lanes, vec4);
  for (int k = 0; k < t.num_slots; ++k) {
    float* dst = t.slots + (k * cap + s) * dim;
    if (in.on && in.slots != nullptr) {
      CopyRow(dst, in.slots + (k * in.n + j) * dim, dim, lane, lanes, vec4);
    } else {
      FillRow(dst, t.slot_inits[k], dim, lane, lanes);
    }
  }
  if (lane == 0) {
    *ge_ev::FreqOf(t.meta, s) = in.on && in.freq != nullptr ? in.freq[j] : 0;
    *ge_ev::VersionOf(t.meta, s) = now;
  }
}

// A group call as the kernels see it (descriptors in the scratch): every
// feature's occurrences numbered one after the other (`occ_base`), every
// table's buckets too (`bucket_base`), so that one probe, one sort and
// one insert launch serve all tables. A single-table call is a group of
// one.
struct Group {
  const GeEvTable* tables;     // [nt]
  const GeEvBatch* batches;    // [nb]
  const GeEvEvicted* evicted;  // [nt]; count NULL: dropped
  const int64_t* occ_base;     // [nb + 1]
  const int64_t* bucket_base;  // [nt + 1]
  int nt, nb;
  int64_t n;                   // occurrences in all
  int64_t now;                 // max(step, 0)
  uint32_t none;               // the bucket number of "found / bad"
  int64_t* slot_scratch;       // [n]: slots of batches without out_slots
  ImportRows in;               // imports: one table, one batch
  unsigned long long* counters;
  bool vec4;
};

// Occurrence j of the call: its batch, its index in the batch.
struct Occurrence {
  const GeEvBatch* batch;
  int64_t jl;
};
__device__ __forceinline__ Occurrence Locate(const Group& g, int64_t j) {
  const int b = g.nb == 1 ? 0 : FindSegment(g.occ_base, g.nb, j);
  return {&g.batches[b], j - g.occ_base[b]};
}
__device__ __forceinline__ int64_t* SlotRef(const Group& g, int64_t j,
                                            const Occurrence& o) {
  return o.batch->out_slots != nullptr ? o.batch->out_slots + o.jl
                                       : g.slot_scratch + j;
}

// Probe of every occurrence: found keys are stamped (training) or
// overwritten (import) and their rows read; a missing key leaves its
// call-wide bucket number in `bucket_of` (others `none`) for the insert.
// Without a filter the read does not depend on freq, so hits are counted
// here; with one, CountHitsKernel counts them once every read is done.
__global__ void __launch_bounds__(kBlock)
    ProbeKernel(Group g, uint32_t* bucket_of, int32_t* index_of) {
  const Tile me = MyTile();
  const bool active = me.j < g.n;
  const Occurrence o = active ? Locate(g, me.j) : Occurrence{g.batches, 0};
  const int tn = o.batch->table;
  const GeEvTable& t = g.tables[tn];
  const int64_t key = active ? o.batch->keys[o.jl] : 0;
  const bool bad = key == GE_EV_EMPTY_KEY;
  const uint64_t h = Mix(static_cast<uint64_t>(key));
  const int64_t s = TileFind(t, active && !bad, key, h, me.lane, me.tile);
  // The warp's occurrences of one stored key stamp and count it once (the
  // lowest lane among them): the few keys of a small table recur
  // thousands of times a batch, and an access per occurrence to one
  // address serialises in L2. Matched on the key's metadata address
  // (table and slot); a tile that holds no hit matches only itself.
  const bool hit = active && !bad && s >= 0;
  const unsigned peers = __match_any_sync(
      kAll, hit ? reinterpret_cast<unsigned long long>(t.meta + 2 * s)
                : ~static_cast<unsigned long long>(me.tile));
  const bool leader = static_cast<int>(threadIdx.x % 32) == __ffs(peers) - 1;
  const unsigned long long repeats = __popc(peers) / kTile;
  if (!active) return;
  float* out = o.batch->out != nullptr && !g.in.on
                   ? o.batch->out + o.jl * t.dim
                   : nullptr;
  if (me.lane == 0) {
    *SlotRef(g, me.j, o) = s;
    index_of[me.j] = static_cast<int32_t>(me.j);
    bucket_of[me.j] =
        (s >= 0 || bad)
            ? g.none
            : static_cast<uint32_t>(g.bucket_base[tn] +
                                    BucketOf(h, t.num_buckets));
    if (bad) Count(g.counters, GE_EV_BAD_KEYS);
  }
  if (bad) {
    if (out != nullptr) AbsentRow(t, key, out, me.lane, g.vec4);
    return;
  }
  if (s < 0) return;
  if (g.in.on) {
    WriteEntry(t, s, key, o.jl, g.now, g.in, me.lane, kTile, g.vec4);
    return;
  }
  int64_t* meta = t.meta + 2 * s;
  if (t.filter_freq <= 0) {
    // No filter: the read does not depend on freq. The leader's load of
    // the version is issued before the row's loads and waited for after
    // them (a stamp between the two made the row wait for it).
    int64_t version = 0;
    if (leader) version = meta[1];
    if (out != nullptr) {
      CopyRow(out, t.values + s * t.dim, t.dim, me.lane, kTile, g.vec4);
    }
    if (leader) {
      // Warps with the same key store the same version: benign.
      if (version < g.now) meta[1] = g.now;
      atomicAdd(reinterpret_cast<unsigned long long*>(meta), repeats);
    }
    return;
  }
  const longlong2 fv = *reinterpret_cast<const longlong2*>(meta);
  // Repeats of the key store the same version: the race is benign.
  if (leader && fv.y < g.now) meta[1] = g.now;
  if (out == nullptr) return;
  // The freq read above is from before this call counted
  // (CountHitsKernel counts once every read is done).
  if (Admitted(fv.x, t.filter_freq)) {
    CopyRow(out, t.values + s * t.dim, t.dim, me.lane, kTile, g.vec4);
  } else {
    FillRow(out, t.no_permission, t.dim, me.lane, kTile);
  }
}

namespace cg = cooperative_groups;
using Lanes = cg::thread_block_tile<kTile>;

// The victim of a full bucket (slot in the bucket), or -1 when every key
// is pinned; the whole tile calls it. Lane l weighs slots 16l .. 16l + 15.
__device__ __forceinline__ int Victim(const Lanes& tile,
                                      const GeEvTable& t, int64_t base,
                                      int64_t now) {
  const int lane = tile.thread_rank();
  int best = -1;
  int64_t bf = 0, bv = 0;
  const longlong2* meta =
      reinterpret_cast<const longlong2*>(t.meta + 2 * (base + 16 * lane));
#pragma unroll 4
  for (int i = 0; i < 16; ++i) {
    const longlong2 fv = meta[i];
    if (fv.y >= now) continue;  // pinned
    const int64_t f = t.policy == GE_EV_LFU ? fv.x : 0;
    if (best < 0 ||
        ge_ev::EvictsBefore(t.policy, f, fv.y, 16 * lane + i, bf, bv, best)) {
      best = 16 * lane + i;
      bf = f;
      bv = fv.y;
    }
  }
  for (int off = kTile / 2; off > 0; off >>= 1) {
    const int ob = tile.shfl_down(best, off);
    const int64_t of = tile.shfl_down(bf, off);
    const int64_t ov = tile.shfl_down(bv, off);
    if (ob >= 0 &&
        (best < 0 || ge_ev::EvictsBefore(t.policy, of, ov, ob, bf, bv,
                                         best))) {
      best = ob;
      bf = of;
      bv = ov;
    }
  }
  return tile.shfl(best, 0);
}

// Lowest byte index (0..15) of the 16 in `d` equal to `want4`'s byte, or
// 16; `want4` = the byte repeated 4 times.
__device__ __forceinline__ int FirstByte(const uint4& d, unsigned want4) {
  const unsigned w[4] = {__vcmpeq4(d.x, want4), __vcmpeq4(d.y, want4),
                         __vcmpeq4(d.z, want4), __vcmpeq4(d.w, want4)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (w[i] != 0) return 4 * i + ((__ffs(w[i]) - 1) >> 3);
  }
  return 16;
}

// Sets byte `k` of the 16 in `d`.
__device__ __forceinline__ void SetByte(uint4* d, int k, unsigned v) {
  const int shift = 8 * (k % 4);
  unsigned* w = k < 4 ? &d->x : k < 8 ? &d->y : k < 12 ? &d->z : &d->w;
  *w = (*w & ~(0xffu << shift)) | (v << shift);
}

// What a new key's occurrence reads in training: its freq before this
// call is 0, so its row only without a filter.
__device__ __forceinline__ void NewKeyRow(const GeEvTable& t, int64_t s,
                                          float* dst, int lane, bool vec4) {
  if (t.filter_freq <= 0) {
    CopyRow(dst, t.values + s * t.dim, t.dim, lane, kTile, vec4);
  } else {
    FillRow(dst, t.no_permission, t.dim, lane, kTile);
  }
}

// An insert tile's counts, added to the call's counters once when the
// tile is done: one atomic per key on the same three addresses
// serialised the insert in L2.
struct RunCounts {
  unsigned long long inserted = 0, evicted = 0, full = 0;
};

// The sorted entries a tile walks, read ahead: lane l holds entry c0 + l
// (its bucket, occurrence and key), so that a run inside the chunk does
// not wait for an index and then a key, one entry after another.
struct Chunk {
  int64_t c0;
  uint32_t bucket;
  int64_t j;
  int64_t key;
};

// The missing keys of call-wide bucket gb, sorted entries [e, ...),
// inserted in turn by one tile of 8 lanes. The tile keeps the bucket's
// digests (16 a lane: slots 16l .. 16l + 15), so it finds free slots and
// the keys it inserted earlier in the run without reading keys.
__device__ void InsertRun(const Lanes& tile, const Group& g,
                          const uint32_t* bucket_sorted,
                          const int32_t* index_sorted, const Chunk& chunk,
                          int64_t e, uint32_t gb, RunCounts* counts) {
  const int lane = tile.thread_rank();
  const int tn = g.nt == 1 ? 0 : FindSegment(g.bucket_base, g.nt, gb);
  const GeEvTable& t = g.tables[tn];
  const GeEvEvicted& ev = g.evicted[tn];
  const int64_t base = (gb - g.bucket_base[tn]) * GE_EV_BUCKET;
  const int64_t cap = t.num_buckets * GE_EV_BUCKET;
  uint4 dg = reinterpret_cast<const uint4*>(t.digests + base)[lane];
  for (; e < g.n; ++e) {
    // Entry e from the chunk's lanes, or read (a run that goes past it).
    const int64_t at = e - chunk.c0;  // the same in every lane
    const bool held = at < kTile;
    const int src = held ? static_cast<int>(at) : 0;
    const uint32_t b_held = tile.shfl(chunk.bucket, src);
    const int64_t j_held = tile.shfl(chunk.j, src);
    const int64_t key_held = tile.shfl(chunk.key, src);
    if ((held ? b_held : bucket_sorted[e]) != gb) break;
    const int64_t j = held ? j_held : index_sorted[e];
    const Occurrence o = Locate(g, j);
    const int64_t key = held ? key_held : o.batch->keys[o.jl];
    const uint64_t h = Mix(static_cast<uint64_t>(key));
    const unsigned d = DigestOf(h);
    float* dst = o.batch->out != nullptr && !g.in.on
                     ? o.batch->out + o.jl * t.dim
                     : nullptr;
    int64_t* slot = SlotRef(g, j, o);
    // A repeat of a key this tile inserted earlier in the run.
    int found = -1;
    const unsigned want = d * 0x01010101u;
    const unsigned words[4] = {__vcmpeq4(dg.x, want), __vcmpeq4(dg.y, want),
                               __vcmpeq4(dg.z, want), __vcmpeq4(dg.w, want)};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      for (unsigned m = words[w]; m != 0;) {
        const int byte = (__ffs(m) - 1) >> 3;
        m &= ~(0xffu << (8 * byte));
        const int q = 16 * lane + 4 * w + byte;
        if (t.keys[base + q] == key) found = q;
      }
    }
    const unsigned hits = tile.ballot(found >= 0);
    if (hits != 0) {
      const int64_t s = base + tile.shfl(found, __ffs(hits) - 1);
      if (lane == 0) {
        *slot = s;
        if (!g.in.on) ++*ge_ev::FreqOf(t.meta, s);  // this tile's key
      }
      if (dst != nullptr) NewKeyRow(t, s, dst, lane, g.vec4);
      continue;
    }
    // The lowest free slot (digest 0), else the policy's victim.
    const int mine = FirstByte(dg, 0u);
    const unsigned frees = tile.ballot(mine < 16);
    int q;
    if (frees != 0) {
      const int src = __ffs(frees) - 1;
      q = 16 * src + tile.shfl(mine, src);
    } else {
      q = Victim(tile, t, base, g.now);
      bool room = q >= 0;
      int64_t a = 0;
      if (room && ev.count != nullptr) {
        unsigned long long at = 0;
        if (lane == 0) at = atomicAdd(ev.count, 1ull);
        at = tile.shfl(at, 0);
        room = at < static_cast<unsigned long long>(ev.capacity);
        a = static_cast<int64_t>(at);
      }
      if (!room) {  // every key pinned, or nowhere to put the victim
        if (lane == 0) *slot = -1;
        ++counts->full;
        if (dst != nullptr) AbsentRow(t, key, dst, lane, g.vec4);
        continue;
      }
      const int64_t victim = base + q;
      if (ev.count != nullptr) {
        if (lane == 0) {
          ev.keys[a] = t.keys[victim];
          ev.freq[a] = *ge_ev::FreqOf(t.meta, victim);
          ev.version[a] = *ge_ev::VersionOf(t.meta, victim);
        }
        CopyRow(ev.values + a * t.dim, t.values + victim * t.dim, t.dim,
                lane, kTile, g.vec4);
        for (int sl = 0; sl < t.num_slots; ++sl) {
          CopyRow(ev.slots + (sl * ev.capacity + a) * t.dim,
                  t.slots + (sl * cap + victim) * t.dim, t.dim, lane, kTile,
                  g.vec4);
        }
        tile.sync();
      }
      ++counts->evicted;
    }
    const int64_t s = base + q;
    WriteEntry(t, s, key, o.jl, g.now, g.in, lane, kTile, g.vec4);
    if (lane == 0) {
      t.keys[s] = key;
      t.digests[s] = static_cast<uint8_t>(d);
      if (!g.in.on) *ge_ev::FreqOf(t.meta, s) = 1;  // this occurrence
      *slot = s;
    }
    ++counts->inserted;
    if (lane == q / 16) SetByte(&dg, q % 16, d);
    tile.sync();
    // The new row is the default row WriteEntry copied: read from there
    // rather than back from the write (an import has no output).
    if (dst != nullptr && t.filter_freq <= 0) {
      CopyRow(dst, t.defaults + DefaultRow(key, t.default_rows) * t.dim,
              t.dim, lane, kTile, g.vec4);
    } else if (dst != nullptr) {
      FillRow(dst, t.no_permission, t.dim, lane, kTile);
    }
  }
}

// Resident blocks per SM the insert asks for (caps its registers: 4 ->
// 64 with 96 bytes of spills, 3 -> 80 with 24).
#ifndef GE_EV_INSERT_MIN_BLOCKS
#define GE_EV_INSERT_MIN_BLOCKS 3
#endif

// Tiles walk the sorted entries 8 at a time; a run belongs to the tile
// whose chunk holds its first entry. The sort puts `none` last, so a
// chunk that starts with it ends the walk.
__global__ void __launch_bounds__(kBlock, GE_EV_INSERT_MIN_BLOCKS)
    InsertKernel(Group g, const uint32_t* __restrict__ bucket_sorted,
                 const int32_t* __restrict__ index_sorted) {
  const Lanes tile = cg::tiled_partition<kTile>(cg::this_thread_block());
  const int lane = tile.thread_rank();
  const int64_t tiles = gridDim.x * static_cast<int64_t>(kBlock / kTile);
  RunCounts counts;
  for (int64_t w = (blockIdx.x * static_cast<int64_t>(blockDim.x) +
                    threadIdx.x) / kTile;
       w * kTile < g.n; w += tiles) {
    const int64_t e = w * kTile + lane;
    const uint32_t b = e < g.n ? bucket_sorted[e] : g.none;
    if (tile.shfl(b, 0) == g.none) break;
    const bool start = b != g.none && (e == 0 || bucket_sorted[e - 1] != b);
    Chunk chunk{w * kTile, b, 0, 0};
    if (b != g.none) {
      chunk.j = index_sorted[e];
      const Occurrence o = Locate(g, chunk.j);
      chunk.key = o.batch->keys[o.jl];
    }
    for (unsigned starts = tile.ballot(start); starts != 0;
         starts &= starts - 1) {
      const int l = __ffs(starts) - 1;
      InsertRun(tile, g, bucket_sorted, index_sorted, chunk, w * kTile + l,
                tile.shfl(b, l), &counts);
    }
  }
  if (lane != 0) return;
  if (counts.inserted) Count(g.counters, GE_EV_INSERTED, counts.inserted);
  if (counts.evicted) Count(g.counters, GE_EV_EVICTED, counts.evicted);
  if (counts.full) Count(g.counters, GE_EV_FULL, counts.full);
}

// The hits of filtered tables, counted once every read is done (a group
// may mix filtered and unfiltered tables).
__global__ void __launch_bounds__(kBlock)
    CountHitsKernel(Group g, const uint32_t* bucket_of) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) +
                    threadIdx.x;
  if (j >= g.n || bucket_of[j] != g.none) return;
  const Occurrence o = Locate(g, j);
  const GeEvTable& t = g.tables[o.batch->table];
  // A table without a filter counted its hits in the probe.
  const int64_t s = *SlotRef(g, j, o);
  if (s < 0 || t.filter_freq <= 0) return;
  atomicAdd(reinterpret_cast<unsigned long long*>(ge_ev::FreqOf(t.meta, s)),
            1ull);
}

// An import's keys get their own versions once nothing can evict them.
__global__ void __launch_bounds__(kBlock) ImportVersionsKernel(Group g) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) +
                    threadIdx.x;
  if (j >= g.n) return;
  const int64_t s = g.slot_scratch[j];
  if (s >= 0) *ge_ev::VersionOf(g.tables[0].meta, s) = g.in.version[j];
}

__global__ void InitKernel(GeEvTable t, int64_t cap) {
  const int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) +
                    threadIdx.x;
  if (s >= cap) return;
  t.keys[s] = GE_EV_EMPTY_KEY;
  t.digests[s] = 0;
}

__global__ void EvictKernel(GeEvTable t, int64_t cap, int64_t step,
                            int64_t steps_to_live, float l2_threshold,
                            GeEvEvicted ev, bool has_ev,
                            unsigned long long* counters) {
  const int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) +
                    threadIdx.x;
  if (s >= cap || t.keys[s] == GE_EV_EMPTY_KEY) return;
  bool doomed;
  if (steps_to_live > 0) {
    // Both are steps in [0, 2^63): the difference cannot overflow.
    doomed = step - *ge_ev::VersionOf(t.meta, s) > steps_to_live;
  } else {
    double ss = 0.0;
    const float* v = t.values + s * t.dim;
    for (int64_t d = 0; d < t.dim; ++d) ss += double(v[d]) * v[d];
    doomed = 0.5 * ss < l2_threshold;
  }
  if (!doomed) return;
  if (has_ev) {
    const unsigned long long at = atomicAdd(ev.count, 1ull);
    if (at >= static_cast<unsigned long long>(ev.capacity)) {
      Count(counters, GE_EV_FULL);
      return;  // kept: nothing leaves without a place to go
    }
    const int64_t a = static_cast<int64_t>(at);
    ev.keys[a] = t.keys[s];
    ev.freq[a] = *ge_ev::FreqOf(t.meta, s);
    ev.version[a] = *ge_ev::VersionOf(t.meta, s);
    CopyRow(ev.values + a * t.dim, t.values + s * t.dim, t.dim, 0, 1, false);
    for (int sl = 0; sl < t.num_slots; ++sl) {
      CopyRow(ev.slots + (sl * ev.capacity + a) * t.dim,
              t.slots + (sl * cap + s) * t.dim, t.dim, 0, 1, false);
    }
  }
  t.keys[s] = GE_EV_EMPTY_KEY;
  t.digests[s] = 0;
  Count(counters, GE_EV_EVICTED);
}

// One block per bucket: its live keys counted (export, size).
__global__ void __launch_bounds__(GE_EV_BUCKET)
    CountKernel(GeEvTable t, int64_t* per_bucket, unsigned long long* total) {
  const int64_t s = blockIdx.x * static_cast<int64_t>(GE_EV_BUCKET) +
                    threadIdx.x;
  const int c = __syncthreads_count(t.keys[s] != GE_EV_EMPTY_KEY);
  if (threadIdx.x == 0) {
    if (per_bucket != nullptr) per_bucket[blockIdx.x] = c;
    if (c) atomicAdd(total, static_cast<unsigned long long>(c));
  }
}

__global__ void __launch_bounds__(GE_EV_BUCKET)
    ExportKernel(GeEvTable t, const int64_t* first, int64_t* keys,
                 float* values, float* slots, int64_t* freq,
                 int64_t* version, int64_t capacity) {
  using Scan = cub::BlockScan<int, GE_EV_BUCKET>;
  __shared__ typename Scan::TempStorage temp;
  const int64_t cap = t.num_buckets * GE_EV_BUCKET;
  const int64_t s = blockIdx.x * static_cast<int64_t>(GE_EV_BUCKET) +
                    threadIdx.x;
  const bool live = t.keys[s] != GE_EV_EMPTY_KEY;
  int before = 0;
  Scan(temp).ExclusiveSum(live ? 1 : 0, before);
  const int64_t a = first[blockIdx.x] + before;
  if (!live || a >= capacity) return;
  keys[a] = t.keys[s];
  if (freq) freq[a] = *ge_ev::FreqOf(t.meta, s);
  if (version) version[a] = *ge_ev::VersionOf(t.meta, s);
  if (values) {
    CopyRow(values + a * t.dim, t.values + s * t.dim, t.dim, 0, 1, false);
  }
  for (int sl = 0; slots && sl < t.num_slots; ++sl) {
    CopyRow(slots + (sl * capacity + a) * t.dim,
            t.slots + (sl * cap + s) * t.dim, t.dim, 0, 1, false);
  }
}

bool Aligned(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// Rows can be moved as float4 when every row array involved allows it.
bool Vec4(const GeEvTable& t, std::initializer_list<const void*> more) {
  if (t.dim % 4 != 0 || !Aligned(t.values) || !Aligned(t.defaults) ||
      (t.slots && !Aligned(t.slots))) {
    return false;
  }
  for (const void* p : more) {
    if (p != nullptr && !Aligned(p)) return false;
  }
  return true;
}

int Launched() { return static_cast<int>(cudaGetLastError()); }

int64_t Blocks(int64_t threads) { return (threads + kBlock - 1) / kBlock; }

// Sort key bits: buckets < total, plus `none` = total.
int SortBits(int64_t total_buckets) {
  int bits = 1;
  while ((int64_t{1} << bits) <= total_buckets) ++bits;
  return bits;
}

// The scratch of an export: live keys per bucket, their prefix sums, the
// scan's temporary storage.
struct ExportScratch {
  int64_t *counts, *first;
  void* scan_temp;
  size_t scan_bytes;
  size_t total;
};

ExportScratch TakeExportScratch(void* base, int64_t nb) {
  ge_core::ScratchLayout layout(base);
  ExportScratch x;
  x.counts = layout.Take<int64_t>(nb);
  x.first = layout.Take<int64_t>(nb);
  x.scan_bytes = 0;
  cub::DeviceScan::ExclusiveSum(nullptr, x.scan_bytes, x.counts, x.first,
                                static_cast<int>(nb));
  x.scan_temp = layout.Take<char>(static_cast<int64_t>(x.scan_bytes));
  x.total = layout.used();
  return x;
}

// The scratch of a group call: descriptors, then the sort's arrays.
struct GroupScratch {
  GeEvTable* tables;
  GeEvBatch* batches;
  GeEvEvicted* evicted;
  int64_t *occ_base, *bucket_base;
  uint32_t *bucket_of, *bucket_sorted;
  int32_t *index_of, *index_sorted;
  int64_t* slot_of;
  void* sort_temp;
  size_t sort_bytes;
  size_t head;   // bytes of the descriptor blocks (uploaded at once)
  size_t total;
};

GroupScratch Layout(void* base, int nt, int nb, int64_t n) {
  ge_core::ScratchLayout layout(base);
  GroupScratch s;
  s.tables = layout.Take<GeEvTable>(nt);
  s.batches = layout.Take<GeEvBatch>(nb);
  s.evicted = layout.Take<GeEvEvicted>(nt);
  s.occ_base = layout.Take<int64_t>(nb + 1);
  s.bucket_base = layout.Take<int64_t>(nt + 1);
  s.head = layout.used();
  s.bucket_of = layout.Take<uint32_t>(n);
  s.bucket_sorted = layout.Take<uint32_t>(n);
  s.index_of = layout.Take<int32_t>(n);
  s.index_sorted = layout.Take<int32_t>(n);
  s.slot_of = layout.Take<int64_t>(n);
  s.sort_bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, s.sort_bytes, s.bucket_of,
                                  s.bucket_sorted, s.index_of,
                                  s.index_sorted, static_cast<int>(n));
  s.sort_temp = layout.Take<char>(static_cast<int64_t>(s.sort_bytes));
  s.total = layout.used();
  return s;
}

int64_t TotalKeys(const GeEvBatch* batches, int nb) {
  int64_t n = 0;
  for (int b = 0; b < nb; ++b) n += batches[b].n > 0 ? batches[b].n : 0;
  return n;
}

// The probe, sort, insert (and, with a filter, count) of a group call;
// `in` (an import) only with one table and one batch.
int Upsert(const GeEvTable* tables, int nt, const GeEvBatch* batches,
           int nb, int64_t step, const GeEvEvicted* evicted,
           const ImportRows& in, void* scratch, size_t scratch_bytes,
           unsigned long long* counters, void* stream) {
  ge_ev::GroupBases bases;
  const int status = ge_ev::CheckGroupCall(tables, nt, batches, nb, evicted,
                                           counters, &bases);
  if (status != GE_OK) return status;
  const int64_t n = bases.keys();
  if (n == 0) return GE_OK;
  if (scratch == nullptr ||
      scratch_bytes < Layout(nullptr, nt, nb, n).total) {
    return GE_ERR_SCRATCH;
  }
  // The descriptors go up in ONE copy (pageable memory is staged at
  // once, so the host vector may go when it returns).
  const size_t head = Layout(nullptr, nt, nb, n).head;
  std::vector<char> host(head);
  GroupScratch h = Layout(host.data(), nt, nb, n);
  for (int t = 0; t < nt; ++t) {
    h.tables[t] = tables[t];
    h.evicted[t] = evicted != nullptr ? evicted[t] : GeEvEvicted{};
  }
  for (int b = 0; b < nb; ++b) h.batches[b] = batches[b];
  std::copy(bases.occ.begin(), bases.occ.end(), h.occ_base);
  std::copy(bases.bucket.begin(), bases.bucket.end(), h.bucket_base);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  cudaError_t e = cudaMemcpyAsync(scratch, host.data(), head,
                                  cudaMemcpyHostToDevice, st);
  if (e != cudaSuccess) return static_cast<int>(e);
  GroupScratch s = Layout(scratch, nt, nb, n);
  bool vec4 = in.rows == nullptr || Aligned(in.rows);
  vec4 = vec4 && (in.slots == nullptr || Aligned(in.slots));
  for (int t = 0; t < nt; ++t) {
    vec4 = vec4 && Vec4(tables[t], {evicted ? evicted[t].values : nullptr,
                                    evicted ? evicted[t].slots : nullptr});
  }
  for (int b = 0; b < nb; ++b) vec4 = vec4 && Aligned(batches[b].out);
  Group g{s.tables, s.batches, s.evicted, s.occ_base, s.bucket_base,
          nt, nb, n, step < 0 ? 0 : step,
          static_cast<uint32_t>(bases.bucket[nt]), s.slot_of, in, counters,
          vec4};
  ProbeKernel<<<Blocks(n * kTile), kBlock, 0, st>>>(g, s.bucket_of,
                                                    s.index_of);
  if (int e1 = Launched()) return e1;
  e = cub::DeviceRadixSort::SortPairs(
      s.sort_temp, s.sort_bytes, s.bucket_of, s.bucket_sorted, s.index_of,
      s.index_sorted, static_cast<int>(n), 0, SortBits(bases.bucket[nt]), st);
  if (e != cudaSuccess) return static_cast<int>(e);
  // Enough tiles to keep the GPU busy; each walks chunks of 8 entries
  // (measured on an H200: one warp per 32 entries, 80 registers, left
  // the insert latency-bound at 0.46 ms for 400k new keys). No more
  // blocks than the GPU holds at once: most calls have few new keys, and
  // a block per chunk then mostly starts blocks that stop at once.
  const int64_t tiles = (n + kTile - 1) / kTile;
  const int64_t blocks = std::min<int64_t>(
      (tiles + kBlock / kTile - 1) / (kBlock / kTile),
      ge_cuda::ResidentBlocks(GE_EV_INSERT_MIN_BLOCKS));
  InsertKernel<<<blocks, kBlock, 0, st>>>(g, s.bucket_sorted,
                                          s.index_sorted);
  if (int e2 = Launched()) return e2;
  if (in.on) {
    if (in.version == nullptr) return GE_OK;
    ImportVersionsKernel<<<Blocks(n), kBlock, 0, st>>>(g);
    return Launched();
  }
  bool filtered = false;
  for (int t = 0; t < nt; ++t) filtered = filtered || tables[t].filter_freq > 0;
  if (!filtered) return GE_OK;
  CountHitsKernel<<<Blocks(n), kBlock, 0, st>>>(g, s.bucket_of);
  return Launched();
}

}  // namespace
}  // namespace ge_cuda_ev

using namespace ge_cuda_ev;  // NOLINT: the C entry points below

extern "C" {

size_t ge_ev_table_bytes(int64_t num_buckets, int64_t dim, int num_slots) {
  return ge_ev::TableBytes(num_buckets, dim, num_slots);
}

int ge_ev_init(const GeEvTable* table, void* stream) {
  const int status = ge_ev::CheckInit(table);
  if (status != GE_OK) return status;
  const int64_t cap = ge_ev::Capacity(table);
  InitKernel<<<Blocks(cap), kBlock, 0, static_cast<cudaStream_t>(stream)>>>(
      *table, cap);
  return Launched();
}

size_t ge_ev_scratch_bytes(const GeEvTable* table, int64_t n) {
  (void)table;
  if (n < 0 || n > ge_ev::kMaxKeys) return 0;
  return Layout(nullptr, 1, 1, n).total;
}

size_t ge_ev_group_scratch_bytes(const GeEvTable* tables, int num_tables,
                                 const GeEvBatch* batches, int num_batches) {
  (void)tables;
  if (batches == nullptr || num_tables < 1 || num_batches < 1) return 0;
  const int64_t n = TotalKeys(batches, num_batches);
  if (n > ge_ev::kMaxKeys) return 0;
  return Layout(nullptr, num_tables, num_batches, n).total;
}

int ge_ev_find_or_insert_group(const GeEvTable* tables, int num_tables,
                               const GeEvBatch* batches, int num_batches,
                               int64_t step, const GeEvEvicted* evicted,
                               void* scratch, size_t scratch_bytes,
                               unsigned long long* counters, void* stream) {
  const ImportRows none{false, nullptr, nullptr, nullptr, nullptr, 0};
  return Upsert(tables, num_tables, batches, num_batches, step, evicted,
                none, scratch, scratch_bytes, counters, stream);
}

int ge_ev_find(const GeEvTable* table, const int64_t* keys, int64_t n,
               float* out, int64_t* out_slots, unsigned long long* counters,
               void* stream) {
  const int status = ge_ev::CheckBatch(table, keys, n);
  if (status != GE_OK) return status;
  if (counters == nullptr) return GE_ERR_ARGUMENT;
  if (n == 0) return GE_OK;
  FindKernel<<<Blocks(n * kTile), kBlock, 0,
               static_cast<cudaStream_t>(stream)>>>(
      *table, keys, n, out, out_slots, counters, Vec4(*table, {out}));
  return Launched();
}

int ge_ev_stamp(const GeEvTable* table, const int64_t* keys, int64_t n,
                int64_t step, int64_t* out_slots,
                unsigned long long* counters, void* stream) {
  const int status = ge_ev::CheckBatch(table, keys, n);
  if (status != GE_OK) return status;
  if (counters == nullptr || (n > 0 && out_slots == nullptr)) {
    return GE_ERR_ARGUMENT;
  }
  if (n == 0) return GE_OK;
  StampKernel<<<Blocks(n * kTile), kBlock, 0,
                static_cast<cudaStream_t>(stream)>>>(
      *table, keys, n, step > 0 ? step : 0, out_slots, counters);
  return Launched();
}

int ge_ev_swap_versions(const GeEvTable* table, const int64_t* keys,
                        int64_t n, int64_t* versions,
                        unsigned long long* counters, void* stream) {
  const int status = ge_ev::CheckBatch(table, keys, n);
  if (status != GE_OK) return status;
  if (counters == nullptr || (n > 0 && versions == nullptr)) {
    return GE_ERR_ARGUMENT;
  }
  if (n == 0) return GE_OK;
  SwapVersionsKernel<<<Blocks(n * kTile), kBlock, 0,
                       static_cast<cudaStream_t>(stream)>>>(
      *table, keys, n, versions, counters);
  return Launched();
}

int ge_ev_find_or_insert(const GeEvTable* table, const int64_t* keys,
                         int64_t n, int64_t step, float* out,
                         int64_t* out_slots,
                         const GeEvEvicted* evicted, void* scratch,
                         size_t scratch_bytes, unsigned long long* counters,
                         void* stream) {
  const ImportRows none{false, nullptr, nullptr, nullptr, nullptr, n};
  const GeEvBatch batch{0, 0, keys, n, out, out_slots};
  return Upsert(table, 1, &batch, 1, step, evicted, none, scratch,
                scratch_bytes, counters, stream);
}

int ge_ev_insert(const GeEvTable* table, const int64_t* keys, int64_t n,
                 const float* rows, const float* slots, const int64_t* freq,
                 const int64_t* version, int64_t step,
                 const GeEvEvicted* evicted, void* scratch,
                 size_t scratch_bytes, unsigned long long* counters,
                 void* stream) {
  if (n > 0 && rows == nullptr) return GE_ERR_ARGUMENT;
  const ImportRows in{true, rows, slots, freq, version, n};
  const GeEvBatch batch{0, 0, keys, n, nullptr, nullptr};
  return Upsert(table, 1, &batch, 1, step, evicted, in, scratch,
                scratch_bytes, counters, stream);
}

int ge_ev_evict(const GeEvTable* table, int64_t step, int64_t steps_to_live,
                float l2_threshold, const GeEvEvicted* evicted,
                unsigned long long* counters, void* stream) {
  const int status =
      ge_ev::CheckEvict(table, evicted, counters, steps_to_live);
  if (status != GE_OK) return status;
  if (steps_to_live == 0 && !(l2_threshold >= 0.0f)) return GE_OK;
  const int64_t cap = ge_ev::Capacity(table);
  GeEvEvicted ev{};
  if (evicted) ev = *evicted;
  EvictKernel<<<Blocks(cap), kBlock, 0, static_cast<cudaStream_t>(stream)>>>(
      *table, cap, step < 0 ? 0 : step, steps_to_live, l2_threshold, ev,
      evicted != nullptr, counters);
  return Launched();
}

int ge_ev_size(const GeEvTable* table, unsigned long long* count,
               void* stream) {
  const int status = ge_ev::CheckTable(table);
  if (status != GE_OK) return status;
  if (count == nullptr) return GE_ERR_ARGUMENT;
  CountKernel<<<table->num_buckets, GE_EV_BUCKET, 0,
                static_cast<cudaStream_t>(stream)>>>(*table, nullptr, count);
  return Launched();
}

size_t ge_ev_export_scratch_bytes(const GeEvTable* table) {
  if (ge_ev::CheckTable(table) != GE_OK) return 0;
  return TakeExportScratch(nullptr, table->num_buckets).total;
}

int ge_ev_export(const GeEvTable* table, int64_t* keys, float* values,
                 float* slots, int64_t* freq, int64_t* version,
                 int64_t capacity, unsigned long long* count, void* scratch,
                 size_t scratch_bytes, void* stream) {
  const int status = ge_ev::CheckExport(table, keys, capacity, count);
  if (status != GE_OK) return status;
  if (scratch == nullptr ||
      scratch_bytes < ge_ev_export_scratch_bytes(table)) {
    return GE_ERR_SCRATCH;
  }
  const int64_t nb = table->num_buckets;
  ExportScratch x = TakeExportScratch(scratch, nb);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  CountKernel<<<nb, GE_EV_BUCKET, 0, st>>>(*table, x.counts, count);
  if (int e = Launched()) return e;
  cudaError_t e = cub::DeviceScan::ExclusiveSum(
      x.scan_temp, x.scan_bytes, x.counts, x.first, static_cast<int>(nb), st);
  if (e != cudaSuccess) return static_cast<int>(e);
  if (capacity == 0) return GE_OK;
  ExportKernel<<<nb, GE_EV_BUCKET, 0, st>>>(*table, x.first, keys, values,
                                            slots, freq, version, capacity);
  return Launched();
}

}  // extern "C"

#ifndef GROUP_EMBEDDING_OPS_KERNELS_HASH_MIX_H_
#define GROUP_EMBEDDING_OPS_KERNELS_HASH_MIX_H_

// The kernels' one hash mixer, without any framework header: the CPU
// kernels (id_map.h, ev_storage.h) and the CUDA core's GPU EV table
// (../cuda/ev_table_hash.h, on the device too) hash keys with it.
//
// The 64-bit finaliser of MurmurHash3: ids that differ in any bit land in
// unrelated buckets (sequential ids, ids that share their low bits). It
// is a bijection of uint64, so distinct keys never share a hash.
// EmbeddingVariable storage's counting Bloom filter positions derive from
// it, so it must never change.

#include <stdint.h>

#if defined(__CUDACC__)
#define GE_MIX_HD __host__ __device__ __forceinline__
#else
#define GE_MIX_HD inline
#endif

namespace group_embedding {

GE_MIX_HD uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

}  // namespace group_embedding

#endif  // GROUP_EMBEDDING_OPS_KERNELS_HASH_MIX_H_

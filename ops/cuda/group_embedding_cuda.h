#ifndef GROUP_EMBEDDING_OPS_CUDA_GROUP_EMBEDDING_CUDA_H_
#define GROUP_EMBEDDING_OPS_CUDA_GROUP_EMBEDDING_CUDA_H_

// The CUDA core of the grouped lookup, behind a plain C interface so that
// it is tested without any framework (ctypes + CuPy / torch on the GPU
// machine, the host stand-in `host_core.cc` on CPU machines) and called
// by a thin TensorFlow adaptor.
//
// Rules of the interface:
// * every pointer inside a `GeTable` and every array argument is DEVICE
//   memory (host memory for the host stand-in); the `GeTable` array
//   itself is host memory and is copied into the scratch;
// * `stream` is a cudaStream_t (0: the legacy default stream); every call
//   only enqueues work on it, nothing waits, nothing is allocated: the
//   caller passes `scratch` of at least `ge_*_scratch_bytes()` bytes;
// * bad input found on the device is counted, never read through:
//   `errors[GE_BAD_IDS]` (ids outside [0, vocab)), `errors[GE_BAD_LAYOUT]`
//   (row_splits not 0..nnz non-decreasing, positions outside [0, seq_len))
//   are ADDED to (two unsigned 64-bit device counters the caller zeroes);
//   a bad id contributes nothing, a bad row is read as empty;
// * a group shares one `dim` (the tables of a fused lookup have one
//   width); rows are contiguous, `vocab` x `dim` floats;
// * return value: 0 on success, a GE_ERR_* code for bad host arguments
//   (nothing was enqueued), or a cudaError_t (> 0) from a launch.

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// 2: GeTable.flags (was reserved) and ge_clip_grads.
// 3: ge_backward_padded.
// 4: ge_check_ids.
#define GE_CUDA_ABI_VERSION 4

// The libraries are built with hidden visibility: only these functions
// are exported (not cub's or the static CUDA runtime's symbols).
#define GE_API __attribute__((visibility("default")))

enum GeCombiner { GE_SUM = 0, GE_MEAN = 1, GE_SQRTN = 2 };
enum GeErrorCounter { GE_BAD_IDS = 0, GE_BAD_LAYOUT = 1, GE_NUM_ERRORS = 2 };
// GeTable.flags. GE_ROWS_BY_POSITION (ge_weight_grads only): `table`
// holds one row per id, row j for ids[j] (a snapshot of the ids' rows
// taken where the forward read them, as GroupEmbeddingTableSnapshot
// copies them when the variable is in copy-on-read mode); `vocab` is its
// row count, at least nnz, and ids are not range-checked (the snapshot
// checked them). Every other call refuses a non-zero flags.
enum GeTableFlags { GE_ROWS_BY_POSITION = 1 };
enum GeOptimizer {
  GE_OPT_SGD = 0,      // v -= lr g
  GE_OPT_ADAGRAD = 1,  // a += g^2; v -= lr g / sqrt(a + eps)  (Keras)
  GE_OPT_ADAM = 2,     // m, u moments; v -= alpha m / (sqrt(u) + eps)
  GE_OPT_FTRL = 3,     // TF's ApplyFtrlV2 (slot0: accum, slot1: linear)
  // DeepRec's AdagradDecay (the CPU EV's EVApplyAdagradDecay): slot0 the
  // accumulator, slot1 the decay power, a count kept in element 0 of the
  // row. When period > power: a = max(a * decay_rate, floor), power += 1;
  // then a += g^2; v -= lr g / sqrt(a). Reads lr, beta1 as the decay
  // rate, beta2 as the floor and l1 as the period (a whole number, exact
  // as a float up to 2^24, as the power is).
  GE_OPT_ADAGRAD_DECAY = 4,
};
// Host argument errors (negative, so they never collide with cudaError_t).
enum GeStatus {
  GE_OK = 0,
  GE_ERR_ARGUMENT = -1,  // a null pointer, a negative size, a bad enum
  GE_ERR_SCRATCH = -2,   // scratch smaller than ge_*_scratch_bytes()
  GE_ERR_TOO_LARGE = -3, // > 2^31 - 1 ids in one call
};

// One table of a group and its batch of ragged ids.
typedef struct GeTable {
  float* table;             // [vocab, dim]; written only by *_apply
  int64_t vocab;            // rows of `table`
  const int64_t* ids;       // [nnz]
  const int64_t* splits;    // [batch + 1]; NULL: one id per row (batch = nnz)
  const float* weights;     // [nnz] per-id weights, or NULL (all 1)
  const int64_t* positions; // sequence lookups: [nnz] column of each id
  int64_t nnz;
  int64_t batch;
  int64_t seq_len;          // sequence lookups: T of the [B, T, dim] output
  int32_t combiner;         // GeCombiner (pooled lookups)
  int32_t flags;            // GeTableFlags; 0 unless a call says otherwise
  // Forward output: row b at out + b * out_stride ([B, T, dim] for
  // sequences: position p of row b at out + b * out_stride + p * dim).
  // The concatenated [B, K * dim] layout is out = base + t * dim,
  // out_stride = K * dim.
  float* out;
  int64_t out_stride;
  // Backward input, laid out as `out`: the gradient of the output.
  const float* grad;
  int64_t grad_stride;
  // ge_weight_grads: the pooled output of the forward (same layout as
  // grad) and where d loss / d weights ([nnz]) goes.
  const float* pooled;
  float* weight_grad;
  // Optimizer slots of *_apply, [vocab, dim] each (NULL when unused).
  float* slot0;
  float* slot1;
} GeTable;

typedef struct GeOptimizerConfig {
  int32_t kind;  // GeOptimizer
  int32_t reserved;
  float lr;      // SGD, Adagrad, FTRL learning rate; Adam: bias-corrected
                 // step size alpha
  float epsilon; // Adagrad (inside the root), Adam (outside)
  float beta1, beta2;                          // Adam
  float l1, l2, l2_shrinkage, lr_power;        // FTRL
} GeOptimizerConfig;

// Pooled lookup of every table of the group in ONE launch:
// out[b] = scale_b * sum_j w_j * clip(table[ids[j]]) over row b's ids,
// scale_b = 1 (sum) | 1 / sum w (mean) | 1 / sqrt(sum w^2) (sqrtn), an
// empty row gives zeros; clip(e) = e * max_norm / max(|e|, max_norm) when
// max_norm >= 0.
GE_API
size_t ge_lookup_scratch_bytes(int num_tables);
GE_API
int ge_lookup_pooled(const GeTable* tables, int num_tables, int64_t dim,
                     float max_norm, void* scratch, size_t scratch_bytes,
                     unsigned long long* errors, void* stream);

// Sequence lookup, [B, seq_len, dim] per table, ONE launch:
// out[b, positions[j]] += w_j * clip(table[ids[j]]), zeros elsewhere.
GE_API
int ge_lookup_sequence(const GeTable* tables, int num_tables, int64_t dim,
                       float max_norm, void* scratch, size_t scratch_bytes,
                       unsigned long long* errors, void* stream);

// Backward: ids deduplicated per table on the device and each distinct
// id's gradient summed (in the order of its occurrences, as the CPU
// kernel adds), then the max_norm clip's backward applied with the
// table's row. Pooled tables read grad row b with factor scale_b * w_j;
// sequence tables (positions != NULL) row b * seq_len + positions[j]
// with factor w_j.
// Outputs, for all tables together: table t's distinct ids (ascending)
// are unique_ids[offsets[t] .. offsets[t + 1]) and their summed
// gradients the same rows of unique_grads ([*, dim]); both need room for
// the total nnz; `offsets` has num_tables + 1 entries.
GE_API
size_t ge_backward_scratch_bytes(const GeTable* tables, int num_tables,
                                 int64_t dim);
GE_API
int ge_backward(const GeTable* tables, int num_tables, int64_t dim,
                float max_norm, void* scratch, size_t scratch_bytes,
                int64_t* unique_ids, float* unique_grads, int64_t* offsets,
                unsigned long long* errors, void* stream);

// ge_backward with outputs of a size known before the call, so that a
// caller sizes its outputs without reading a count back from the device
// (issue 35.3: a host wait each): table t's block is rows
// [P_t, P_t + nnz_t) of unique_ids / unique_grads, P_t = the nnz of the
// tables before t; its u_t distinct ids (ascending) and their sums are
// the block's first u_t rows, its other rows are left as the caller
// filled them (the TF adaptor: the table's own ids with zero gradients,
// duplicates that add nothing to a consumer's sum). `offsets` is filled
// as by ge_backward (u_t = offsets[t + 1] - offsets[t]).
GE_API
int ge_backward_padded(const GeTable* tables, int num_tables, int64_t dim,
                       float max_norm, void* scratch, size_t scratch_bytes,
                       int64_t* unique_ids, float* unique_grads,
                       int64_t* offsets, unsigned long long* errors,
                       void* stream);

// The same deduplication and sums, then the optimizer applied to each
// distinct row of each table (and its slots) in place, without writing
// the gradients anywhere: the sparse update of the fused training step.
// A table given with splits = NULL, combiner sum and grad = [n, dim]
// rows is a plain sparse apply of (ids, grad) with duplicates summed.
GE_API
int ge_backward_apply(const GeTable* tables, int num_tables, int64_t dim,
                      float max_norm, const GeOptimizerConfig* optimizer,
                      void* scratch, size_t scratch_bytes,
                      unsigned long long* errors, void* stream);

// d loss / d w_j of weighted tables (weights != NULL; others skipped):
// pooled: (clip(e_j).g_b - [combiner term]) * scale_b, as the CPU
// kernel's WeightGradRows; sequence: clip(e_j).g[b, positions[j]].
// e_j is table row ids[j], or row j with flags GE_ROWS_BY_POSITION.
GE_API
int ge_weight_grads(const GeTable* tables, int num_tables, int64_t dim,
                    float max_norm, void* scratch, size_t scratch_bytes,
                    unsigned long long* errors, void* stream);

// Backward of the max_norm clip on rows that are already summed per
// distinct id (what GroupEmbeddingClipGrad does after a backward without
// clip): for each table (splits = NULL, positions = NULL, batch = nnz),
// row j of `out` = the clip's backward of row j of `grad` with the
// table's row ids[j], as ge_backward applies it: g' = a (g - e b). `out`
// may be `grad` (in place). A bad id is counted and its row is zeros.
// Scratch: ge_lookup_scratch_bytes(num_tables).
GE_API
int ge_clip_grads(const GeTable* tables, int num_tables, int64_t dim,
                  float max_norm, void* scratch, size_t scratch_bytes,
                  unsigned long long* errors, void* stream);

// Counts every table's ids outside [0, vocab) (errors[GE_BAD_IDS]), bad
// row_splits and positions outside [0, seq_len) of tables that have
// positions (errors[GE_BAD_LAYOUT]), as the lookups count them, and reads
// nothing else: the one check of a training step's ids for all its groups
// (issue 35.3), tables of any dims and kinds in one call, after which
// their lookups run without reading their own counts. `table`, `out`
// and `grad` are not read. Scratch:
// ge_lookup_scratch_bytes(num_tables).
GE_API
int ge_check_ids(const GeTable* tables, int num_tables, void* scratch,
                 size_t scratch_bytes, unsigned long long* errors,
                 void* stream);

// Stream-ordered memory helpers, so that a framework adaptor needs no
// CUDA runtime of its own: copy `bytes` device -> host (to_host = 1; the
// caller then synchronises), device -> device (0) or host -> device (2:
// the host buffer must stay untouched until the stream has run the
// copy), zero `bytes`, and wait for the stream. Return 0 or a
// cudaError_t.
GE_API
int ge_copy_async(void* dst, const void* src, size_t bytes, int to_host,
                  void* stream);
GE_API
int ge_zero_async(void* dst, size_t bytes, void* stream);
GE_API
int ge_synchronize(void* stream);

// GE_CUDA_ABI_VERSION of the library (checked by the bindings).
GE_API
int ge_abi_version(void);
// "cuda" or "host": which implementation this library is.
GE_API
const char* ge_backend_name(void);

#ifdef __cplusplus
}
#endif

#endif  // GROUP_EMBEDDING_OPS_CUDA_GROUP_EMBEDDING_CUDA_H_

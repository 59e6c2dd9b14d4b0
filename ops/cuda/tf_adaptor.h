#ifndef GROUP_EMBEDDING_OPS_CUDA_TF_ADAPTOR_H_
#define GROUP_EMBEDDING_OPS_CUDA_TF_ADAPTOR_H_

// What the TF adaptors of the CUDA core share (tf_gpu_kernels.cc: the
// plain-variable lookups; tf_ev_table_kernels.cc: the HBM EV table):
// TF's stream, the core's status as a TF Status, temporaries from TF's
// allocator, the ragged inputs and their descriptors, and one core call
// with its scratch and error counters. Built with -DGE_ADAPTOR_ON_HOST
// it runs on DEVICE_CPU against the core's host stand-in.

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "tensorflow/core/framework/op_kernel.h"
#ifndef GE_ADAPTOR_ON_HOST
#include "xla/stream_executor/stream.h"
#endif
#include "../kernels/op_checks.h"
#include "../kernels/pooling.h"
#include "group_embedding_cuda.h"

namespace group_embedding {
namespace gpu_kernels {

// Besides the TF names op_checks.h gives all of namespace group_embedding.
using ::tensorflow::DT_FLOAT;
using ::tensorflow::DT_INT64;
using ::tensorflow::DT_UINT8;
using ::tensorflow::errors::Internal;

// The backward ops see no table: ids are keyed with this many rows per
// table (2^40 rows; 2^23 tables fit the 63-bit key).
constexpr int64_t kBackwardVocab = int64_t{1} << 40;

inline void* StreamOf(OpKernelContext* ctx) {
#ifdef GE_ADAPTOR_ON_HOST
  (void)ctx;
  return nullptr;
#else
  auto* dc = ctx->op_device_context();
  if (dc == nullptr || dc->stream() == nullptr) return nullptr;
  return dc->stream()->platform_specific_handle().stream;
#endif
}

inline Status CoreStatus(const std::string& what, int code) {
  switch (code) {
    case GE_OK:
      return Status();
    case GE_ERR_ARGUMENT:
      return InvalidArgument(what, ": the CUDA core refused its arguments.");
    case GE_ERR_SCRATCH:
      return Internal(what, ": scratch smaller than the core asked for.");
    case GE_ERR_TOO_LARGE:
      return InvalidArgument(what, ": too large for the CUDA kernels "
                             "(embedding_dim > 1024, or > 2^31 - 1 ids).");
    default:
      return Internal(what, ": CUDA error ", code, ".");
  }
}

// A device buffer of `bytes` from TF's allocator, and its address.
inline Status Temp(OpKernelContext* ctx, size_t bytes, Tensor* t, void** p) {
  TF_RETURN_IF_ERROR(ctx->allocate_temp(
      DT_UINT8, TensorShape({static_cast<int64_t>(bytes ? bytes : 1)}), t));
  *p = t->flat<uint8_t>().data();
  return Status();
}

template <typename T>
inline T* DataOr(const Tensor& t) {
  return t.NumElements() ? const_cast<T*>(t.flat<T>().data()) : nullptr;
}

// The ranks and sizes of table t's ragged ids (values on the device are
// checked by the core).
inline Status CheckRaggedShapes(const std::string& name, const Tensor& ids,
                         const Tensor& splits, const Tensor& weights) {
  if (ids.dims() != 1 || splits.dims() != 1 || weights.dims() != 1) {
    return InvalidArgument(name, ": ids, row_splits and weights must be "
                           "vectors, got shapes ", ids.shape().DebugString(),
                           ", ", splits.shape().DebugString(), ", ",
                           weights.shape().DebugString(), ".");
  }
  if (splits.NumElements() < 1) {
    return InvalidArgument(name, ": row_splits must not be empty.");
  }
  if (weights.NumElements() != 0 &&
      weights.NumElements() != ids.NumElements()) {
    return InvalidArgument(name, ": has ", ids.NumElements(), " ids but ",
                           weights.NumElements(), " weights.");
  }
  return Status();
}

// The descriptors of a group's core call, and what CheckCounters names a
// bad id with: each table's ids and the rows they are checked against.
struct CoreGroup {
  std::vector<GeTable> descs;
  std::vector<const Tensor*> ids;
  std::vector<int64_t> vocabs;

  explicit CoreGroup(int k) : descs(k), ids(k), vocabs(k) {}
  // Table t's ids, checked against its descriptor's rows (`vocab`).
  void SetIds(int t, const Tensor& id_tensor) {
    ids[t] = &id_tensor;
    vocabs[t] = descs[t].vocab;
  }
};

// The error counts `host` (GE_NUM_ERRORS, read back) as a status; on a
// bad id, copies the tables' ids back to name the first one, as the CPU
// kernels do.
inline Status CheckCounts(void* stream, const uint64_t* host,
                          const std::vector<std::string>& names,
                          const CoreGroup& group) {
  if (host[GE_BAD_LAYOUT] != 0) {
    return InvalidArgument(
        host[GE_BAD_LAYOUT], " rows of the group have row_splits that do "
        "not run from 0 to the number of ids without decreasing, or "
        "positions outside [0, max_len) (tables: ",
        absl::StrJoin(names, ", "), ").");
  }
  if (host[GE_BAD_IDS] == 0) return Status();
  for (size_t t = 0; t < group.ids.size(); ++t) {
    const int64_t n = group.ids[t]->NumElements();
    std::vector<int64_t> v(n);
    int code = ge_copy_async(v.data(), group.ids[t]->flat<int64_t>().data(),
                             sizeof(int64_t) * n, 1, stream);
    if (code == GE_OK) code = ge_synchronize(stream);
    TF_RETURN_IF_ERROR(CoreStatus("reading the ids", code));
    for (int64_t j = 0; j < n; ++j) {
      if (v[j] < 0 || v[j] >= group.vocabs[t]) {
        return InvalidArgument(names[t], ": id ", v[j],
                               " is out of range [0, ", group.vocabs[t],
                               ") for this table.");
      }
    }
  }
  return InvalidArgument(host[GE_BAD_IDS], " ids out of range.");
}

// Reads the error counters (waiting for the stream), then CheckCounts.
inline Status CheckCounters(OpKernelContext* ctx, void* stream, void* counters,
                     const std::vector<std::string>& names,
                     const CoreGroup& group) {
  uint64_t host[GE_NUM_ERRORS] = {0, 0};
  int code = ge_copy_async(host, counters, sizeof(host), 1, stream);
  if (code == GE_OK) code = ge_synchronize(stream);
  TF_RETURN_IF_ERROR(CoreStatus("reading the error counts", code));
  return CheckCounts(stream, host, names, group);
}

// The `combiners` attr of a pooled op, parsed as the CPU kernels parse
// it (pooling.h), as GeCombiner values.
static_assert(kSum == GE_SUM && kMean == GE_MEAN && kSqrtn == GE_SQRTN,
              "the core's combiner codes are the CPU kernels'");
inline Status CombinersAttr(OpKernelConstruction* ctx, std::vector<int32_t>* out) {
  std::vector<Combiner> parsed;
  TF_RETURN_IF_ERROR(ParseCombiners(ctx, &parsed));
  out->assign(parsed.begin(), parsed.end());
  return Status();
}

// The ragged inputs every op of this file takes (positions: sequence ops).
struct RaggedInputs {
  OpInputList ids, splits, weights, positions;
  Status Read(OpKernelContext* ctx, bool sequence) {
    TF_RETURN_IF_ERROR(ctx->input_list("ids", &ids));
    TF_RETURN_IF_ERROR(ctx->input_list("row_splits", &splits));
    TF_RETURN_IF_ERROR(ctx->input_list("weights", &weights));
    if (sequence) TF_RETURN_IF_ERROR(ctx->input_list("positions", &positions));
    return Status();
  }
  // Checks table t's shapes and fills the id fields of its descriptor.
  Status Describe(int t, const std::string& name, GeTable* d) const {
    TF_RETURN_IF_ERROR(CheckRaggedShapes(name, ids[t], splits[t],
                                         weights[t]));
    std::memset(d, 0, sizeof(*d));
    d->ids = DataOr<int64_t>(ids[t]);
    d->splits = DataOr<int64_t>(splits[t]);
    d->weights = DataOr<float>(weights[t]);
    d->nnz = ids[t].NumElements();
    d->batch = splits[t].NumElements() - 1;
    if (positions.size() > 0) {
      if (positions[t].NumElements() != d->nnz) {
        return InvalidArgument(name, ": has ", d->nnz, " ids but ",
                               positions[t].NumElements(), " positions.");
      }
      d->positions = DataOr<int64_t>(positions[t]);
    }
    return Status();
  }
};

// A core call's scratch of `bytes` and its error counters, zeroed on the
// stream: TF temporaries, alive as long as this object. What every call
// of the core takes before it runs.
struct CoreScratch {
  Tensor scratch_t, counters_t;
  void* scratch = nullptr;
  void* counters = nullptr;
  size_t bytes = 0;

  Status Allocate(OpKernelContext* ctx, size_t size, void* stream) {
    bytes = size;
    TF_RETURN_IF_ERROR(Temp(ctx, bytes, &scratch_t, &scratch));
    TF_RETURN_IF_ERROR(Temp(ctx, 16, &counters_t, &counters));
    return CoreStatus("zeroing the error counts",
                      ge_zero_async(counters, 16, stream));
  }
  unsigned long long* errors() const {
    return static_cast<unsigned long long*>(counters);
  }
};

// A group's core call that has no scratch but its descriptors (the
// lookups, ge_weight_grads, ge_clip_grads): zeroes the error counters,
// calls `core`, then reads the counts (CheckCounters), unless `checked`:
// the ids are the forward's of the same step, which checked them (the
// `ids_checked` attr, IdsCheckedAttr in op_checks.h), and reading the
// counts again would be a host wait of its own. The core still counts
// and skips a bad id then (it never reads outside a table).
template <typename Core>
inline Status CallCore(OpKernelContext* ctx, const std::string& what, Core core,
                CoreGroup* group, int64_t dim, float max_norm,
                const std::vector<std::string>& names, bool checked = false) {
  void* stream = StreamOf(ctx);
  const int k = static_cast<int>(group->descs.size());
  CoreScratch s;
  TF_RETURN_IF_ERROR(s.Allocate(ctx, ge_lookup_scratch_bytes(k), stream));
  TF_RETURN_IF_ERROR(CoreStatus(
      what, core(group->descs.data(), k, dim, max_norm, s.scratch, s.bytes,
                 s.errors(), stream)));
  if (checked) return Status();
  return CheckCounters(ctx, stream, s.counters, names, *group);
}


}  // namespace gpu_kernels
}  // namespace group_embedding

#endif  // GROUP_EMBEDDING_OPS_CUDA_TF_ADAPTOR_H_

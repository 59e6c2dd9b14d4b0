// TensorFlow GPU kernels of the fused lookups: a thin adaptor over the CUDA
// core (group_embedding_cuda.h). It reads the variables, builds the
// descriptors, allocates outputs and temporaries with TF's allocator,
// takes TF's stream and calls the core; the arithmetic is all in the core.
//
// Registered for the ops of ops/kernels/ (which define them) on
// DEVICE_GPU, in a library of their own (_group_embedding_gpu_ops.so)
// loaded only when TF sees a GPU: a GPU registration must not take the
// CPU kernels down in a TF without GPU support.
//
// Built with -DGE_ADAPTOR_ON_HOST, the same code registers on DEVICE_CPU
// under the kernel label "ge_host_core" and calls the core's host
// stand-in: how CPU-only CI runs this adaptor through TF (graphs with
// that label) without a GPU.
//
// Differences from the CPU kernels, by design:
// * the backward returns each table's distinct ids in ascending order
//   (the CPU kernels: first-occurrence order); IndexedSlices have no order;
// * the backward ops have no table input, so ids are bounded by 2^40
//   there (the forward checked them against the tables);
// * bad ids and row_splits are counted on the device; the op waits for
//   the stream to read the counts, and on an error reads the ids back to
//   name the table and the id, as the CPU kernels do.

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#ifndef GE_ADAPTOR_ON_HOST
#include "xla/stream_executor/stream.h"
#endif
#include "../kernels/pooling.h"
#include "../kernels/table_access.h"
#include "group_embedding_cuda.h"

namespace group_embedding {
namespace gpu_kernels {
namespace {

using ::tensorflow::DT_FLOAT;
using ::tensorflow::DT_INT64;
using ::tensorflow::DT_UINT8;
using ::tensorflow::OpInputList;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::OpOutputList;
using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::Var;
using ::tensorflow::core::RefCountPtr;
using ::tensorflow::errors::Internal;
using ::tensorflow::errors::InvalidArgument;

// The backward ops see no table: ids are keyed with this many rows per
// table (2^40 rows; 2^23 tables fit the 63-bit key).
constexpr int64_t kBackwardVocab = int64_t{1} << 40;

void* StreamOf(OpKernelContext* ctx) {
#ifdef GE_ADAPTOR_ON_HOST
  (void)ctx;
  return nullptr;
#else
  auto* dc = ctx->op_device_context();
  if (dc == nullptr || dc->stream() == nullptr) return nullptr;
  return dc->stream()->platform_specific_handle().stream;
#endif
}

Status CoreStatus(const std::string& what, int code) {
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
Status Temp(OpKernelContext* ctx, size_t bytes, Tensor* t, void** p) {
  TF_RETURN_IF_ERROR(ctx->allocate_temp(
      DT_UINT8, TensorShape({static_cast<int64_t>(bytes ? bytes : 1)}), t));
  *p = t->flat<uint8_t>().data();
  return Status();
}

template <typename T>
T* DataOr(const Tensor& t) {
  return t.NumElements() ? const_cast<T*>(t.flat<T>().data()) : nullptr;
}

// The ranks and sizes of table t's ragged ids (values on the device are
// checked by the core).
Status CheckRaggedShapes(const std::string& name, const Tensor& ids,
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

// Reads the error counters (waiting for the stream); on a bad id, copies
// the tables' ids back to name the first one, as the CPU kernels do.
Status CheckCounters(OpKernelContext* ctx, void* stream, void* counters,
                     const std::vector<std::string>& names,
                     const std::vector<const Tensor*>& ids,
                     const std::vector<int64_t>& vocabs) {
  uint64_t host[GE_NUM_ERRORS] = {0, 0};
  int code = ge_copy_async(host, counters, sizeof(host), 1, stream);
  if (code == GE_OK) code = ge_synchronize(stream);
  TF_RETURN_IF_ERROR(CoreStatus("reading the error counts", code));
  if (host[GE_BAD_LAYOUT] != 0) {
    return InvalidArgument(
        host[GE_BAD_LAYOUT], " rows of the group have row_splits that do "
        "not run from 0 to the number of ids without decreasing, or "
        "positions outside [0, max_len) (tables: ",
        absl::StrJoin(names, ", "), ").");
  }
  if (host[GE_BAD_IDS] == 0) return Status();
  for (size_t t = 0; t < ids.size(); ++t) {
    const int64_t n = ids[t]->NumElements();
    std::vector<int64_t> v(n);
    code = ge_copy_async(v.data(), ids[t]->flat<int64_t>().data(),
                         sizeof(int64_t) * n, 1, stream);
    if (code == GE_OK) code = ge_synchronize(stream);
    TF_RETURN_IF_ERROR(CoreStatus("reading the ids", code));
    for (int64_t j = 0; j < n; ++j) {
      if (v[j] < 0 || v[j] >= vocabs[t]) {
        return InvalidArgument(names[t], ": id ", v[j],
                               " is out of range [0, ", vocabs[t],
                               ") for this table.");
      }
    }
  }
  return InvalidArgument(host[GE_BAD_IDS], " ids out of range.");
}

// The `combiners` attr of a pooled op, parsed as the CPU kernels parse
// it (pooling.h), as GeCombiner values.
static_assert(kSum == GE_SUM && kMean == GE_MEAN && kSqrtn == GE_SQRTN,
              "the core's combiner codes are the CPU kernels'");
Status CombinersAttr(OpKernelConstruction* ctx, std::vector<int32_t>* out) {
  std::vector<std::string> names;
  TF_RETURN_IF_ERROR(ctx->GetAttr("combiners", &names));
  std::vector<Combiner> parsed;
  TF_RETURN_IF_ERROR(ParseCombiners(names, &parsed));
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

enum class Layout { kPerTable, kConcat, kSequence };

Layout LayoutOf(const std::string& op) {
  if (op.find("Concat") != std::string::npos) return Layout::kConcat;
  if (op.find("Sequence") != std::string::npos) return Layout::kSequence;
  return Layout::kPerTable;
}

// GroupEmbeddingPooledLookup / GroupEmbeddingConcatLookup /
// GroupEmbeddingSequenceLookup: one core call for the whole group.
class LookupOp : public OpKernel {
 public:
  explicit LookupOp(OpKernelConstruction* ctx)
      : OpKernel(ctx), layout_(LayoutOf(ctx->def().op())) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table_names", &names_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("embedding_dim", &dim_));
    OP_REQUIRES_OK(ctx, GetMaxNorm(ctx, &max_norm_));
    if (layout_ != Layout::kSequence) {
      OP_REQUIRES_OK(ctx, CombinersAttr(ctx, &combiners_));
    }
  }

  void Compute(OpKernelContext* ctx) override {
    const bool sequence = layout_ == Layout::kSequence;
    RaggedInputs in;
    OP_REQUIRES_OK(ctx, in.Read(ctx, sequence));
    OpInputList max_lens;
    if (sequence) OP_REQUIRES_OK(ctx, ctx->input_list("max_lens", &max_lens));
    const int k = in.ids.size();
    OP_REQUIRES(ctx, static_cast<int>(names_.size()) == k &&
                         (sequence || static_cast<int>(combiners_.size()) == k),
                InvalidArgument("table_names/combiners must have ", k,
                                " entries."));
    LockedTables locked;
    OP_REQUIRES_OK(ctx, locked.Open(ctx, k));
    const std::vector<Var*>& vars = locked.vars();
    const int64_t batch0 = in.splits[0].NumElements() - 1;
    Tensor* concat_out = nullptr;
    if (layout_ == Layout::kConcat) {
      OP_REQUIRES_OK(ctx, ctx->allocate_output(
                              0, TensorShape({batch0, k * dim_}),
                              &concat_out));
    }
    OpOutputList outs;
    if (layout_ != Layout::kConcat) {
      OP_REQUIRES_OK(ctx, ctx->output_list(sequence ? "sequences" : "pooled",
                                           &outs));
    }
    std::vector<GeTable> descs(k);
    std::vector<const Tensor*> id_tensors(k);
    std::vector<int64_t> vocabs(k);
    for (int t = 0; t < k; ++t) {
      const Tensor* table = vars[t]->tensor();
      OP_REQUIRES(ctx, table->dtype() == DT_FLOAT && table->dims() == 2 &&
                           table->dim_size(1) == dim_,
                  InvalidArgument(names_[t], ": expected a float32 [vocab, ",
                                  dim_, "] table, got ",
                                  table->shape().DebugString()));
      GeTable& d = descs[t];
      OP_REQUIRES_OK(ctx, in.Describe(t, names_[t], &d));
      const int64_t batch = d.batch;
      d.table = DataOr<float>(*table);
      d.vocab = table->dim_size(0);
      id_tensors[t] = &in.ids[t];
      vocabs[t] = d.vocab;
      if (sequence) {
        OP_REQUIRES(ctx, max_lens[t].dims() == 0,
                    InvalidArgument(names_[t], ": max_lens must be a "
                                    "scalar."));
        d.seq_len = max_lens[t].scalar<int64_t>()();
        OP_REQUIRES(ctx, d.seq_len >= 0,
                    InvalidArgument(names_[t], ": max_lens must be >= 0, "
                                    "got ", d.seq_len, "."));
        Tensor* o = nullptr;
        OP_REQUIRES_OK(ctx, outs.allocate(
                                t, TensorShape({batch, d.seq_len, dim_}), &o));
        d.out = DataOr<float>(*o);
        d.out_stride = d.seq_len * dim_;
      } else if (layout_ == Layout::kConcat) {
        OP_REQUIRES(ctx, batch == batch0,
                    InvalidArgument(names_[t], ": has ", batch, " rows but ",
                                    names_[0], " has ", batch0, "; a "
                                    "concatenated output needs equal batch "
                                    "sizes."));
        d.combiner = combiners_[t];
        float* base = DataOr<float>(*concat_out);
        d.out = base ? base + t * dim_ : nullptr;
        d.out_stride = k * dim_;
      } else {
        d.combiner = combiners_[t];
        Tensor* o = nullptr;
        OP_REQUIRES_OK(ctx, outs.allocate(t, TensorShape({batch, dim_}), &o));
        d.out = DataOr<float>(*o);
        d.out_stride = dim_;
      }
    }
    void* stream = StreamOf(ctx);
    Tensor scratch_t, counters_t;
    void *scratch = nullptr, *counters = nullptr;
    const size_t bytes = ge_lookup_scratch_bytes(k);
    OP_REQUIRES_OK(ctx, Temp(ctx, bytes, &scratch_t, &scratch));
    OP_REQUIRES_OK(ctx, Temp(ctx, 16, &counters_t, &counters));
    OP_REQUIRES_OK(ctx, CoreStatus("zeroing the error counts",
                                   ge_zero_async(counters, 16, stream)));
    const int code =
        sequence
            ? ge_lookup_sequence(descs.data(), k, dim_, max_norm_, scratch,
                                 bytes, static_cast<unsigned long long*>(
                                            counters), stream)
            : ge_lookup_pooled(descs.data(), k, dim_, max_norm_, scratch,
                               bytes,
                               static_cast<unsigned long long*>(counters),
                               stream);
    OP_REQUIRES_OK(ctx, CoreStatus(name(), code));
    OP_REQUIRES_OK(ctx, CheckCounters(ctx, stream, counters, names_,
                                      id_tensors, vocabs));
  }

 private:
  const Layout layout_;
  std::vector<std::string> names_;
  std::vector<int32_t> combiners_;
  int64_t dim_;
  float max_norm_;
};

// The backward ops: distinct ids and summed gradient rows per table, from
// one core call; the outputs are sized once the device has counted the
// distinct ids.
class LookupGradOp : public OpKernel {
 public:
  explicit LookupGradOp(OpKernelConstruction* ctx)
      : OpKernel(ctx), layout_(LayoutOf(ctx->def().op())) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("embedding_dim", &dim_));
    if (layout_ != Layout::kSequence) {
      OP_REQUIRES_OK(ctx, CombinersAttr(ctx, &combiners_));
    }
  }

  void Compute(OpKernelContext* ctx) override {
    const bool sequence = layout_ == Layout::kSequence;
    RaggedInputs in;
    OP_REQUIRES_OK(ctx, in.Read(ctx, sequence));
    OpInputList grads;
    const int k = in.ids.size();
    OP_REQUIRES(ctx, sequence || static_cast<int>(combiners_.size()) == k,
                InvalidArgument("combiners must have ", k, " entries."));
    if (layout_ != Layout::kConcat) {
      OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
    }
    std::vector<GeTable> descs(k);
    std::vector<std::string> names(k);
    std::vector<const Tensor*> id_tensors(k);
    int64_t total = 0;
    for (int t = 0; t < k; ++t) {
      names[t] = absl::StrCat("table ", t);
      GeTable& d = descs[t];
      OP_REQUIRES_OK(ctx, in.Describe(t, names[t], &d));
      const int64_t batch = d.batch;
      d.vocab = kBackwardVocab;
      id_tensors[t] = &in.ids[t];
      total += d.nnz;
      if (layout_ == Layout::kConcat) {
        const Tensor& g = ctx->input(0);
        OP_REQUIRES(ctx, g.dims() == 2 && g.dim_size(0) == batch &&
                             g.dim_size(1) == k * dim_,
                    InvalidArgument("grads must be [", batch, ", ", k * dim_,
                                    "], got ", g.shape().DebugString()));
        float* base = DataOr<float>(g);
        d.grad = base ? base + t * dim_ : nullptr;
        d.grad_stride = k * dim_;
        d.combiner = combiners_[t];
      } else if (sequence) {
        const Tensor& g = grads[t];
        OP_REQUIRES(ctx, g.dims() == 3 && g.dim_size(0) == batch &&
                             g.dim_size(2) == dim_,
                    InvalidArgument(names[t], ": grads must be [", batch,
                                    ", T, ", dim_, "], got ",
                                    g.shape().DebugString()));
        d.seq_len = g.dim_size(1);
        d.grad = DataOr<float>(g);
        d.grad_stride = d.seq_len * dim_;
      } else {
        const Tensor& g = grads[t];
        OP_REQUIRES(ctx, g.dims() == 2 && g.dim_size(0) == batch &&
                             g.dim_size(1) == dim_,
                    InvalidArgument(names[t], ": grads must be [", batch,
                                    ", ", dim_, "], got ",
                                    g.shape().DebugString()));
        d.grad = DataOr<float>(g);
        d.grad_stride = dim_;
        d.combiner = combiners_[t];
      }
    }
    void* stream = StreamOf(ctx);
    const size_t bytes = ge_backward_scratch_bytes(descs.data(), k, dim_);
    OP_REQUIRES(ctx, bytes > 0,
                InvalidArgument("the CUDA core refused the backward's "
                                "arguments."));
    Tensor scratch_t, counters_t, uids_t, ugrads_t, offsets_t;
    void *scratch, *counters;
    OP_REQUIRES_OK(ctx, Temp(ctx, bytes, &scratch_t, &scratch));
    OP_REQUIRES_OK(ctx, Temp(ctx, 16, &counters_t, &counters));
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(DT_INT64,
                                           TensorShape({total + 1}), &uids_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(
                            DT_FLOAT, TensorShape({total + 1, dim_}),
                            &ugrads_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(DT_INT64, TensorShape({k + 1}),
                                           &offsets_t));
    OP_REQUIRES_OK(ctx, CoreStatus("zeroing the error counts",
                                   ge_zero_async(counters, 16, stream)));
    int64_t* uids = uids_t.flat<int64_t>().data();
    float* ugrads = ugrads_t.flat<float>().data();
    OP_REQUIRES_OK(ctx, CoreStatus(name(), ge_backward(
        descs.data(), k, dim_, -1.0f, scratch, bytes, uids, ugrads,
        offsets_t.flat<int64_t>().data(),
        static_cast<unsigned long long*>(counters), stream)));
    OP_REQUIRES_OK(ctx, CheckCounters(ctx, stream, counters, names,
                                      id_tensors,
                                      std::vector<int64_t>(k,
                                                           kBackwardVocab)));
    std::vector<int64_t> offsets(k + 1);
    int code = ge_copy_async(offsets.data(), offsets_t.flat<int64_t>().data(),
                             sizeof(int64_t) * (k + 1), 1, stream);
    if (code == GE_OK) code = ge_synchronize(stream);
    OP_REQUIRES_OK(ctx, CoreStatus("reading the distinct id counts", code));
    OpOutputList uniq_out, grad_out;
    OP_REQUIRES_OK(ctx, ctx->output_list("unique_ids", &uniq_out));
    OP_REQUIRES_OK(ctx, ctx->output_list("id_grads", &grad_out));
    for (int t = 0; t < k; ++t) {
      const int64_t u = offsets[t + 1] - offsets[t];
      OP_REQUIRES(ctx, u >= 0 && offsets[t + 1] <= total,
                  Internal("distinct id offsets out of range."));
      Tensor *oi = nullptr, *og = nullptr;
      OP_REQUIRES_OK(ctx, uniq_out.allocate(t, TensorShape({u}), &oi));
      OP_REQUIRES_OK(ctx, grad_out.allocate(t, TensorShape({u, dim_}), &og));
      code = ge_copy_async(DataOr<int64_t>(*oi), uids + offsets[t],
                           sizeof(int64_t) * u, 0, stream);
      if (code == GE_OK) {
        code = ge_copy_async(DataOr<float>(*og), ugrads + offsets[t] * dim_,
                             sizeof(float) * u * dim_, 0, stream);
      }
      OP_REQUIRES_OK(ctx, CoreStatus("copying the gradients", code));
    }
  }

 private:
  const Layout layout_;
  std::vector<int32_t> combiners_;
  int64_t dim_;
};

#ifdef GE_ADAPTOR_ON_HOST
#define GE_KERNEL(op) \
  Name(op).Device(::tensorflow::DEVICE_CPU).Label("ge_host_core")
#else
#define GE_KERNEL(op) Name(op).Device(::tensorflow::DEVICE_GPU)
#endif

// GroupEmbeddingVariableLookup(Grad): the pre-rename names of
// GroupEmbeddingPooledLookup(Grad), kept for graphs saved before
// (ops/kernels/op_registration.h).
REGISTER_KERNEL_BUILDER(GE_KERNEL("GroupEmbeddingPooledLookup"), LookupOp);
REGISTER_KERNEL_BUILDER(GE_KERNEL("GroupEmbeddingVariableLookup"), LookupOp);
REGISTER_KERNEL_BUILDER(GE_KERNEL("GroupEmbeddingConcatLookup"), LookupOp);
REGISTER_KERNEL_BUILDER(GE_KERNEL("GroupEmbeddingSequenceLookup")
                            .HostMemory("max_lens"),
                        LookupOp);
REGISTER_KERNEL_BUILDER(GE_KERNEL("GroupEmbeddingPooledLookupGrad"),
                        LookupGradOp);
REGISTER_KERNEL_BUILDER(GE_KERNEL("GroupEmbeddingVariableLookupGrad"),
                        LookupGradOp);
REGISTER_KERNEL_BUILDER(GE_KERNEL("GroupEmbeddingConcatLookupGrad"),
                        LookupGradOp);
REGISTER_KERNEL_BUILDER(GE_KERNEL("GroupEmbeddingSequenceLookupGrad"),
                        LookupGradOp);

}  // namespace
}  // namespace gpu_kernels
}  // namespace group_embedding

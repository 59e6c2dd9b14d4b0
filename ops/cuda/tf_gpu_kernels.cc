// TensorFlow GPU kernels of the fused lookups: a thin adaptor over the CUDA
// core (group_embedding_cuda.h). It reads the variables, builds the
// descriptors, allocates outputs and temporaries with TF's allocator,
// takes TF's stream and calls the core; the arithmetic is all in the core.
//
// Registered for the ops of ops/kernels/ (which define them) on
// DEVICE_GPU: every plain-variable lookup (pooled, concatenated,
// sequence; weighted or not; max_norm or not), its backward, and the ops
// the gradient functions add for weights and max_norm (the clip's
// backward, the table snapshot, the weight gradients), in a library of
// their own (_group_embedding_gpu_ops.so) loaded only when TF sees a GPU:
// a GPU registration must not take the CPU kernels down in a TF without
// GPU support.
//
// Built with -DGE_ADAPTOR_ON_HOST, the same code registers on DEVICE_CPU
// under the kernel label "ge_host_core" and calls the core's host
// stand-in: how CPU-only CI runs this adaptor through TF (graphs with
// that label) without a GPU.
//
// Differences from the CPU kernels, by design:
// * the backward returns each table's distinct ids in ascending order
//   (the CPU kernels: first-occurrence order; IndexedSlices have no
//   order), followed by rows of zeros (LookupGradOp): a row per id;
// * the backward ops have no table input, so ids are bounded by 2^40
//   there (the forward checked them against the tables);
// * bad ids and row_splits are counted on the device; the op waits for
//   the stream to read the counts (one wait), and on an error reads the
//   ids back to name the table and the id, as the CPU kernels do. The
//   ops a gradient function builds (`ids_checked`) do not wait: the
//   forward of their step checked the same ids, so a step waits once.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
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
#include "../kernels/op_checks.h"
#include "../kernels/pooling.h"
#include "../kernels/table_access.h"
#include "group_embedding_cuda.h"
#include "tf_adaptor.h"

namespace group_embedding {
namespace gpu_kernels {
namespace {

// ge_check_ids in CallCore's form (it has no dim and no max_norm).
int CheckIdsCore(const GeTable* tables, int num_tables, int64_t /*dim*/,
                 float /*max_norm*/, void* scratch, size_t scratch_bytes,
                 unsigned long long* errors, void* stream) {
  return ge_check_ids(tables, num_tables, scratch, scratch_bytes, errors,
                      stream);
}

// Checks that `table` is a float32 [vocab, dim] matrix, of the call's dim
// when one is known (*dim >= 0); sets *dim.
Status CheckTable(const std::string& name, const Tensor& table,
                  int64_t* dim) {
  if (table.dtype() != DT_FLOAT || table.dims() != 2 ||
      (*dim >= 0 && table.dim_size(1) != *dim)) {
    return InvalidArgument(name, ": expected a float32 [vocab, dim] table "
                           "of the group's dim, got ",
                           ::tensorflow::DataTypeString(table.dtype()), " ",
                           table.shape().DebugString(), ".");
  }
  *dim = table.dim_size(1);
  return Status();
}

enum class Layout { kPerTable, kConcat, kSequence };

Layout LayoutOf(const std::string& op) {
  if (op.find("Concat") != std::string::npos) return Layout::kConcat;
  if (op.find("Sequence") != std::string::npos) return Layout::kSequence;
  return Layout::kPerTable;
}

// The gradient fields of table t (of k) of a descriptor whose ids are
// described, from a backward op's `grads`: pooled, [B, D] per table;
// concat, one [B, k * D] with table t in its columns; sequence,
// [B, T, D] per table (sets seq_len).
Status DescribeGrad(Layout layout, const OpInputList& grads, int t, int k,
                    int64_t dim, int32_t combiner, const std::string& name,
                    GeTable* d) {
  const int64_t batch = d->batch;
  if (layout == Layout::kConcat) {
    const Tensor& g = grads[0];
    if (g.dims() != 2 || g.dim_size(0) != batch || g.dim_size(1) != k * dim) {
      return InvalidArgument(name, ": grads must be [", batch, ", ", k * dim,
                             "], got ", g.shape().DebugString());
    }
    float* base = DataOr<float>(g);
    d->grad = base ? base + t * dim : nullptr;
    d->grad_stride = k * dim;
    d->combiner = combiner;
    return Status();
  }
  const Tensor& g = grads[t];
  if (layout == Layout::kSequence) {
    if (g.dims() != 3 || g.dim_size(0) != batch || g.dim_size(2) != dim) {
      return InvalidArgument(name, ": grads must be [", batch, ", T, ", dim,
                             "], got ", g.shape().DebugString());
    }
    d->seq_len = g.dim_size(1);
    d->grad = DataOr<float>(g);
    d->grad_stride = d->seq_len * dim;
    return Status();
  }
  if (g.dims() != 2 || g.dim_size(0) != batch || g.dim_size(1) != dim) {
    return InvalidArgument(name, ": grads must be [", batch, ", ", dim,
                           "], got ", g.shape().DebugString());
  }
  d->grad = DataOr<float>(g);
  d->grad_stride = dim;
  d->combiner = combiner;
  return Status();
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
    OP_REQUIRES_OK(ctx, IdsCheckedAttr(ctx, &ids_checked_));
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
    CoreGroup group(k);
    for (int t = 0; t < k; ++t) {
      const Tensor* table = vars[t]->tensor();
      OP_REQUIRES(ctx, table->dtype() == DT_FLOAT && table->dims() == 2 &&
                           table->dim_size(1) == dim_,
                  InvalidArgument(names_[t], ": expected a float32 [vocab, ",
                                  dim_, "] table, got ",
                                  table->shape().DebugString()));
      GeTable& d = group.descs[t];
      OP_REQUIRES_OK(ctx, in.Describe(t, names_[t], &d));
      const int64_t batch = d.batch;
      d.table = DataOr<float>(*table);
      d.vocab = table->dim_size(0);
      group.SetIds(t, in.ids[t]);
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
    OP_REQUIRES_OK(ctx, CallCore(ctx, name(),
                                 sequence ? ge_lookup_sequence
                                          : ge_lookup_pooled,
                                 &group, dim_, max_norm_, names_,
                                 ids_checked_));
  }

 private:
  const Layout layout_;
  std::vector<std::string> names_;
  std::vector<int32_t> combiners_;
  int64_t dim_;
  float max_norm_;
  bool ids_checked_;
};

// GroupEmbeddingCheckIds (ops/kernels/check_ids_op.cc): the ids of every
// group of a step checked by one core call (ge_check_ids) and one wait,
// naming the table and the id of an error as the lookups do; the
// lookups built after it take `ids_checked` and do not wait (issue 35.3).
class CheckIdsOp : public OpKernel {
 public:
  explicit CheckIdsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table_names", &names_));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList ids, splits, positions, max_lens;
    OP_REQUIRES_OK(ctx, ctx->input_list("ids", &ids));
    OP_REQUIRES_OK(ctx, ctx->input_list("row_splits", &splits));
    OP_REQUIRES_OK(ctx, ctx->input_list("positions", &positions));
    OP_REQUIRES_OK(ctx, ctx->input_list("max_lens", &max_lens));
    const int k = ids.size();
    OP_REQUIRES(ctx, static_cast<int>(names_.size()) == k,
                InvalidArgument("table_names must have ", k, " entries."));
    LockedTables locked;
    OP_REQUIRES_OK(ctx, locked.Open(ctx, k));
    CoreGroup group(k);
    const Tensor no_weights(DT_FLOAT, TensorShape({0}));
    for (int t = 0; t < k; ++t) {
      const Tensor* table = locked.vars()[t]->tensor();
      OP_REQUIRES(ctx, table->dims() == 2,
                  InvalidArgument(names_[t], ": expected a [vocab, dim] "
                                  "table, got ",
                                  table->shape().DebugString()));
      OP_REQUIRES_OK(ctx, CheckRaggedShapes(names_[t], ids[t], splits[t],
                                            no_weights));
      GeTable& d = group.descs[t];
      std::memset(&d, 0, sizeof(d));
      d.vocab = table->dim_size(0);
      d.ids = DataOr<int64_t>(ids[t]);
      d.splits = DataOr<int64_t>(splits[t]);
      d.nnz = ids[t].NumElements();
      d.batch = splits[t].NumElements() - 1;
      if (positions[t].NumElements() > 0) {
        OP_REQUIRES(ctx, positions[t].dims() == 1 &&
                             positions[t].NumElements() == d.nnz,
                    InvalidArgument(names_[t], ": has ", d.nnz,
                                    " ids but positions of shape ",
                                    positions[t].shape().DebugString()));
        OP_REQUIRES(ctx, max_lens[t].dims() == 0,
                    InvalidArgument(names_[t], ": max_lens must be a "
                                    "scalar."));
        d.positions = DataOr<int64_t>(positions[t]);
        d.seq_len = max_lens[t].scalar<int64_t>()();
        OP_REQUIRES(ctx, d.seq_len >= 0,
                    InvalidArgument(names_[t], ": max_lens must be >= 0, "
                                    "got ", d.seq_len, "."));
      }
      group.SetIds(t, ids[t]);
    }
    OP_REQUIRES_OK(ctx, CallCore(ctx, name(), CheckIdsCore, &group, 0, -1.0f,
                                 names_));
  }

 private:
  std::vector<std::string> names_;
};

// The backward ops: distinct ids and summed gradient rows per table, from
// one core call (ge_backward_padded). Each table's outputs have a row per
// id, known before the call, so no count is read back from the device:
// its distinct ids (ascending) and their sums come first, the other rows
// are the table's own ids with zero gradients, duplicates that add
// nothing to what an IndexedSlices consumer sums (densifying, Keras'
// scatter updates, ops/sparse_apply.py's dedup). With `ids_checked` (the
// gradient function's: the forward checked these ids and row_splits) the
// op does not wait for its stream at all (issue 35.3).
class LookupGradOp : public OpKernel {
 public:
  explicit LookupGradOp(OpKernelConstruction* ctx)
      : OpKernel(ctx), layout_(LayoutOf(ctx->def().op())) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("embedding_dim", &dim_));
    OP_REQUIRES_OK(ctx, IdsCheckedAttr(ctx, &ids_checked_));
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
    OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
    CoreGroup group(k);
    const std::vector<GeTable>& descs = group.descs;
    std::vector<std::string> names(k);
    int64_t total = 0;
    for (int t = 0; t < k; ++t) {
      names[t] = absl::StrCat("table ", t);
      GeTable& d = group.descs[t];
      OP_REQUIRES_OK(ctx, in.Describe(t, names[t], &d));
      d.vocab = kBackwardVocab;
      group.SetIds(t, in.ids[t]);
      total += d.nnz;
      OP_REQUIRES_OK(ctx, DescribeGrad(layout_, grads, t, k, dim_,
                                       sequence ? 0 : combiners_[t],
                                       names[t], &d));
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
    int64_t* uids = uids_t.flat<int64_t>().data();
    float* ugrads = ugrads_t.flat<float>().data();
    // The fill of the rows past each table's distinct ids: its own ids
    // (block t starts after the ids of the tables before it), zero rows.
    int code = ge_zero_async(counters, 16, stream);
    if (code == GE_OK) {
      code = ge_zero_async(ugrads, sizeof(float) * (total + 1) * dim_,
                           stream);
    }
    for (int64_t t = 0, start = 0; t < k && code == GE_OK; ++t) {
      const int64_t n = descs[t].nnz;
      if (n > 0) {
        code = ge_copy_async(uids + start, descs[t].ids,
                             sizeof(int64_t) * n, 0, stream);
      }
      start += n;
    }
    OP_REQUIRES_OK(ctx, CoreStatus("filling the gradient outputs", code));
    OP_REQUIRES_OK(ctx, CoreStatus(name(), ge_backward_padded(
        descs.data(), k, dim_, -1.0f, scratch, bytes, uids, ugrads,
        offsets_t.flat<int64_t>().data(),
        static_cast<unsigned long long*>(counters), stream)));
    OpOutputList uniq_out, grad_out;
    OP_REQUIRES_OK(ctx, ctx->output_list("unique_ids", &uniq_out));
    OP_REQUIRES_OK(ctx, ctx->output_list("id_grads", &grad_out));
    for (int64_t t = 0, start = 0; t < k; ++t) {
      const int64_t n = descs[t].nnz;
      Tensor *oi = nullptr, *og = nullptr;
      OP_REQUIRES_OK(ctx, uniq_out.allocate(t, TensorShape({n}), &oi));
      OP_REQUIRES_OK(ctx, grad_out.allocate(t, TensorShape({n, dim_}), &og));
      if (n > 0) {
        code = ge_copy_async(DataOr<int64_t>(*oi), uids + start,
                             sizeof(int64_t) * n, 0, stream);
        if (code == GE_OK && dim_ > 0) {
          code = ge_copy_async(DataOr<float>(*og), ugrads + start * dim_,
                               sizeof(float) * n * dim_, 0, stream);
        }
        OP_REQUIRES_OK(ctx, CoreStatus("copying the gradients", code));
      }
      start += n;
    }
    if (ids_checked_) return;
    // Built by hand: the op checks its own ids and row_splits (one wait).
    OP_REQUIRES_OK(ctx, CheckCounters(ctx, stream, counters, names, group));
  }

 private:
  const Layout layout_;
  std::vector<int32_t> combiners_;
  int64_t dim_;
  bool ids_checked_;
};

// GroupEmbeddingBackwardApply (ops/kernels/backward_apply_op.cc): the
// group's backward and optimizer step in one core call
// (ge_backward_apply): per table, its distinct ids' gradients summed and
// applied to the table and its slots in place; no gradient is written
// anywhere and the group is sorted once (issue 35.2).
class BackwardApplyOp : public OpKernel {
 public:
  explicit BackwardApplyOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string layout, optimizer;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("layout", &layout));
    layout_ = layout == "concat"     ? Layout::kConcat
              : layout == "sequence" ? Layout::kSequence
                                     : Layout::kPerTable;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("embedding_dim", &dim_));
    OP_REQUIRES_OK(ctx, GetMaxNorm(ctx, &max_norm_));
    OP_REQUIRES_OK(ctx, IdsCheckedAttr(ctx, &ids_checked_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table_names", &names_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("optimizer", &optimizer));
    // The attr's values as GeOptimizer, and each one's slots per table.
    static const struct {
      const char* name;
      int32_t kind;
      int slots;
    } kOptimizers[] = {{"sgd", GE_OPT_SGD, 0},
                       {"adagrad", GE_OPT_ADAGRAD, 1},
                       {"adam", GE_OPT_ADAM, 2},
                       {"ftrl", GE_OPT_FTRL, 2}};
    for (const auto& o : kOptimizers) {
      if (optimizer == o.name) {
        kind_ = o.kind;
        slots_per_table_ = o.slots;
      }
    }
    if (layout_ != Layout::kSequence) {
      OP_REQUIRES_OK(ctx, CombinersAttr(ctx, &combiners_));
    }
  }

  void Compute(OpKernelContext* ctx) override {
    const bool sequence = layout_ == Layout::kSequence;
    RaggedInputs in;
    OP_REQUIRES_OK(ctx, in.Read(ctx, sequence));
    const int k = in.ids.size();
    OP_REQUIRES(ctx, static_cast<int>(names_.size()) == k &&
                         (sequence || static_cast<int>(combiners_.size()) == k),
                InvalidArgument("table_names/combiners must have ", k,
                                " entries."));
    OpInputList grads, slots;
    OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
    OP_REQUIRES_OK(ctx, ctx->input_list("slots", &slots));
    OP_REQUIRES(ctx, slots.size() == slots_per_table_ * k,
                InvalidArgument(name(), ": the optimizer has ",
                                slots_per_table_, " slots per table, got ",
                                slots.size(), " slot variables for ", k,
                                " tables."));
    OP_REQUIRES(ctx, grads.size() == (layout_ == Layout::kConcat ? 1 : k),
                InvalidArgument(name(), ": got ", grads.size(),
                                " gradients for ", k, " tables."));
    const Tensor* hyper = nullptr;
    OP_REQUIRES_OK(ctx, ctx->input("hyper", &hyper));
    OP_REQUIRES(ctx, hyper->dims() == 1 && hyper->NumElements() == 8,
                InvalidArgument(name(), ": hyper must have 8 values, got "
                                "shape ", hyper->shape().DebugString()));
    const float* h = hyper->flat<float>().data();
    GeOptimizerConfig config = {kind_, 0,    h[0], h[1], h[2],
                                h[3],  h[4], h[5], h[6], h[7]};

    // Tables and slots: inputs 0 .. k - 1, then k .. k + slots - 1.
    const int nv = k + slots.size();
    std::vector<RefCountPtr<Var>> refs(nv);
    for (int i = 0; i < nv; ++i) {
      OP_REQUIRES_OK(ctx, ::tensorflow::LookupResource(
                              ctx, ::tensorflow::HandleFromInput(ctx, i),
                              &refs[i]));
    }
    // The core applies each table once per call: a table named twice
    // (or a slot that is also a table) would be updated twice.
    std::vector<Var*> order(nv);
    for (int i = 0; i < nv; ++i) order[i] = refs[i].get();
    std::sort(order.begin(), order.end());
    OP_REQUIRES(ctx, std::adjacent_find(order.begin(), order.end()) ==
                         order.end(),
                InvalidArgument(name(), ": a variable is passed twice "
                                "(tables: ", absl::StrJoin(names_, ", "),
                                ")."));
    // Exclusive locks in address order (TF's order for several variables).
    std::vector<std::unique_ptr<::tensorflow::mutex_lock>> locks;
    for (Var* v : order) {
      locks.push_back(std::make_unique<::tensorflow::mutex_lock>(*v->mu()));
    }
    void* stream = StreamOf(ctx);
    std::vector<float*> data(nv);
    for (int i = 0; i < nv; ++i) {
      const std::string& owner = names_[i < k ? i : (i - k) % k];
      Tensor* t = refs[i]->tensor();
      const Tensor* table = refs[i < k ? i : (i - k) % k]->tensor();
      OP_REQUIRES(ctx, t->dtype() == DT_FLOAT && t->dims() == 2 &&
                           t->dim_size(1) == dim_ &&
                           t->dim_size(0) == table->dim_size(0),
                  InvalidArgument(owner, i < k ? "" : " (slot)",
                                  ": expected a float32 [vocab, ", dim_,
                                  "] variable, got ",
                                  t->shape().DebugString()));
      // Written in place: a buffer still shared with an earlier read's
      // tensor gets a copy first (copy on write), so that read keeps
      // its values. Then, as TF's sparse updates do, the variable turns
      // copy-on-read: a later read that must outlive the next update
      // (the weight gradients' snapshot) copies just the rows it needs
      // instead of holding the table and costing the next update a
      // whole copy.
      refs[i]->copy_on_read_mode.store(true);
      if (!t->RefCountIsOne()) {
        Tensor copy;
        OP_REQUIRES_OK(ctx, ctx->allocate_temp(DT_FLOAT, t->shape(), &copy));
        if (t->NumElements() > 0) {
          OP_REQUIRES_OK(ctx, CoreStatus(
                                  "copying a shared table",
                                  ge_copy_async(DataOr<float>(copy),
                                                DataOr<float>(*t),
                                                t->TotalBytes(), 0, stream)));
        }
        *t = copy;
      }
      data[i] = DataOr<float>(*t);
    }
    CoreGroup group(k);
    for (int t = 0; t < k; ++t) {
      GeTable& d = group.descs[t];
      OP_REQUIRES_OK(ctx, in.Describe(t, names_[t], &d));
      d.table = data[t];
      d.vocab = refs[t]->tensor()->dim_size(0);
      d.slot0 = slots_per_table_ > 0 ? data[k + t] : nullptr;
      d.slot1 = slots_per_table_ > 1 ? data[2 * k + t] : nullptr;
      group.SetIds(t, in.ids[t]);
      OP_REQUIRES_OK(ctx, DescribeGrad(layout_, grads, t, k, dim_,
                                       sequence ? 0 : combiners_[t],
                                       names_[t], &d));
    }
    const size_t bytes =
        ge_backward_scratch_bytes(group.descs.data(), k, dim_);
    OP_REQUIRES(ctx, bytes > 0,
                InvalidArgument("the CUDA core refused the backward's "
                                "arguments."));
    CoreScratch s;
    OP_REQUIRES_OK(ctx, s.Allocate(ctx, bytes, stream));
    OP_REQUIRES_OK(ctx, CoreStatus(name(), ge_backward_apply(
        group.descs.data(), k, dim_, max_norm_, &config, s.scratch, s.bytes,
        s.errors(), stream)));
    if (ids_checked_) return;
    OP_REQUIRES_OK(ctx, CheckCounters(ctx, stream, s.counters, names_,
                                      group));
  }

 private:
  Layout layout_;
  std::vector<std::string> names_;
  std::vector<int32_t> combiners_;
  int64_t dim_;
  float max_norm_;
  bool ids_checked_;
  int32_t kind_ = GE_OPT_SGD;  // the op def allows only the four
  int slots_per_table_ = 0;
};

// GroupEmbeddingClipGrad: the max_norm clip's backward of each table's
// per-id gradients, with the rows read from the tables (one core call).
class ClipGradOp : public OpKernel {
 public:
  explicit ClipGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, GetMaxNorm(ctx, &max_norm_));
    OP_REQUIRES_OK(ctx, IdsCheckedAttr(ctx, &ids_checked_));
  }

  void Compute(OpKernelContext* ctx) override {
    ClipGradInputs in;
    OP_REQUIRES_OK(ctx, in.Open(ctx));
    const int k = in.size();
    CoreGroup group(k);
    std::vector<std::string> names(k);
    int64_t dim = -1;
    for (int t = 0; t < k; ++t) {
      names[t] = absl::StrCat("table ", t);
      const Tensor* table = nullptr;
      Tensor* o = nullptr;
      // The core rewrites the gradients in place when `o` is their buffer.
      OP_REQUIRES_OK(ctx, in.Table(ctx, t, &dim, &table, &o));
      const Tensor& uniq = in.unique_ids(t);
      const int64_t u = uniq.NumElements();
      GeTable& d = group.descs[t];
      std::memset(&d, 0, sizeof(d));
      d.table = DataOr<float>(*table);
      d.vocab = table->dim_size(0);
      d.ids = DataOr<int64_t>(uniq);
      d.nnz = d.batch = u;
      d.grad = DataOr<float>(in.id_grads(t));
      d.grad_stride = dim;
      d.out = DataOr<float>(*o);
      d.out_stride = dim;
      group.SetIds(t, uniq);
    }
    OP_REQUIRES_OK(ctx, CallCore(ctx, name(), ge_clip_grads, &group, dim,
                                 max_norm_, names, ids_checked_));
  }

 private:
  float max_norm_;
  bool ids_checked_;
};

// GroupEmbeddingTableSnapshot, as the CPU kernel: the table itself
// (aliased) unless the variable is in copy-on-read mode, then the rows of
// `ids` gathered by position (a pooled "lookup" of one id per row).
class TableSnapshotOp : public OpKernel {
 public:
  explicit TableSnapshotOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table_name", &name_));
    OP_REQUIRES_OK(ctx, IdsCheckedAttr(ctx, &ids_checked_));
  }

  void Compute(OpKernelContext* ctx) override {
    RefCountPtr<Var> var;
    const Tensor* ids_in = nullptr;
    OP_REQUIRES_OK(ctx, SnapshotInputs(ctx, name_, &var, &ids_in));
    const Tensor& ids = *ids_in;
    ::tensorflow::tf_shared_lock lock(*var->mu());
    const Tensor* table = var->tensor();
    int64_t dim = -1;
    OP_REQUIRES_OK(ctx, CheckTable(name_, *table, &dim));
    Tensor* flag = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &flag));
    const bool by_position = var->copy_on_read_mode.load();
    flag->scalar<bool>()() = by_position;
    if (!by_position) {
      ctx->set_output(0, *table);
      return;
    }
    const int64_t n = ids.NumElements();
    Tensor* rows = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, dim}),
                                             &rows));
    if (n == 0) return;
    CoreGroup group(1);
    GeTable& d = group.descs[0];
    std::memset(&d, 0, sizeof(d));
    d.table = DataOr<float>(*table);
    d.vocab = table->dim_size(0);
    d.ids = DataOr<int64_t>(ids);
    d.nnz = d.batch = n;  // no splits: one id per output row
    d.combiner = GE_SUM;
    d.out = DataOr<float>(*rows);
    d.out_stride = dim;
    group.SetIds(0, ids);
    OP_REQUIRES_OK(ctx, CallCore(ctx, name(), ge_lookup_pooled, &group, dim,
                                 -1.0f, {name_}, ids_checked_));
  }

 private:
  std::string name_;
  bool ids_checked_;
};

// GroupEmbedding(Sequence)WeightGrad(FromSnapshots): d loss / d weights
// of the weighted tables of a group, one core call for all of them, the
// rows read from the variables or from GroupEmbeddingTableSnapshot's
// outputs (by position: row j for id j). Unweighted tables get an empty
// output, as on the CPU.
class WeightGradOp : public OpKernel {
 public:
  explicit WeightGradOp(OpKernelConstruction* ctx)
      : OpKernel(ctx),
        layout_(LayoutOf(ctx->def().op())),
        snapshots_(ctx->def().op().find("FromSnapshots") !=
                   std::string::npos) {
    OP_REQUIRES_OK(ctx, GetMaxNorm(ctx, &max_norm_));
    OP_REQUIRES_OK(ctx, IdsCheckedAttr(ctx, &ids_checked_));
    if (layout_ != Layout::kSequence) {
      OP_REQUIRES_OK(ctx, CombinersAttr(ctx, &combiners_));
    }
  }

  void Compute(OpKernelContext* ctx) override {
    const bool sequence = layout_ == Layout::kSequence;
    RaggedInputs in;
    OP_REQUIRES_OK(ctx, in.Read(ctx, sequence));
    OpInputList grads, pooled;
    OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
    if (!sequence) OP_REQUIRES_OK(ctx, ctx->input_list("pooled", &pooled));
    OpOutputList out;
    OP_REQUIRES_OK(ctx, ctx->output_list("weight_grads", &out));
    const int k = in.ids.size();
    OP_REQUIRES(ctx, sequence || static_cast<int>(combiners_.size()) == k,
                InvalidArgument("combiners must have ", k, " entries."));
    LockedTables locked;
    if (!snapshots_) OP_REQUIRES_OK(ctx, locked.Open(ctx, k));
    CoreGroup group(0);  // the weighted tables only
    std::vector<std::string> names;
    int64_t dim = -1;
    for (int t = 0; t < k; ++t) {
      const std::string name = absl::StrCat("table ", t);
      GeTable d;
      OP_REQUIRES_OK(ctx, in.Describe(t, name, &d));
      Tensor* o = nullptr;
      OP_REQUIRES_OK(ctx, out.allocate(t, in.weights[t].shape(), &o));
      if (d.weights == nullptr) continue;
      const Tensor* table =
          snapshots_ ? &ctx->input(t) : locked.vars()[t]->tensor();
      bool by_position = false;
      if (snapshots_) {
        const Tensor& flag = ctx->input(k + t);
        OP_REQUIRES(ctx, flag.dims() == 0,
                    InvalidArgument(name, ": by_position must be a bool "
                                    "scalar, got shape ",
                                    flag.shape().DebugString(), "."));
        by_position = flag.scalar<bool>()();
      }
      OP_REQUIRES_OK(ctx, CheckTable(name, *table, &dim));
      OP_REQUIRES(ctx, !by_position || table->dim_size(0) == d.nnz,
                  InvalidArgument(name, ": the snapshot has ",
                                  table->dim_size(0), " rows for ", d.nnz,
                                  " ids."));
      d.table = DataOr<float>(*table);
      d.vocab = table->dim_size(0);
      d.flags = by_position ? GE_ROWS_BY_POSITION : 0;
      d.weight_grad = DataOr<float>(*o);
      if (sequence) {
        OP_REQUIRES_OK(ctx, CheckSequenceGrad(name, grads[t], d.batch, dim,
                                              &d.seq_len));
        d.grad_stride = d.seq_len * dim;
      } else {
        OP_REQUIRES_OK(ctx, CheckMatrix(name + ": grads", grads[t], d.batch,
                                        dim));
        OP_REQUIRES_OK(ctx, CheckMatrix(name + ": pooled", pooled[t],
                                        d.batch, dim));
        d.pooled = DataOr<float>(pooled[t]);
        d.grad_stride = dim;
        d.combiner = combiners_[t];
      }
      d.grad = DataOr<float>(grads[t]);
      group.descs.push_back(d);
      names.push_back(name);
      group.ids.push_back(&in.ids[t]);
      // A snapshot by position was range-checked when taken.
      group.vocabs.push_back(
          by_position ? std::numeric_limits<int64_t>::max() : d.vocab);
    }
    if (group.descs.empty()) return;
    OP_REQUIRES_OK(ctx, CallCore(ctx, name(), ge_weight_grads, &group, dim,
                                 max_norm_, names, ids_checked_));
  }

 private:
  const Layout layout_;
  const bool snapshots_;
  std::vector<int32_t> combiners_;
  float max_norm_;
  bool ids_checked_;
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
REGISTER_KERNEL_BUILDER(GE_KERNEL("GroupEmbeddingCheckIds")
                            .HostMemory("max_lens"),
                        CheckIdsOp);
REGISTER_KERNEL_BUILDER(GE_KERNEL("GroupEmbeddingClipGrad"), ClipGradOp);
REGISTER_KERNEL_BUILDER(GE_KERNEL("GroupEmbeddingBackwardApply")
                            .HostMemory("hyper"),
                        BackwardApplyOp);
REGISTER_KERNEL_BUILDER(GE_KERNEL("GroupEmbeddingTableSnapshot")
                            .HostMemory("by_position"),
                        TableSnapshotOp);
// The snapshot forms are what the gradient functions build; the forms
// that read the variables are kept for graphs saved before
// (weight_grad_ops.cc).
REGISTER_KERNEL_BUILDER(GE_KERNEL("GroupEmbeddingWeightGradFromSnapshots")
                            .HostMemory("by_position"),
                        WeightGradOp);
REGISTER_KERNEL_BUILDER(
    GE_KERNEL("GroupEmbeddingSequenceWeightGradFromSnapshots")
        .HostMemory("by_position"),
    WeightGradOp);
REGISTER_KERNEL_BUILDER(GE_KERNEL("GroupEmbeddingWeightGrad"), WeightGradOp);
REGISTER_KERNEL_BUILDER(GE_KERNEL("GroupEmbeddingSequenceWeightGrad"),
                        WeightGradOp);

}  // namespace
}  // namespace gpu_kernels
}  // namespace group_embedding

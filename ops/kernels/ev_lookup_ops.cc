// Fused pooled lookup of a group of same-dim EmbeddingVariables: the EV
// analogue of GroupEmbeddingPooledLookup (lookup_ops.cc), which
// pools straight into [B, D] outputs instead of gathering [nnz, D] rows.
//
// Why two phases: inserting keys mutates a variable's hash map, which
// threads cannot share, while pooling only reads rows. So the op first
// resolves every key to the row it reads (in parallel over variables,
// each variable's keys in order), then pools in parallel over batch rows.
// Rows never move (chunked storage) and the locks of all the group's
// variables are held until pooling ends, so the resolved pointers stay
// valid.
//
// Gradient (registered in fused_lookup.py): GroupEmbeddingPooledLookupGrad
// with keys in the role of ids gives, per variable, the unique keys and
// their summed gradients; GroupEmbeddingEVWeightGrad below gives the weights'.
//
// GroupEmbeddingEVGather (unpooled rows, for sequences, max_norm and the
// pure-TF path) lives here too: it resolves keys exactly as
// GroupEmbeddingEVLookup does.
//
// Locking rule: the op takes every lock it needs BEFORE handing work to
// the intra-op pool, and work items never lock. A work item that waited
// on a variable's lock could deadlock with an op that holds that lock
// while it waits for the same pool (EVApply*, GroupEmbeddingEVLookup).

#include <optional>

#include "ev_group_locks.h"
#include "ev_storage.h"
#include "pooling.h"
#include "op_registration.h"

namespace group_embedding {
namespace ev {
namespace {

using ::tensorflow::OpOutputList;

// The `training` input: a scalar bool.
Status ReadTraining(OpKernelContext* ctx, int input, bool* training) {
  TF_RETURN_IF_ERROR(CheckScalar(ctx->input(input), "training"));
  *training = ctx->input(input).scalar<bool>()();
  return Status();
}

// Checks one variable of a group: its dim and its default values.
Status CheckGroupMember(const EVStorage* ev, int64_t dim,
                        const Tensor& defaults) {
  const std::string& name = ev->config().name;
  if (ev->dim() != dim) {
    return InvalidArgument(name, ": has dim ", ev->dim(),
                           " but the group has dim ", dim, ".");
  }
  if (defaults.dims() != 2 || defaults.dim_size(1) != dim ||
      defaults.dim_size(0) == 0) {
    return InvalidArgument(name, ": default values must be [n > 0, ", dim,
                           "], got ", defaults.shape().DebugString());
  }
  return Status();
}

// The variables of inputs [0, k) of a group op (`refs` hold them), each
// checked against the group's dim and its "default_values" input.
struct GroupEVs {
  std::vector<RefCountPtr<EVStorage>> refs;
  std::vector<EVStorage*> evs;
  OpInputList defaults;
};

Status ReadGroupEVs(OpKernelContext* ctx, int64_t dim, GroupEVs* g) {
  TF_RETURN_IF_ERROR(ctx->input_list("default_values", &g->defaults));
  const int k = g->defaults.size();
  g->refs.resize(k);
  g->evs.resize(k);
  for (int t = 0; t < k; ++t) {
    TF_RETURN_IF_ERROR(GetEV(ctx, t, &g->refs[t]));
    g->evs[t] = g->refs[t].get();
    TF_RETURN_IF_ERROR(CheckGroupMember(g->evs[t], dim, g->defaults[t]));
  }
  return Status();
}

// The checked inputs of a ragged group op over EVs: its variables, and
// its keys' ragged lists (ReadRaggedGroup's `lists`), errors naming each
// table after its variable.
struct GroupInputs : RaggedGroup, GroupEVs {};

Status ReadGroupInputs(OpKernelContext* ctx, int64_t dim, unsigned lists,
                       GroupInputs* in) {
  TF_RETURN_IF_ERROR(ReadGroupEVs(ctx, dim, in));
  return ReadRaggedGroup(
      ctx, "keys", lists, dim,
      [in](int t) { return in->evs[t]->config().name; }, in);
}

// Points `out[j]` at the row key j reads, as GroupEmbeddingEVGather would copy
// it: its value if stored and admitted, else `no_permission` (a row of the
// filter's constant) or, for unknown keys outside training, its default row.
// With `training`, new keys are inserted (a CBFFilter inserts a key only once
// admitted), every occurrence is counted and every stored key is stamped with
// the current step (its version: the last step it was seen, admitted or not).
// As in DeepRec, a lookup reads what the key had BEFORE this batch counted it:
// under CounterFilter(N) a key reads `no_permission` for its first N lookups,
// its row from lookup N + 1 on, and all occurrences of a key in the batch read
// the same row. Needs the variable's lock (exclusive when training). Fails only
// when the table is full.
Status ResolveKeys(EVStorage* ev, const int64_t* key, int64_t n,
                   const Tensor& defaults, bool training,
                   const float* no_permission, const float** out,
                   const int64_t* known = nullptr) {
  const float* dflt = defaults.flat<float>().data();
  const int64_t drows = defaults.dim_size(0);
  const bool filtered = ev->config().filter_freq > 0;
  // `known`: key j's row as the tier's promotion pass found it (-1: not
  // found then, look again), so that a key costs one probe, not two.
  auto find = [&](int64_t j) {
    return known != nullptr && known[j] >= 0 ? known[j] : ev->Find(key[j]);
  };
  auto unknown = [&](int64_t j) { return known == nullptr || known[j] < 0; };
  auto prefetch = [&](int64_t j) {
    if (j + 2 * kPrefetchDistance < n && unknown(j + 2 * kPrefetchDistance)) {
      ev->PrefetchBucket(key[j + 2 * kPrefetchDistance]);
    }
    if (j + kPrefetchDistance < n && unknown(j + kPrefetchDistance)) {
      ev->PrefetchKeyRow(key[j + kPrefetchDistance]);
    }
  };
  if (!training) {
    for (int64_t j = 0; j < n; ++j) {
      prefetch(j);
      const int64_t r = find(j);
      if (r >= 0 && ev->Admitted(r)) {
        out[j] = ev->Value(r);
      } else if (filtered) {
        out[j] = no_permission;
      } else {
        out[j] = DefaultRowOf(key[j], dflt, drows, ev->dim());
      }
    }
    return Status();
  }
  if (filtered) {
    // What each key reads is fixed before any is counted. Rows never
    // move, so these pointers survive the inserts below.
    for (int64_t j = 0; j < n; ++j) {
      prefetch(j);
      const int64_t r = find(j);
      out[j] = (r >= 0 && ev->Admitted(r)) ? ev->Value(r) : no_permission;
    }
  }
  const bool cbf = ev->has_cbf();
  for (int64_t j = 0; j < n; ++j) {
    prefetch(j);
    // A key the promotion pass did not find may have been inserted
    // since by an earlier occurrence: find() looks again.
    int64_t r = find(j);
    if (r < 0 && cbf) {
      // Counted in the Bloom filter; stored once admitted.
      const int64_t count = ev->CountUnstored(key[j]);
      if (count < ev->config().filter_freq) continue;
      r = ev->FindOrInsert(key[j], dflt, drows);
      if (r < 0) return ev->FullError();
      *ev->Freq(r) = count;
    } else {
      if (r < 0) r = ev->FindOrInsert(key[j], dflt, drows);
      if (r < 0) return ev->FullError();
      CountOccurrence(ev->Freq(r));
    }
    ev->Touch(r);
    if (!filtered) out[j] = ev->Value(r);
  }
  return Status();
}

// The keys of a group's K tables resolved to the rows they read (table t's
// from rows(t)), the three EV lookups' first phase. Resolve() takes the
// locks of the distinct variables (EVGroupLocks), which stay held while
// this object lives, so the row pointers stay valid for the second phase.
class ResolvedGroup {
 public:
  // Lays out the keys (nothing locked or read yet): table t's keys at
  // [offset_[t], offset_[t + 1]) of the rows, and a row of each table's
  // CounterFilter constant.
  ResolvedGroup(const std::vector<EVStorage*>& evs, const OpInputList& keys,
                int64_t dim)
      : offset_(keys.size() + 1, 0), no_permission_(keys.size()) {
    for (int t = 0; t < keys.size(); ++t) {
      offset_[t + 1] = offset_[t] + keys[t].NumElements();
      no_permission_[t].assign(dim, evs[t]->config().no_permission);
    }
  }

  // How many keys the group has.
  int64_t total() const { return offset_.back(); }
  const float* const* rows(int t) const { return rows_.data() + offset_[t]; }

  // Locks the variables (exclusive when training, which inserts) and
  // resolves every key (ResolveKeys), in parallel over distinct variables
  // and in table order within each: work items only read or insert, each
  // into its own variable.
  Status Resolve(OpKernelContext* ctx, const std::vector<EVStorage*>& evs,
                 const OpInputList& keys, const OpInputList& defaults,
                 bool training) {
    locks_.emplace(evs, training);
    rows_.resize(total());
    const std::vector<EVStorage*>& distinct = locks_->distinct();
    const int k = evs.size();
    const int64_t n = distinct.size();
    // SSD tiers first, serially: the batch's keys get DRAM rows, which
    // stay until the next op on the variable (see ev_storage.h). One
    // spill per variable, then its tables' keys, so that no promoted row
    // of one table is spilled for another.
    // The promotion pass probes every key in DRAM; the rows it finds
    // (`known`) stay put until this op ends (promotions only add rows),
    // so ResolveKeys takes them instead of probing again.
    std::vector<int64_t> known;
    for (EVStorage* ev : distinct) {
      if (!ev->has_tier()) continue;
      if (known.empty()) known.assign(total(), -1);
      TF_RETURN_IF_ERROR(ev->SpillToBudget());
      for (int t = 0; t < k; ++t) {
        if (evs[t] != ev) continue;
        TF_RETURN_IF_ERROR(ev->PrepareTier(keys[t].flat<int64_t>().data(),
                                           keys[t].NumElements(),
                                           /*spill=*/false,
                                           known.data() + offset_[t]));
      }
    }
    std::vector<Status> status(n);  // one writer per entry
    auto work = [&](int64_t begin, int64_t end) {
      for (int64_t e = begin; e < end; ++e) {
        for (int t = 0; t < k && status[e].ok(); ++t) {
          if (evs[t] != distinct[e]) continue;
          status[e] = ResolveKeys(evs[t], keys[t].flat<int64_t>().data(),
                                  keys[t].NumElements(), defaults[t],
                                  training, no_permission_[t].data(),
                                  rows_.data() + offset_[t],
                                  evs[t]->has_tier()
                                      ? known.data() + offset_[t]
                                      : nullptr);
        }
      }
    };
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
    tensorflow::Shard(pool->num_threads, pool->workers, n,
                      (total() / n + 1) * 100, work);
    for (const Status& st : status) TF_RETURN_IF_ERROR(st);
    return Status();
  }

 private:
  std::vector<int64_t> offset_;
  std::vector<std::vector<float>> no_permission_;
  std::optional<EVGroupLocks> locks_;
  std::vector<const float*> rows_;
};

Status PooledShapes(InferenceContext* c) {
  int n;
  int64_t dim;
  TF_RETURN_IF_ERROR(GetGroupAttrs(c, &n, &dim));
  TF_RETURN_IF_ERROR(InputsWithRank(c, n, 3 * n, 1));  // keys, splits, w
  TF_RETURN_IF_ERROR(InputsWithRank(c, 4 * n, n, 2));  // default values
  TF_RETURN_IF_ERROR(InputsWithRank(c, 5 * n, 1, 0));  // training
  for (int i = 0; i < n; ++i) {
    TF_RETURN_IF_ERROR(SetPooledShape(c, i, 2 * n + i, dim));
  }
  return Status();
}

GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingEVLookup", "EVGroupLookup",
    .Input("handles: num_tables * resource")
    .Input("keys: num_tables * int64")
    .Input("row_splits: num_tables * int64")
    .Input("weights: num_tables * float")
    .Input("default_values: num_tables * float")
    .Input("training: bool")
    .Output("pooled: num_tables * float")
    .Attr("num_tables: int >= 1")
    .Attr("combiners: list(string)")
    .Attr("embedding_dim: int >= 1")
    .SetIsStateful()
    .SetShapeFn(PooledShapes));

// The kernels of a pooled group of EVs (the lookup and its weight
// gradient): their combiners, their dim and their checked inputs.
class PooledEVKernel : public OpKernel {
 public:
  explicit PooledEVKernel(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ParseCombiners(ctx, &combiners_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("embedding_dim", &dim_));
  }

 protected:
  Status Read(OpKernelContext* ctx, GroupInputs* in) const {
    TF_RETURN_IF_ERROR(ReadGroupInputs(ctx, dim_, kWithWeights, in));
    const int k = in->size();
    if (static_cast<int>(combiners_.size()) != k) {
      return InvalidArgument("combiners must have ", k, " entries.");
    }
    return Status();
  }

  std::vector<Combiner> combiners_;
  int64_t dim_;
};

class EVLookupOp : public PooledEVKernel {
 public:
  using PooledEVKernel::PooledEVKernel;

  void Compute(OpKernelContext* ctx) override {
    GroupInputs in;
    OP_REQUIRES_OK(ctx, Read(ctx, &in));
    const int k = in.size();
    bool training = false;
    OP_REQUIRES_OK(ctx, ReadTraining(ctx, 5 * k, &training));
    const int64_t dim = dim_;

    ResolvedGroup resolved(in.evs, in.ids, dim);
    std::vector<int64_t> first_row(k + 1, 0);
    for (int t = 0; t < k; ++t) first_row[t + 1] = first_row[t] + in.batch(t);
    OpOutputList out;
    OP_REQUIRES_OK(ctx, ctx->output_list("pooled", &out));
    std::vector<PooledTable<ResolvedRows>> pooled(k);
    for (int t = 0; t < k; ++t) {
      Tensor* o = nullptr;
      const int64_t batch = first_row[t + 1] - first_row[t];
      OP_REQUIRES_OK(ctx, out.allocate(t, TensorShape({batch, dim}), &o));
      pooled[t].splits = in.splits[t].flat<int64_t>().data();
      pooled[t].weights = in.weight_data(t);
      pooled[t].nnz = in.nnz(t);
      pooled[t].dim = dim;
      pooled[t].combiner = combiners_[t];
      pooled[t].out = o->flat<float>().data();
      pooled[t].stride = dim;
    }

    OP_REQUIRES_OK(ctx, resolved.Resolve(ctx, in.evs, in.ids, in.defaults,
                                         training));
    const int64_t total_rows = first_row[k];
    if (total_rows == 0) return;
    for (int t = 0; t < k; ++t) pooled[t].rows = {resolved.rows(t)};
    // Every key has a row (ResolveKeys): no id is refused, no clipping.
    const int64_t avg = resolved.total() / total_rows + 1;
    PoolTables(ctx, pooled, first_row, /*max_norm=*/-1.0f,
               avg * dim * 4 + 20);
  }
};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingEVLookup", "EVGroupLookup",
    EVLookupOp);

// ---------------------------------------------------------------------------
// Unpooled (is_sequence=True) lookup of a group of same-dim EVs: each key's
// row, resolved exactly as GroupEmbeddingEVLookup resolves it, lands at [row,
// position] of a padded [B, T, D] output; zeros elsewhere.
// GroupEmbeddingEVGather + a TF segment sum computed the same with a [nnz, D]
// tensor each way. Unweighted tables only (weighted ones keep that path, whose
// weight gradient TF derives). Gradient (fused_lookup.py):
// GroupEmbeddingSequenceLookupGrad with keys as ids, i.e. per variable its
// unique keys and their summed gradients.
// ---------------------------------------------------------------------------
GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingEVSequenceLookup", "EVGroupSequenceLookup",
    .Input("handles: num_tables * resource")
    .Input("keys: num_tables * int64")
    .Input("row_splits: num_tables * int64")
    .Input("positions: num_tables * int64")
    .Input("max_lens: num_tables * int64")
    .Input("default_values: num_tables * float")
    .Input("training: bool")
    .Output("sequences: num_tables * float")
    .Attr("num_tables: int >= 1")
    .Attr("embedding_dim: int >= 1")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      int n;
      int64_t dim;
      TF_RETURN_IF_ERROR(GetGroupAttrs(c, &n, &dim));
      TF_RETURN_IF_ERROR(InputsWithRank(c, n, 3 * n, 1));  // keys..positions
      TF_RETURN_IF_ERROR(InputsWithRank(c, 4 * n, n, 0));  // max_lens
      TF_RETURN_IF_ERROR(InputsWithRank(c, 5 * n, n, 2));  // default values
      TF_RETURN_IF_ERROR(InputsWithRank(c, 6 * n, 1, 0));  // training
      return SequenceOutputShapes(c, n, dim);
    }));

class EVSequenceLookupOp : public OpKernel {
 public:
  explicit EVSequenceLookupOp(OpKernelConstruction* ctx)
      : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("embedding_dim", &dim_));
  }

  void Compute(OpKernelContext* ctx) override {
    GroupInputs in;
    OP_REQUIRES_OK(ctx, ReadGroupInputs(ctx, dim_, kWithMaxLens, &in));
    const int k = in.size();
    bool training = false;
    OP_REQUIRES_OK(ctx, ReadTraining(ctx, 6 * k, &training));
    const int64_t dim = dim_;
    ResolvedGroup resolved(in.evs, in.ids, dim);
    std::vector<int64_t> first_row(k + 1, 0);
    OpOutputList out;
    OP_REQUIRES_OK(ctx, ctx->output_list("sequences", &out));
    std::vector<float*> outs(k);
    for (int t = 0; t < k; ++t) {
      Tensor* o = nullptr;
      OP_REQUIRES_OK(ctx, out.allocate(t, in.sequence_shapes[t], &o));
      outs[t] = o->flat<float>().data();
      first_row[t + 1] = first_row[t] + in.batch(t);
    }

    OP_REQUIRES_OK(ctx, resolved.Resolve(ctx, in.evs, in.ids, in.defaults,
                                         training));
    const int64_t total_rows = first_row[k];
    if (total_rows == 0) return;

    int64_t total_slots = 0;
    std::vector<SequenceTable<ResolvedRows>> tables(k);
    for (int t = 0; t < k; ++t) {
      total_slots += in.batch(t) * in.lens[t];
      tables[t] = {{resolved.rows(t)},
                   in.splits[t].flat<int64_t>().data(),
                   in.positions[t].flat<int64_t>().data(),
                   /*weights=*/nullptr,
                   in.nnz(t),
                   in.lens[t],
                   outs[t]};
    }
    ScatterSequences(ctx, tables, first_row, dim, /*max_norm=*/-1.0f,
                     ((total_slots + resolved.total()) / total_rows + 1) *
                         dim * 3);
  }

 private:
  int64_t dim_;
};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingEVSequenceLookup", "EVGroupSequenceLookup",
    EVSequenceLookupOp);

// ---------------------------------------------------------------------------
// Gradient w.r.t. the per-key weights of GroupEmbeddingEVLookup (weighted
// tables only), as GroupEmbeddingWeightGrad computes it for plain variables:
//   d/dw_j = (e_j.g_b - pooled_b.g_b * dn_b/dw_j) / n_b
// e_j is the row key j read in the forward pass, re-resolved without
// inserting (the forward already inserted and counted it). Not stateful,
// so that graph pruning drops it when nothing needs weight gradients.
// ---------------------------------------------------------------------------
GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingEVWeightGrad", "EVGroupWeightGrad",
    .Input("handles: num_tables * resource")
    .Input("keys: num_tables * int64")
    .Input("row_splits: num_tables * int64")
    .Input("weights: num_tables * float")
    .Input("default_values: num_tables * float")
    .Input("grads: num_tables * float")
    .Input("pooled: num_tables * float")
    .Output("weight_grads: num_tables * float")
    .Attr("num_tables: int >= 1")
    .Attr("combiners: list(string)")
    .Attr("embedding_dim: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      int n;
      TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &n));
      TF_RETURN_IF_ERROR(InputsWithRank(c, n, 3 * n, 1));  // keys, splits, w
      TF_RETURN_IF_ERROR(InputsWithRank(c, 4 * n, 3 * n, 2));
      for (int i = 0; i < n; ++i) c->set_output(i, c->input(3 * n + i));
      return Status();
    }));

class EVWeightGradOp : public PooledEVKernel {
 public:
  using PooledEVKernel::PooledEVKernel;

  void Compute(OpKernelContext* ctx) override {
    GroupInputs in;
    OP_REQUIRES_OK(ctx, Read(ctx, &in));
    OpInputList grads, pooled;
    OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
    OP_REQUIRES_OK(ctx, ctx->input_list("pooled", &pooled));
    OpOutputList out;
    OP_REQUIRES_OK(ctx, ctx->output_list("weight_grads", &out));
    const int k = in.size();
    const int64_t dim = dim_;
    for (int t = 0; t < k; ++t) {
      const std::string& name = in.evs[t]->config().name;
      const int64_t batch = in.batch(t);
      OP_REQUIRES_OK(ctx, CheckMatrix(name + ": grads", grads[t], batch, dim));
      OP_REQUIRES_OK(ctx, CheckMatrix(name + ": pooled", pooled[t], batch,
                                      dim));
    }
    for (int t = 0; t < k; ++t) {
      Tensor* o = nullptr;
      OP_REQUIRES_OK(ctx, out.allocate(t, in.weights[t].shape(), &o));
      if (in.weights[t].NumElements() == 0) continue;
      EVStorage* ev = in.evs[t];
      const int64_t nnz = in.nnz(t);
      std::vector<const float*> rows(nnz);
      const std::vector<float> no_permission(dim, ev->config().no_permission);
      const int64_t* ids = in.ids[t].flat<int64_t>().data();
      auto resolve = [&]() {
        OP_REQUIRES_OK(ctx, ResolveKeys(ev, ids, nnz, in.defaults[t],
                                        /*training=*/false,
                                        no_permission.data(), rows.data()));
        WeightGrad(t, in, grads[t], pooled[t], rows, o->flat<float>().data());
      };
      if (ev->has_tier()) {
        // Rows of the SSD tier come back to DRAM first (exclusive); no
        // spill of the forward pass's rows (slack nnz, as the update's).
        tensorflow::mutex_lock lock(*ev->mu());
        OP_REQUIRES_OK(ctx, ev->SpillToBudget(/*slack=*/nnz));
        OP_REQUIRES_OK(ctx, ev->PrepareTier(ids, nnz, /*spill=*/false));
        resolve();
      } else {
        tensorflow::tf_shared_lock lock(*ev->mu());
        resolve();
      }
      if (!ctx->status().ok()) return;
    }
  }

 private:
  void WeightGrad(int t, const GroupInputs& in, const Tensor& grads,
                  const Tensor& pooled, const std::vector<const float*>& rows,
                  float* dw) const {
    const auto table =
        MakeGradTable(PooledGrads{grads.flat<float>().data(), dim_},
                      in.splits[t], in.weights[t], in.nnz(t), combiners_[t]);
    WeightGradRows(table, dim_, pooled.flat<float>().data(),
                   [&rows](int64_t j) { return rows[j]; }, dw);
  }
};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingEVWeightGrad", "EVGroupWeightGrad",
    EVWeightGradOp);

// ---------------------------------------------------------------------------
// Grouped gather: rows of K same-dim EVs, concatenated [sum n_i, D].
// training=true inserts new keys and counts frequencies; false reads only.
// Rows are those GroupEmbeddingEVLookup pools (same ResolveKeys).
// ---------------------------------------------------------------------------
GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingEVGather", "EVGroupGather",
    .Input("handles: num_tables * resource")
    .Input("keys: num_tables * int64")
    .Input("default_values: num_tables * float")
    .Input("training: bool")
    .Output("rows: float")
    .Attr("num_tables: int >= 1")
    .Attr("embedding_dim: int >= 1")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      int n;
      int64_t dim;
      TF_RETURN_IF_ERROR(GetGroupAttrs(c, &n, &dim));
      TF_RETURN_IF_ERROR(InputsWithRank(c, n, n, 1));      // keys
      TF_RETURN_IF_ERROR(InputsWithRank(c, 2 * n, n, 2));  // defaults
      TF_RETURN_IF_ERROR(InputsWithRank(c, 3 * n, 1, 0));  // training
      c->set_output(0, c->MakeShape({c->UnknownDim(), c->MakeDim(dim)}));
      return Status();
    }));

class EVGatherOp : public OpKernel {
 public:
  explicit EVGatherOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("embedding_dim", &dim_));
  }

  void Compute(OpKernelContext* ctx) override {
    GroupEVs g;
    OP_REQUIRES_OK(ctx, ReadGroupEVs(ctx, dim_, &g));
    const std::vector<EVStorage*>& evs = g.evs;
    OpInputList keys;
    OP_REQUIRES_OK(ctx, ctx->input_list("keys", &keys));
    const int k = keys.size();
    bool training = false;
    OP_REQUIRES_OK(ctx, ReadTraining(ctx, 3 * k, &training));
    const int64_t dim = dim_;
    for (int t = 0; t < k; ++t) {
      // Not ragged: keys alone.
      OP_REQUIRES(ctx, keys[t].dims() == 1,
                  InvalidArgument(evs[t]->config().name,
                                  ": keys must be a vector, got shape ",
                                  keys[t].shape().DebugString(), "."));
    }
    ResolvedGroup resolved(evs, keys, dim);
    const int64_t n = resolved.total();
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, dim}), &out));
    float* dst = out->flat<float>().data();

    OP_REQUIRES_OK(ctx, resolved.Resolve(ctx, evs, keys, g.defaults,
                                         training));
    // Copy while the locks still pin the rows (no lock in the work items).
    const float* const* rows = resolved.rows(0);
    auto copy = [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) {
        std::memcpy(dst + j * dim, rows[j], sizeof(float) * dim);
      }
    };
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
    tensorflow::Shard(pool->num_threads, pool->workers, n, dim * 2, copy);
  }

 private:
  int64_t dim_;
};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingEVGather", "EVGroupGather",
    EVGatherOp);

}  // namespace
}  // namespace ev
}  // namespace group_embedding

// Ops that create, export, import and evict EmbeddingVariable storage
// (ev_storage.h). The lookups (GroupEmbeddingEVLookup, GroupEmbeddingEVGather)
// are in ev_lookup_ops.cc, the sparse optimizer updates in ev_apply_ops.cc.

#include "ev_storage.h"
#include "op_registration.h"

namespace group_embedding {
namespace ev {
namespace {

// ---------------------------------------------------------------------------
// Handle: creates the storage on first use, with its configuration.
// ---------------------------------------------------------------------------
GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingEVHandle", "EVHandleOp",
    .Output("handle: resource")
    .Attr("container: string = ''")
    .Attr("shared_name: string")
    .Attr("variable_name: string")
    .Attr("embedding_dim: int >= 1")
    .Attr("filter_freq: int >= 0 = 0")
    .Attr("default_value_no_permission: float = 0.0")
    .Attr("steps_to_live: int >= 0 = 0")
    .Attr("l2_weight_threshold: float = -1.0")
    .Attr("cbf_counters: int >= 0 = 0")
    .Attr("cbf_hashes: int >= 0 = 0")
    .Attr("cbf_counter_bytes: int = 8")
    .Attr("max_rows: int = 0")
    .Attr("storage_path: string = ''")
    .Attr("dram_bytes: int = 0")
    .Attr("cache_lru: bool = false")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape));

class EVHandleOp : public OpKernel {
 public:
  explicit EVHandleOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("container", &container_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shared_name", &shared_name_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("variable_name", &config_.name));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("embedding_dim", &config_.dim));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("filter_freq", &config_.filter_freq));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("default_value_no_permission",
                                     &config_.no_permission));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("steps_to_live",
                                     &config_.steps_to_live));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("l2_weight_threshold",
                                     &config_.l2_threshold));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("cbf_counters", &config_.cbf_counters));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("cbf_hashes", &config_.cbf_hashes));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("cbf_counter_bytes",
                                     &config_.cbf_counter_bytes));
    const int b = config_.cbf_counter_bytes;
    OP_REQUIRES(ctx, b == 1 || b == 2 || b == 4 || b == 8,
                InvalidArgument(config_.name, ": cbf_counter_bytes must be "
                                "1, 2, 4 or 8, got ", b, "."));
    OP_REQUIRES(ctx, config_.cbf_counters == 0 ||
                         (config_.cbf_hashes > 0 && config_.filter_freq > 0 &&
                          (b == 8 || config_.filter_freq < (int64_t{1}
                                                            << (8 * b)))),
                InvalidArgument(config_.name, ": a CBFFilter needs "
                                "cbf_hashes > 0 and 0 < filter_freq < "
                                "2^(8 * cbf_counter_bytes), got ",
                                config_.cbf_hashes, " and ",
                                config_.filter_freq, "."));
    // A lower cap lets tests reach the "table full" error without
    // inserting 2^32 rows; 0 keeps the uint32 index limit.
    int64_t max_rows = 0;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("max_rows", &max_rows));
    OP_REQUIRES(ctx, max_rows >= 0 && max_rows <= kMaxRows,
                InvalidArgument(config_.name, ": max_rows must be in [0, ",
                                kMaxRows, "], got ", max_rows, "."));
    if (max_rows > 0) config_.max_rows = max_rows;
    // SSD tier (StorageType.DRAM_SSDHASH / SSDHASH): a folder, the DRAM
    // budget in bytes (0: SSDHASH, every row back to the tier after each
    // op) and the cache strategy.
    OP_REQUIRES_OK(ctx, ctx->GetAttr("storage_path", &config_.tier_dir));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dram_bytes", &config_.dram_bytes));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("cache_lru", &config_.tier_lru));
    OP_REQUIRES(ctx, config_.dram_bytes >= 0,
                InvalidArgument(config_.name, ": dram_bytes must be >= 0, "
                                "got ", config_.dram_bytes, "."));
  }

  void Compute(OpKernelContext* ctx) override {
    ResourceHandle handle = tensorflow::MakeResourceHandle<EVStorage>(
        ctx, container_, shared_name_);
    EVStorage* ev = nullptr;
    OP_REQUIRES_OK(ctx, ctx->resource_manager()->LookupOrCreate<EVStorage>(
                            handle.container(), handle.name(), &ev,
                            [this](EVStorage** out) {
                              *out = new EVStorage(config_);
                              Status s = (*out)->OpenTier();
                              if (!s.ok()) (*out)->Unref();
                              return s;
                            }));
    const int64_t dim = ev->dim();
    ev->Unref();
    OP_REQUIRES(ctx, dim == config_.dim,
                InvalidArgument(config_.name, ": an EmbeddingVariable named ",
                                shared_name_, " already exists with dim ",
                                dim, ", not ", config_.dim, "."));
    Tensor* out = nullptr;
    tensorflow::AllocatorAttributes attr;
    attr.set_on_host(true);
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out, attr));
    out->scalar<ResourceHandle>()() = handle;
  }

 private:
  std::string container_;
  std::string shared_name_;
  EVConfig config_;
};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingEVHandle", "EVHandleOp",
    EVHandleOp);


// ---------------------------------------------------------------------------
// Slots, size, export, import, eviction.
// ---------------------------------------------------------------------------
GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingEVEnsureSlot", "EVEnsureSlot",
    .Input("handle: resource")
    .Attr("slot_name: string")
    .Attr("initial_value: float")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext*) { return Status(); }));

class EVEnsureSlotOp : public OpKernel {
 public:
  explicit EVEnsureSlotOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("slot_name", &name_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("initial_value", &init_));
  }
  void Compute(OpKernelContext* ctx) override {
    RefCountPtr<EVStorage> ev;
    OP_REQUIRES_OK(ctx, GetEV(ctx, 0, &ev));
    tensorflow::mutex_lock lock(*ev->mu());
    int index = 0;
    OP_REQUIRES_OK(ctx, ev->EnsureSlot(name_, init_, &index));
  }

 private:
  std::string name_;
  float init_;
};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingEVEnsureSlot", "EVEnsureSlot",
    EVEnsureSlotOp);

GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingEVSize", "EVSize",
    .Input("handle: resource")
    .Output("num_keys: int64")
    .Output("num_bytes: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      c->set_output(1, c->Scalar());
      return Status();
    }));

class EVSizeOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    RefCountPtr<EVStorage> ev;
    OP_REQUIRES_OK(ctx, GetEV(ctx, 0, &ev));
    tensorflow::tf_shared_lock lock(*ev->mu());
    Tensor* n = nullptr;
    Tensor* b = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &n));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &b));
    n->scalar<int64_t>()() = ev->size();
    b->scalar<int64_t>()() = ev->Bytes();
  }
};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingEVSize", "EVSize",
    EVSizeOp);

// The SSD tier's counters: keys in DRAM, keys on disk, promotions (disk ->
// DRAM, i.e. misses of the DRAM tier), spills (DRAM -> disk), the bytes
// of the tier's in-memory index, nanoseconds spent promoting and spilling
// (compactions included), compactions; all 0 but the first without a tier.
// A new op: no pre-rename alias.
REGISTER_OP("GroupEmbeddingEVTierStats")
    .Input("handle: resource")
    .Output("stats: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(8));
      return Status();
    });

class EVTierStatsOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    RefCountPtr<EVStorage> ev;
    OP_REQUIRES_OK(ctx, GetEV(ctx, 0, &ev));
    tensorflow::tf_shared_lock lock(*ev->mu());
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({8}), &out));
    auto v = out->flat<int64_t>();
    v(1) = ev->tier_size();
    v(0) = ev->size() - v(1);
    v(2) = ev->promotions();
    v(3) = ev->spills();
    v(4) = ev->tier_index_bytes();
    v(5) = ev->promote_ns();
    v(6) = ev->spill_ns();
    v(7) = ev->compactions();
  }
};

REGISTER_KERNEL_BUILDER(
    Name("GroupEmbeddingEVTierStats").Device(DEVICE_CPU), EVTierStatsOp);

// Outputs 0-7 of GroupEmbeddingEVExport and GroupEmbeddingEVExportChanges:
// keys, values, freqs, versions, slot_names, slot_inits, slots [n, S * D],
// step.
Status SnapshotShapes(InferenceContext* c) {
  int64_t dim;
  TF_RETURN_IF_ERROR(c->GetAttr("embedding_dim", &dim));
  auto n = c->UnknownDim();
  c->set_output(0, c->Vector(n));
  c->set_output(1, c->MakeShape({n, c->MakeDim(dim)}));
  c->set_output(2, c->Vector(n));
  c->set_output(3, c->Vector(n));
  c->set_output(4, c->Vector(c->UnknownDim()));
  c->set_output(5, c->Vector(c->UnknownDim()));
  c->set_output(6, c->MakeShape({n, c->UnknownDim()}));
  c->set_output(7, c->Scalar());
  return Status();
}

// Writes `rows` of `ev` (the caller holds its lock), then the SSD tier's
// records of `tier_keys`, to outputs 0-7.
template <typename Row>
Status WriteSnapshot(OpKernelContext* ctx, EVStorage* ev,
                     const std::vector<Row>& rows,
                     const std::vector<int64_t>& tier_keys = {}) {
  const int64_t dram = rows.size();
  const int64_t n = dram + static_cast<int64_t>(tier_keys.size());
  const int64_t dim = ev->dim();
  const int64_t s = ev->slot_names().size();
  Tensor *keys, *values, *freqs, *versions, *names, *inits, *slots, *step;
  TF_RETURN_IF_ERROR(ctx->allocate_output(0, TensorShape({n}), &keys));
  TF_RETURN_IF_ERROR(
      ctx->allocate_output(1, TensorShape({n, dim}), &values));
  TF_RETURN_IF_ERROR(ctx->allocate_output(2, TensorShape({n}), &freqs));
  TF_RETURN_IF_ERROR(ctx->allocate_output(3, TensorShape({n}), &versions));
  TF_RETURN_IF_ERROR(ctx->allocate_output(4, TensorShape({s}), &names));
  TF_RETURN_IF_ERROR(ctx->allocate_output(5, TensorShape({s}), &inits));
  TF_RETURN_IF_ERROR(
      ctx->allocate_output(6, TensorShape({n, s * dim}), &slots));
  TF_RETURN_IF_ERROR(ctx->allocate_output(7, TensorShape({}), &step));
  auto k = keys->flat<int64_t>();
  auto f = freqs->flat<int64_t>();
  auto v = versions->flat<int64_t>();
  float* val = values->flat<float>().data();
  float* sl = slots->flat<float>().data();
  for (int64_t i = 0; i < s; ++i) {
    names->flat<tensorflow::tstring>()(i) = ev->slot_names()[i];
    inits->flat<float>()(i) = ev->slot_inits()[i];
  }
  TierRecord rec;
  for (int64_t i = dram; i < n; ++i) {
    TF_RETURN_IF_ERROR(ev->ReadTier(tier_keys[i - dram], &rec));
    k(i) = rec.key;
    f(i) = rec.freq;
    v(i) = rec.version;
    std::memcpy(val + i * dim, rec.row.data(), sizeof(float) * dim);
    std::memcpy(sl + i * s * dim, rec.slots.data(), sizeof(float) * s * dim);
  }
  for (int64_t i = 0; i < dram; ++i) {
    const int64_t r = rows[i];
    k(i) = ev->Key(r);
    f(i) = *ev->Freq(r);
    v(i) = *ev->Version(r);
    std::memcpy(val + i * dim, ev->Value(r), sizeof(float) * dim);
    for (int64_t j = 0; j < s; ++j) {
      std::memcpy(sl + (i * s + j) * dim, ev->Slot(j, r),
                  sizeof(float) * dim);
    }
  }
  step->scalar<int64_t>()() = ev->current_step();
  return Status();
}

GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingEVExport", "EVExport",
    .Input("handle: resource")
    .Output("keys: int64")
    .Output("values: float")
    .Output("freqs: int64")
    .Output("versions: int64")
    .Output("slot_names: string")
    .Output("slot_inits: float")
    .Output("slots: float")
    .Output("step: int64")
    .Attr("embedding_dim: int >= 1")
    .SetIsStateful()
    .SetShapeFn(SnapshotShapes));

class EVExportOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    RefCountPtr<EVStorage> ev;
    OP_REQUIRES_OK(ctx, GetEV(ctx, 0, &ev));
    // One lock for the whole snapshot: keys, values and slots agree.
    tensorflow::tf_shared_lock lock(*ev->mu());
    const std::vector<uint32_t> rows = ev->LiveRows();
    OP_REQUIRES_OK(ctx, WriteSnapshot(ctx, ev.get(), rows, ev->TierKeys()));
  }
};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingEVExport", "EVExport",
    EVExportOp);

// Incremental checkpoints (see "Change tracking" in ev_storage.h).
GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingEVExportChanges", "EVExportChanges",
    .Input("handle: resource")
    .Input("since: int64")
    .Output("keys: int64")
    .Output("values: float")
    .Output("freqs: int64")
    .Output("versions: int64")
    .Output("slot_names: string")
    .Output("slot_inits: float")
    .Output("slots: float")
    .Output("step: int64")
    .Output("removed: int64")
    .Output("covered: int64")
    .Attr("embedding_dim: int >= 1")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(SnapshotShapes(c));
      c->set_output(8, c->Vector(c->UnknownDim()));
      c->set_output(9, c->Scalar());
      return Status();
    }));

// Every live key (`since` == 0) or the keys written since the confirmed save
// `since` (GroupEmbeddingEVConfirmSave), as GroupEmbeddingEVExport lays them
// out, the keys evicted since, and this export's number (`covered`, to confirm
// once its files are durable). One lock: a write racing the export is marked
// for the next one.
class EVExportChangesOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    RefCountPtr<EVStorage> ev;
    OP_REQUIRES_OK(ctx, GetEV(ctx, 0, &ev));
    const Tensor& since_t = ctx->input(1);
    const std::string& var = ev->config().name;
    OP_REQUIRES_OK(ctx, CheckScalar(since_t, var + ": `since`"));
    const int64_t since = since_t.scalar<int64_t>()();
    // Exclusive: starting an export moves the marks.
    tensorflow::mutex_lock lock(*ev->mu());
    OP_REQUIRES(ctx, since == 0 || (since > 0 && since == ev->delta_base()),
                tensorflow::errors::FailedPrecondition(
                    var, ": no delta can be exported since save ", since,
                    " (the changes are tracked since ",
                    ev->delta_base() > 0
                        ? "save " + std::to_string(ev->delta_base())
                        : std::string("no save: a restore, a new optimizer "
                                      "slot or an eviction before "
                                      "incremental saves began came since"),
                    "); save in full."));
    const int64_t id = ev->StartExport();
    OP_REQUIRES_OK(ctx, since == 0
                            ? WriteSnapshot(ctx, ev.get(), ev->LiveRows(),
                                            ev->TierKeys())
                            : WriteSnapshot(ctx, ev.get(),
                                            ev->ExportedRows(),
                                            ev->ExportedTierKeys()));
    const std::vector<int64_t> removed =
        since == 0 ? std::vector<int64_t>() : ev->RemovedKeys();
    Tensor *gone, *covered;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            8, TensorShape({static_cast<int64_t>(
                                   removed.size())}), &gone));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(9, TensorShape({}), &covered));
    std::copy(removed.begin(), removed.end(), gone->flat<int64_t>().data());
    covered->scalar<int64_t>()() = id;
  }
};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingEVExportChanges", "EVExportChanges",
    EVExportChangesOp);

GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingEVDeltaBase", "EVDeltaBase",
    .Input("handle: resource")
    .Output("base: int64")
    .Attr("restored: bool = false")
    // With `restored`: the slots of the checkpoint just restored.
    .Attr("restored_slot_names: list(string) = []")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape));

// The confirmed save the next delta may extend (0: none). With
// `restored`, after a restore: the restored content becomes that base,
// unless the variable kept slots the checkpoint lacks (an import keeps
// them): a delta cannot add their columns to the keys it leaves out.
class EVDeltaBaseOp : public OpKernel {
 public:
  explicit EVDeltaBaseOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("restored", &restored_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("restored_slot_names", &names_));
  }
  void Compute(OpKernelContext* ctx) override {
    RefCountPtr<EVStorage> ev;
    OP_REQUIRES_OK(ctx, GetEV(ctx, 0, &ev));
    tensorflow::mutex_lock lock(*ev->mu());
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() =
        restored_ ? ev->MarkRestored(names_) : ev->delta_base();
  }

 private:
  bool restored_ = false;
  std::vector<std::string> names_;
};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingEVDeltaBase", "EVDeltaBase",
    EVDeltaBaseOp);

GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingEVConfirmSave", "EVConfirmSave",
    .Input("handle: resource")
    .Input("covered: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext*) { return Status(); }));

// The files of export `covered` are durable: the next delta extends it;
// the marks and evictions it wrote are dropped, so that they stay as
// small as one save interval's.
class EVConfirmSaveOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    RefCountPtr<EVStorage> ev;
    OP_REQUIRES_OK(ctx, GetEV(ctx, 0, &ev));
    const Tensor& covered = ctx->input(1);
    OP_REQUIRES_OK(ctx,
                   CheckScalar(covered, ev->config().name + ": `covered`"));
    tensorflow::mutex_lock lock(*ev->mu());
    ev->ConfirmSave(covered.scalar<int64_t>()());
  }
};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingEVConfirmSave", "EVConfirmSave",
    EVConfirmSaveOp);

GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingEVImport", "EVImport",
    .Input("handle: resource")
    .Input("keys: int64")
    .Input("values: float")
    .Input("freqs: int64")
    .Input("versions: int64")
    .Input("slot_names: string")
    .Input("slot_inits: float")
    .Input("slots: float")
    .Input("step: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      tensorflow::shape_inference::ShapeHandle unused;
      for (int i : {1, 3, 4, 5, 6}) {  // keys, freqs, versions, names, inits
        TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 1, &unused));
      }
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 2, &unused));  // values
      return c->WithRank(c->input(8), 0, &unused);               // step
    }));

class EVImportOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    RefCountPtr<EVStorage> ev;
    OP_REQUIRES_OK(ctx, GetEV(ctx, 0, &ev));
    const Tensor& keys = ctx->input(1);
    const Tensor& values = ctx->input(2);
    const Tensor& freqs = ctx->input(3);
    const Tensor& versions = ctx->input(4);
    const Tensor& names = ctx->input(5);
    const Tensor& inits = ctx->input(6);
    const Tensor& slots = ctx->input(7);
    const std::string& var = ev->config().name;
    const int64_t n = keys.NumElements();
    const int64_t dim = ev->dim();
    const int64_t s = names.NumElements();
    OP_REQUIRES(ctx, keys.dims() == 1 && freqs.dims() == 1 &&
                         versions.dims() == 1 && names.dims() == 1 &&
                         inits.dims() == 1,
                InvalidArgument(var, ": checkpoint keys, freqs, versions, "
                                "slot_names and slot_inits must be vectors, "
                                "got ", keys.shape().DebugString(), ", ",
                                freqs.shape().DebugString(), ", ",
                                versions.shape().DebugString(), ", ",
                                names.shape().DebugString(), ", ",
                                inits.shape().DebugString(), "."));
    OP_REQUIRES_OK(ctx, CheckScalar(ctx->input(8), var + ": checkpoint step"));
    OP_REQUIRES(ctx, values.dims() == 2 && values.dim_size(1) == dim,
                InvalidArgument(var, ": checkpoint values have shape ",
                                values.shape().DebugString(),
                                " but the variable has embedding_dim ", dim,
                                "."));
    OP_REQUIRES(ctx, values.dim_size(0) == n && freqs.NumElements() == n &&
                         versions.NumElements() == n &&
                         inits.NumElements() == s &&
                         slots.NumElements() == n * s * dim,
                InvalidArgument(var, ": inconsistent checkpoint: ", n,
                                " keys, values ",
                                values.shape().DebugString(), ", slots ",
                                slots.shape().DebugString()));
    tensorflow::mutex_lock lock(*ev->mu());
    ev->Clear();
    OP_REQUIRES_OK(ctx, ev->ClearTier());
    // With a tier, the rows go to DRAM and spill as the budget fills.
    if (!ev->has_tier()) ev->Reserve(n);
    std::vector<int> slot_index(s);
    for (int64_t j = 0; j < s; ++j) {
      const std::string name(names.flat<tensorflow::tstring>()(j));
      // The initial value travels with the slot, so keys inserted after a
      // restore (before the optimizer runs) start like uninterrupted ones.
      OP_REQUIRES_OK(ctx, ev->EnsureSlot(name, inits.flat<float>()(j),
                                         &slot_index[j]));
    }
    const float* val = values.flat<float>().data();
    const float* sl = slots.flat<float>().data();
    const auto k = keys.flat<int64_t>();
    const auto f = freqs.flat<int64_t>();
    const auto v = versions.flat<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = ev->FindOrInsert(k(i), val + i * dim, 1);
      OP_REQUIRES(ctx, r >= 0, ev->FullError());
      *ev->Freq(r) = std::max<int64_t>(f(i), 0);
      *ev->Version(r) = ClampStep(v(i));
      for (int64_t j = 0; j < s; ++j) {
        std::memcpy(ev->Slot(slot_index[j], r), sl + (i * s + j) * dim,
                    sizeof(float) * dim);
      }
      // Spill as we go: the checkpoint may not fit in the DRAM tier.
      if (ev->has_tier() && (i & 4095) == 4095) {
        OP_REQUIRES_OK(ctx, ev->SpillToBudget());
      }
    }
    if (ev->has_tier()) OP_REQUIRES_OK(ctx, ev->SpillToBudget());
    ev->AdvanceStep(ctx->input(8).scalar<int64_t>()());
  }
};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingEVImport", "EVImport",
    EVImportOp);

GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingEVEvict", "EVEvict",
    .Input("handle: resource")
    .Output("num_evicted: int64")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape));

class EVEvictOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    RefCountPtr<EVStorage> ev;
    OP_REQUIRES_OK(ctx, GetEV(ctx, 0, &ev));
    tensorflow::mutex_lock lock(*ev->mu());
    const EVConfig& cfg = ev->config();
    auto doomed_row = [&](int64_t version, const float* v) {
      if (cfg.steps_to_live > 0) {
        // Both are steps in [0, 2^63): the difference cannot overflow.
        return ev->current_step() - version > cfg.steps_to_live;
      } else if (cfg.l2_threshold >= 0.0f) {
        // DeepRec's rule: half the squared L2 norm below the threshold.
        double ss = 0.0;
        for (int64_t d = 0; d < ev->dim(); ++d) ss += double(v[d]) * v[d];
        return 0.5 * ss < cfg.l2_threshold;
      }
      return false;
    };
    std::vector<int64_t> doomed;
    for (uint32_t r : ev->LiveRows()) {
      if (doomed_row(*ev->Version(r), ev->Value(r))) {
        doomed.push_back(ev->Key(r));
      }
    }
    // The SSD tier's keys face the same rule.
    if (ev->has_tier() && (cfg.steps_to_live > 0 || cfg.l2_threshold >= 0)) {
      TierRecord rec;
      for (int64_t key : ev->TierKeys()) {
        OP_REQUIRES_OK(ctx, ev->ReadTier(key, &rec));
        if (doomed_row(rec.version, rec.row.data())) doomed.push_back(key);
      }
    }
    for (int64_t key : doomed) ev->Erase(key);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = doomed.size();
  }
};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingEVEvict", "EVEvict",
    EVEvictOp);

}  // namespace
}  // namespace ev
}  // namespace group_embedding

// Sparse optimizer updates of EmbeddingVariables, keyed by key: only the
// rows of the gradient's keys (and their slots) change; keys absent or not
// admitted by the filter are skipped, though a stored key not admitted yet
// still gets the step as its version (it was seen).

#include "ev_storage.h"
#include "ev_update_rules.h"
#include "id_map.h"
#include "pooling.h"
#include "op_registration.h"

namespace group_embedding {
namespace ev {
namespace {


// Shared skeleton of the updates: call `update(value row, gradient row,
// slot rows, dim)` once per distinct admitted key and stamp its version.
// Under the variable's lock:
//  1. every key is resolved to its row in parallel (reads only), with the
//     hash buckets and key rows prefetched ahead;
//  2. a bitmap over row indices (one bit per row, cheap even for big
//     tables) detects duplicate keys; gradients of the fused lookup are
//     already unique, so usually nothing is summed, else duplicates are
//     summed first (DuplicateSums) so that the update equals the dense one;
//  3. the rows are updated in parallel, with the value, slot and key rows
//     of a few keys ahead prefetched.
template <typename Update>
void ApplySparse(OpKernelContext* ctx, const std::vector<std::string>& slots,
                 int keys_input, Update update) {
  RefCountPtr<EVStorage> ev;
  OP_REQUIRES_OK(ctx, GetEV(ctx, 0, &ev));
  const Tensor& keys = ctx->input(keys_input);
  const Tensor& grad = ctx->input(keys_input + 1);
  const std::string& var = ev->config().name;
  OP_REQUIRES_OK(ctx, CheckScalar(ctx->input(keys_input + 2),
                                  "global_step"));
  const int64_t step = ctx->input(keys_input + 2).scalar<int64_t>()();
  const int64_t dim = ev->dim();
  OP_REQUIRES(ctx, keys.dims() == 1,
              InvalidArgument(var, ": keys must be a vector, got shape ",
                              keys.shape().DebugString(), "."));
  const int64_t n = keys.NumElements();
  OP_REQUIRES_OK(ctx, CheckMatrix(var + ": gradient", grad, n, dim));
  tensorflow::mutex_lock lock(*ev->mu());
  std::vector<int> idx;
  for (const auto& s : slots) {
    idx.push_back(ev->SlotIndex(s));
    OP_REQUIRES(ctx, idx.back() >= 0,
                InvalidArgument(var, ": optimizer slot '", s,
                                "' was not created; build the optimizer "
                                "first."));
  }
  ev->AdvanceStep(step);
  const int64_t* k = keys.flat<int64_t>().data();
  // Keys of the SSD tier come back to DRAM (ev_storage.h); right after
  // the lookup of the same keys DRAM is over its budget by at most them,
  // and that is no reason to spill (slack n).
  const bool tier = ev->has_tier();
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
  if (tier) OP_REQUIRES_OK(ctx, ev->SpillToBudget(/*slack=*/n, pool));
  const float* g = grad.flat<float>().data();

  // 1. Row of every key; -1 when absent or not admitted (no update).
  const int64_t version = ClampStep(step);
  const bool filtered = ev->config().filter_freq > 0;
  std::vector<int64_t> rows(n);
  std::vector<int64_t> unadmitted(filtered ? n : 0, -1);
  // With a tier: the keys without a DRAM row, which may be on disk.
  std::vector<uint8_t> absent(tier ? n : 0, 0);
  auto resolve_one = [&](int64_t j) {
    const int64_t r = ev->Find(k[j]);
    rows[j] = (r >= 0 && ev->Admitted(r)) ? r : -1;
    if (filtered && r >= 0 && rows[j] < 0) unadmitted[j] = r;
    if (tier) absent[j] = r < 0;
  };
  auto resolve = [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      if (j + 2 * kPrefetchDistance < end) {
        ev->PrefetchBucket(k[j + 2 * kPrefetchDistance]);
      }
      if (j + kPrefetchDistance < end) {
        ev->PrefetchKeyRow(k[j + kPrefetchDistance]);
      }
      resolve_one(j);
    }
  };
  tensorflow::Shard(pool->num_threads, pool->workers, n, 200, resolve);
  if (tier) {
    // Promoted after the DRAM pass, not before: after its lookup an
    // update's keys are all in DRAM, and a second probe of every key
    // (Promote's) cost as much as the update.
    std::vector<int64_t> away;
    for (int64_t j = 0; j < n; ++j) {
      if (absent[j]) away.push_back(k[j]);
    }
    if (!away.empty()) {
      OP_REQUIRES_OK(ctx, ev->PrepareTier(away.data(), away.size(),
                                          /*spill=*/false, nullptr, pool));
      for (int64_t j = 0; j < n; ++j) {
        if (absent[j]) resolve_one(j);
      }
    }
  }
  // Versions of keys seen but not admitted, serially: duplicates share a
  // row.
  for (int64_t j = 0; filtered && j < n; ++j) {
    if (unadmitted[j] < 0) continue;
    *ev->Version(unadmitted[j]) = version;
    ev->MarkChanged(unadmitted[j]);
  }

  // 2. Distinct rows and their (summed) gradients.
  std::vector<uint64_t> seen((ev->num_rows() + 63) / 64, 0);
  bool duplicates = false;
  for (int64_t j = 0; j < n && !duplicates; ++j) {
    if (rows[j] < 0) continue;
    uint64_t& word = seen[rows[j] >> 6];
    const uint64_t bit = uint64_t{1} << (rows[j] & 63);
    duplicates = (word & bit) != 0;
    word |= bit;
  }
  std::vector<int64_t> urows;
  std::vector<const float*> ugrads;
  std::unique_ptr<DuplicateSums> dedup;
  if (duplicates) {
    // Rows identify keys as well as keys do, and -1 collects the skipped.
    dedup.reset(new DuplicateSums(rows.data(), n, g, dim));
    for (int64_t u = 0; u < dedup->size(); ++u) {
      const int64_t r = rows[dedup->first(u)];
      if (r < 0) continue;
      urows.push_back(r);
      ugrads.push_back(dedup->grad(u));
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      if (rows[j] < 0) continue;
      urows.push_back(rows[j]);
      ugrads.push_back(g + j * dim);
    }
  }

  // 3. Updates, one distinct row per key: no write conflicts.
  const int64_t m = urows.size();
  auto work = [&](int64_t begin, int64_t end) {
    UpdateRows(ev.get(), urows.data(),
               [&ugrads](int64_t u) { return ugrads[u]; }, begin, end, idx,
               version, update);
  };
  tensorflow::Shard(pool->num_threads, pool->workers, m, dim * 30, work);
}

// Scalar hyperparameters of an update (inputs `first`, `first` + 1, ...).
Status ReadScalars(OpKernelContext* ctx, int first,
                   const std::vector<const char*>& names,
                   std::vector<float>* out) {
  for (size_t i = 0; i < names.size(); ++i) {
    const Tensor& t = ctx->input(first + i);
    TF_RETURN_IF_ERROR(CheckScalar(t, names[i]));
    out->push_back(t.scalar<float>()());
  }
  return Status();
}

// keys [n], grad [n, D], global_step and the hyperparameters scalars.
Status ApplyShapes(InferenceContext* c) {
  TF_RETURN_IF_ERROR(InputsWithRank(c, 1, 1, 1));
  TF_RETURN_IF_ERROR(InputsWithRank(c, 2, 1, 2));
  return InputsWithRank(c, 3, c->num_inputs() - 3, 0);
}

#define EV_APPLY_INPUTS          \
  Input("handle: resource")      \
      .Input("keys: int64")      \
      .Input("grad: float")      \
      .Input("global_step: int64")

GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingEVApplySGD", "EVApplySGD",
    .EV_APPLY_INPUTS.Input("lr: float")
    .SetShapeFn(ApplyShapes));

// The optimizers with two slots: their `slot_names` attr, refused with
// `needs` (which names the op and its slots) unless it has two.
class TwoSlotApplyKernel : public OpKernel {
 public:
  TwoSlotApplyKernel(OpKernelConstruction* ctx, const char* needs)
      : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("slot_names", &slots_));
    OP_REQUIRES(ctx, slots_.size() == 2, InvalidArgument(needs));
  }

 protected:
  std::vector<std::string> slots_;
};

class EVApplySGDOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    std::vector<float> h;
    OP_REQUIRES_OK(ctx, ReadScalars(ctx, 4, {"lr"}, &h));
    const float lr = h[0];
    ApplySparse(ctx, {}, 1, SgdUpdate{lr});
  }
};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingEVApplySGD", "EVApplySGD",
    EVApplySGDOp);

// AdagradUpdate (ev_update_rules.h).
GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingEVApplyAdagrad", "EVApplyAdagrad",
    .EV_APPLY_INPUTS.Input("lr: float")
    .Input("epsilon: float")
    .Attr("slot_name: string")
    .SetShapeFn(ApplyShapes));

class EVApplyAdagradOp : public OpKernel {
 public:
  explicit EVApplyAdagradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string s;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("slot_name", &s));
    slots_ = {s};
  }
  void Compute(OpKernelContext* ctx) override {
    std::vector<float> h;
    OP_REQUIRES_OK(ctx, ReadScalars(ctx, 4, {"lr", "epsilon"}, &h));
    const float lr = h[0];
    const float eps = h[1];
    ApplySparse(ctx, slots_, 1, AdagradUpdate{lr, eps});
  }

 private:
  std::vector<std::string> slots_;
};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingEVApplyAdagrad", "EVApplyAdagrad",
    EVApplyAdagradOp);

// DeepRec's AdagradDecay on the touched keys (slots: accumulator, decay
// power). `period` = (global_step + 1) // accumulator_decay_step; a key
// whose power is behind it first decays: accum = max(accum * rate,
// floor), power += 1; then accum += g^2; var -= lr * g / sqrt(accum).
// The power is a count kept in element 0 of a float slot row: exact up to
// 2^24 periods (with the default 100000-step period, 1.6e12 steps).
GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingEVApplyAdagradDecay", "EVApplyAdagradDecay",
    .EV_APPLY_INPUTS.Input("lr: float")
    .Input("decay_rate: float")
    .Input("floor: float")
    .Input("period: int64")
    .Attr("slot_names: list(string)")
    .SetShapeFn(ApplyShapes));

class EVApplyAdagradDecayOp : public TwoSlotApplyKernel {
 public:
  explicit EVApplyAdagradDecayOp(OpKernelConstruction* ctx)
      : TwoSlotApplyKernel(ctx, "EVApplyAdagradDecay needs 2 slots "
                                "(accumulator, decay power).") {}
  void Compute(OpKernelContext* ctx) override {
    std::vector<float> h;
    OP_REQUIRES_OK(ctx, ReadScalars(ctx, 4, {"lr", "decay_rate", "floor"},
                                    &h));
    OP_REQUIRES_OK(ctx, CheckScalar(ctx->input(7), "period"));
    const float lr = h[0];
    const float rate = h[1];
    const float floor = h[2];
    const double period = static_cast<double>(
        ctx->input(7).scalar<int64_t>()());
    ApplySparse(ctx, slots_, 1,
                [=](float* v, const float* g, float** s, int64_t dim) {
                  float* acc = s[0];
                  float* power = s[1];
                  const bool decay = period > power[0];
                  if (decay) power[0] += 1.0f;
                  for (int64_t d = 0; d < dim; ++d) {
                    if (decay) acc[d] = std::max(acc[d] * rate, floor);
                    acc[d] += g[d] * g[d];
                    v[d] -= lr * g[d] / std::sqrt(acc[d]);
                  }
                });
  }
};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingEVApplyAdagradDecay", "EVApplyAdagradDecay",
    EVApplyAdagradDecayOp);

// AdamUpdate (ev_update_rules.h): lazy Adam, alpha bias-corrected by the
// caller.
GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingEVApplyAdam", "EVApplyAdam",
    .EV_APPLY_INPUTS.Input("alpha: float")
    .Input("beta1: float")
    .Input("beta2: float")
    .Input("epsilon: float")
    .Attr("slot_names: list(string)")
    .SetShapeFn(ApplyShapes));

class EVApplyAdamOp : public TwoSlotApplyKernel {
 public:
  explicit EVApplyAdamOp(OpKernelConstruction* ctx)
      : TwoSlotApplyKernel(ctx, "EVApplyAdam needs 2 slots (m, v).") {}
  void Compute(OpKernelContext* ctx) override {
    std::vector<float> h;
    OP_REQUIRES_OK(ctx, ReadScalars(ctx, 4,
                                    {"alpha", "beta1", "beta2", "epsilon"},
                                    &h));
    const float alpha = h[0];
    const float b1 = h[1];
    const float b2 = h[2];
    const float eps = h[3];
    ApplySparse(ctx, slots_, 1, AdamUpdate{alpha, b1, b2, eps});
  }
};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingEVApplyAdam", "EVApplyAdam",
    EVApplyAdamOp);

// FtrlUpdate (ev_update_rules.h): TF's ApplyFtrlV2 on the touched rows
// (slots: accumulator, linear).
GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingEVApplyFtrl", "EVApplyFtrl",
    .EV_APPLY_INPUTS.Input("lr: float")
    .Input("l1: float")
    .Input("l2: float")
    .Input("l2_shrinkage: float")
    .Input("lr_power: float")
    .Attr("slot_names: list(string)")
    .SetShapeFn(ApplyShapes));

class EVApplyFtrlOp : public TwoSlotApplyKernel {
 public:
  explicit EVApplyFtrlOp(OpKernelConstruction* ctx)
      : TwoSlotApplyKernel(ctx, "EVApplyFtrl needs 2 slots.") {}
  void Compute(OpKernelContext* ctx) override {
    std::vector<float> h;
    OP_REQUIRES_OK(ctx, ReadScalars(
                            ctx, 4,
                            {"lr", "l1", "l2", "l2_shrinkage", "lr_power"},
                            &h));
    const float lr = h[0];
    const float l1 = h[1];
    const float l2 = h[2];
    const float shrink = h[3];
    const float power = h[4];
    ApplySparse(ctx, slots_, 1, FtrlUpdate{lr, l1, l2, shrink, power});
  }
};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingEVApplyFtrl", "EVApplyFtrl",
    EVApplyFtrlOp);

}  // namespace
}  // namespace ev
}  // namespace group_embedding

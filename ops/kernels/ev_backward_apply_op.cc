// GroupEmbeddingEVBackwardApply: the backward of a pooled lookup of
// EmbeddingVariables (GroupEmbeddingEVLookup) and its optimizer step as
// ONE op per group (issue 36.5), what ops/backward_apply.py builds in a
// traced step in place of the gradient op's IndexedSlices
// (GroupEmbeddingPooledLookupGrad) and one GroupEmbeddingEVApply* per
// variable. From the lookup's own inputs, per variable: its keys numbered
// by first occurrence and each distinct key's gradient summed by the one
// gradient loop (SumIdGrads, pooling.h: combiner scale and per-id
// weights, the same adds in the same order as the gradient op), then each
// distinct key resolved once and its row and slots updated in place with
// the update rules of the per-variable ops (ev_update_rules.h). So the
// rows, slots and versions equal those of the unfused path bitwise, with
// no gradient written out and no second pass over the keys.
//
// Semantics kept from ApplySparse (ev_apply_ops.cc): absent keys and keys
// the CounterFilter has not admitted are not updated, but a stored key
// not admitted still gets the step as its version; an SSD tier brings the
// batch's keys back to DRAM first (no spill of the lookup's own rows).
//
// Two phases, every lock taken before either (ev_group_locks.h):
//  A. per distinct variable, largest first (RunUneven): dedup + sums;
//  B. resolve and update each distinct key: in the same work item as A
//     when the group has a variable per thread or more (its sums still
//     in cache), else sharded over the distinct keys of all variables.
// B's work items write distinct rows (distinct keys of one variable).

#include <cstdint>
#include <string>
#include <vector>

#include "ev_group_locks.h"
#include "ev_storage.h"
#include "ev_update_rules.h"
#include "id_map.h"
#include "op_registration.h"
#include "pooling.h"
#include "work_queue.h"

namespace group_embedding {
namespace ev {
namespace {

// The `hyper` input (ops/backward_apply.py's `hyper()`): [lr, epsilon,
// beta_1, beta_2, l1, l2, l2_shrinkage, lr_power].
constexpr int64_t kHyper = 8;

REGISTER_OP("GroupEmbeddingEVBackwardApply")
    // The group's variables, in the lookup's order, updated in place.
    .Input("handles: num_tables * resource")
    // The gradient of each pooled output, [B_t, D].
    .Input("grads: num_tables * float")
    // The lookup's keys, row splits and weights (empty: unweighted).
    .Input("keys: num_tables * int64")
    .Input("row_splits: num_tables * int64")
    .Input("weights: num_tables * float")
    // The step stamped as each updated key's version.
    .Input("global_step: int64")
    // kHyper floats; lr is Adam's bias-corrected step size alpha.
    .Input("hyper: float")
    .Attr("num_tables: int >= 1")
    .Attr("combiners: list(string)")
    .Attr("embedding_dim: int >= 1")
    .Attr("optimizer: {'sgd', 'adagrad', 'adam', 'ftrl'}")
    // The optimizer's slots in every variable: Adagrad, its accumulator;
    // Adam, m and v; FTRL, accumulator and linear; SGD, none.
    .Attr("slot_names: list(string)")
    .SetShapeFn([](InferenceContext* c) {
      int n;
      TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &n));
      TF_RETURN_IF_ERROR(InputsWithRank(c, n, n, 2));      // grads
      TF_RETURN_IF_ERROR(InputsWithRank(c, 2 * n, 3 * n, 1));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 5 * n, 1, 0));  // global_step
      return InputsWithRank(c, 5 * n + 1, 1, 1);           // hyper
    });

// One distinct variable of the group: its tables, then (phase A) its
// distinct keys and their summed gradients, [keys.size(), dim].
struct Member {
  EVStorage* ev = nullptr;
  std::vector<int> tables;
  int64_t nnz = 0;
  std::vector<int> slots;
  std::vector<int64_t> keys;
  std::vector<float> sums;
};

class EVBackwardApplyOp : public OpKernel {
 public:
  explicit EVBackwardApplyOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ParseCombiners(ctx, &combiners_));
    int k = 0;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_tables", &k));
    // Compute() reads the handles by the combiners' count.
    OP_REQUIRES(ctx, static_cast<int>(combiners_.size()) == k,
                InvalidArgument("combiners must have ", k, " entries, got ",
                                combiners_.size(), "."));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("embedding_dim", &dim_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("optimizer", &optimizer_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("slot_names", &slot_names_));
    const size_t need = optimizer_ == "sgd" ? 0
                        : optimizer_ == "adagrad" ? 1 : 2;
    OP_REQUIRES(ctx, slot_names_.size() == need,
                InvalidArgument("GroupEmbeddingEVBackwardApply: optimizer '",
                                optimizer_, "' needs ", need,
                                " slot names, got ", slot_names_.size(), "."));
  }

  void Compute(OpKernelContext* ctx) override {
    const int k = static_cast<int>(combiners_.size());
    std::vector<RefCountPtr<EVStorage>> refs(k);
    std::vector<EVStorage*> evs(k);
    for (int t = 0; t < k; ++t) {
      OP_REQUIRES_OK(ctx, GetEV(ctx, t, &refs[t]));
      evs[t] = refs[t].get();
      OP_REQUIRES(ctx, evs[t]->dim() == dim_,
                  InvalidArgument(evs[t]->config().name, ": has dim ",
                                  evs[t]->dim(), " but the group has dim ",
                                  dim_, "."));
    }
    auto name_of = [&evs](int t) { return evs[t]->config().name; };
    RaggedGroup in;
    OP_REQUIRES_OK(ctx, ReadRaggedGroup(ctx, "keys", kWithWeights, dim_,
                                        name_of, &in));
    OpInputList grads;
    OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
    for (int t = 0; t < k; ++t) {
      OP_REQUIRES_OK(ctx, CheckMatrix(name_of(t) + ": grads", grads[t],
                                      in.batch(t), dim_));
    }
    const Tensor& step_t = ctx->input(5 * k);
    OP_REQUIRES_OK(ctx, CheckScalar(step_t, "global_step"));
    const int64_t step = step_t.scalar<int64_t>()();
    const Tensor& hyper_t = ctx->input(5 * k + 1);
    OP_REQUIRES(ctx, hyper_t.dims() == 1 && hyper_t.NumElements() == kHyper,
                InvalidArgument("hyper must be a vector of ", kHyper,
                                " floats, got shape ",
                                hyper_t.shape().DebugString(), "."));
    const float* h = hyper_t.flat<float>().data();

    // The distinct variables (one may serve several tables).
    std::vector<Member> members;
    for (int t = 0; t < k; ++t) {
      size_t m = 0;
      while (m < members.size() && members[m].ev != evs[t]) ++m;
      if (m == members.size()) {
        members.emplace_back();
        members[m].ev = evs[t];
      }
      members[m].tables.push_back(t);
      members[m].nnz += in.nnz(t);
    }

    EVGroupLocks locks(evs, /*exclusive=*/true);
    for (Member& m : members) {
      for (const std::string& s : slot_names_) {
        m.slots.push_back(m.ev->SlotIndex(s));
        OP_REQUIRES(ctx, m.slots.back() >= 0,
                    InvalidArgument(m.ev->config().name,
                                    ": optimizer slot '", s,
                                    "' was not created; build the "
                                    "optimizer first."));
      }
      m.ev->AdvanceStep(step);
      if (!m.ev->has_tier()) continue;
      // As the per-variable update: no spill of the lookup's own rows
      // (slack: its keys), then the keys found on disk back to DRAM.
      auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
      OP_REQUIRES_OK(ctx, m.ev->SpillToBudget(/*slack=*/m.nnz, pool));
      for (int t : m.tables) {
        OP_REQUIRES_OK(ctx, m.ev->PrepareTier(
                                in.ids[t].flat<int64_t>().data(), in.nnz(t),
                                /*spill=*/false, nullptr, pool));
      }
    }

    std::vector<int64_t> costs;
    for (const Member& m : members) costs.push_back(m.nnz * (dim_ + 8));
    const int64_t version = ClampStep(step);
    const int threads =
        ctx->device()->tensorflow_cpu_worker_threads()->num_threads;
    auto run = [&](auto rule) {
      if (static_cast<int>(members.size()) >= threads) {
        // Enough variables to keep every thread busy: each work item
        // does both phases for its variable, whose sums are still in
        // cache for the update.
        RunUneven(ctx, costs, [&](int64_t i) {
          SumGradients(in, grads, &members[i]);
          Apply(&members[i], 0, members[i].keys.size(), version, rule);
        });
        return;
      }
      // A. Distinct keys and summed gradients, per variable.
      RunUneven(ctx, costs, [&](int64_t i) {
        SumGradients(in, grads, &members[i]);
      });
      // B. Every distinct key of every variable resolved and updated,
      // sharded.
      std::vector<int64_t> first(members.size() + 1, 0);
      for (size_t i = 0; i < members.size(); ++i) {
        first[i + 1] = first[i] + members[i].keys.size();
      }
      ShardExamples(ctx, first, dim_ * 30 + 60,
                    [&](int i, int64_t u0, int64_t u1) {
                      Apply(&members[i], u0, u1, version, rule);
                    });
    };
    if (optimizer_ == "sgd") {
      run(SgdUpdate{h[0]});
    } else if (optimizer_ == "adagrad") {
      run(AdagradUpdate{h[0], h[1]});
    } else if (optimizer_ == "adam") {
      run(AdamUpdate{h[0], h[2], h[3], h[1]});
    } else {
      run(FtrlUpdate{h[0], h[4], h[5], h[6], h[7]});
    }
  }

 private:
  // Phase A for one variable: its distinct keys and their gradients,
  // summed as GroupEmbeddingPooledLookupGrad sums them per table. A
  // variable of several tables then sums its tables' rows per key in
  // table order, as the per-variable update sums the concatenated
  // slices of its gradients (DuplicateSums).
  void SumGradients(const RaggedGroup& in, const OpInputList& grads,
                    Member* m) const {
    std::vector<int64_t> slot;
    auto table_sums = [&](int t, std::vector<int64_t>* keys,
                          std::vector<float>* sums) {
      const int64_t* ids = in.ids[t].flat<int64_t>().data();
      *keys = NumberIds(ids, in.nnz(t), &slot);
      sums->resize(keys->size() * dim_);
      SumIdGrads(MakeGradTable(PooledGrads{grads[t].flat<float>().data(),
                                           dim_},
                               in.splits[t], in.weights[t], in.nnz(t),
                               combiners_[t]),
                 slot.data(), keys->size(), dim_, sums->data());
    };
    if (m->tables.size() == 1) {
      table_sums(m->tables[0], &m->keys, &m->sums);
      return;
    }
    std::vector<int64_t> all_keys;
    std::vector<float> all_sums;
    for (int t : m->tables) {
      std::vector<int64_t> keys;
      std::vector<float> sums;
      table_sums(t, &keys, &sums);
      all_keys.insert(all_keys.end(), keys.begin(), keys.end());
      all_sums.insert(all_sums.end(), sums.begin(), sums.end());
    }
    const DuplicateSums dedup(all_keys.data(), all_keys.size(),
                              all_sums.data(), dim_);
    m->keys.resize(dedup.size());
    m->sums.resize(dedup.size() * dim_);
    for (int64_t u = 0; u < dedup.size(); ++u) {
      m->keys[u] = all_keys[dedup.first(u)];
      std::copy(dedup.grad(u), dedup.grad(u) + dim_,
                m->sums.data() + u * dim_);
    }
  }

  // Phase B for distinct keys [u0, u1) of one variable: each resolved
  // (hash buckets and key rows prefetched ahead), then the admitted ones
  // updated (UpdateRows) and the stored ones not admitted stamped.
  template <typename Update>
  void Apply(Member* m, int64_t u0, int64_t u1, int64_t version,
             const Update& rule) const {
    EVStorage* ev = m->ev;
    const int64_t* key = m->keys.data();
    std::vector<int64_t> rows;
    std::vector<int64_t> at;  // the distinct key of each row
    rows.reserve(u1 - u0);
    at.reserve(u1 - u0);
    for (int64_t u = u0; u < u1; ++u) {
      if (u + 2 * kPrefetchDistance < u1) {
        ev->PrefetchBucket(key[u + 2 * kPrefetchDistance]);
      }
      if (u + kPrefetchDistance < u1) {
        ev->PrefetchKeyRow(key[u + kPrefetchDistance]);
      }
      const int64_t r = ev->Find(key[u]);
      if (r < 0) continue;
      if (ev->Admitted(r)) {
        rows.push_back(r);
        at.push_back(u);
      } else {
        *ev->Version(r) = version;
        ev->MarkChanged(r);
      }
    }
    const float* sums = m->sums.data();
    const int64_t dim = dim_;
    UpdateRows(ev, rows.data(),
               [&](int64_t i) { return sums + at[i] * dim; }, 0,
               static_cast<int64_t>(rows.size()), m->slots, version, rule);
  }

  std::vector<Combiner> combiners_;
  int64_t dim_;
  std::string optimizer_;
  std::vector<std::string> slot_names_;
};

REGISTER_KERNEL_BUILDER(
    Name("GroupEmbeddingEVBackwardApply").Device(::tensorflow::DEVICE_CPU),
    EVBackwardApplyOp);

}  // namespace
}  // namespace ev
}  // namespace group_embedding

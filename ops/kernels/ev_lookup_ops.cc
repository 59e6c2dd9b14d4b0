// Fused pooled lookup of a group of same-dim EmbeddingVariables: the EV
// analogue of GroupEmbeddingPooledLookup (lookup_ops.cc), which
// pools straight into [B, D] outputs instead of gathering [nnz, D] rows.
//
// Why two phases: inserting keys mutates a variable's hash map, which
// threads cannot share, while pooling only reads rows. So the op first
// resolves every key to the row it reads (on all intra-op threads: see
// ResolvedGroup), then pools in parallel over batch rows.
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
#include "work_queue.h"

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

// What the keys of a group read: key j reads its value if stored and
// admitted, else `no_permission` (a row of the filter's constant) or, for
// unknown keys outside training, its default row. With `training`, new keys
// are inserted (a CBFFilter inserts a key only once admitted), every
// occurrence is counted and every stored key is stamped with the current
// step (its version: the last step it was seen, admitted or not). As in
// DeepRec, a lookup reads what the key had BEFORE this batch counted it:
// under CounterFilter(N) a key reads `no_permission` for its first N
// lookups, its row from lookup N + 1 on, and all occurrences of a key in the
// batch read the same row. Only inserting fails (the table is full).
//
// Three functions, so that one variable's keys resolve on several threads
// (ResolvedGroup): ReadKeys (no training; any split of the keys), then for
// training CountStoredKeys (the keys already stored; threads split the keys
// by hash, so all occurrences of a key, whose counts and version they
// update, belong to one thread) and InsertMissingKeys (the others, on one
// thread per variable: inserting moves the hash map).
//
// `known` (variables with an SSD tier, else null): key j's DRAM row as the
// tier's promotion pass found it (-1: not found then, look again), so that
// such a key costs one probe, not two. Those rows stay put until the op
// ends (promotions and inserts only add rows).

// Where ReadKeys puts what key j reads: a pointer to the row (the pooled
// lookups pool from it later), or
struct RowPointers {
  static constexpr bool kCopies = false;
  const float** out;
  void Put(int64_t j, const float* row) const { out[j] = row; }
};
// a copy of it (GroupEmbeddingEVGather outside training: copied while
// the row is in cache, one pass over the keys instead of two).
struct RowCopies {
  static constexpr bool kCopies = true;
  float* out;
  int64_t dim;
  void Put(int64_t j, const float* row) const {
    std::memcpy(out + j * dim, row, sizeof(float) * dim);
  }
};

// Reads only (the shared lock suffices): keys [0, n), into `sink`.
template <typename Sink>
void ReadKeys(EVStorage* ev, const int64_t* key, int64_t n,
              const Tensor& defaults, const float* no_permission,
              const int64_t* known, Sink sink) {
  const float* dflt = defaults.flat<float>().data();
  const int64_t drows = defaults.dim_size(0);
  const int64_t dim = ev->dim();
  const bool filtered = ev->config().filter_freq > 0;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t far = j + 2 * kPrefetchDistance;
    const int64_t near = j + kPrefetchDistance;
    if (far < n && (known == nullptr || known[far] < 0)) {
      ev->PrefetchBucketHashed(EVStorage::Hash(key[far]));
    }
    if (near < n) {
      int64_t r = known != nullptr ? known[near] : -1;
      if (r < 0) r = ev->PrefetchKeyRowHashed(EVStorage::Hash(key[near]));
      if (Sink::kCopies && r >= 0) PrefetchRow(ev->Value(r), dim);
    }
    int64_t r = known != nullptr ? known[j] : -1;
    if (r < 0) r = ev->Find(key[j]);
    if (r >= 0 && ev->Admitted(r)) {
      sink.Put(j, ev->Value(r));
    } else if (filtered) {
      sink.Put(j, no_permission);
    } else {
      sink.Put(j, DefaultRowOf(key[j], dflt, drows, dim));
    }
  }
}

// Which of `parts` threads counts a key: high hash bits, independent of
// the bucket (low bits).
inline int PartOf(uint64_t hash, int parts) {
  return static_cast<int>((hash >> 40) % static_cast<uint64_t>(parts));
}

// Training, the keys [0, n) of part `part` of `parts` (PartOf) that are
// stored: sets what they read, counts them and stamps their version. Appends
// the others' positions to `missing`, in order. Under the exclusive lock,
// with the other parts on other threads and no insert meanwhile.
void CountStoredKeys(EVStorage* ev, const int64_t* key, int64_t n, int part,
                     int parts, const float* no_permission,
                     const int64_t* known, const float** out,
                     std::vector<int64_t>* missing) {
  // This part's hashes (mixed once for all passes) and, when split, the
  // positions they are of (else all keys: position i).
  std::vector<int64_t> pos;
  std::vector<uint64_t> hash;
  hash.reserve(parts == 1 ? n : n / parts + n / 8);
  for (int64_t j = 0; j < n; ++j) {
    const uint64_t h = EVStorage::Hash(key[j]);
    if (parts == 1) {
      hash.push_back(h);
    } else if (PartOf(h, parts) == part) {
      pos.push_back(j);
      hash.push_back(h);
    }
  }
  const int64_t m = static_cast<int64_t>(hash.size());
  auto at = [&](int64_t i) { return parts == 1 ? i : pos[i]; };
  auto is_known = [&](int64_t i) {
    return known != nullptr && known[at(i)] >= 0;
  };
  auto find = [&](int64_t i) {
    const int64_t far = i + 2 * kPrefetchDistance;
    const int64_t near = i + kPrefetchDistance;
    if (far < m && !is_known(far)) ev->PrefetchBucketHashed(hash[far]);
    if (near < m) {
      // A known key's row needs no probe, but its freq and version
      // (counted below) are as scattered as the probe's lines.
      if (is_known(near)) {
        __builtin_prefetch(ev->Meta(known[at(near)]), 1);
      } else {
        ev->PrefetchKeyRowHashed(hash[near]);
      }
    }
    // A key the promotion pass did not find may be stored all the same
    // (promoted, or inserted by an earlier table of the variable).
    return is_known(i) ? known[at(i)] : ev->FindHashed(key[at(i)], hash[i]);
  };
  const bool filtered = ev->config().filter_freq > 0;
  if (filtered) {
    // What each key reads is fixed before any is counted. Rows never
    // move, so these pointers survive the inserts that follow.
    for (int64_t i = 0; i < m; ++i) {
      const int64_t r = find(i);
      out[at(i)] = (r >= 0 && ev->Admitted(r)) ? ev->Value(r)
                                                : no_permission;
    }
  }
  for (int64_t i = 0; i < m; ++i) {
    const int64_t r = find(i);
    if (r < 0) {
      missing->push_back(at(i));
      continue;
    }
    CountOccurrence(ev->Freq(r));
    // Alone on the variable: the plain change mark.
    if (parts == 1) {
      ev->Touch(r);
    } else {
      ev->TouchShared(r);
    }
    if (!filtered) out[at(i)] = ev->Value(r);
  }
}

// Training, the keys at `positions` (increasing) that CountStoredKeys found
// missing: inserts them (a CBFFilter counts them in its Bloom filter and
// inserts them once admitted), counts and stamps them. One thread per
// variable, under its exclusive lock.
Status InsertMissingKeys(EVStorage* ev, const int64_t* key,
                         const std::vector<int64_t>& positions,
                         const Tensor& defaults, const float** out) {
  const float* dflt = defaults.flat<float>().data();
  const int64_t drows = defaults.dim_size(0);
  const bool filtered = ev->config().filter_freq > 0;
  const bool cbf = ev->has_cbf();
  const size_t n = positions.size();
  for (size_t i = 0; i < n; ++i) {
    // New keys: their buckets, probe rows and fresh rows are all cache
    // misses; loaded a few keys ahead.
    if (i + 16 < n) ev->PrefetchBucket(key[positions[i + 16]]);
    if (i + 8 < n) {
      ev->PrefetchKeyRow(key[positions[i + 8]]);
      ev->PrefetchFreeRow(8);
    }
    const int64_t j = positions[i];
    int64_t r;
    if (cbf) {
      // An earlier occurrence in the batch may have inserted it; if not,
      // it is counted in the Bloom filter and stored once admitted.
      r = ev->Find(key[j]);
      if (r < 0) {
        const int64_t count = ev->CountUnstored(key[j]);
        if (count < ev->config().filter_freq) continue;
        r = ev->FindOrInsert(key[j], dflt, drows);
        if (r < 0) return ev->FullError();
        *ev->Freq(r) = count;
        ev->Touch(r);
        continue;  // filtered: it reads what CountStoredKeys set
      }
    } else {
      // Finds the key an earlier occurrence inserted, else inserts it.
      r = ev->FindOrInsert(key[j], dflt, drows);
      if (r < 0) return ev->FullError();
    }
    CountOccurrence(ev->Freq(r));
    ev->Touch(r);
    if (!filtered) out[j] = ev->Value(r);
  }
  return Status();
}

// Keys per thread below which a variable's keys are not split: splitting
// costs every extra thread a pass over all the keys (training) or a
// hand-off.
constexpr int64_t kKeysPerPart = 4096;
// Rough cost of resolving one key, in RunUneven's unit (ns).
constexpr int64_t kKeyCost = 40;

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
      : dim_(dim), offset_(keys.size() + 1, 0),
        no_permission_(keys.size()) {
    for (int t = 0; t < keys.size(); ++t) {
      offset_[t + 1] = offset_[t] + keys[t].NumElements();
      no_permission_[t].assign(dim, evs[t]->config().no_permission);
    }
  }

  // How many keys the group has.
  int64_t total() const { return offset_.back(); }
  const float* const* rows(int t) const { return rows_.data() + offset_[t]; }

  // Locks the variables (exclusive when training, which inserts, or when
  // one has an SSD tier, whose promotions move rows), brings the tiers'
  // rows of the keys into DRAM, then resolves every key (see ReadKeys) in
  // parallel: the keys of each variable are split into parts, one work
  // item each (RunUneven), and when training, the keys missing go to one
  // work item per variable afterwards, in table order (an insert moves
  // the variable's hash map). With `copy_to` ([total(), dim]) and no
  // training, the rows are copied there as they are found, and rows()
  // stays empty.
  Status Resolve(OpKernelContext* ctx, const std::vector<EVStorage*>& evs,
                 const OpInputList& keys, const OpInputList& defaults,
                 bool training, float* copy_to = nullptr) {
    locks_.emplace(evs, training);
    const bool copy = copy_to != nullptr && !training;
    if (!copy) rows_.resize(total());
    const std::vector<EVStorage*>& distinct = locks_->distinct();
    const int k = evs.size();
    const int64_t n = distinct.size();
    // SSD tiers first, a variable at a time (its promotion probes and
    // reads on the pool), before any row is taken: the batch's keys get
    // DRAM rows, which stay until the next op on the variable
    // (see ev_storage.h). One spill per variable, then its tables' keys,
    // so that no promoted row of one table is spilled for another.
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
    std::vector<int64_t> known;
    for (EVStorage* ev : distinct) {
      if (!ev->has_tier()) continue;
      if (known.empty()) known.assign(total(), -1);
      TF_RETURN_IF_ERROR(ev->SpillToBudget(0, pool));
      for (int t = 0; t < k; ++t) {
        if (evs[t] != ev) continue;
        TF_RETURN_IF_ERROR(ev->PrepareTier(keys[t].flat<int64_t>().data(),
                                           keys[t].NumElements(),
                                           /*spill=*/false,
                                           known.data() + offset_[t],
                                           pool));
      }
    }
    auto known_of = [&](int t) -> const int64_t* {
      return evs[t]->has_tier() ? known.data() + offset_[t] : nullptr;
    };
    // Each table's distinct variable, and each variable's key count.
    std::vector<int64_t> owner(k), ev_keys(n, 0);
    std::vector<int> ev_tables(n, 0);
    for (int t = 0; t < k; ++t) {
      owner[t] = std::lower_bound(distinct.begin(), distinct.end(), evs[t]) -
                 distinct.begin();
      ev_keys[owner[t]] += keys[t].NumElements();
      ++ev_tables[owner[t]];
    }
    // Work items: (variable, part, parts). Reads split a variable's keys
    // into ranges, up to twice the threads (finer items balance better);
    // counting splits them by hash, at most one part per thread (each
    // part passes over all the variable's keys).
    const int64_t threads = std::max(
        1, ctx->device()->tensorflow_cpu_worker_threads()->num_threads);
    struct Item {
      int64_t ev;
      int part;
      int parts;
    };
    std::vector<Item> items;
    std::vector<int64_t> costs;
    const int64_t dim = dim_;
    for (int64_t e = 0; e < n; ++e) {
      int parts = static_cast<int>(std::min(
          (training ? 1 : 2) * threads,
          std::max<int64_t>(1, ev_keys[e] / kKeysPerPart)));
      // Counting threads that share a variable write neighbouring rows
      // (false sharing): only worth it when the variables alone cannot
      // keep the threads busy.
      if (training && n >= 2 * threads) parts = 1;
      // A filter reads counts that an earlier table of the group may have
      // raised for a key inserted since: such a variable resolves table
      // after table on one thread, inserting as it goes.
      if (training && ev_tables[e] > 1 &&
          distinct[e]->config().filter_freq > 0) {
        parts = 1;
      }
      const int64_t per_key = kKeyCost + (copy ? dim / 4 : 0);
      for (int p = 0; p < parts; ++p) {
        items.push_back({e, p, parts});
        costs.push_back(ev_keys[e] / parts * per_key +
                        (training ? ev_keys[e] : 0));
      }
    }
    std::vector<std::vector<int64_t>> missing(training ? items.size() : 0);
    std::vector<Status> item_status(items.size());  // one writer per entry
    RunUneven(ctx, costs, [&](int64_t i) {
      const Item& it = items[i];
      for (int t = 0; t < k; ++t) {
        if (owner[t] != it.ev) continue;
        const int64_t* key = keys[t].flat<int64_t>().data();
        const int64_t nt = keys[t].NumElements();
        const int64_t* kn = known_of(t);
        if (!training) {
          // Ranges of each of the variable's tables: [begin, end).
          const int64_t begin = nt * it.part / it.parts;
          const int64_t end = nt * (it.part + 1) / it.parts;
          const int64_t* kb = kn == nullptr ? nullptr : kn + begin;
          if (copy) {
            ReadKeys(evs[t], key + begin, end - begin, defaults[t],
                     no_permission_[t].data(), kb,
                     RowCopies{copy_to + (offset_[t] + begin) * dim, dim});
          } else {
            ReadKeys(evs[t], key + begin, end - begin, defaults[t],
                     no_permission_[t].data(), kb,
                     RowPointers{rows_.data() + offset_[t] + begin});
          }
          continue;
        }
        const float** out = rows_.data() + offset_[t];
        const size_t first = missing[i].size();
        CountStoredKeys(evs[t], key, nt, it.part, it.parts,
                        no_permission_[t].data(), kn, out, &missing[i]);
        if (it.parts == 1) {
          // The whole variable is this item's: insert right away, so
          // that its next table finds (and counts) them.
          if (item_status[i].ok()) {
            item_status[i] = InsertMissingKeys(evs[t], key, missing[i],
                                               defaults[t], out);
          }
          missing[i].clear();
          continue;
        }
        // Positions in the group (table order), as the inserts below
        // take them back.
        for (size_t m = first; m < missing[i].size(); ++m) {
          missing[i][m] += offset_[t];
        }
      }
    });
    for (const Status& st : item_status) TF_RETURN_IF_ERROR(st);
    if (!training) return Status();
    // Per variable, its missing keys in group order: table by table, and
    // within a table in key order, as one thread would have met them.
    std::vector<std::vector<int64_t>> ev_missing(n);
    for (size_t i = 0; i < items.size(); ++i) {
      auto& dst = ev_missing[items[i].ev];
      dst.insert(dst.end(), missing[i].begin(), missing[i].end());
    }
    std::vector<int64_t> insert_costs(n);
    for (int64_t e = 0; e < n; ++e) {
      std::sort(ev_missing[e].begin(), ev_missing[e].end());
      insert_costs[e] = static_cast<int64_t>(ev_missing[e].size()) *
                        kKeyCost * 4;
    }
    std::vector<Status> status(n);  // one writer per entry
    RunUneven(ctx, insert_costs, [&](int64_t e) {
      const std::vector<int64_t>& pos = ev_missing[e];
      size_t i = 0;
      std::vector<int64_t> local;
      for (int t = 0; t < k && status[e].ok(); ++t) {
        // This table's share of the variable's sorted positions.
        local.clear();
        while (i < pos.size() && pos[i] < offset_[t + 1]) {
          local.push_back(pos[i++] - offset_[t]);
        }
        if (local.empty()) continue;
        status[e] = InsertMissingKeys(evs[t], keys[t].flat<int64_t>().data(),
                                      local, defaults[t],
                                      rows_.data() + offset_[t]);
      }
    });
    for (const Status& st : status) TF_RETURN_IF_ERROR(st);
    return Status();
  }

 private:
  int64_t dim_;
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
    // Every key has a row (ReadKeys): no id is refused, no clipping.
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
      std::vector<int64_t> known;  // the promotion's rows (see ReadKeys)
      auto resolve = [&]() {
        ReadKeys(ev, ids, nnz, in.defaults[t], no_permission.data(),
                 known.empty() ? nullptr : known.data(),
                 RowPointers{rows.data()});
        WeightGrad(t, in, grads[t], pooled[t], rows, o->flat<float>().data());
      };
      if (ev->has_tier()) {
        // Rows of the SSD tier come back to DRAM first (exclusive); no
        // spill of the forward pass's rows (slack nnz, as the update's).
        tensorflow::mutex_lock lock(*ev->mu());
        OP_REQUIRES_OK(ctx, ev->SpillToBudget(/*slack=*/nnz));
        known.assign(nnz, -1);
        OP_REQUIRES_OK(ctx, ev->PrepareTier(ids, nnz, /*spill=*/false,
                                            known.data()));
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
// Rows are those GroupEmbeddingEVLookup pools (same ResolvedGroup); outside
// training each is copied where its key is found, on all threads.
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
                                         training, dst));
    // Training: what each key reads is fixed before the batch counts it
    // (see ReadKeys), so the copy comes after. Copy while the locks still
    // pin the rows (no lock in the work items).
    if (!training) return;
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

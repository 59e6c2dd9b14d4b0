// CPU kernels of the collective (model-parallel) lookup; the Python side is
// ops/collective_routing.py and group_embedding/distributed/
// collective_lookup.py.
//
// One step of a group of sharded tables, per worker (op names without
// their GroupEmbedding prefix):
//   CollectiveRouteIds     dedups the ids of every table in one pass and
//                          buckets the unique ids by owner worker into ONE
//                          int64 send buffer (per owner: K counts, then the
//                          local rows, table by table). It also returns, per
//                          id, where its row will sit in the rows buffer that
//                          comes back, so that neither the forward pooling
//                          nor the backward dedups again.
//   (alltoall of ids)
//   CollectiveOwnerGather  the owner copies the asked rows of its shards into
//                          one flat float buffer, source worker by source.
//   (alltoall of rows)
//   CollectivePool         pools each feature's rows straight from that
//                          buffer into [B, D] (no [nnz, D] tensor).
// Backward: GroupEmbeddingCollectivePoolGrad sums the pooled gradients into one
// gradient per unique row (the returned buffer's layout), the alltoall gradient
// sends them to the owners, and GroupEmbeddingCollectiveOwnerGatherGrad turns
// them into per-shard (unique local row, summed gradient) pairs for the sparse
// optimizer.
//
// Why C++: the pure-TF routing (per-table unique, argsort, dynamic_partition,
// stitch, forward and again backward) cost more than the whole single-process
// step. Buffers hold rows of several dims, so offsets are in floats.
//
// Locking: GroupEmbeddingCollectiveOwnerGather takes shared locks on the shards
// (address order) before handing work to the intra-op pool; work items never
// lock.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"
#include "id_map.h"
#include "pooling.h"
#include "table_access.h"
#include "weight_grad.h"
#include "op_registration.h"

namespace group_embedding {
namespace collective {
namespace {

// Horovod takes int32 splits: no segment of a buffer may exceed this.
constexpr int64_t kMaxSplit = std::numeric_limits<int32_t>::max();

Status CheckDims(const std::vector<int64_t>& dims, int k) {
  if (static_cast<int>(dims.size()) != k) {
    return InvalidArgument("`dims` must have ", k, " entries, got ",
                           dims.size(), ".");
  }
  for (int64_t d : dims) {
    // A row travels in one int32 split; the bound also keeps every
    // count * dim product below 2**63.
    if (d < 0 || d > kMaxSplit) {
      return InvalidArgument("`dims` must be in [0, ", kMaxSplit, "], got ",
                             d, ".");
    }
  }
  return Status();
}

// The `dims` attr (a width per table) of a kernel or a shape function,
// checked by CheckDims against `num_tables`.
template <typename Context>
Status GetDims(Context* c, std::vector<int64_t>* dims) {
  int k;
  TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &k));
  TF_RETURN_IF_ERROR(c->GetAttr("dims", dims));
  return CheckDims(*dims, k);
}

// Who owns the rows of one table: `mod` (row r on worker r % N, local row
// r / N), `div` (blocks of ceil(V / N) rows) or `table:R` (every row on
// worker R, local row r); see ShardedVariable.owner in
// group_embedding/distributed/sharded_variable.py.
struct Partition {
  enum Kind { kMod, kDiv, kTable } kind = kMod;
  int64_t owner = 0;  // kTable only
};

// Parses a `partitions` attribute entry; a table-wise owner must be a
// decimal rank in [0, num_workers).
Status ParsePartition(const std::string& text, const std::string& table,
                      int64_t num_workers, Partition* out) {
  if (text == "mod" || text == "div") {
    out->kind = text == "mod" ? Partition::kMod : Partition::kDiv;
    return Status();
  }
  constexpr char kPrefix[] = "table:";
  constexpr size_t kPrefixLen = sizeof(kPrefix) - 1;
  const bool prefixed = text.compare(0, kPrefixLen, kPrefix) == 0;
  const std::string digits = prefixed ? text.substr(kPrefixLen) : "";
  // At most 9 digits: the value fits any int64 without overflow checks.
  bool numeric = !digits.empty() && digits.size() <= 9;
  for (char c : digits) numeric = numeric && c >= '0' && c <= '9';
  if (!numeric) {
    return InvalidArgument("Invalid partition '", text, "' for ", table,
                           ", use mod, div or table:<rank>.");
  }
  int64_t rank = 0;
  for (char c : digits) rank = rank * 10 + (c - '0');
  if (rank >= num_workers) {
    return InvalidArgument("Invalid partition '", text, "' for ", table,
                           ": rank ", rank, " is not in [0, ", num_workers,
                           ").");
  }
  out->kind = Partition::kTable;
  out->owner = rank;
  return Status();
}

// The received buffer of GroupEmbeddingCollectiveRouteIds' layout: per source
// worker s, K counts then the ids of table 0, 1, ... Checked and indexed once.
struct ReceivedLayout {
  // id_begin[s * k + t]: index in the buffer of the first id of (s, t);
  // count[s * k + t]: how many; elem_begin: float offset of its rows in
  // the flat rows buffer (sources in order, tables in order per source).
  std::vector<int64_t> id_begin, count, elem_begin;
  std::vector<int64_t> elems_per_source;
  int64_t total_elems = 0;
  int64_t total_ids = 0;
};

Status ParseReceived(const Tensor& ids, const Tensor& splits, int k,
                     const std::vector<int64_t>& dims,
                     ReceivedLayout* out) {
  if (ids.dims() != 1) {
    return InvalidArgument("received_ids must be a vector, got shape ",
                           ids.shape().DebugString(), ".");
  }
  if (splits.dims() != 1 || splits.NumElements() < 1) {
    return InvalidArgument("received_splits must be a non-empty vector, got "
                           "shape ", splits.shape().DebugString(), ".");
  }
  const int64_t n = splits.NumElements();
  const auto sp = splits.flat<int32_t>();
  const auto v = ids.flat<int64_t>();
  out->id_begin.assign(n * k, 0);
  out->count.assign(n * k, 0);
  out->elem_begin.assign(n * k, 0);
  out->elems_per_source.assign(n, 0);
  int64_t at = 0, elem = 0;
  for (int64_t s = 0; s < n; ++s) {
    const int64_t len = sp(s);
    if (len < k || at + len > v.size()) {
      return InvalidArgument("received_splits[", s, "] = ", len,
                             " does not hold the ", k, " counts of a source "
                             "(or overruns the ", v.size(), " received ids).");
    }
    int64_t ids_at = at + k, source_elems = 0;
    for (int t = 0; t < k; ++t) {
      const int64_t c = v(at + t);
      if (c < 0 || c > len - k) {
        return InvalidArgument("source ", s, " announces ", c, " ids of table ",
                               t, " in a segment of ", len - k, " ids.");
      }
      out->id_begin[s * k + t] = ids_at;
      out->count[s * k + t] = c;
      out->elem_begin[s * k + t] = elem + source_elems;
      ids_at += c;
      // c <= int32 max and dims[t] <= kMaxSplit: no overflow, and checked
      // per table so that the sum cannot overflow either.
      source_elems += c * dims[t];
      if (source_elems > kMaxSplit) {
        return InvalidArgument("source ", s, " asks for ", source_elems,
                               " floats, more than an int32 split allows; "
                               "use smaller batches.");
      }
    }
    if (ids_at != at + len) {
      return InvalidArgument("source ", s, ": counts add up to ",
                             ids_at - at - k, " ids but the segment holds ",
                             len - k, ".");
    }
    out->elems_per_source[s] = source_elems;
    elem += source_elems;
    at += len;
  }
  if (at != v.size()) {
    return InvalidArgument("received_splits add up to ", at, " but ",
                           v.size(), " ids were received.");
  }
  out->total_elems = elem;
  out->total_ids = at - n * k;
  return Status();
}

// ---------------------------------------------------------------------------
// Router: dedup + bucketing by owner of K id vectors at once.
// ---------------------------------------------------------------------------
GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingCollectiveRouteIds", "CollectiveRouteIds",
    .Input("ids: num_tables * int64")
    .Output("send_ids: int64")
    .Output("send_splits: int32")
    .Output("row_offsets: num_tables * int64")
    .Attr("num_tables: int >= 1")
    .Attr("num_workers: int >= 1")
    .Attr("vocab_sizes: list(int)")
    .Attr("dims: list(int)")
    .Attr("partitions: list(string)")
    .Attr("table_names: list(string)")
    .SetShapeFn([](InferenceContext* c) {
      int k, n;
      TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &k));
      TF_RETURN_IF_ERROR(c->GetAttr("num_workers", &n));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 0, k, 1));
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Vector(n));
      for (int t = 0; t < k; ++t) c->set_output(2 + t, c->input(t));
      return Status();
    }));

class CollectiveRouteIdsOp : public OpKernel {
 public:
  explicit CollectiveRouteIdsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_workers", &workers_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("vocab_sizes", &vocab_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table_names", &names_));
    std::vector<std::string> partitions;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("partitions", &partitions));
    OP_REQUIRES_OK(ctx, GetDims(ctx, &dims_));
    const int k = static_cast<int>(dims_.size());
    OP_REQUIRES(ctx, static_cast<int>(vocab_.size()) == k &&
                         static_cast<int>(names_.size()) == k &&
                         static_cast<int>(partitions.size()) == k,
                InvalidArgument("vocab_sizes, table_names and partitions "
                                "must have ", k, " entries."));
    for (int t = 0; t < k; ++t) {
      OP_REQUIRES(ctx, vocab_[t] >= 1,
                  InvalidArgument(names_[t], ": vocab size must be >= 1, "
                                  "got ", vocab_[t], "."));
      Partition parsed;
      OP_REQUIRES_OK(ctx, ParsePartition(partitions[t], names_[t], workers_,
                                         &parsed));
      partitions_.push_back(parsed);
    }
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList ids;
    OP_REQUIRES_OK(ctx, ctx->input_list("ids", &ids));
    const int k = ids.size();
    OP_REQUIRES(ctx, static_cast<int>(dims_.size()) == k,
                InvalidArgument("expected ", dims_.size(), " id vectors, got ",
                                k, "."));
    for (int t = 0; t < k; ++t) {
      OP_REQUIRES(ctx, ids[t].dims() == 1,
                  InvalidArgument(names_[t], ": ids must be a vector, got "
                                  "shape ", ids[t].shape().DebugString(), "."));
    }
    const int64_t n = workers_;
    // Each id's slot (its distinct id) goes straight into its row offset,
    // which phase 3 rewrites in place: no [nnz] scratch per step.
    OpOutputList offsets_out;
    OP_REQUIRES_OK(ctx, ctx->output_list("row_offsets", &offsets_out));
    std::vector<int64_t*> offsets(k);
    for (int t = 0; t < k; ++t) {
      Tensor* o = nullptr;
      OP_REQUIRES_OK(ctx, offsets_out.allocate(t, ids[t].shape(), &o));
      offsets[t] = o->flat<int64_t>().data();
    }
    // Phase 1, per table (independent, so sharded over tables): range
    // check, dedup, owner and local row of every distinct id, and its
    // position inside the (owner, table) bucket.
    struct Route {
      std::vector<int64_t> local;   // per distinct id
      std::vector<int64_t> owner;   // per distinct id
      std::vector<int64_t> pos;     // per distinct id, inside its bucket
      std::vector<int64_t> count;   // per owner
      Status status;
    };
    std::vector<Route> routes(k);
    const IdScratch::Lease scratch(&scratch_, k);
    int64_t total_ids = 0;
    for (int t = 0; t < k; ++t) total_ids += ids[t].NumElements();
    auto dedup = [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        Route& r = routes[t];
        const int64_t nnz = ids[t].NumElements();
        const int64_t* v = ids[t].flat<int64_t>().data();
        const int64_t vocab = vocab_[t];
        r.status = CheckIdRange(names_[t], v, nnz, vocab);
        if (!r.status.ok()) return;
        int64_t* slot = offsets[t];
        std::vector<int64_t> keys;
        WithIdMap(vocab, nnz, scratch.For(t),
                  [&](auto& map) {
          // Slots are read at random: fetch a few ids ahead.
          constexpr int64_t kAhead = 16;
          for (int64_t j = 0; j < nnz; ++j) {
            if (j + kAhead < nnz) map.Prefetch(v[j + kAhead]);
            slot[j] = map.Insert(v[j]);
          }
          keys = map.TakeKeys();
        });
        const int64_t u = static_cast<int64_t>(keys.size());
        r.local.resize(u);
        r.owner.resize(u);
        r.pos.resize(u);
        r.count.assign(n, 0);
        // div: blocks of ceil(V / N) rows (ShardedVariable.owner);
        // V + N - 1 would overflow for V near 2**63.
        const int64_t per = vocab / n + (vocab % n != 0);
        // A power-of-two N (the common case) needs no 64-bit division.
        const bool pow2 = (n & (n - 1)) == 0;
        int shift = 0;
        while ((int64_t{1} << shift) < n) ++shift;
        const Partition& part = partitions_[t];
        const bool is_mod = part.kind == Partition::kMod;
        for (int64_t i = 0; i < u; ++i) {
          const int64_t id = keys[i];
          int64_t o, local;
          if (part.kind == Partition::kTable) {
            o = part.owner;
            local = id;
          } else if (is_mod && pow2) {
            o = id & (n - 1);
            local = id >> shift;
          } else if (is_mod) {
            o = id % n;
            local = id / n;
          } else {
            o = id / per;
            local = id - o * per;
          }
          r.owner[i] = o;
          r.local[i] = local;
          r.pos[i] = r.count[o]++;
        }
      }
    };
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
    tensorflow::Shard(pool->num_threads, pool->workers, k,
                      (total_ids / k + 1) * 40, dedup);
    for (const Route& r : routes) OP_REQUIRES_OK(ctx, r.status);

    // Phase 2, serial: where each (owner, table) bucket starts in the send
    // buffer (after the owner's K counts) and in the returned rows.
    std::vector<int64_t> send_at(n * k), elem_at(n * k);
    Tensor* splits_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n}), &splits_t));
    auto splits = splits_t->flat<int32_t>();
    int64_t send_total = 0, elem_total = 0;
    for (int64_t o = 0; o < n; ++o) {
      int64_t len = k, elems = 0;
      for (int t = 0; t < k; ++t) {
        send_at[o * k + t] = send_total + len;
        elem_at[o * k + t] = elem_total + elems;
        len += routes[t].count[o];
        // Checked per table, count before the product: no overflow.
        OP_REQUIRES(ctx, len <= kMaxSplit,
                    InvalidArgument("worker ", o, " would receive ", len,
                                    " ids or more, more than an int32 "
                                    "split allows; use smaller batches."));
        elems += routes[t].count[o] * dims_[t];
        OP_REQUIRES(ctx, elems <= kMaxSplit,
                    InvalidArgument("worker ", o, " would send back ", elems,
                                    " floats or more, more than an int32 "
                                    "split allows; use smaller batches."));
      }
      splits(o) = static_cast<int32_t>(len);
      send_total += len;
      elem_total += elems;
    }
    Tensor* send_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({send_total}),
                                             &send_t));
    int64_t* send = send_t->flat<int64_t>().data();
    int64_t at = 0;
    for (int64_t o = 0; o < n; ++o) {
      for (int t = 0; t < k; ++t) send[at + t] = routes[t].count[o];
      at += splits(o);
    }
    // Phase 3, per table: fill its buckets and every id's row offset.
    auto fill = [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const Route& r = routes[t];
        const int64_t u = static_cast<int64_t>(r.local.size());
        const int64_t dim = dims_[t];
        std::vector<int64_t> row_at(u);
        for (int64_t i = 0; i < u; ++i) {
          const int64_t b = r.owner[i] * k + t;
          send[send_at[b] + r.pos[i]] = r.local[i];
          row_at[i] = elem_at[b] + r.pos[i] * dim;
        }
        const int64_t nnz = ids[t].NumElements();
        int64_t* out = offsets[t];
        for (int64_t j = 0; j < nnz; ++j) out[j] = row_at[out[j]];
      }
    };
    tensorflow::Shard(pool->num_threads, pool->workers, k,
                      (total_ids / k + 1) * 10, fill);
  }

 private:
  IdScratch scratch_;
  int64_t workers_;
  std::vector<int64_t> vocab_, dims_;
  std::vector<std::string> names_;
  std::vector<Partition> partitions_;
};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingCollectiveRouteIds", "CollectiveRouteIds",
    CollectiveRouteIdsOp);

// ---------------------------------------------------------------------------
// Owner side: the rows asked by every source, from this worker's shards.
// ---------------------------------------------------------------------------
GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingCollectiveOwnerGather", "CollectiveOwnerGather",
    .Input("shards: num_tables * resource")
    .Input("received_ids: int64")
    .Input("received_splits: int32")
    .Output("rows: float")
    .Output("row_splits: int32")
    .Attr("num_tables: int >= 1")
    .Attr("dims: list(int)")
    .Attr("table_names: list(string)")
    // The rows of each shard when the graph was built (empty: unknown);
    // the gradient takes them instead of reading every shard's shape.
    .Attr("shard_rows: list(int) = []")
    .SetShapeFn([](InferenceContext* c) {
      int k;
      TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &k));
      TF_RETURN_IF_ERROR(InputsWithRank(c, k, 2, 1));
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Vector(c->Dim(c->input(k + 1), 0)));
      return Status();
    }));

class CollectiveOwnerGatherOp : public OpKernel {
 public:
  explicit CollectiveOwnerGatherOp(OpKernelConstruction* ctx)
      : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table_names", &names_));
    OP_REQUIRES_OK(ctx, GetDims(ctx, &dims_));
    const int k = static_cast<int>(dims_.size());
    OP_REQUIRES(ctx, static_cast<int>(names_.size()) == k,
                InvalidArgument("table_names must have ", k, " entries."));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shard_rows", &shard_rows_));
    OP_REQUIRES(ctx, shard_rows_.empty() ||
                         static_cast<int>(shard_rows_.size()) == k,
                InvalidArgument("shard_rows must be empty or have ", k,
                                " entries."));
  }

  void Compute(OpKernelContext* ctx) override {
    const int k = static_cast<int>(dims_.size());
    ReceivedLayout layout;
    OP_REQUIRES_OK(ctx, ParseReceived(ctx->input(k), ctx->input(k + 1), k,
                                      dims_, &layout));
    const int64_t n = ctx->input(k + 1).NumElements();
    LockedTables locked;
    OP_REQUIRES_OK(ctx, locked.Open(ctx, k));
    const std::vector<Var*>& vars = locked.vars();
    std::vector<const float*> tables(k);
    const int64_t* v = ctx->input(k).flat<int64_t>().data();
    for (int t = 0; t < k; ++t) {
      const Tensor* table = vars[t]->tensor();
      OP_REQUIRES(ctx, table->dtype() == tensorflow::DT_FLOAT &&
                           table->dims() == 2 &&
                           table->dim_size(1) == dims_[t],
                  InvalidArgument(names_[t], ": expected a float32 [rows, ",
                                  dims_[t], "] shard, got ",
                                  table->shape().DebugString()));
      const int64_t rows = table->dim_size(0);
      // The gradient bounds its rows by the built-in count: the shard
      // must still have it.
      OP_REQUIRES(ctx, shard_rows_.empty() || shard_rows_[t] == rows,
                  InvalidArgument(names_[t], ": the shard has ", rows,
                                  " rows, but the lookup was built for ",
                                  shard_rows_.empty() ? 0 : shard_rows_[t],
                                  "."));
      for (int64_t s = 0; s < n; ++s) {
        const int64_t* bad = FirstOutside(v + layout.id_begin[s * k + t],
                                          layout.count[s * k + t], rows);
        OP_REQUIRES(ctx, bad == nullptr,
                    InvalidArgument(names_[t], ": worker ", s, " asks for "
                                    "local row ", *bad, " outside this "
                                    "shard's [0, ", rows, ")."));
      }
      tables[t] = table->flat<float>().data();
    }
    Tensor* rows_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            0, TensorShape({layout.total_elems}), &rows_t));
    Tensor* splits_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n}), &splits_t));
    for (int64_t s = 0; s < n; ++s) {
      splits_t->flat<int32_t>()(s) =
          static_cast<int32_t>(layout.elems_per_source[s]);
    }
    float* out = rows_t->flat<float>().data();
    // Work units are the (source, table) buckets.
    auto work = [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int t = static_cast<int>(b % k);
        const int64_t dim = dims_[t];
        const int64_t* ids = v + layout.id_begin[b];
        const int64_t c = layout.count[b];
        float* dst = out + layout.elem_begin[b];
        const float* table = tables[t];
        WithStaticDim(dim, [&](auto fixed) {
          constexpr int64_t kDim = decltype(fixed)::value;
          const int64_t width = kDim > 0 ? kDim : dim;
          for (int64_t j = 0; j < c; ++j) {
            if (j + kPrefetchDistance < c) {
              PrefetchRow(table + ids[j + kPrefetchDistance] * width, width);
            }
            const float* row = table + ids[j] * width;
            for (int64_t d = 0; d < width; ++d) dst[j * width + d] = row[d];
          }
        });
      }
    };
    const int64_t units = n * k;
    const int64_t avg = layout.total_ids / units + 1;
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
    tensorflow::Shard(pool->num_threads, pool->workers, units, avg * 64,
                      work);
  }

 private:
  std::vector<int64_t> dims_;
  std::vector<std::string> names_;
  std::vector<int64_t> shard_rows_;
};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingCollectiveOwnerGather", "CollectiveOwnerGather",
    CollectiveOwnerGatherOp);

// Its gradient: per shard, the distinct local rows asked for by any source
// and the sum of their gradients (duplicates across sources added), times
// `scale` (allreduce_gradients' 1/N, applied here instead of by one
// multiply op per shard).
// `shard_rows` [K]: the rows of each shard, the bound every received
// local row is checked against (the op may run apart from its forward).
GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingCollectiveOwnerGatherGrad", "CollectiveOwnerGatherGrad",
    .Input("grad: float")
    .Input("received_ids: int64")
    .Input("received_splits: int32")
    .Input("shard_rows: int64")
    .Output("indices: num_tables * int64")
    .Output("values: num_tables * float")
    .Attr("num_tables: int >= 1")
    .Attr("dims: list(int)")
    .Attr("table_names: list(string) = []")
    .Attr("scale: float = 1.0")
    .SetShapeFn([](InferenceContext* c) {
      std::vector<int64_t> dims;
      TF_RETURN_IF_ERROR(GetDims(c, &dims));
      const int k = static_cast<int>(dims.size());
      TF_RETURN_IF_ERROR(InputsWithRank(c, 0, 4, 1));
      for (int t = 0; t < k; ++t) {
        c->set_output(t, c->Vector(c->UnknownDim()));
        c->set_output(k + t, c->MakeShape({c->UnknownDim(),
                                           c->MakeDim(dims[t])}));
      }
      return Status();
    }));

class CollectiveOwnerGatherGradOp : public OpKernel {
 public:
  explicit CollectiveOwnerGatherGradOp(OpKernelConstruction* ctx)
      : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, GetDims(ctx, &dims_));
    const int k = static_cast<int>(dims_.size());
    std::vector<std::string> names;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table_names", &names));
    OP_REQUIRES(ctx, names.empty() || static_cast<int>(names.size()) == k,
                InvalidArgument("GroupEmbeddingCollectiveOwnerGatherGrad: "
                                "table_names must have ", k, " entries, got ",
                                names.size(), "."));
    for (int t = 0; t < k; ++t) {
      names_.push_back(names.empty() ? absl::StrCat("table ", t) : names[t]);
    }
    OP_REQUIRES_OK(ctx, ctx->GetAttr("scale", &scale_));
  }

  void Compute(OpKernelContext* ctx) override {
    const int k = static_cast<int>(dims_.size());
    const Tensor& grad = ctx->input(0);
    const Tensor& rows_t = ctx->input(3);
    OP_REQUIRES(ctx, rows_t.dims() == 1 && rows_t.NumElements() == k,
                InvalidArgument("GroupEmbeddingCollectiveOwnerGatherGrad: "
                                "shard_rows must be a vector of ", k,
                                " row counts, got shape ",
                                rows_t.shape().DebugString(), "."));
    const auto shard_rows = rows_t.flat<int64_t>();
    for (int t = 0; t < k; ++t) {
      // A row count bounds the id map below: never negative.
      OP_REQUIRES(ctx, shard_rows(t) >= 0,
                  InvalidArgument("GroupEmbeddingCollectiveOwnerGatherGrad: ",
                                  names_[t], ": shard_rows is ",
                                  shard_rows(t), ", not a row count."));
    }
    ReceivedLayout layout;
    OP_REQUIRES_OK(ctx, ParseReceived(ctx->input(1), ctx->input(2), k, dims_,
                                      &layout));
    OP_REQUIRES(ctx, grad.dims() == 1 &&
                         grad.NumElements() == layout.total_elems,
                InvalidArgument("grad must be a vector of ",
                                layout.total_elems, " floats, got shape ",
                                grad.shape().DebugString(), "."));
    const int64_t n = ctx->input(2).NumElements();
    const int64_t* v = ctx->input(1).flat<int64_t>().data();
    const float* g = grad.flat<float>().data();
    OpOutputList idx_out, val_out;
    OP_REQUIRES_OK(ctx, ctx->output_list("indices", &idx_out));
    OP_REQUIRES_OK(ctx, ctx->output_list("values", &val_out));
    std::vector<Status> status(k);
    const IdScratch::Lease scratch(&scratch_, k);
    auto work = [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t dim = dims_[t];
        int64_t total = 0;
        for (int64_t s = 0; s < n; ++s) total += layout.count[s * k + t];
        // Every local row must lie in the shard, which then bounds the
        // id map (an id of 2**63-1 once wrapped the bound `id + 1`
        // negative and the map wrote out of bounds).
        const int64_t rows = shard_rows(t);
        for (int64_t s = 0; s < n; ++s) {
          const int64_t* ids = v + layout.id_begin[s * k + t];
          const int64_t c = layout.count[s * k + t];
          const int64_t* at = FirstOutside(ids, c, rows);
          if (at != nullptr) {
            status[t] = InvalidArgument(
                "GroupEmbeddingCollectiveOwnerGatherGrad: ", names_[t],
                ": worker ", s, " sent a gradient for local row ", *at,
                " outside this shard's [0, ", rows, ").");
            return;
          }
        }
        std::vector<int64_t> slot(total);
        std::vector<int64_t> keys;
        WithIdMap(rows, total, scratch.For(t),
                  [&](auto& map) {
          // Slots are read at random: fetch a few ids ahead.
          constexpr int64_t kAhead = 16;
          int64_t j = 0;
          for (int64_t s = 0; s < n; ++s) {
            const int64_t* ids = v + layout.id_begin[s * k + t];
            const int64_t c = layout.count[s * k + t];
            for (int64_t i = 0; i < c; ++i) {
              if (i + kAhead < c) map.Prefetch(ids[i + kAhead]);
              slot[j++] = map.Insert(ids[i]);
            }
          }
          keys = map.TakeKeys();
        });
        const int64_t u = static_cast<int64_t>(keys.size());
        Tensor* it = nullptr;
        Tensor* vt = nullptr;
        status[t] = idx_out.allocate(t, TensorShape({u}), &it);
        if (!status[t].ok()) return;
        status[t] = val_out.allocate(t, TensorShape({u, dim}), &vt);
        if (!status[t].ok()) return;
        std::copy(keys.begin(), keys.end(), it->flat<int64_t>().data());
        float* sums = vt->flat<float>().data();
        // Slots are numbered in this loop's order: a slot's first
        // gradient is the one whose slot equals the count so far. It is
        // stored as 0 + g (not copied: a -0.0 becomes +0.0, as in the
        // single-process backward), the later ones added.
        int64_t j = 0, seen = 0;
        for (int64_t s = 0; s < n; ++s) {
          const float* src = g + layout.elem_begin[s * k + t];
          const int64_t c = layout.count[s * k + t];
          WithStaticDim(dim, [&](auto fixed) {
            constexpr int64_t kDim = decltype(fixed)::value;
            const int64_t width = kDim > 0 ? kDim : dim;
            for (int64_t i = 0; i < c; ++i) {
              const int64_t at = slot[j + i];
              float* dst = sums + at * width;
              const float* row = src + i * width;
              if (at == seen) {
                ++seen;
                for (int64_t d = 0; d < width; ++d) dst[d] = 0.0f + row[d];
              } else {
                for (int64_t d = 0; d < width; ++d) dst[d] += row[d];
              }
            }
          });
          j += c;
        }
        // Once summed, as a multiply after the merge would (the rows are
        // still in cache).
        if (scale_ != 1.0f) {
          for (int64_t i = 0; i < u * dim; ++i) sums[i] *= scale_;
        }
      }
    };
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
    tensorflow::Shard(pool->num_threads, pool->workers, k,
                      (layout.total_ids / k + 1) * 64, work);
    for (const auto& st : status) OP_REQUIRES_OK(ctx, st);
  }

 private:
  IdScratch scratch_;
  std::vector<int64_t> dims_;
  std::vector<std::string> names_;
  float scale_;
};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingCollectiveOwnerGatherGrad", "CollectiveOwnerGatherGrad",
    CollectiveOwnerGatherGradOp);

// ---------------------------------------------------------------------------
// Local pooling from the returned rows buffer.
// ---------------------------------------------------------------------------

// One table of the returned rows buffer as the pooling core reads it; no
// output yet.
PooledTable<BufferRows> BufferTable(const float* rows, int64_t elems,
                                    const Tensor& offsets,
                                    const Tensor& splits,
                                    const Tensor& weights, int64_t dim,
                                    Combiner combiner) {
  PooledTable<BufferRows> p;
  p.rows = {rows, offsets.flat<int64_t>().data(), BufferRowsEnd(elems, dim)};
  p.splits = splits.flat<int64_t>().data();
  p.weights = weights.NumElements() ? weights.flat<float>().data() : nullptr;
  p.nnz = offsets.NumElements();
  p.dim = dim;
  p.combiner = combiner;
  p.out = nullptr;
  p.stride = dim;
  return p;
}

// The error for a row offset outside a buffer of `elems` floats.
Status BadOffset(const std::string& name, int64_t offset, int64_t dim,
                 int64_t elems) {
  return InvalidArgument(name, ": row offset ", offset, " does not address "
                         "a row of ", dim, " floats in a buffer of ", elems,
                         ".");
}

// Checks that every row offset of one table addresses a whole `dim`-float
// row of a buffer of `elems` floats.
Status CheckOffsetValues(const std::string& name, const Tensor& offsets,
                         int64_t dim, int64_t elems) {
  const int64_t* bad = FirstOutside(offsets.flat<int64_t>().data(),
                                    offsets.NumElements(),
                                    BufferRowsEnd(elems, dim));
  return bad == nullptr ? Status() : BadOffset(name, *bad, dim, elems);
}

// The ragged inputs of the three pooling kernels, row offsets in the
// place of ids, shapes and splits checked (offsets are checked against the
// buffer by each kernel).
Status ReadRaggedOffsets(OpKernelContext* ctx, RaggedGroup* in) {
  return ReadRaggedGroup(ctx, "row_offsets", kWithWeights, /*dim=*/0, in);
}

GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingCollectivePool", "CollectivePool",
    .Input("rows: float")
    .Input("row_offsets: num_tables * int64")
    .Input("row_splits: num_tables * int64")
    .Input("weights: num_tables * float")
    .Output("pooled: num_tables * float")
    .Attr("num_tables: int >= 1")
    .Attr("combiners: list(string)")
    .Attr("dims: list(int)")
    .SetShapeFn([](InferenceContext* c) {
      std::vector<int64_t> dims;
      TF_RETURN_IF_ERROR(GetDims(c, &dims));
      const int k = static_cast<int>(dims.size());
      TF_RETURN_IF_ERROR(InputsWithRank(c, 0, 1 + 3 * k, 1));
      for (int t = 0; t < k; ++t) {
        TF_RETURN_IF_ERROR(SetPooledShape(c, t, 1 + k + t, dims[t]));
      }
      return Status();
    }));

// The attrs of the three pooling kernels (GroupEmbeddingCollectivePool and its
// two gradients): a combiner and a width per table.
class PoolKernel : public OpKernel {
 public:
  explicit PoolKernel(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ParseCombiners(ctx, &combiners_));
    OP_REQUIRES_OK(ctx, GetDims(ctx, &dims_));
    const int k = static_cast<int>(dims_.size());
    OP_REQUIRES(ctx, static_cast<int>(combiners_.size()) == k,
                InvalidArgument("combiners must have ", k, " entries."));
  }

 protected:
  std::vector<Combiner> combiners_;
  std::vector<int64_t> dims_;
};

class CollectivePoolOp : public PoolKernel {
 public:
  using PoolKernel::PoolKernel;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& rows_t = ctx->input(0);
    RaggedGroup in;
    OP_REQUIRES_OK(ctx, ReadRaggedOffsets(ctx, &in));
    const OpInputList& offsets = in.ids;
    const int k = in.size();
    OP_REQUIRES(ctx, k == static_cast<int>(dims_.size()),
                InvalidArgument("expected ", dims_.size(), " tables, got ",
                                k, "."));
    OP_REQUIRES(ctx, rows_t.dims() == 1,
                InvalidArgument("rows must be a vector, got shape ",
                                rows_t.shape().DebugString(), "."));
    const int64_t elems = rows_t.NumElements();
    std::vector<int64_t> first_row(k + 1, 0);
    int64_t total_nnz = 0;
    OpOutputList out;
    OP_REQUIRES_OK(ctx, ctx->output_list("pooled", &out));
    const float* rows = rows_t.flat<float>().data();
    std::vector<PooledTable<BufferRows>> tables(k);
    for (int t = 0; t < k; ++t) {
      // Offsets are checked by the pooling, as it reads them.
      const int64_t batch = in.batch(t);
      first_row[t + 1] = first_row[t] + batch;
      total_nnz += offsets[t].NumElements();
      Tensor* o = nullptr;
      OP_REQUIRES_OK(ctx, out.allocate(t, TensorShape({batch, dims_[t]}),
                                       &o));
      tables[t] = BufferTable(rows, elems, offsets[t], in.splits[t],
                              in.weights[t], dims_[t], combiners_[t]);
      tables[t].out = o->flat<float>().data();
      tables[t].stride = dims_[t];
    }
    const int64_t total_rows = first_row[k];
    if (total_rows == 0) return;
    // An offset outside the buffer is skipped (never read) and reported.
    // No clipping.
    const int64_t avg = total_nnz / total_rows + 1;
    const Refused bad = PoolTables(ctx, tables, first_row,
                                   /*max_norm=*/-1.0f, avg * 64 + 20);
    if (bad.any()) {
      const int t = bad.table;
      const int64_t j = bad.pos;
      ctx->SetStatus(BadOffset(absl::StrCat("table ", t),
                               offsets[t].flat<int64_t>()(j), dims_[t],
                               elems));
    }
  }

};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingCollectivePool", "CollectivePool",
    CollectivePoolOp);

// Gradient of GroupEmbeddingCollectivePool w.r.t. the rows buffer: one summed
// gradient per distinct row (ids sharing a row share its offset), zeros
// elsewhere.
GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingCollectivePoolGrad", "CollectivePoolGrad",
    .Input("grads: num_tables * float")
    .Input("row_offsets: num_tables * int64")
    .Input("row_splits: num_tables * int64")
    .Input("weights: num_tables * float")
    .Input("num_elements: int64")
    .Output("rows_grad: float")
    .Attr("num_tables: int >= 1")
    .Attr("combiners: list(string)")
    .Attr("dims: list(int)")
    .SetShapeFn([](InferenceContext* c) {
      int k;
      TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &k));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 0, k, 2));
      TF_RETURN_IF_ERROR(InputsWithRank(c, k, 3 * k, 1));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 4 * k, 1, 0));
      c->set_output(0, c->Vector(c->UnknownDim()));
      return Status();
    }));

class CollectivePoolGradOp : public PoolKernel {
 public:
  using PoolKernel::PoolKernel;

  void Compute(OpKernelContext* ctx) override {
    RaggedGroup in;
    OP_REQUIRES_OK(ctx, ReadRaggedOffsets(ctx, &in));
    OpInputList grads;
    OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
    const OpInputList& offsets = in.ids;
    const int k = in.size();
    OP_REQUIRES(ctx, k == static_cast<int>(dims_.size()),
                InvalidArgument("expected ", dims_.size(), " tables, got ",
                                k, "."));
    const Tensor& num = ctx->input(4 * k);
    OP_REQUIRES_OK(ctx, CheckScalar(num, "num_elements"));
    const int64_t elems = num.scalar<int64_t>()();
    OP_REQUIRES(ctx, elems >= 0,
                InvalidArgument("num_elements must be >= 0, got ", elems,
                                "."));
    int64_t total = 0;
    for (int t = 0; t < k; ++t) {
      OP_REQUIRES_OK(ctx, CheckMatrix(absl::StrCat("table ", t, ": grads"),
                                      grads[t], in.batch(t), dims_[t]));
      total += offsets[t].NumElements();
    }
    Tensor* out_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({elems}),
                                             &out_t));
    float* out = out_t->flat<float>().data();
    std::fill(out, out + elems, 0.0f);
    std::vector<Status> status(k);
    // Tables own disjoint parts of the buffer: shard over tables. The
    // scatter refuses an offset outside the buffer as it reaches it.
    auto work = [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        // The single-process backward's loop (pooling.h): collective
        // training computes the same gradients bitwise.
        const auto table = MakeGradTable(
            PooledGrads{grads[t].flat<float>().data(), dims_[t]},
            in.splits[t], in.weights[t], in.nnz(t), combiners_[t]);
        const int64_t* off = offsets[t].flat<int64_t>().data();
        const OffsetSlots slots{out, off, BufferRowsEnd(elems, dims_[t])};
        int64_t refused = -1;
        WithStaticDim(dims_[t], [&](auto d) {
          refused = ScatterIdGrads<decltype(d)::value>(table, slots,
                                                       dims_[t]);
        });
        if (refused >= 0) {
          status[t] = BadOffset(absl::StrCat("table ", t), off[refused],
                                dims_[t], elems);
        }
      }
    };
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
    tensorflow::Shard(pool->num_threads, pool->workers, k,
                      (total / k + 1) * 64, work);
    for (const Status& st : status) OP_REQUIRES_OK(ctx, st);
  }

};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingCollectivePoolGrad", "CollectivePoolGrad",
    CollectivePoolGradOp);

// Gradient of GroupEmbeddingCollectivePool w.r.t. the per-id weights (weighted
// tables only; empty outputs for the others). Not stateful: pruned when unused.
GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingCollectivePoolWeightGrad", "CollectivePoolWeightGrad",
    .Input("rows: float")
    .Input("row_offsets: num_tables * int64")
    .Input("row_splits: num_tables * int64")
    .Input("weights: num_tables * float")
    .Input("grads: num_tables * float")
    .Input("pooled: num_tables * float")
    .Output("weight_grads: num_tables * float")
    .Attr("num_tables: int >= 1")
    .Attr("combiners: list(string)")
    .Attr("dims: list(int)")
    .SetShapeFn([](InferenceContext* c) {
      int k;
      TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &k));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 0, 1 + 3 * k, 1));
      TF_RETURN_IF_ERROR(InputsWithRank(c, 1 + 3 * k, 2 * k, 2));
      for (int t = 0; t < k; ++t) c->set_output(t, c->input(1 + 2 * k + t));
      return Status();
    }));

class CollectivePoolWeightGradOp : public PoolKernel {
 public:
  using PoolKernel::PoolKernel;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& rows_t = ctx->input(0);
    RaggedGroup in;
    OP_REQUIRES_OK(ctx, ReadRaggedOffsets(ctx, &in));
    OpInputList grads, pooled;
    OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
    OP_REQUIRES_OK(ctx, ctx->input_list("pooled", &pooled));
    const OpInputList& offsets = in.ids;
    const int k = in.size();
    OP_REQUIRES(ctx, k == static_cast<int>(dims_.size()),
                InvalidArgument("expected ", dims_.size(), " tables, got ",
                                k, "."));
    OP_REQUIRES(ctx, rows_t.dims() == 1,
                InvalidArgument("rows must be a vector, got shape ",
                                rows_t.shape().DebugString(), "."));
    const float* rows = rows_t.flat<float>().data();
    OpOutputList out;
    OP_REQUIRES_OK(ctx, ctx->output_list("weight_grads", &out));
    for (int t = 0; t < k; ++t) {
      const std::string name = absl::StrCat("table ", t);
      const int64_t dim = dims_[t];
      // Only weighted tables read rows at their offsets.
      const bool weighted = in.weights[t].NumElements() != 0;
      if (weighted) {
        OP_REQUIRES_OK(ctx, CheckOffsetValues(name, offsets[t], dim,
                                              rows_t.NumElements()));
      }
      Tensor* o = nullptr;
      OP_REQUIRES_OK(ctx, out.allocate(t, in.weights[t].shape(), &o));
      if (!weighted) continue;
      const int64_t* off = offsets[t].flat<int64_t>().data();
      OP_REQUIRES_OK(ctx, PooledWeightGrad(
                              name, in, t, grads[t], pooled[t],
                              combiners_[t], dim,
                              [rows, off](int64_t j) { return rows + off[j]; },
                              o->flat<float>().data()));
    }
  }

};

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingCollectivePoolWeightGrad", "CollectivePoolWeightGrad",
    CollectivePoolWeightGradOp);

}  // namespace
}  // namespace collective
}  // namespace group_embedding

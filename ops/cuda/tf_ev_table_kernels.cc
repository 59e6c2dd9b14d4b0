// TensorFlow ops of the HBM EmbeddingVariable (StorageType.HBM): a TF
// resource over the CUDA core's EV table (ev_table.h) and the ops on it,
// a thin adaptor like tf_gpu_kernels.cc: it owns the table's arrays (TF
// temporaries kept by the resource), builds descriptors, takes TF's
// stream and calls the core; the hashing, admission, eviction and the
// optimizer arithmetic are all in the core.
//
// Unlike the plain-variable ops, these ops are defined here (not in the
// C++ CPU library): an HBM EV exists only where this library loads. The
// GPU build registers them on DEVICE_GPU; built with -DGE_ADAPTOR_ON_HOST
// (the core's host stand-in, CPU-only CI) on DEVICE_CPU, where nothing
// else registers them.
//
// Semantics are the CPU EV's (ops/kernels/ev_lookup_ops.cc,
// ev_apply_ops.cc): a lookup in training inserts new keys (row `key mod
// default_rows` of the default matrix), counts every occurrence and
// stamps the keys with the last step applied; CounterFilter keys read
// `no_permission` until admitted; an update skips keys absent or not
// admitted and stamps every stored key of the gradient with its step.
// The table is bounded (num_buckets * 128 keys): a key arriving at a full
// bucket evicts the bucket's least valuable key (LRU / LFU); a step that
// brings more distinct keys to one bucket than it has unpinned slots
// fails (ResourceExhausted, naming the EV) instead of losing keys.
//
// StorageType.HBM_DRAM: the same table over a host-memory tier
// (ev_host_tier.h) that receives every key the table evicts by capacity,
// with its whole state, and gives it back before any op reads or updates
// the key (Promote): a lookup, an update or an export sees every key of
// both tiers as the CPU EV would, and only where rows live differs.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <memory_resource>
#include <new>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "ev_host_tier.h"
#include "ev_table.h"
#include "tf_adaptor.h"

namespace group_embedding {
namespace gpu_kernels {
namespace {

using ::tensorflow::ResourceHandle;
using ::tensorflow::errors::FailedPrecondition;
using ::tensorflow::errors::ResourceExhausted;
using ::tensorflow::shape_inference::InferenceContext;

// One HBM EV: the core table's arrays (TF tensors on the op's device,
// kept alive here), its descriptor, the names of its optimizer slots and
// the last step an update applied (the version lookups stamp, as the CPU
// EV's current step).
class HbmEvTable : public ::tensorflow::ResourceBase {
 public:
  std::string DebugString() const override {
    return absl::StrCat("HbmEvTable ", name);
  }

  ::tensorflow::mutex* mu() { return &mu_; }
  int64_t capacity() const { return desc.num_buckets * GE_EV_BUCKET; }
  int SlotIndex(const std::string& slot) const {
    for (size_t s = 0; s < slot_names.size(); ++s) {
      if (slot_names[s] == slot) return static_cast<int>(s);
    }
    return -1;
  }
  // The descriptor with `defaults` (a call that reads no default row
  // passes the resource's own one-row placeholder).
  GeEvTable With(const float* defaults, int64_t rows) const {
    GeEvTable d = desc;
    d.defaults = defaults ? defaults : DataOr<float>(placeholder);
    d.default_rows = defaults ? rows : 1;
    return d;
  }
  // Points the descriptor at the slot arrays.
  void SetSlots() {
    desc.num_slots = static_cast<int32_t>(slot_names.size());
    desc.slots = slot_names.empty() ? nullptr : DataOr<float>(slots);
    desc.slot_inits =
        slot_names.empty() ? nullptr : DataOr<float>(slot_inits);
  }

  std::string name;
  GeEvTable desc;
  Tensor keys, digests, meta, values, slots, slot_inits, placeholder,
      counters;
  std::vector<std::string> slot_names;
  int64_t step = 0;
  // Keys the eviction policy removed, for the next incremental
  // checkpoint's removed keys (GroupEmbeddingHbmEVTakeEvicted); kept only
  // once an incremental save asked for them, as the CPU EV records them.
  bool track_evicted = false;
  bool evicted_lost = false;
  std::vector<int64_t> evicted_keys;
  // HBM_DRAM: the keys the table gave up (null for HBM: they are dropped).
  std::unique_ptr<EvHostTier> tier;
  // HBM_DRAM: the key tensors of the last lookup that succeeded, and the
  // tier's puts() when it ended. Until a key moves to the tier, all of
  // those keys are in the table (or were removed): an update of one of
  // these tensors need not look for its keys in the tier (a wait). The
  // tensors are held, so their buffers cannot hold other keys meanwhile.
  std::vector<Tensor> looked_up;
  uint64_t looked_up_puts = 0;

  bool InTableSinceLookup(const Tensor& keys) const {
    if (tier == nullptr || tier->puts() != looked_up_puts) return false;
    for (const Tensor& t : looked_up) {
      if (t.NumElements() == keys.NumElements() &&
          t.tensor_data().data() == keys.tensor_data().data()) {
        return true;
      }
    }
    return false;
  }

 private:
  ::tensorflow::mutex mu_;
};

Status Allocate(OpKernelContext* ctx, ::tensorflow::DataType dtype,
                const TensorShape& shape, Tensor* t) {
  return ctx->allocate_temp(dtype, shape, t);
}

// Reads `n` device counters to `host` (one wait for the stream).
Status ReadCounters(void* stream, const Tensor& counters, uint64_t* host,
                    int n) {
  int code = ge_copy_async(host, counters.flat<uint8_t>().data(),
                           sizeof(uint64_t) * n, 1, stream);
  if (code == GE_OK) code = ge_synchronize(stream);
  return CoreStatus("reading the table's counters", code);
}

// Table errors of a call, naming the EV: the reserved key, a bucket that
// one step filled with pinned keys.
Status TableErrors(const std::string& name, const uint64_t* c) {
  if (c[GE_EV_BAD_KEYS] != 0) {
    return InvalidArgument(name, ": ", c[GE_EV_BAD_KEYS], " keys are ",
                           GE_EV_EMPTY_KEY, " (int64 min), which the HBM "
                           "table reserves for free slots.");
  }
  if (c[GE_EV_FULL] != 0) {
    return ResourceExhausted(
        name, ": the HBM table could not store ", c[GE_EV_FULL], " keys: "
        "one step brought more distinct keys to one bucket of 128 than it "
        "has slots not seen in this step; raise storage_size[0].");
  }
  return Status();
}

Status GetTable(OpKernelContext* ctx, int input,
                ::tensorflow::core::RefCountPtr<HbmEvTable>* out) {
  return ::tensorflow::LookupResource(
      ctx, ::tensorflow::HandleFromInput(ctx, input), out);
}

// ---------------------------------------------------------------------------
// HBM_DRAM: moving records between the table and its host tier.
// ---------------------------------------------------------------------------
// Host memory the GPU copies to and from directly: TF's GPU-compatible
// host allocator (pinned memory on a GPU device, plain host memory on
// the stand-in), the staging of every transfer between the table and its
// host tier (the tier itself is plain memory: pinning gigabytes for keys
// that sit still would only take them from the system).
class StagingMemory : public std::pmr::memory_resource {
 public:
  explicit StagingMemory(OpKernelContext* ctx) {
    ::tensorflow::AllocatorAttributes attr;
    attr.set_on_host(true);
    attr.set_gpu_compatible(true);
    allocator_ = ctx->device()->GetAllocator(attr);
  }

 private:
  void* do_allocate(size_t bytes, size_t align) override {
    void* p = allocator_->AllocateRaw(std::max<size_t>(align, 64),
                                      std::max<size_t>(bytes, 1));
    if (p == nullptr) throw std::bad_alloc();
    return p;
  }
  void do_deallocate(void* p, size_t, size_t) override {
    allocator_->DeallocateRaw(p);
  }
  bool do_is_equal(const std::pmr::memory_resource& other)
      const noexcept override {
    return this == &other;
  }

  ::tensorflow::Allocator* allocator_;
};

// Device arrays of `n` records in the core's evicted / import layout:
// keys, freq, version [n], values [n, D], slots [S, n, D].
struct DeviceRecords {
  Tensor keys, values, slots, freq, version, count_t;
  int64_t n = 0;

  Status Allocate(OpKernelContext* ctx, const HbmEvTable& table,
                  int64_t size) {
    const int64_t dim = table.desc.dim, s_count = table.desc.num_slots;
    n = size;
    TF_RETURN_IF_ERROR(Allocate1(ctx, DT_INT64, {n}, &keys));
    TF_RETURN_IF_ERROR(Allocate1(ctx, DT_FLOAT, {n, dim}, &values));
    TF_RETURN_IF_ERROR(Allocate1(ctx, DT_FLOAT, {s_count, n, dim}, &slots));
    TF_RETURN_IF_ERROR(Allocate1(ctx, DT_INT64, {n}, &freq));
    TF_RETURN_IF_ERROR(Allocate1(ctx, DT_INT64, {n}, &version));
    return Allocate1(ctx, DT_INT64, {1}, &count_t);
  }
  // The arrays as an evicted output with room for n keys (count zeroed).
  Status AsEvicted(const HbmEvTable& table, void* stream, GeEvEvicted* e) {
    std::memset(e, 0, sizeof(*e));
    e->keys = DataOr<int64_t>(keys);
    e->values = DataOr<float>(values);
    e->slots = table.desc.num_slots > 0 ? DataOr<float>(slots) : nullptr;
    e->freq = DataOr<int64_t>(freq);
    e->version = DataOr<int64_t>(version);
    e->capacity = n;
    e->count = reinterpret_cast<unsigned long long*>(
        count_t.flat<int64_t>().data());
    return CoreStatus(table.name + ": zeroing a count",
                      ge_zero_async(e->count, 8, stream));
  }

 private:
  static Status Allocate1(OpKernelContext* ctx, ::tensorflow::DataType type,
                          std::initializer_list<int64_t> dims, Tensor* t) {
    return ctx->allocate_temp(type, TensorShape(dims), t);
  }
};

// Copies the first `m` records of device arrays of `n` entries (slots
// [S, n, D]) into `out` (host); the caller synchronises before reading
// `out`. The mirror of RecordsToDevice.
int RecordsToHost(const int64_t* keys, const float* values,
                  const float* slots, const int64_t* freq,
                  const int64_t* version, int64_t n, int64_t m, int64_t dim,
                  int64_t s_count, EvTierRecords* out, void* stream) {
  out->Resize(m, dim, s_count);
  if (m == 0) return GE_OK;
  int code = ge_copy_async(out->keys.data(), keys, sizeof(int64_t) * m, 1,
                           stream);
  if (code == GE_OK) {
    code = ge_copy_async(out->rows.data(), values, sizeof(float) * m * dim,
                         1, stream);
  }
  if (code == GE_OK) {
    code = ge_copy_async(out->freq.data(), freq, sizeof(int64_t) * m, 1,
                         stream);
  }
  if (code == GE_OK) {
    code = ge_copy_async(out->version.data(), version, sizeof(int64_t) * m,
                         1, stream);
  }
  for (int64_t s = 0; code == GE_OK && s < s_count; ++s) {
    code = ge_copy_async(out->slots.data() + s * m * dim,
                         slots + s * n * dim, sizeof(float) * m * dim, 1,
                         stream);
  }
  return code;
}

// Copies host records `in` to device arrays at entry `at` of arrays of
// `n` entries (slots planes of n).
int RecordsToDevice(const EvTierRecords& in, int64_t at, int64_t n,
                    int64_t dim, int64_t s_count, int64_t* keys,
                    float* values, float* slots, int64_t* freq,
                    int64_t* version, void* stream) {
  const int64_t m = in.size();
  if (m == 0) return GE_OK;
  int code = ge_copy_async(keys + at, in.keys.data(), sizeof(int64_t) * m, 2,
                           stream);
  if (code == GE_OK) {
    code = ge_copy_async(values + at * dim, in.rows.data(),
                         sizeof(float) * m * dim, 2, stream);
  }
  if (code == GE_OK) {
    code = ge_copy_async(freq + at, in.freq.data(), sizeof(int64_t) * m, 2,
                         stream);
  }
  if (code == GE_OK) {
    code = ge_copy_async(version + at, in.version.data(),
                         sizeof(int64_t) * m, 2, stream);
  }
  for (int64_t s = 0; code == GE_OK && s < s_count; ++s) {
    code = ge_copy_async(slots + (s * n + at) * dim,
                         in.slots.data() + s * m * dim,
                         sizeof(float) * m * dim, 2, stream);
  }
  return code;
}

// One table's evicted output and its count (read by the caller's
// synchronisation).
struct EvictedOf {
  HbmEvTable* table;
  const DeviceRecords* out;
  uint64_t count;
};

// Enqueues the copies of what evicted outputs received (their counts
// read) to host records, one entry of `recs` per output; the caller
// waits for the stream, then calls DemotePut.
int DemoteCopies(const std::vector<EvictedOf>& evicted,
                 std::pmr::memory_resource* staging, void* stream,
                 std::vector<EvTierRecords>* recs) {
  recs->reserve(evicted.size());
  int code = GE_OK;
  for (const EvictedOf& e : evicted) {
    recs->emplace_back(staging);
    const int64_t m =
        std::min<int64_t>(static_cast<int64_t>(e.count), e.out->n);
    if (code == GE_OK && m > 0) {
      const DeviceRecords& d = *e.out;
      code = RecordsToHost(DataOr<int64_t>(d.keys), DataOr<float>(d.values),
                           DataOr<float>(d.slots), DataOr<int64_t>(d.freq),
                           DataOr<int64_t>(d.version), d.n, m,
                           e.table->desc.dim, e.table->desc.num_slots,
                           &recs->back(), stream);
    }
  }
  return code;
}

// Puts the records DemoteCopies read into their tables' host tiers.
void DemotePut(const std::vector<EvictedOf>& evicted,
               const std::vector<EvTierRecords>& recs) {
  for (size_t i = 0; i < evicted.size(); ++i) {
    if (recs[i].size() > 0) evicted[i].table->tier->Put(recs[i]);
  }
}

// The records of DemoteCopies until they are in their tiers: Put after
// the caller's wait; an op that returns before (an error on the way)
// waits and puts them as it leaves, so that no key given up is lost.
class PendingDemote {
 public:
  PendingDemote(const std::vector<EvictedOf>& evicted, void* stream)
      : evicted_(evicted), stream_(stream) {}
  ~PendingDemote() {
    if (!recs_.empty() && ge_synchronize(stream_) == GE_OK) Put();
  }
  std::vector<EvTierRecords>* records() { return &recs_; }
  void Put() {
    DemotePut(evicted_, recs_);
    recs_.clear();
  }

 private:
  const std::vector<EvictedOf>& evicted_;
  void* stream_;
  std::vector<EvTierRecords> recs_;
};

// Moves what evicted outputs received into their tables' host tiers:
// every copy enqueued, then one wait.
Status Demote(const std::vector<EvictedOf>& evicted,
              std::pmr::memory_resource* staging, void* stream) {
  std::vector<EvTierRecords> recs;
  int code = DemoteCopies(evicted, staging, stream, &recs);
  bool any = false;
  for (const EvTierRecords& rec : recs) any = any || rec.size() > 0;
  if (code == GE_OK && any) code = ge_synchronize(stream);
  if (code != GE_OK) {
    return CoreStatus(evicted.front().table->name +
                          ": moving evicted keys to host memory",
                      code);
  }
  DemotePut(evicted, recs);
  return Status();
}

// Enqueues the copy of an evicted output's count to `count` (host); the
// caller synchronises.
int EnqueueCount(const DeviceRecords& d, uint64_t* count, void* stream) {
  return ge_copy_async(count, d.count_t.flat<int64_t>().data(), 8, 1,
                       stream);
}

// PromoteAll's import for one table, whose op keys `host` (copied to the
// host, as PromoteAll reads them) its tier may hold.
Status ImportFromTier(OpKernelContext* ctx, HbmEvTable* table,
                      const std::pmr::vector<int64_t>& host,
                      std::pmr::memory_resource* staging, void* stream,
                      bool full_is_error) {
  EvTierRecords rec(staging);
  table->tier->Take(host.data(), static_cast<int64_t>(host.size()), &rec);
  const int64_t m = rec.size();
  if (m == 0) return Status();
  int code = GE_OK;
  // From here the records are only in `rec`: any failure puts them back.
  Status status = [&]() -> Status {
    const int64_t dim = table->desc.dim, s_count = table->desc.num_slots;
    DeviceRecords in, out;
    TF_RETURN_IF_ERROR(in.Allocate(ctx, *table, m));
    TF_RETURN_IF_ERROR(out.Allocate(ctx, *table, m));
    GeEvEvicted evicted;
    TF_RETURN_IF_ERROR(out.AsEvicted(*table, stream, &evicted));
    const GeEvTable desc = table->With(nullptr, 0);
    const size_t bytes = ge_ev_scratch_bytes(&desc, m);
    if (bytes == 0) {
      return InvalidArgument(table->name, ": the CUDA core refused ", m,
                             " keys to move back from host memory.");
    }
    Tensor scratch_t, counters_t;
    void *scratch = nullptr, *counters = nullptr;
    TF_RETURN_IF_ERROR(Temp(ctx, bytes, &scratch_t, &scratch));
    TF_RETURN_IF_ERROR(Temp(ctx, 8 * GE_EV_NUM_COUNTERS, &counters_t,
                            &counters));
    auto* c = static_cast<unsigned long long*>(counters);
    // The op's keys already in the table (or absent), distinct.
    std::vector<int64_t> moving(rec.keys.begin(), rec.keys.end());
    std::sort(moving.begin(), moving.end());
    std::pmr::vector<int64_t> stay(host.begin(), host.end(), staging);
    std::sort(stay.begin(), stay.end());
    stay.erase(std::unique(stay.begin(), stay.end()), stay.end());
    stay.erase(std::remove_if(stay.begin(), stay.end(),
                              [&](int64_t key) {
                                return std::binary_search(
                                    moving.begin(), moving.end(), key);
                              }),
               stay.end());
    const int64_t p = static_cast<int64_t>(stay.size());
    std::pmr::vector<int64_t> pins(p, INT64_MAX, staging);
    Tensor stay_t, pins_t;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(DT_INT64, TensorShape({p}),
                                          &stay_t));
    TF_RETURN_IF_ERROR(ctx->allocate_temp(DT_INT64, TensorShape({p}),
                                          &pins_t));
    int64_t* stay_d = DataOr<int64_t>(stay_t);
    int64_t* pins_d = DataOr<int64_t>(pins_t);
    code = ge_copy_async(stay_d, stay.data(), sizeof(int64_t) * p, 2, stream);
    if (code == GE_OK) {
      code = ge_copy_async(pins_d, pins.data(), sizeof(int64_t) * p, 2,
                           stream);
    }
    if (code == GE_OK) code = ge_zero_async(c, 8 * GE_EV_NUM_COUNTERS, stream);
    if (code == GE_OK) {
      code = ge_ev_swap_versions(&desc, stay_d, p, pins_d, c, stream);
    }
    TF_RETURN_IF_ERROR(CoreStatus(table->name + ": pinning keys", code));
    code = RecordsToDevice(rec, 0, m, dim, s_count,
                           DataOr<int64_t>(in.keys), DataOr<float>(in.values),
                           DataOr<float>(in.slots), DataOr<int64_t>(in.freq),
                           DataOr<int64_t>(in.version), stream);
    if (code == GE_OK) {
      code = ge_ev_insert(&desc, DataOr<int64_t>(in.keys), m,
                          DataOr<float>(in.values),
                          s_count > 0 ? DataOr<float>(in.slots) : nullptr,
                          DataOr<int64_t>(in.freq),
                          DataOr<int64_t>(in.version), table->step, &evicted,
                          scratch, bytes, c, stream);
    }
    // Their versions back, whatever the import did.
    const int unpinned = ge_ev_swap_versions(&desc, stay_d, p, pins_d, c,
                                             stream);
    if (code == GE_OK) code = unpinned;
    TF_RETURN_IF_ERROR(CoreStatus(
        table->name + ": moving keys back from host memory", code));
    // The table holds them now (but those FULL counts, found below).
    const EvTierRecords moved = std::move(rec);
    rec = EvTierRecords();
    // The counters and the evicted count in one wait.
    uint64_t host_c[GE_EV_NUM_COUNTERS] = {0, 0, 0, 0};
    uint64_t count = 0;
    TF_RETURN_IF_ERROR(CoreStatus(table->name + ": reading counts",
                                  EnqueueCount(out, &count, stream)));
    TF_RETURN_IF_ERROR(ReadCounters(stream, counters_t, host_c,
                                    GE_EV_NUM_COUNTERS));
    TF_RETURN_IF_ERROR(Demote({{table, &out, count}}, staging, stream));
    if (host_c[GE_EV_FULL] == 0) return Status();
    // Which records did not get in: a find with the filter off (every
    // stored key then has a slot) on the moved keys.
    GeEvTable all = desc;
    all.filter_freq = 0;
    Tensor where_t;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(DT_INT64, TensorShape({m}),
                                          &where_t));
    std::pmr::vector<int64_t> where(m, staging);
    code = ge_ev_find(&all, DataOr<int64_t>(in.keys), m, nullptr,
                      DataOr<int64_t>(where_t), c, stream);
    if (code == GE_OK) {
      code = ge_copy_async(where.data(), DataOr<int64_t>(where_t),
                           sizeof(int64_t) * m, 1, stream);
    }
    if (code == GE_OK) code = ge_synchronize(stream);
    TF_RETURN_IF_ERROR(CoreStatus(table->name + ": finding moved keys",
                                  code));
    EvTierRecords left;
    int64_t kept = 0;
    for (int64_t i = 0; i < m; ++i) kept += where[i] < 0;
    left.Resize(kept, dim, s_count);
    int64_t j = 0;
    for (int64_t i = 0; i < m; ++i) {
      if (where[i] >= 0) continue;
      left.keys[j] = moved.keys[i];
      left.freq[j] = moved.freq[i];
      left.version[j] = moved.version[i];
      std::copy(moved.rows.begin() + i * dim,
                moved.rows.begin() + (i + 1) * dim,
                left.rows.begin() + j * dim);
      for (int64_t s = 0; s < s_count; ++s) {
        std::copy(moved.slots.begin() + (s * m + i) * dim,
                  moved.slots.begin() + (s * m + i + 1) * dim,
                  left.slots.begin() + (s * kept + j) * dim);
      }
      ++j;
    }
    rec = std::move(left);
    return full_is_error ? TableErrors(table->name, host_c) : Status();
  }();
  if (rec.size() > 0) table->tier->Put(rec);
  return status;
}

// One table's keys for PromoteAll: device arrays of the op's keys.
struct PromoteRequest {
  HbmEvTable* table;
  std::vector<std::pair<const int64_t*, int64_t>> spans;
};

// Before an op reads or updates the keys of `requests` (each a table's
// spans of device keys), PromoteAll brings those keys of each table that
// its host tier holds back into the table with their whole state, in one
// import a table (its keys pinned while it runs, so none displaces
// another; the op's other keys pinned too, by swapping their versions
// for INT64_MAX and back, so that none leaves the table before the op
// reads it); the keys they displace go to the tier. Keys a table cannot
// take (one bucket full of keys pinned in this step) stay in its tier
// and the op fails (ResourceExhausted, naming the EV; with
// `full_is_error` false it succeeds): nothing is lost. The keys of every
// table whose tier holds keys are read in one wait (none when no tier
// does); each table that takes keys back waits up to twice more.
Status PromoteAll(OpKernelContext* ctx,
                  const std::vector<PromoteRequest>& requests, void* stream,
                  bool full_is_error = true) {
  StagingMemory staging(ctx);
  std::vector<HbmEvTable*> tables;
  std::vector<std::pmr::vector<int64_t>> hosts;
  int code = GE_OK;
  for (const PromoteRequest& r : requests) {
    if (r.table->tier == nullptr || r.table->tier->empty()) continue;
    int64_t n = 0;
    for (const auto& span : r.spans) n += span.second;
    if (n == 0) continue;
    tables.push_back(r.table);
    hosts.emplace_back(n, &staging);
    int64_t at = 0;
    for (const auto& span : r.spans) {
      if (code == GE_OK) {
        code = ge_copy_async(hosts.back().data() + at, span.first,
                             sizeof(int64_t) * span.second, 1, stream);
      }
      at += span.second;
    }
  }
  if (tables.empty()) return Status();
  if (code == GE_OK) code = ge_synchronize(stream);
  TF_RETURN_IF_ERROR(CoreStatus(tables.front()->name + ": reading keys",
                                code));
  for (size_t i = 0; i < tables.size(); ++i) {
    TF_RETURN_IF_ERROR(ImportFromTier(ctx, tables[i], hosts[i], &staging,
                                      stream, full_is_error));
  }
  return Status();
}

// PromoteAll of one table.
Status Promote(OpKernelContext* ctx, HbmEvTable* table,
               const std::vector<std::pair<const int64_t*, int64_t>>& spans,
               void* stream, bool full_is_error = true) {
  return PromoteAll(ctx, {{table, spans}}, stream, full_is_error);
}

// ---------------------------------------------------------------------------
// Handle: creates the table on first use.
// ---------------------------------------------------------------------------
REGISTER_OP("GroupEmbeddingHbmEVHandle")
    .Output("handle: resource")
    .Attr("container: string = ''")
    .Attr("shared_name: string")
    .Attr("variable_name: string")
    .Attr("embedding_dim: int >= 1")
    .Attr("num_buckets: int >= 1")
    .Attr("filter_freq: int >= 0 = 0")
    .Attr("default_value_no_permission: float = 0.0")
    .Attr("lfu: bool = true")
    .Attr("host_tier: bool = false")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape);

class HandleOp : public OpKernel {
 public:
  explicit HandleOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("container", &container_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shared_name", &shared_name_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("variable_name", &name_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("embedding_dim", &dim_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_buckets", &num_buckets_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("filter_freq", &filter_freq_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("default_value_no_permission",
                                     &no_permission_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("lfu", &lfu_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("host_tier", &host_tier_));
    OP_REQUIRES(ctx, (num_buckets_ & (num_buckets_ - 1)) == 0,
                InvalidArgument(name_, ": num_buckets must be a power of "
                                "two, got ", num_buckets_, "."));
  }

  void Compute(OpKernelContext* ctx) override {
    ResourceHandle handle = ::tensorflow::MakeResourceHandle<HbmEvTable>(
        ctx, container_, shared_name_);
    HbmEvTable* table = nullptr;
    OP_REQUIRES_OK(ctx, ctx->resource_manager()->LookupOrCreate<HbmEvTable>(
                            handle.container(), handle.name(), &table,
                            [this, ctx](HbmEvTable** out) {
                              return Create(ctx, out);
                            }));
    const int64_t dim = table->desc.dim;
    const bool tiered = table->tier != nullptr;
    table->Unref();
    OP_REQUIRES(ctx, dim == dim_,
                InvalidArgument(name_, ": an EmbeddingVariable named ",
                                shared_name_, " already exists with dim ",
                                dim, ", not ", dim_, "."));
    OP_REQUIRES(ctx, tiered == host_tier_,
                InvalidArgument(name_, ": an EmbeddingVariable named ",
                                shared_name_, " already exists ",
                                tiered ? "with" : "without", " a host-memory "
                                "tier (HBM_DRAM vs HBM)."));
    Tensor* out = nullptr;
    ::tensorflow::AllocatorAttributes attr;
    attr.set_on_host(true);
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out, attr));
    out->scalar<ResourceHandle>()() = handle;
  }

 private:
  Status Create(OpKernelContext* ctx, HbmEvTable** out) {
    std::unique_ptr<HbmEvTable, void (*)(HbmEvTable*)> t(
        new HbmEvTable, [](HbmEvTable* p) { p->Unref(); });
    t->name = name_;
    if (host_tier_) t->tier = std::make_unique<EvHostTier>(dim_);
    const int64_t cap = num_buckets_ * GE_EV_BUCKET;
    TF_RETURN_IF_ERROR(Allocate(ctx, DT_INT64, TensorShape({cap}), &t->keys));
    // One byte a slot, read as 16-byte words: allocated as int64.
    TF_RETURN_IF_ERROR(
        Allocate(ctx, DT_INT64, TensorShape({(cap + 7) / 8}), &t->digests));
    TF_RETURN_IF_ERROR(
        Allocate(ctx, DT_INT64, TensorShape({cap, 2}), &t->meta));
    TF_RETURN_IF_ERROR(
        Allocate(ctx, DT_FLOAT, TensorShape({cap, dim_}), &t->values));
    TF_RETURN_IF_ERROR(
        Allocate(ctx, DT_FLOAT, TensorShape({1, dim_}), &t->placeholder));
    TF_RETURN_IF_ERROR(Allocate(ctx, DT_UINT8,
                                TensorShape({8 * GE_EV_NUM_COUNTERS}),
                                &t->counters));
    GeEvTable& d = t->desc;
    std::memset(&d, 0, sizeof(d));
    d.keys = t->keys.flat<int64_t>().data();
    d.digests = reinterpret_cast<uint8_t*>(t->digests.flat<int64_t>().data());
    d.meta = t->meta.flat<int64_t>().data();
    d.values = t->values.flat<float>().data();
    d.num_buckets = num_buckets_;
    d.dim = dim_;
    d.policy = lfu_ ? GE_EV_LFU : GE_EV_LRU;
    d.filter_freq = filter_freq_;
    d.no_permission = no_permission_;
    t->SetSlots();
    void* stream = StreamOf(ctx);
    // Rows of free slots are never read, but zeroed all the same.
    int code = ge_zero_async(d.values, t->values.TotalBytes(), stream);
    if (code == GE_OK) {
      code = ge_zero_async(DataOr<float>(t->placeholder),
                           t->placeholder.TotalBytes(), stream);
    }
    if (code == GE_OK) {
      const GeEvTable init = t->With(nullptr, 0);
      code = ge_ev_init(&init, stream);
    }
    TF_RETURN_IF_ERROR(CoreStatus(name_ + ": creating the HBM table", code));
    *out = t.release();
    return Status();
  }

  std::string container_, shared_name_, name_;
  int64_t dim_, num_buckets_, filter_freq_;
  float no_permission_;
  bool lfu_, host_tier_;
};

// ---------------------------------------------------------------------------
// The group's lookup: find-or-insert of every feature's keys (one core
// call per distinct step of its tables), then the pooling of the rows
// read (one core call), max_norm and every combiner included. `pool`
// false (sequence lookups, which place the rows themselves): only the
// rows, the pooled outputs empty ([0, D]).
// ---------------------------------------------------------------------------
REGISTER_OP("GroupEmbeddingHbmEVLookup")
    .Input("handles: num_tables * resource")
    .Input("keys: num_tables * int64")
    .Input("row_splits: num_tables * int64")
    .Input("weights: num_tables * float")
    .Input("default_values: num_tables * float")
    .Input("positions: int64")
    .Input("training: bool")
    .Output("pooled: num_tables * float")
    .Output("rows: float")
    .Attr("num_tables: int >= 1")
    .Attr("combiners: list(string)")
    .Attr("embedding_dim: int >= 1")
    .Attr("max_norm: float = -1.0")
    .Attr("pool: bool = true")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      int k = 0, dim = 0;
      TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &k));
      TF_RETURN_IF_ERROR(c->GetAttr("embedding_dim", &dim));
      for (int t = 0; t < k; ++t) {
        c->set_output(t, c->Matrix(c->UnknownDim(), dim));
      }
      c->set_output(k, c->Matrix(c->UnknownDim(), dim));
      return Status();
    });

// The distinct tables of a call, locked exclusively in address order (a
// table named by several features appears once).
struct LockedHbmTables {
  std::vector<::tensorflow::core::RefCountPtr<HbmEvTable>> refs;
  std::vector<HbmEvTable*> distinct;
  std::vector<int> index;  // feature -> its table in `distinct`
  std::vector<std::unique_ptr<::tensorflow::mutex_lock>> locks;

  Status Open(OpKernelContext* ctx, int k) {
    refs.resize(k);
    for (int t = 0; t < k; ++t) TF_RETURN_IF_ERROR(GetTable(ctx, t, &refs[t]));
    for (int t = 0; t < k; ++t) distinct.push_back(refs[t].get());
    std::sort(distinct.begin(), distinct.end());
    distinct.erase(std::unique(distinct.begin(), distinct.end()),
                   distinct.end());
    for (int t = 0; t < k; ++t) {
      index.push_back(static_cast<int>(
          std::lower_bound(distinct.begin(), distinct.end(), refs[t].get()) -
          distinct.begin()));
    }
    for (HbmEvTable* table : distinct) {
      locks.push_back(std::make_unique<::tensorflow::mutex_lock>(*table->mu()));
    }
    return Status();
  }
};

class LookupOp : public OpKernel {
 public:
  explicit LookupOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("embedding_dim", &dim_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("pool", &pool_));
    OP_REQUIRES_OK(ctx, GetMaxNorm(ctx, &max_norm_));
    OP_REQUIRES_OK(ctx, CombinersAttr(ctx, &combiners_));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList keys, splits, weights, defaults;
    OP_REQUIRES_OK(ctx, ctx->input_list("keys", &keys));
    OP_REQUIRES_OK(ctx, ctx->input_list("row_splits", &splits));
    OP_REQUIRES_OK(ctx, ctx->input_list("weights", &weights));
    OP_REQUIRES_OK(ctx, ctx->input_list("default_values", &defaults));
    const int k = keys.size();
    OP_REQUIRES(ctx, static_cast<int>(combiners_.size()) == k,
                InvalidArgument("combiners must have ", k, " entries."));
    const Tensor& positions = ctx->input(5 * k);
    const Tensor& training_t = ctx->input(5 * k + 1);
    OP_REQUIRES_OK(ctx, CheckScalar(training_t, "training"));
    const bool training = training_t.scalar<bool>()();
    LockedHbmTables locked;
    OP_REQUIRES_OK(ctx, locked.Open(ctx, k));
    std::vector<std::string> names(k);
    int64_t total = 0;
    for (int t = 0; t < k; ++t) {
      HbmEvTable* table = locked.refs[t].get();
      names[t] = table->name;
      OP_REQUIRES(ctx, table->desc.dim == dim_,
                  InvalidArgument(names[t], ": has embedding_dim ",
                                  table->desc.dim, ", the group ", dim_,
                                  "."));
      OP_REQUIRES_OK(ctx, CheckRaggedShapes(names[t], keys[t], splits[t],
                                            weights[t]));
      OP_REQUIRES(ctx, defaults[t].dims() == 2 &&
                           defaults[t].dim_size(0) >= 1 &&
                           defaults[t].dim_size(1) == dim_,
                  InvalidArgument(names[t], ": default_values must be [>= 1, ",
                                  dim_, "], got ",
                                  defaults[t].shape().DebugString(), "."));
      total += keys[t].NumElements();
    }
    OP_REQUIRES(ctx, positions.dims() == 1,
                InvalidArgument("positions must be a vector."));
    for (int t = 0; t < k; ++t) {
      OP_REQUIRES(ctx, positions.NumElements() >= keys[t].NumElements(),
                  InvalidArgument(names[t], ": positions holds ",
                                  positions.NumElements(), " entries for ",
                                  keys[t].NumElements(), " keys."));
    }
    Tensor* rows = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(k, TensorShape({total, dim_}),
                                             &rows));
    void* stream = StreamOf(ctx);
    // 1. The rows every key reads, [sum nnz, D], features in order.
    std::vector<GeEvTable> descs(locked.distinct.size());
    for (int t = 0; t < k; ++t) {
      // A table's defaults: those of its first feature (all the same).
      GeEvTable& d = descs[locked.index[t]];
      if (d.keys == nullptr) {
        d = locked.refs[t]->With(DataOr<float>(defaults[t]),
                                 defaults[t].dim_size(0));
      }
    }
    Tensor counters_t;
    void* counters = nullptr;
    OP_REQUIRES_OK(ctx, Temp(ctx, 8 * GE_EV_NUM_COUNTERS, &counters_t,
                             &counters));
    auto* c = static_cast<unsigned long long*>(counters);
    OP_REQUIRES_OK(ctx, CoreStatus("zeroing the counters",
                                   ge_zero_async(counters,
                                                 8 * GE_EV_NUM_COUNTERS,
                                                 stream)));
    // HBM_DRAM: every table's keys of the call held in host memory move
    // back first (one import a table, one wait to read all the keys).
    std::vector<PromoteRequest> requests(locked.distinct.size());
    for (size_t u = 0; u < locked.distinct.size(); ++u) {
      requests[u].table = locked.distinct[u];
    }
    for (int t = 0; t < k; ++t) {
      if (keys[t].NumElements() == 0) continue;
      requests[locked.index[t]].spans.emplace_back(DataOr<int64_t>(keys[t]),
                                                   keys[t].NumElements());
    }
    OP_REQUIRES_OK(ctx, PromoteAll(ctx, requests, stream));
    float* out = DataOr<float>(*rows);
    std::vector<int64_t> offset(k + 1, 0);
    for (int t = 0; t < k; ++t) {
      offset[t + 1] = offset[t] + keys[t].NumElements();
    }
    // HBM_DRAM (training): each table's evicted output, and those to move
    // to host memory once their counts are read.
    std::vector<std::unique_ptr<DeviceRecords>> evicted_rows(descs.size());
    std::vector<EvictedOf> given_up;
    if (!training) {
      for (int t = 0; t < k; ++t) {
        const int64_t n = keys[t].NumElements();
        if (n == 0) continue;
        OP_REQUIRES_OK(ctx, CoreStatus(names[t], ge_ev_find(
            &descs[locked.index[t]], DataOr<int64_t>(keys[t]), n,
            out + offset[t] * dim_, nullptr, c, stream)));
      }
    } else {
      // One group call per distinct step (tables trained together share
      // theirs): each table stamps its own last applied step. A filtered
      // table read by several features takes them one call after the
      // other (the n-th in call n): as on the CPU EV, a feature reads the
      // counts the features before it raised (a key they admitted reads
      // its row), where one call on their concatenation would read every
      // occurrence as before the call.
      std::map<std::pair<int64_t, int>, std::vector<int>> by_step;
      std::vector<int> seen(locked.distinct.size(), 0);
      for (int t = 0; t < k; ++t) {
        const int u = locked.index[t];
        const int wave =
            locked.distinct[u]->desc.filter_freq > 0 ? seen[u]++ : 0;
        by_step[{locked.refs[t]->step, wave}].push_back(t);
      }
      // HBM_DRAM: what a table gives up goes to an evicted output with
      // room for all its keys of the call (an insert evicts one key at
      // most), then to its host tier.
      const size_t nd = descs.size();
      std::vector<GeEvEvicted> evicted(nd);
      bool any_tier = false;
      for (size_t u = 0; u < nd; ++u) {
        std::memset(&evicted[u], 0, sizeof(evicted[u]));
        HbmEvTable* table = locked.distinct[u];
        if (table->tier == nullptr) continue;
        int64_t n = 0;
        for (int t = 0; t < k; ++t) {
          if (locked.index[t] == static_cast<int>(u)) {
            n += keys[t].NumElements();
          }
        }
        if (n == 0) continue;
        any_tier = true;
        evicted_rows[u] = std::make_unique<DeviceRecords>();
        OP_REQUIRES_OK(ctx, evicted_rows[u]->Allocate(ctx, *table, n));
        OP_REQUIRES_OK(ctx, evicted_rows[u]->AsEvicted(*table, stream,
                                                       &evicted[u]));
      }
      // The later calls' stored keys are stamped first (version = step:
      // pinned), so that an insert of an earlier call gives none of them
      // up before it is read, as in one call.
      for (const auto& entry : by_step) {
        if (entry.first.second == 0) continue;
        for (int t : entry.second) {
          const int64_t n = keys[t].NumElements();
          if (n == 0) continue;
          Tensor unused;  // the stamp's slots of the keys
          OP_REQUIRES_OK(ctx, Allocate(ctx, DT_INT64, TensorShape({n}),
                                       &unused));
          OP_REQUIRES_OK(ctx, CoreStatus(names[t], ge_ev_stamp(
              &descs[locked.index[t]], DataOr<int64_t>(keys[t]), n,
              entry.first.first, DataOr<int64_t>(unused), c, stream)));
        }
      }
      for (const auto& entry : by_step) {
        std::vector<GeEvBatch> batches;
        for (int t : entry.second) {
          GeEvBatch b;
          std::memset(&b, 0, sizeof(b));
          b.table = locked.index[t];
          b.keys = DataOr<int64_t>(keys[t]);
          b.n = keys[t].NumElements();
          b.out = b.n ? out + offset[t] * dim_ : nullptr;
          batches.push_back(b);
        }
        const int nt = static_cast<int>(descs.size());
        const int nb = static_cast<int>(batches.size());
        const size_t bytes =
            ge_ev_group_scratch_bytes(descs.data(), nt, batches.data(), nb);
        OP_REQUIRES(ctx, bytes > 0,
                    InvalidArgument(name(), ": the CUDA core refused the "
                                    "tables of the group."));
        Tensor scratch_t;
        void* scratch = nullptr;
        OP_REQUIRES_OK(ctx, Temp(ctx, bytes, &scratch_t, &scratch));
        OP_REQUIRES_OK(ctx, CoreStatus(name(), ge_ev_find_or_insert_group(
            descs.data(), nt, batches.data(), nb, entry.first.first,
            any_tier ? evicted.data() : nullptr, scratch, bytes, c,
            stream)));
      }
      for (size_t u = 0; u < nd; ++u) {
        if (evicted_rows[u] == nullptr) continue;
        given_up.push_back({locked.distinct[u], evicted_rows[u].get(), 0});
      }
      // Their counts come with the counters' wait below.
      for (EvictedOf& e : given_up) {
        OP_REQUIRES_OK(ctx, CoreStatus(name(), EnqueueCount(
                                                   *e.out, &e.count,
                                                   stream)));
      }
    }
    // Keys given up to host tiers: their counts are read now, their
    // records with the pooling's error counts, and they move before any
    // error (nothing is lost). Otherwise the table's counters are read
    // with the pooling's error counts, in one wait.
    const std::string all_names = absl::StrJoin(names, ", ");
    uint64_t host[GE_EV_NUM_COUNTERS] = {0, 0, 0, 0};
    StagingMemory staging(ctx);
    PendingDemote demoted(given_up, stream);
    if (!given_up.empty()) {
      OP_REQUIRES_OK(ctx, ReadCounters(stream, counters_t, host,
                                       GE_EV_NUM_COUNTERS));
      // Their records come with the pooling's error counts.
      const int code = DemoteCopies(given_up, &staging, stream,
                                    demoted.records());
      if (code != GE_OK) demoted.records()->clear();  // not all copied
      OP_REQUIRES_OK(ctx, CoreStatus(all_names + ": moving evicted keys to "
                                     "host memory", code));
    }
    // 2. Pooled: row j of feature t's block is its key j's row.
    OpOutputList pooled;
    OP_REQUIRES_OK(ctx, ctx->output_list("pooled", &pooled));
    CoreGroup group(k);
    for (int t = 0; t < k; ++t) {
      GeTable& d = group.descs[t];
      std::memset(&d, 0, sizeof(d));
      d.nnz = keys[t].NumElements();
      d.table = d.nnz ? out + offset[t] * dim_ : nullptr;
      d.vocab = d.nnz;
      d.ids = d.nnz ? DataOr<int64_t>(positions) : nullptr;
      d.splits = DataOr<int64_t>(splits[t]);
      d.weights = DataOr<float>(weights[t]);
      d.batch = splits[t].NumElements() - 1;
      d.combiner = combiners_[t];
      Tensor* o = nullptr;
      OP_REQUIRES_OK(ctx, pooled.allocate(
                              t, TensorShape({pool_ ? d.batch : 0, dim_}),
                              &o));
      d.out = DataOr<float>(*o);
      d.out_stride = dim_;
      group.SetIds(t, positions);
      group.vocabs[t] = d.nnz;
    }
    CoreScratch s;
    uint64_t errors[GE_NUM_ERRORS] = {0, 0};
    int code = GE_OK;
    if (pool_) {
      OP_REQUIRES_OK(ctx, s.Allocate(ctx, ge_lookup_scratch_bytes(k),
                                     stream));
      OP_REQUIRES_OK(ctx, CoreStatus(name(), ge_lookup_pooled(
          group.descs.data(), k, dim_, max_norm_, s.scratch, s.bytes,
          s.errors(), stream)));
      code = ge_copy_async(errors, s.counters, sizeof(errors), 1, stream);
    }
    if (code == GE_OK && given_up.empty()) {
      code = ge_copy_async(host, counters_t.flat<uint8_t>().data(),
                           sizeof(host), 1, stream);
    }
    if (code == GE_OK) code = ge_synchronize(stream);
    OP_REQUIRES_OK(ctx, CoreStatus("reading the error counts", code));
    // Before any error: the keys given up are kept.
    demoted.Put();
    // A table's error first: a key it could not store read no row.
    OP_REQUIRES_OK(ctx, TableErrors(all_names, host));
    OP_REQUIRES_OK(ctx, CheckCounts(stream, errors, names, group));
    // Every key of the call is in its table now.
    for (HbmEvTable* table : locked.distinct) {
      if (table->tier == nullptr) continue;
      table->looked_up.clear();
      table->looked_up_puts = table->tier->puts();
    }
    for (int t = 0; t < k; ++t) {
      HbmEvTable* table = locked.refs[t].get();
      if (table->tier != nullptr) table->looked_up.push_back(keys[t]);
    }
  }

 private:
  std::vector<int32_t> combiners_;
  int64_t dim_;
  bool pool_ = true;
  float max_norm_;
};

// ---------------------------------------------------------------------------
// Optimizer step of a group of EVs, one core update for all of them:
// ge_ev_stamp per EV (each key's row, -1 for keys absent or not
// admitted, which the update skips; every stored key's version), then
// ONE ge_backward_apply over every EV's table and slots in place,
// duplicates summed. Entry t of each list is EV t's; every EV appears
// once (the features of a table two features read come joined).
// Two uses, one op:
// * the fused backward-apply of a lookup: `keys`, `row_splits`,
//   `weights` of one feature of the forward, `grads` its pooled output's
//   gradient [B, D], the forward's combiners and max_norm: the per-key
//   gradients are never written;
// * a gradient given per key (IndexedSlices): row_splits 0 .. n (a key a
//   row), no weights, `grads` [n, D], sum, no max_norm.
// `keys_checked`: the keys are the forward lookup's of the same step,
// which refused the reserved key already; then the counters are not
// read back, and the op never waits for the stream but once to read the
// keys of all its HBM_DRAM EVs whose host tiers hold keys (PromoteAll).
// ---------------------------------------------------------------------------
REGISTER_OP("GroupEmbeddingHbmEVApply")
    .Input("handles: num_tables * resource")
    .Input("keys: num_tables * int64")
    .Input("row_splits: num_tables * int64")
    .Input("weights: num_tables * float")
    .Input("grads: num_tables * float")
    .Input("global_step: int64")
    .Input("hyper: float")
    .Attr("num_tables: int >= 1")
    .Attr("combiners: list(string)")
    .Attr("max_norm: float = -1.0")
    .Attr("optimizer: {'sgd', 'adagrad', 'adam', 'ftrl', 'adagrad_decay'}")
    .Attr("slot_names: list(string) >= 0")
    .Attr("keys_checked: bool = false")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::NoOutputs);

class ApplyOp : public OpKernel {
 public:
  explicit ApplyOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string optimizer;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("optimizer", &optimizer));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("slot_names", &slots_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("keys_checked", &keys_checked_));
    OP_REQUIRES_OK(ctx, CombinersAttr(ctx, &combiners_));
    OP_REQUIRES_OK(ctx, GetMaxNorm(ctx, &max_norm_));
    kind_ = optimizer == "sgd"       ? GE_OPT_SGD
            : optimizer == "adagrad" ? GE_OPT_ADAGRAD
            : optimizer == "adam"    ? GE_OPT_ADAM
            : optimizer == "ftrl"    ? GE_OPT_FTRL
                                     : GE_OPT_ADAGRAD_DECAY;
    const size_t need = kind_ == GE_OPT_SGD ? 0 : kind_ == GE_OPT_ADAGRAD ? 1
                                                                          : 2;
    OP_REQUIRES(ctx, slots_.size() == need,
                InvalidArgument(optimizer, " needs ", need,
                                " slot names, got ", slots_.size(), "."));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList keys, splits, weights, grads;
    OP_REQUIRES_OK(ctx, ctx->input_list("keys", &keys));
    OP_REQUIRES_OK(ctx, ctx->input_list("row_splits", &splits));
    OP_REQUIRES_OK(ctx, ctx->input_list("weights", &weights));
    OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
    const int k = keys.size();
    OP_REQUIRES(ctx, static_cast<int>(combiners_.size()) == k,
                InvalidArgument("combiners must have ", k, " entries."));
    const Tensor& step_t = ctx->input(5 * k);
    const Tensor& hyper = ctx->input(5 * k + 1);
    OP_REQUIRES_OK(ctx, CheckScalar(step_t, "global_step"));
    const int64_t step = step_t.scalar<int64_t>()();
    OP_REQUIRES(ctx, hyper.dims() == 1 && hyper.NumElements() == 8,
                InvalidArgument("hyper must have 8 values."));
    const float* h = hyper.flat<float>().data();
    const GeOptimizerConfig config = {kind_, 0,    h[0], h[1], h[2],
                                      h[3],  h[4], h[5], h[6], h[7]};
    LockedHbmTables locked;
    OP_REQUIRES_OK(ctx, locked.Open(ctx, k));
    OP_REQUIRES(ctx, static_cast<int>(locked.distinct.size()) == k,
                InvalidArgument("an EV appears twice in one update (",
                                TableNames(locked), "); sum its gradients "
                                "first."));
    const int64_t dim = locked.refs[0]->desc.dim;
    // Each EV's slot planes, in the optimizer's order.
    std::vector<std::vector<int>> idx(k);
    for (int t = 0; t < k; ++t) {
      HbmEvTable* table = locked.refs[t].get();
      const std::string& var = table->name;
      OP_REQUIRES(ctx, table->desc.dim == dim,
                  InvalidArgument(var, ": has embedding_dim ",
                                  table->desc.dim, ", the group ", dim,
                                  "."));
      OP_REQUIRES_OK(ctx, CheckRaggedShapes(var, keys[t], splits[t],
                                            weights[t]));
      OP_REQUIRES_OK(ctx, CheckMatrix(var + ": gradient", grads[t],
                                      splits[t].NumElements() - 1, dim));
      for (const auto& s : slots_) {
        idx[t].push_back(table->SlotIndex(s));
        OP_REQUIRES(ctx, idx[t].back() >= 0,
                    InvalidArgument(var, ": optimizer slot '", s,
                                    "' was not created; build the "
                                    "optimizer first."));
      }
    }
    void* stream = StreamOf(ctx);
    Tensor counters_t;
    void* counters = nullptr;
    OP_REQUIRES_OK(ctx, Temp(ctx, 8 * GE_EV_NUM_COUNTERS, &counters_t,
                             &counters));
    OP_REQUIRES_OK(ctx, CoreStatus("zeroing the counters",
                                   ge_zero_async(counters,
                                                 8 * GE_EV_NUM_COUNTERS,
                                                 stream)));
    // HBM_DRAM: keys held in host memory move back to be updated (at
    // this step: an import evicts no key this step has stamped).
    std::vector<PromoteRequest> requests(k);
    for (int t = 0; t < k; ++t) {
      requests[t].table = locked.refs[t].get();
      requests[t].table->step = std::max(requests[t].table->step, step);
      if (keys[t].NumElements() == 0) continue;
      // The keys of the step's lookup, none moved out since: in place.
      if (requests[t].table->InTableSinceLookup(keys[t])) continue;
      requests[t].spans.emplace_back(DataOr<int64_t>(keys[t]),
                                     keys[t].NumElements());
    }
    OP_REQUIRES_OK(ctx, PromoteAll(ctx, requests, stream));
    std::vector<Tensor> slot_of(k);
    CoreGroup group(k);
    int updated = 0;  // tables with keys, first in group.descs
    for (int t = 0; t < k; ++t) {
      HbmEvTable* table = locked.refs[t].get();
      const int64_t n = keys[t].NumElements();
      if (n == 0) continue;
      const GeEvTable desc = table->With(nullptr, 0);
      OP_REQUIRES_OK(ctx, Allocate(ctx, DT_INT64, TensorShape({n}),
                                   &slot_of[t]));
      int64_t* slots_of_keys = slot_of[t].flat<int64_t>().data();
      OP_REQUIRES_OK(ctx, CoreStatus(table->name, ge_ev_stamp(
          &desc, DataOr<int64_t>(keys[t]), n, step, slots_of_keys,
          static_cast<unsigned long long*>(counters), stream)));
      const int64_t cap = table->capacity();
      float* planes = DataOr<float>(table->slots);
      GeTable& d = group.descs[updated++];
      std::memset(&d, 0, sizeof(d));
      d.table = table->desc.values;
      d.vocab = cap;
      // Keys absent or not admitted have row -1: the core skips them
      // (the combiner's scale still counts them, as the forward did).
      d.ids = slots_of_keys;
      d.splits = DataOr<int64_t>(splits[t]);
      d.weights = DataOr<float>(weights[t]);
      d.nnz = n;
      d.batch = splits[t].NumElements() - 1;
      d.combiner = combiners_[t];
      d.grad = DataOr<float>(grads[t]);
      d.grad_stride = dim;
      d.slot0 = idx[t].size() > 0 ? planes + idx[t][0] * cap * dim : nullptr;
      d.slot1 = idx[t].size() > 1 ? planes + idx[t][1] * cap * dim : nullptr;
    }
    if (updated > 0) {
      const size_t bytes =
          ge_backward_scratch_bytes(group.descs.data(), updated, dim);
      OP_REQUIRES(ctx, bytes > 0,
                  InvalidArgument(TableNames(locked), ": the CUDA core "
                                  "refused the update's arguments."));
      CoreScratch s;
      OP_REQUIRES_OK(ctx, s.Allocate(ctx, bytes, stream));
      const int code = ge_backward_apply(
          group.descs.data(), updated, dim, max_norm_, &config, s.scratch,
          s.bytes, s.errors(), stream);
      // The names only on an error: this runs every step.
      if (code != GE_OK) {
        OP_REQUIRES_OK(ctx, CoreStatus(TableNames(locked), code));
      }
    }
    if (keys_checked_ || updated == 0) return;
    // The skipped keys are counted as bad ids by design; only the
    // reserved key is an error.
    uint64_t host[GE_EV_NUM_COUNTERS] = {0, 0, 0, 0};
    OP_REQUIRES_OK(ctx, ReadCounters(stream, counters_t, host,
                                     GE_EV_NUM_COUNTERS));
    OP_REQUIRES_OK(ctx, TableErrors(TableNames(locked), host));
  }

 private:
  static std::string TableNames(const LockedHbmTables& locked) {
    std::vector<std::string> names;
    for (const auto& ref : locked.refs) names.push_back(ref->name);
    return absl::StrJoin(names, ", ");
  }

  std::vector<std::string> slots_;
  std::vector<int32_t> combiners_;
  bool keys_checked_ = false;
  int32_t kind_;
  float max_norm_;
};

// ---------------------------------------------------------------------------
// Slots, size, export, import.
// ---------------------------------------------------------------------------
// Adds slot `slot_name` unless present: its array is `plane` ([capacity,
// D], every entry the slot's initial value, made by the caller's fill),
// copied in; the initial value new keys get is plane[0][0].
REGISTER_OP("GroupEmbeddingHbmEVEnsureSlot")
    .Input("handle: resource")
    .Input("plane: float")
    .Attr("slot_name: string")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::NoOutputs);

// Replaces a table's slots with `names`, their initial values `inits`
// ([S], device) and arrays `planes` ([S, capacity, D]).
Status SetSlotArrays(OpKernelContext* ctx, HbmEvTable* table,
                     const std::vector<std::string>& names,
                     const float* inits, const float* planes,
                     const float* old_planes, int64_t old_count,
                     void* stream) {
  const int64_t cap = table->capacity(), dim = table->desc.dim;
  const int64_t s_count = static_cast<int64_t>(names.size());
  if (s_count > 8) {
    return InvalidArgument(table->name, ": the HBM table holds at most 8 "
                           "optimizer slots, got ", s_count, ".");
  }
  Tensor slots, slot_inits;
  TF_RETURN_IF_ERROR(Allocate(ctx, DT_FLOAT, TensorShape({s_count, cap, dim}),
                              &slots));
  TF_RETURN_IF_ERROR(Allocate(ctx, DT_FLOAT, TensorShape({s_count}),
                              &slot_inits));
  const size_t plane_bytes = sizeof(float) * cap * dim;
  float* dst = DataOr<float>(slots);
  float* init_dst = DataOr<float>(slot_inits);
  int code = GE_OK;
  // The old planes first (ensure_slot), then the new ones.
  if (old_count > 0) {
    code = ge_copy_async(dst, old_planes, plane_bytes * old_count, 0, stream);
    if (code == GE_OK) {
      code = ge_copy_async(init_dst, DataOr<float>(table->slot_inits),
                           sizeof(float) * old_count, 0, stream);
    }
  }
  const int64_t fresh = s_count - old_count;
  if (code == GE_OK && fresh > 0) {
    code = ge_copy_async(dst + old_count * cap * dim, planes,
                         plane_bytes * fresh, 0, stream);
  }
  if (code == GE_OK && fresh > 0) {
    code = inits != nullptr
               ? ge_copy_async(init_dst + old_count, inits,
                               sizeof(float) * fresh, 0, stream)
               // ensure_slot: the plane's first entry.
               : ge_copy_async(init_dst + old_count, planes, sizeof(float),
                               0, stream);
  }
  TF_RETURN_IF_ERROR(CoreStatus(table->name + ": setting slots", code));
  // The old arrays are released when the stream is done with them: TF's
  // device allocators order frees after the stream's work.
  table->slots = slots;
  table->slot_inits = slot_inits;
  table->slot_names = names;
  table->SetSlots();
  return Status();
}

class EnsureSlotOp : public OpKernel {
 public:
  explicit EnsureSlotOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("slot_name", &slot_));
  }

  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<HbmEvTable> table;
    OP_REQUIRES_OK(ctx, GetTable(ctx, 0, &table));
    const Tensor& plane = ctx->input(1);
    ::tensorflow::mutex_lock lock(*table->mu());
    if (table->SlotIndex(slot_) >= 0) return;
    OP_REQUIRES(ctx, plane.dims() == 2 &&
                         plane.dim_size(0) == table->capacity() &&
                         plane.dim_size(1) == table->desc.dim,
                InvalidArgument(table->name, ": the slot's plane must be [",
                                table->capacity(), ", ", table->desc.dim,
                                "], got ", plane.shape().DebugString(), "."));
    std::vector<std::string> names = table->slot_names;
    names.push_back(slot_);
    const int64_t old = static_cast<int64_t>(table->slot_names.size());
    const Tensor keep = table->slots;  // alive until copied
    void* stream = StreamOf(ctx);
    OP_REQUIRES_OK(ctx, SetSlotArrays(ctx, table.get(), names, nullptr,
                                      DataOr<float>(plane),
                                      DataOr<float>(keep), old, stream));
    if (table->tier != nullptr) {
      // The host tier's keys get the slot's initial value too.
      float init = 0.0f;
      int code = ge_copy_async(&init, DataOr<float>(plane), sizeof(float), 1,
                               stream);
      if (code == GE_OK) code = ge_synchronize(stream);
      OP_REQUIRES_OK(ctx, CoreStatus(table->name + ": reading the slot's "
                                     "initial value", code));
      table->tier->AddSlot(init);
    }
  }

 private:
  std::string slot_;
};

// Number of stored keys, a host scalar (one wait).
Status StoredKeys(OpKernelContext* ctx, HbmEvTable* table, void* stream,
                  int64_t* n) {
  Tensor count_t;
  void* count = nullptr;
  TF_RETURN_IF_ERROR(Temp(ctx, 8, &count_t, &count));
  int code = ge_zero_async(count, 8, stream);
  const GeEvTable desc = table->With(nullptr, 0);
  if (code == GE_OK) {
    code = ge_ev_size(&desc, static_cast<unsigned long long*>(count),
                      stream);
  }
  uint64_t host = 0;
  if (code == GE_OK) code = ge_copy_async(&host, count, 8, 1, stream);
  if (code == GE_OK) code = ge_synchronize(stream);
  TF_RETURN_IF_ERROR(CoreStatus(table->name + ": counting keys", code));
  *n = static_cast<int64_t>(host);
  return Status();
}

REGISTER_OP("GroupEmbeddingHbmEVSize")
    .Input("handle: resource")
    .Output("size: int64")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape);

// The keys of the table of input 0: [in the GPU table, in host memory].
Status KeysPerTier(OpKernelContext* ctx, int64_t counts[2]) {
  ::tensorflow::core::RefCountPtr<HbmEvTable> table;
  TF_RETURN_IF_ERROR(GetTable(ctx, 0, &table));
  ::tensorflow::tf_shared_lock lock(*table->mu());
  TF_RETURN_IF_ERROR(StoredKeys(ctx, table.get(), StreamOf(ctx), &counts[0]));
  counts[1] = table->tier ? table->tier->size() : 0;
  return Status();
}

class SizeOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    int64_t counts[2] = {0, 0};
    OP_REQUIRES_OK(ctx, KeysPerTier(ctx, counts));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = counts[0] + counts[1];
  }
};

// Where the keys are: [keys in the GPU table, keys in host memory (0
// without a host tier)], a host vector (one wait).
REGISTER_OP("GroupEmbeddingHbmEVTierSizes")
    .Input("handle: resource")
    .Output("sizes: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(2));
      return Status();
    });

class TierSizesOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    int64_t counts[2] = {0, 0};
    OP_REQUIRES_OK(ctx, KeysPerTier(ctx, counts));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({2}), &out));
    out->vec<int64_t>()(0) = counts[0];
    out->vec<int64_t>()(1) = counts[1];
  }
};

// Every stored key with its state, under the table's lock: the CPU EV's
// export (GroupEmbeddingEVExport) but for the slots, [S, n, D] here
// (the caller lays them out as the CPU EV's [n, S * D]).
REGISTER_OP("GroupEmbeddingHbmEVExport")
    .Input("handle: resource")
    .Output("keys: int64")
    .Output("values: float")
    .Output("freqs: int64")
    .Output("versions: int64")
    .Output("slot_names: string")
    .Output("slot_inits: float")
    .Output("slots: float")
    .Output("step: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Matrix(c->UnknownDim(), c->UnknownDim()));
      c->set_output(2, c->Vector(c->UnknownDim()));
      c->set_output(3, c->Vector(c->UnknownDim()));
      c->set_output(4, c->Vector(c->UnknownDim()));
      c->set_output(5, c->Vector(c->UnknownDim()));
      c->set_output(6, c->UnknownShapeOfRank(3));
      c->set_output(7, c->Scalar());
      return Status();
    });

class ExportOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<HbmEvTable> table;
    OP_REQUIRES_OK(ctx, GetTable(ctx, 0, &table));
    ::tensorflow::mutex_lock lock(*table->mu());
    void* stream = StreamOf(ctx);
    int64_t in_table = 0;
    OP_REQUIRES_OK(ctx, StoredKeys(ctx, table.get(), stream, &in_table));
    // HBM_DRAM: the host tier's keys follow the table's.
    StagingMemory staging(ctx);
    EvTierRecords tier(&staging);
    if (table->tier != nullptr) table->tier->Export(&tier);
    const int64_t n = in_table + tier.size();
    const int64_t dim = table->desc.dim;
    const int64_t s_count = static_cast<int64_t>(table->slot_names.size());
    Tensor *keys, *values, *freqs, *versions, *names, *inits, *slots, *step;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &keys));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n, dim}),
                                             &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({n}), &freqs));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({n}),
                                             &versions));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(4, TensorShape({s_count}),
                                             &names));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(5, TensorShape({s_count}),
                                             &inits));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            6, TensorShape({s_count, n, dim}), &slots));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(7, TensorShape({}), &step));
    for (int64_t s = 0; s < s_count; ++s) {
      names->flat<::tensorflow::tstring>()(s) = table->slot_names[s];
    }
    step->scalar<int64_t>()() = table->step;
    int code = GE_OK;
    if (s_count > 0) {
      code = ge_copy_async(DataOr<float>(*inits),
                           DataOr<float>(table->slot_inits),
                           sizeof(float) * s_count, 0, stream);
    }
    OP_REQUIRES_OK(ctx, CoreStatus(table->name + ": exporting", code));
    if (tier.size() > 0) {
      code = RecordsToDevice(tier, in_table, n, dim, s_count,
                             DataOr<int64_t>(*keys), DataOr<float>(*values),
                             DataOr<float>(*slots), DataOr<int64_t>(*freqs),
                             DataOr<int64_t>(*versions), stream);
      // `tier` is read by the copies: wait before it goes.
      if (code == GE_OK) code = ge_synchronize(stream);
      OP_REQUIRES_OK(ctx, CoreStatus(table->name + ": exporting the keys "
                                     "in host memory", code));
    }
    if (in_table == 0) return;
    const GeEvTable desc = table->With(nullptr, 0);
    const size_t bytes = ge_ev_export_scratch_bytes(&desc);
    Tensor scratch_t, count_t;
    void *scratch = nullptr, *count = nullptr;
    OP_REQUIRES_OK(ctx, Temp(ctx, bytes, &scratch_t, &scratch));
    OP_REQUIRES_OK(ctx, Temp(ctx, 8, &count_t, &count));
    code = ge_zero_async(count, 8, stream);
    if (code == GE_OK) {
      code = ge_ev_export(&desc, DataOr<int64_t>(*keys),
                          DataOr<float>(*values), DataOr<float>(*slots),
                          DataOr<int64_t>(*freqs), DataOr<int64_t>(*versions),
                          n, static_cast<unsigned long long*>(count), scratch,
                          bytes, stream);
    }
    uint64_t got = 0;
    if (code == GE_OK) code = ge_copy_async(&got, count, 8, 1, stream);
    if (code == GE_OK) code = ge_synchronize(stream);
    OP_REQUIRES_OK(ctx, CoreStatus(table->name + ": exporting", code));
    OP_REQUIRES(ctx, static_cast<int64_t>(got) == in_table,
                ::tensorflow::errors::Internal(
                    table->name, ": the export found ", got, " keys, the "
                    "count ", in_table, "."));
  }
};

// Replaces the whole content with an export snapshot: keys [n], values
// [n, D], freqs, versions [n], slot names [S], their initial values [S],
// their arrays `planes` [S, capacity, D] filled with those values by the
// caller, the snapshot's slots [S, n, D] and its step.
REGISTER_OP("GroupEmbeddingHbmEVImport")
    .Input("handle: resource")
    .Input("keys: int64")
    .Input("values: float")
    .Input("freqs: int64")
    .Input("versions: int64")
    .Input("slot_names: string")
    .Input("slot_inits: float")
    .Input("planes: float")
    .Input("slots: float")
    .Input("step: int64")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::NoOutputs);

class ImportOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<HbmEvTable> table;
    OP_REQUIRES_OK(ctx, GetTable(ctx, 0, &table));
    const std::string& var = table->name;
    const Tensor& keys = ctx->input(1);
    const Tensor& values = ctx->input(2);
    const Tensor& freqs = ctx->input(3);
    const Tensor& versions = ctx->input(4);
    const Tensor& names_t = ctx->input(5);
    const Tensor& inits = ctx->input(6);
    const Tensor& planes = ctx->input(7);
    const Tensor& slots = ctx->input(8);
    OP_REQUIRES_OK(ctx, CheckScalar(ctx->input(9), "step"));
    const int64_t step = ctx->input(9).scalar<int64_t>()();
    const int64_t dim = table->desc.dim, cap = table->capacity();
    OP_REQUIRES(ctx, keys.dims() == 1,
                InvalidArgument(var, ": keys must be a vector."));
    const int64_t n = keys.NumElements();
    OP_REQUIRES_OK(ctx, CheckMatrix(var + ": values", values, n, dim));
    OP_REQUIRES(ctx, freqs.dims() == 1 && freqs.NumElements() == n &&
                         versions.dims() == 1 && versions.NumElements() == n,
                InvalidArgument(var, ": freqs and versions must be [", n,
                                "]."));
    OP_REQUIRES(ctx, names_t.dims() == 1,
                InvalidArgument(var, ": slot_names must be a vector."));
    const int64_t s_count = names_t.NumElements();
    OP_REQUIRES(ctx, inits.dims() == 1 && inits.NumElements() == s_count,
                InvalidArgument(var, ": slot_inits must be [", s_count,
                                "]."));
    OP_REQUIRES(ctx, planes.dims() == 3 && planes.dim_size(0) == s_count &&
                         planes.dim_size(1) == cap &&
                         planes.dim_size(2) == dim,
                InvalidArgument(var, ": planes must be [", s_count, ", ",
                                cap, ", ", dim, "], got ",
                                planes.shape().DebugString(), "."));
    OP_REQUIRES(ctx, slots.dims() == 3 && slots.dim_size(0) == s_count &&
                         slots.dim_size(1) == n && slots.dim_size(2) == dim,
                InvalidArgument(var, ": slots must be [", s_count, ", ", n,
                                ", ", dim, "], got ",
                                slots.shape().DebugString(), "."));
    OP_REQUIRES(ctx, n <= cap || table->tier != nullptr,
                ResourceExhausted(var, ": the checkpoint holds ", n,
                                  " keys, the HBM table ", cap, "; raise "
                                  "storage_size[0]."));
    std::vector<std::string> names;
    for (int64_t s = 0; s < s_count; ++s) {
      names.push_back(names_t.flat<::tensorflow::tstring>()(s));
    }
    ::tensorflow::mutex_lock lock(*table->mu());
    void* stream = StreamOf(ctx);
    OP_REQUIRES_OK(ctx, SetSlotArrays(ctx, table.get(), names,
                                      DataOr<float>(inits),
                                      DataOr<float>(planes), nullptr, 0,
                                      stream));
    table->step = step;
    const GeEvTable desc = table->With(nullptr, 0);
    OP_REQUIRES_OK(ctx, CoreStatus(var + ": clearing",
                                   ge_ev_init(&desc, stream)));
    if (table->tier != nullptr) {
      // HBM_DRAM: every key goes to host memory, then the hottest come
      // back (below); the steps that read the others bring them back.
      table->tier->Clear(s_count);
      if (n == 0) return;
      StagingMemory staging(ctx);
      EvTierRecords rec(&staging);
      int code = RecordsToHost(
          DataOr<int64_t>(keys), DataOr<float>(values), DataOr<float>(slots),
          DataOr<int64_t>(freqs), DataOr<int64_t>(versions), n, n, dim,
          s_count, &rec, stream);
      if (code == GE_OK) code = ge_synchronize(stream);
      OP_REQUIRES_OK(ctx, CoreStatus(var + ": importing into host memory",
                                     code));
      table->tier->Put(rec);
      // The hottest keys by the cache strategy (LFU: freq, then version;
      // LRU: version, then freq; ties by key) go back to the GPU table,
      // up to half its capacity (a bucket then rarely overflows; keys
      // that do not fit stay in host memory): the first steps find them.
      const int64_t seed = std::min(n, cap / 2);
      std::vector<int64_t> order(n);
      for (int64_t i = 0; i < n; ++i) order[i] = i;
      const bool lfu = table->desc.policy == GE_EV_LFU;
      auto hotter = [&](int64_t a, int64_t b) {
        const int64_t pa = lfu ? rec.freq[a] : rec.version[a];
        const int64_t pb = lfu ? rec.freq[b] : rec.version[b];
        if (pa != pb) return pa > pb;
        const int64_t qa = lfu ? rec.version[a] : rec.freq[a];
        const int64_t qb = lfu ? rec.version[b] : rec.freq[b];
        if (qa != qb) return qa > qb;
        return rec.keys[a] < rec.keys[b];
      };
      std::partial_sort(order.begin(), order.begin() + seed, order.end(),
                        hotter);
      std::pmr::vector<int64_t> hot(seed, &staging);
      for (int64_t i = 0; i < seed; ++i) hot[i] = rec.keys[order[i]];
      Tensor hot_t;
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(DT_INT64, TensorShape({seed}),
                                             &hot_t));
      OP_REQUIRES_OK(ctx, CoreStatus(var + ": seeding the GPU table",
                                     ge_copy_async(DataOr<int64_t>(hot_t),
                                                   hot.data(),
                                                   sizeof(int64_t) * seed, 2,
                                                   stream)));
      OP_REQUIRES_OK(ctx, Promote(ctx, table.get(),
                                  {{DataOr<int64_t>(hot_t), seed}}, stream,
                                  /*full_is_error=*/false));
      return;
    }
    if (n == 0) return;
    const size_t bytes = ge_ev_scratch_bytes(&desc, n);
    OP_REQUIRES(ctx, bytes > 0,
                InvalidArgument(var, ": the CUDA core refused the import."));
    Tensor scratch_t, counters_t;
    void *scratch = nullptr, *counters = nullptr;
    OP_REQUIRES_OK(ctx, Temp(ctx, bytes, &scratch_t, &scratch));
    OP_REQUIRES_OK(ctx, Temp(ctx, 8 * GE_EV_NUM_COUNTERS, &counters_t,
                             &counters));
    int code = ge_zero_async(counters, 8 * GE_EV_NUM_COUNTERS, stream);
    if (code == GE_OK) {
      code = ge_ev_insert(&desc, DataOr<int64_t>(keys), n,
                          DataOr<float>(values), DataOr<float>(slots),
                          DataOr<int64_t>(freqs), DataOr<int64_t>(versions),
                          step, nullptr, scratch, bytes,
                          static_cast<unsigned long long*>(counters), stream);
    }
    OP_REQUIRES_OK(ctx, CoreStatus(var + ": importing", code));
    uint64_t host[GE_EV_NUM_COUNTERS] = {0, 0, 0, 0};
    OP_REQUIRES_OK(ctx, ReadCounters(stream, counters_t, host,
                                     GE_EV_NUM_COUNTERS));
    OP_REQUIRES_OK(ctx, TableErrors(var, host));
  }
};

// The eviction policy (GlobalStepEvict when steps_to_live > 0, else
// L2WeightEvict when l2_threshold >= 0) against the last step an update
// applied, as the CPU EV's GroupEmbeddingEVEvict uses its current step:
// ge_ev_evict removes the doomed keys; returns how many.
REGISTER_OP("GroupEmbeddingHbmEVEvict")
    .Input("handle: resource")
    .Output("num_evicted: int64")
    .Attr("steps_to_live: int >= 0 = 0")
    .Attr("l2_threshold: float = -1.0")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape);

class EvictOp : public OpKernel {
 public:
  explicit EvictOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("steps_to_live", &steps_to_live_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("l2_threshold", &l2_threshold_));
  }

  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<HbmEvTable> table;
    OP_REQUIRES_OK(ctx, GetTable(ctx, 0, &table));
    ::tensorflow::mutex_lock lock(*table->mu());
    void* stream = StreamOf(ctx);
    Tensor counters_t;
    void* counters = nullptr;
    OP_REQUIRES_OK(ctx, Temp(ctx, 8 * GE_EV_NUM_COUNTERS, &counters_t,
                             &counters));
    const GeEvTable desc = table->With(nullptr, 0);
    // Recording removals: the evicted output, room for every stored key
    // (the core fills all its arrays; only the keys are kept).
    const bool record = table->track_evicted && DoesEvict();
    int64_t n = 0;
    if (record) {
      OP_REQUIRES_OK(ctx, StoredKeys(ctx, table.get(), stream, &n));
    }
    const int64_t dim = desc.dim, slots = desc.num_slots;
    Tensor keys_t, values_t, slots_t, freq_t, version_t, count_t;
    GeEvEvicted out_ev{};
    if (record && n > 0) {
      OP_REQUIRES_OK(ctx, Allocate(ctx, DT_INT64, TensorShape({n}),
                                   &keys_t));
      OP_REQUIRES_OK(ctx, Allocate(ctx, DT_FLOAT, TensorShape({n, dim}),
                                   &values_t));
      OP_REQUIRES_OK(ctx, Allocate(ctx, DT_FLOAT,
                                   TensorShape({slots, n, dim}), &slots_t));
      OP_REQUIRES_OK(ctx, Allocate(ctx, DT_INT64, TensorShape({n}),
                                   &freq_t));
      OP_REQUIRES_OK(ctx, Allocate(ctx, DT_INT64, TensorShape({n}),
                                   &version_t));
      void* count = nullptr;
      OP_REQUIRES_OK(ctx, Temp(ctx, 8, &count_t, &count));
      out_ev.keys = DataOr<int64_t>(keys_t);
      out_ev.values = DataOr<float>(values_t);
      out_ev.slots = slots > 0 ? DataOr<float>(slots_t) : nullptr;
      out_ev.freq = DataOr<int64_t>(freq_t);
      out_ev.version = DataOr<int64_t>(version_t);
      out_ev.capacity = n;
      out_ev.count = static_cast<unsigned long long*>(count);
    }
    const bool with_output = out_ev.count != nullptr;
    int code = ge_zero_async(counters, 8 * GE_EV_NUM_COUNTERS, stream);
    if (code == GE_OK && with_output) {
      code = ge_zero_async(out_ev.count, 8, stream);
    }
    if (code == GE_OK) {
      code = ge_ev_evict(&desc, table->step, steps_to_live_, l2_threshold_,
                         with_output ? &out_ev : nullptr,
                         static_cast<unsigned long long*>(counters), stream);
    }
    OP_REQUIRES_OK(ctx, CoreStatus(table->name + ": evicting", code));
    uint64_t host[GE_EV_NUM_COUNTERS] = {0, 0, 0, 0};
    OP_REQUIRES_OK(ctx, ReadCounters(stream, counters_t, host,
                                     GE_EV_NUM_COUNTERS));
    if (with_output) {
      // Room for every stored key: the output cannot overflow, so every
      // evicted key is counted in GE_EV_EVICTED and written.
      const int64_t got = static_cast<int64_t>(host[GE_EV_EVICTED]);
      OP_REQUIRES(ctx, got <= n && host[GE_EV_FULL] == 0,
                  ::tensorflow::errors::Internal(
                      table->name, ": evicted ", got, " of ", n, " keys."));
      const size_t at = table->evicted_keys.size();
      table->evicted_keys.resize(at + got);
      code = got == 0 ? GE_OK
                      : ge_copy_async(table->evicted_keys.data() + at,
                                      out_ev.keys, sizeof(int64_t) * got, 1,
                                      stream);
      if (code == GE_OK) code = ge_synchronize(stream);
      if (code != GE_OK) table->evicted_keys.resize(at);
      // Lost removals would leave evicted keys in a delta's replay: the
      // next incremental save must then be full.
      if (code != GE_OK) table->evicted_lost = true;
      OP_REQUIRES_OK(ctx, CoreStatus(table->name + ": reading evicted keys",
                                     code));
    }
    int64_t removed = static_cast<int64_t>(host[GE_EV_EVICTED]);
    if (table->tier != nullptr) {
      // HBM_DRAM: the same rules on the keys in host memory.
      std::vector<int64_t> gone;
      removed += table->tier->Evict(table->step, steps_to_live_,
                                    l2_threshold_, &gone);
      if (record) {
        table->evicted_keys.insert(table->evicted_keys.end(), gone.begin(),
                                   gone.end());
      }
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = removed;
  }

 private:
  bool DoesEvict() const {
    return steps_to_live_ > 0 || l2_threshold_ >= 0.0f;
  }

  int64_t steps_to_live_;
  float l2_threshold_;
};

// The keys the eviction policy removed since the previous call (host,
// in eviction order, duplicates possible when a key came back and went
// again), and whether some were lost (a failed copy: no delta can list
// them). The first call starts the recording, as the CPU EV starts
// recording removals at its first incremental export.
REGISTER_OP("GroupEmbeddingHbmEVTakeEvicted")
    .Input("handle: resource")
    .Output("keys: int64")
    .Output("lost: bool")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Scalar());
      return Status();
    });

class TakeEvictedOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<HbmEvTable> table;
    OP_REQUIRES_OK(ctx, GetTable(ctx, 0, &table));
    ::tensorflow::mutex_lock lock(*table->mu());
    const int64_t n = static_cast<int64_t>(table->evicted_keys.size());
    Tensor *keys = nullptr, *lost = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &keys));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &lost));
    if (n > 0) {
      std::memcpy(keys->flat<int64_t>().data(), table->evicted_keys.data(),
                  sizeof(int64_t) * n);
    }
    lost->scalar<bool>()() = table->evicted_lost;
    table->evicted_keys.clear();
    table->evicted_keys.shrink_to_fit();
    table->evicted_lost = false;
    table->track_evicted = true;
  }
};

// The names of the table's optimizer slots, in export order, and their
// initial values, without exporting the table: whether an incremental
// checkpoint can still extend its base (a delta cannot add a slot column
// to the keys it leaves out), and the slots a restore keeps (those the
// checkpoint lacks, as the CPU EV's import keeps them).
REGISTER_OP("GroupEmbeddingHbmEVSlotNames")
    .Input("handle: resource")
    .Output("slot_names: string")
    .Output("slot_inits: float")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Vector(c->UnknownDim()));
      return Status();
    });

class SlotNamesOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<HbmEvTable> table;
    OP_REQUIRES_OK(ctx, GetTable(ctx, 0, &table));
    ::tensorflow::tf_shared_lock lock(*table->mu());
    const int64_t s_count = static_cast<int64_t>(table->slot_names.size());
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({s_count}),
                                             &out));
    for (int64_t s = 0; s < s_count; ++s) {
      out->flat<::tensorflow::tstring>()(s) = table->slot_names[s];
    }
    Tensor* inits = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({s_count}),
                                             &inits));
    if (s_count == 0) return;
    OP_REQUIRES_OK(ctx, CoreStatus(
                            table->name + ": reading the slots' initial "
                            "values",
                            ge_copy_async(DataOr<float>(*inits),
                                          DataOr<float>(table->slot_inits),
                                          sizeof(float) * s_count, 0,
                                          StreamOf(ctx))));
  }
};

#ifdef GE_ADAPTOR_ON_HOST
#define GE_EV_KERNEL(op) Name(op).Device(::tensorflow::DEVICE_CPU)
#else
#define GE_EV_KERNEL(op) Name(op).Device(::tensorflow::DEVICE_GPU)
#endif

REGISTER_KERNEL_BUILDER(GE_EV_KERNEL("GroupEmbeddingHbmEVHandle")
                            .HostMemory("handle"),
                        HandleOp);
REGISTER_KERNEL_BUILDER(GE_EV_KERNEL("GroupEmbeddingHbmEVLookup")
                            .HostMemory("handles")
                            .HostMemory("training"),
                        LookupOp);
REGISTER_KERNEL_BUILDER(GE_EV_KERNEL("GroupEmbeddingHbmEVApply")
                            .HostMemory("handles")
                            .HostMemory("global_step")
                            .HostMemory("hyper"),
                        ApplyOp);
REGISTER_KERNEL_BUILDER(GE_EV_KERNEL("GroupEmbeddingHbmEVEnsureSlot")
                            .HostMemory("handle"),
                        EnsureSlotOp);
REGISTER_KERNEL_BUILDER(GE_EV_KERNEL("GroupEmbeddingHbmEVSize")
                            .HostMemory("handle")
                            .HostMemory("size"),
                        SizeOp);
REGISTER_KERNEL_BUILDER(GE_EV_KERNEL("GroupEmbeddingHbmEVTierSizes")
                            .HostMemory("handle")
                            .HostMemory("sizes"),
                        TierSizesOp);
REGISTER_KERNEL_BUILDER(GE_EV_KERNEL("GroupEmbeddingHbmEVExport")
                            .HostMemory("handle")
                            .HostMemory("slot_names")
                            .HostMemory("step"),
                        ExportOp);
REGISTER_KERNEL_BUILDER(GE_EV_KERNEL("GroupEmbeddingHbmEVImport")
                            .HostMemory("handle")
                            .HostMemory("slot_names")
                            .HostMemory("step"),
                        ImportOp);
REGISTER_KERNEL_BUILDER(GE_EV_KERNEL("GroupEmbeddingHbmEVEvict")
                            .HostMemory("handle")
                            .HostMemory("num_evicted"),
                        EvictOp);
REGISTER_KERNEL_BUILDER(GE_EV_KERNEL("GroupEmbeddingHbmEVSlotNames")
                            .HostMemory("handle")
                            .HostMemory("slot_names"),
                        SlotNamesOp);
REGISTER_KERNEL_BUILDER(GE_EV_KERNEL("GroupEmbeddingHbmEVTakeEvicted")
                            .HostMemory("handle")
                            .HostMemory("keys")
                            .HostMemory("lost"),
                        TakeEvictedOp);

}  // namespace
}  // namespace gpu_kernels
}  // namespace group_embedding

// CPU storage of EmbeddingVariable: a dynamic-vocabulary table keyed by
// arbitrary int64 keys, and the ops that read, train, export and evict it.
//
// Why one resource holds keys, values, frequencies, versions AND optimizer
// slots: every op sees all of them under one lock, so an export is a
// consistent snapshot of exactly one key set (DeepRec snapshots values and
// slots at different moments and can restore slots of other keys).
//
// Layout (per live key, D = embedding dim, S = slots):
//   hash map   uint32 row index per bucket, load factor in (0.4, 0.8]
//   rows       key int64, freq uint32, version uint32 (steps saturate at
//              2^32 - 1, to keep the overhead per key small), value float[D],
//              S parallel float[D] slot arenas
// Rows live in fixed-size chunks, so growth never moves a row; evicted
// rows go to a free list and are reused by the next insert.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"

namespace group_embedding_ev {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpInputList;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::ResourceHandle;
using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::errors::InvalidArgument;
using ::tensorflow::core::RefCountPtr;
using ::tensorflow::shape_inference::InferenceContext;

constexpr int kChunkShift = 10;  // 1024 rows per chunk
constexpr int64_t kChunkRows = int64_t{1} << kChunkShift;
constexpr uint32_t kEmpty = 0xffffffffu;

inline uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

// Rows of `width` Ts in chunks of kChunkRows rows: a row's address never
// changes once allocated.
template <typename T>
class ChunkedArray {
 public:
  explicit ChunkedArray(int64_t width = 1) : width_(width) {}
  T* Row(int64_t r) {
    return chunks_[r >> kChunkShift].get() + (r & (kChunkRows - 1)) * width_;
  }
  const T* Row(int64_t r) const {
    return chunks_[r >> kChunkShift].get() + (r & (kChunkRows - 1)) * width_;
  }
  void Reserve(int64_t rows) {
    while (static_cast<int64_t>(chunks_.size()) * kChunkRows < rows) {
      chunks_.emplace_back(new T[width_ * kChunkRows]());
    }
  }
  void Clear() { chunks_.clear(); }
  int64_t Bytes() const {
    return static_cast<int64_t>(chunks_.size()) * kChunkRows * width_ *
           sizeof(T);
  }

 private:
  int64_t width_;
  std::vector<std::unique_ptr<T[]>> chunks_;
};

inline const float* DefaultRowOf(int64_t key, const float* defaults,
                                 int64_t default_rows, int64_t dim) {
  int64_t m = key % default_rows;
  if (m < 0) m += default_rows;
  return defaults + m * dim;
}

inline uint32_t ClampStep(int64_t step) {
  return static_cast<uint32_t>(std::min<int64_t>(
      std::max<int64_t>(step, 0), std::numeric_limits<uint32_t>::max()));
}

struct EVConfig {
  std::string name;
  int64_t dim = 0;
  int64_t filter_freq = 0;      // 0: no CounterFilter
  float no_permission = 0.0f;   // value read by keys not admitted
  int64_t steps_to_live = 0;    // 0: no GlobalStepEvict
  float l2_threshold = -1.0f;   // < 0: no L2WeightEvict
};

class EVStorage : public tensorflow::ResourceBase {
 public:
  explicit EVStorage(const EVConfig& config)
      : config_(config), values_(config.dim) {
    buckets_.assign(64, kEmpty);
  }

  std::string DebugString() const override {
    return "EmbeddingVariable " + config_.name;
  }
  int64_t MemoryUsed() const override { return Bytes(); }

  tensorflow::mutex* mu() { return &mu_; }
  const EVConfig& config() const { return config_; }
  int64_t dim() const { return config_.dim; }
  int64_t size() const { return size_; }
  int64_t current_step() const { return current_step_; }
  void AdvanceStep(int64_t step) {
    current_step_ = std::max(current_step_, step);
  }

  // Row of `key`, or -1.
  int64_t Find(int64_t key) const {
    uint64_t h = Mix(static_cast<uint64_t>(key)) & mask();
    while (true) {
      const uint32_t r = buckets_[h];
      if (r == kEmpty) return -1;
      if (*keys_.Row(r) == key) return r;
      h = (h + 1) & mask();
    }
  }

  // Row of `key`, inserted (initialised from `defaults`, a
  // [default_rows, D] matrix, row key mod default_rows) if new.
  int64_t FindOrInsert(int64_t key, const float* defaults,
                       int64_t default_rows) {
    int64_t r = Find(key);
    if (r >= 0) return r;
    if ((size_ + 1) * 5 > static_cast<int64_t>(buckets_.size()) * 4) {
      Rehash(buckets_.size() * 2);
    }
    r = AllocateRow();
    *keys_.Row(r) = key;
    *freqs_.Row(r) = 0;
    *versions_.Row(r) = ClampStep(current_step_);
    std::memcpy(values_.Row(r), DefaultRowOf(key, defaults, default_rows, dim()),
                sizeof(float) * dim());
    for (size_t s = 0; s < slots_.size(); ++s) {
      std::fill(slots_[s].Row(r), slots_[s].Row(r) + dim(), slot_inits_[s]);
    }
    uint64_t h = Mix(static_cast<uint64_t>(key)) & mask();
    while (buckets_[h] != kEmpty) h = (h + 1) & mask();
    buckets_[h] = static_cast<uint32_t>(r);
    ++size_;
    return r;
  }

  // Removes `key` (backward-shift deletion keeps probes tombstone-free).
  void Erase(int64_t key) {
    uint64_t h = Mix(static_cast<uint64_t>(key)) & mask();
    while (buckets_[h] != kEmpty && *keys_.Row(buckets_[h]) != key) {
      h = (h + 1) & mask();
    }
    if (buckets_[h] == kEmpty) return;
    free_rows_.push_back(buckets_[h]);
    buckets_[h] = kEmpty;
    --size_;
    uint64_t hole = h;
    uint64_t j = (h + 1) & mask();
    while (buckets_[j] != kEmpty) {
      const uint64_t home =
          Mix(static_cast<uint64_t>(*keys_.Row(buckets_[j]))) & mask();
      // Move j into the hole if its home is not in (hole, j] cyclically.
      const bool stays = hole <= j ? (home > hole && home <= j)
                                   : (home > hole || home <= j);
      if (!stays) {
        buckets_[hole] = buckets_[j];
        buckets_[j] = kEmpty;
        hole = j;
      }
      j = (j + 1) & mask();
    }
  }

  bool Admitted(int64_t row) const {
    return *freqs_.Row(row) >= static_cast<uint64_t>(config_.filter_freq);
  }

  int64_t Key(int64_t r) const { return *keys_.Row(r); }
  uint32_t* Freq(int64_t r) { return freqs_.Row(r); }
  uint32_t* Version(int64_t r) { return versions_.Row(r); }
  float* Value(int64_t r) { return values_.Row(r); }
  float* Slot(int s, int64_t r) { return slots_[s].Row(r); }

  // Index of slot `name`, created (existing rows set to `init`) if new;
  // an existing slot only takes the new initial value for future rows.
  int EnsureSlot(const std::string& name, float init) {
    for (size_t s = 0; s < slot_names_.size(); ++s) {
      if (slot_names_[s] == name) {
        slot_inits_[s] = init;
        return static_cast<int>(s);
      }
    }
    slot_names_.push_back(name);
    slot_inits_.push_back(init);
    slots_.emplace_back(dim());
    slots_.back().Reserve(num_rows_);
    for (int64_t r = 0; r < num_rows_; ++r) {
      std::fill(slots_.back().Row(r), slots_.back().Row(r) + dim(), init);
    }
    return static_cast<int>(slots_.size() - 1);
  }

  int SlotIndex(const std::string& name) const {
    for (size_t s = 0; s < slot_names_.size(); ++s) {
      if (slot_names_[s] == name) return static_cast<int>(s);
    }
    return -1;
  }
  const std::vector<std::string>& slot_names() const { return slot_names_; }
  const std::vector<float>& slot_inits() const { return slot_inits_; }

  // Live rows in bucket order.
  std::vector<uint32_t> LiveRows() const {
    std::vector<uint32_t> rows;
    rows.reserve(size_);
    for (uint32_t r : buckets_) {
      if (r != kEmpty) rows.push_back(r);
    }
    return rows;
  }

  void Clear() {
    buckets_.assign(64, kEmpty);
    size_ = 0;
    num_rows_ = 0;
    free_rows_.clear();
    keys_.Clear();
    freqs_.Clear();
    versions_.Clear();
    values_.Clear();
    for (auto& s : slots_) s.Clear();
    current_step_ = 0;
  }

  void Reserve(int64_t keys) {
    int64_t cap = static_cast<int64_t>(buckets_.size());
    while (keys * 5 > cap * 4) cap *= 2;
    if (cap != static_cast<int64_t>(buckets_.size())) Rehash(cap);
  }

  int64_t Bytes() const {
    int64_t b = static_cast<int64_t>(buckets_.size()) * sizeof(uint32_t) +
                keys_.Bytes() + freqs_.Bytes() + versions_.Bytes() +
                values_.Bytes() +
                static_cast<int64_t>(free_rows_.capacity()) *
                    sizeof(uint32_t);
    for (const auto& s : slots_) b += s.Bytes();
    return b;
  }

 private:
  uint64_t mask() const { return buckets_.size() - 1; }

  int64_t AllocateRow() {
    if (!free_rows_.empty()) {
      const int64_t r = free_rows_.back();
      free_rows_.pop_back();
      return r;
    }
    const int64_t r = num_rows_++;
    keys_.Reserve(num_rows_);
    freqs_.Reserve(num_rows_);
    versions_.Reserve(num_rows_);
    values_.Reserve(num_rows_);
    for (auto& s : slots_) s.Reserve(num_rows_);
    return r;
  }

  void Rehash(uint64_t capacity) {
    std::vector<uint32_t> old;
    old.swap(buckets_);
    buckets_.assign(capacity, kEmpty);
    for (uint32_t r : old) {
      if (r == kEmpty) continue;
      uint64_t h = Mix(static_cast<uint64_t>(*keys_.Row(r))) & mask();
      while (buckets_[h] != kEmpty) h = (h + 1) & mask();
      buckets_[h] = r;
    }
  }

  EVConfig config_;
  tensorflow::mutex mu_;
  std::vector<uint32_t> buckets_;
  int64_t size_ = 0;
  int64_t num_rows_ = 0;
  std::vector<uint32_t> free_rows_;
  ChunkedArray<int64_t> keys_;
  ChunkedArray<uint32_t> freqs_;
  ChunkedArray<uint32_t> versions_;
  ChunkedArray<float> values_;
  std::vector<std::string> slot_names_;
  std::vector<float> slot_inits_;
  std::vector<ChunkedArray<float>> slots_;
  int64_t current_step_ = 0;
};

// ---------------------------------------------------------------------------
// Handle: creates the storage on first use, with its configuration.
// ---------------------------------------------------------------------------
REGISTER_OP("EVHandleOp")
    .Output("handle: resource")
    .Attr("container: string = ''")
    .Attr("shared_name: string")
    .Attr("variable_name: string")
    .Attr("embedding_dim: int >= 1")
    .Attr("filter_freq: int >= 0 = 0")
    .Attr("default_value_no_permission: float = 0.0")
    .Attr("steps_to_live: int >= 0 = 0")
    .Attr("l2_weight_threshold: float = -1.0")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape);

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
  }

  void Compute(OpKernelContext* ctx) override {
    ResourceHandle handle = tensorflow::MakeResourceHandle<EVStorage>(
        ctx, container_, shared_name_);
    EVStorage* ev = nullptr;
    OP_REQUIRES_OK(ctx, ctx->resource_manager()->LookupOrCreate<EVStorage>(
                            handle.container(), handle.name(), &ev,
                            [this](EVStorage** out) {
                              *out = new EVStorage(config_);
                              return Status();
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

REGISTER_KERNEL_BUILDER(Name("EVHandleOp").Device(DEVICE_CPU), EVHandleOp);

Status GetEV(OpKernelContext* ctx, int input, RefCountPtr<EVStorage>* ev) {
  return LookupResource(ctx, HandleFromInput(ctx, input), ev);
}

// ---------------------------------------------------------------------------
// Grouped gather: rows of K same-dim EVs, concatenated [sum n_i, D].
// training=true inserts new keys and counts frequencies; false reads only.
// ---------------------------------------------------------------------------
REGISTER_OP("EVGroupGather")
    .Input("handles: num_tables * resource")
    .Input("keys: num_tables * int64")
    .Input("default_values: num_tables * float")
    .Input("training: bool")
    .Output("rows: float")
    .Attr("num_tables: int >= 1")
    .Attr("embedding_dim: int >= 1")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      int64_t dim;
      TF_RETURN_IF_ERROR(c->GetAttr("embedding_dim", &dim));
      c->set_output(0, c->MakeShape({c->UnknownDim(), c->MakeDim(dim)}));
      return Status();
    });

class EVGroupGatherOp : public OpKernel {
 public:
  explicit EVGroupGatherOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("embedding_dim", &dim_));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList keys, defaults;
    OP_REQUIRES_OK(ctx, ctx->input_list("keys", &keys));
    OP_REQUIRES_OK(ctx, ctx->input_list("default_values", &defaults));
    const int k = keys.size();
    const bool training = ctx->input(3 * k).scalar<bool>()();
    std::vector<RefCountPtr<EVStorage>> evs(k);
    std::vector<int64_t> offset(k + 1, 0);
    for (int t = 0; t < k; ++t) {
      OP_REQUIRES_OK(ctx, GetEV(ctx, t, &evs[t]));
      const std::string& name = evs[t]->config().name;
      OP_REQUIRES(ctx, evs[t]->dim() == dim_,
                  InvalidArgument(name, ": has dim ", evs[t]->dim(),
                                  " but the group has dim ", dim_, "."));
      OP_REQUIRES(ctx, defaults[t].dims() == 2 &&
                           defaults[t].dim_size(1) == dim_ &&
                           defaults[t].dim_size(0) > 0,
                  InvalidArgument(name, ": default values must be [n > 0, ",
                                  dim_, "], got ",
                                  defaults[t].shape().DebugString()));
      offset[t + 1] = offset[t] + keys[t].NumElements();
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            0, TensorShape({offset[k], dim_}), &out));
    float* rows = out->flat<float>().data();
    const int64_t dim = dim_;
    auto work = [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        EVStorage* ev = evs[t].get();
        const int64_t n = keys[t].NumElements();
        const int64_t* key = keys[t].flat<int64_t>().data();
        const float* dflt = defaults[t].flat<float>().data();
        const int64_t drows = defaults[t].dim_size(0);
        float* o = rows + offset[t] * dim;
        const EVConfig& cfg = ev->config();
        if (training) {
          tensorflow::mutex_lock lock(*ev->mu());
          // Count every occurrence first, so that all occurrences of a key
          // in this batch see the same admission state.
          std::vector<int64_t> row(n);
          for (int64_t j = 0; j < n; ++j) {
            row[j] = ev->FindOrInsert(key[j], dflt, drows);
            ++*ev->Freq(row[j]);
          }
          for (int64_t j = 0; j < n; ++j) {
            if (ev->Admitted(row[j])) {
              std::memcpy(o + j * dim, ev->Value(row[j]),
                          sizeof(float) * dim);
            } else {
              std::fill(o + j * dim, o + (j + 1) * dim, cfg.no_permission);
            }
          }
        } else {
          tensorflow::tf_shared_lock lock(*ev->mu());
          for (int64_t j = 0; j < n; ++j) {
            const int64_t r = ev->Find(key[j]);
            if (r >= 0 && ev->Admitted(r)) {
              std::memcpy(o + j * dim, ev->Value(r), sizeof(float) * dim);
            } else if (cfg.filter_freq > 0) {
              std::fill(o + j * dim, o + (j + 1) * dim, cfg.no_permission);
            } else {
              std::memcpy(o + j * dim, DefaultRowOf(key[j], dflt, drows, dim),
                          sizeof(float) * dim);
            }
          }
        }
      }
    };
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
    tensorflow::Shard(pool->num_threads, pool->workers, k,
                      (offset[k] / k + 1) * dim * 20, work);
  }

 private:
  int64_t dim_;
};

REGISTER_KERNEL_BUILDER(Name("EVGroupGather").Device(DEVICE_CPU),
                        EVGroupGatherOp);

// ---------------------------------------------------------------------------
// Slots, size, export, import, eviction.
// ---------------------------------------------------------------------------
REGISTER_OP("EVEnsureSlot")
    .Input("handle: resource")
    .Attr("slot_name: string")
    .Attr("initial_value: float")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext*) { return Status(); });

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
    ev->EnsureSlot(name_, init_);
  }

 private:
  std::string name_;
  float init_;
};

REGISTER_KERNEL_BUILDER(Name("EVEnsureSlot").Device(DEVICE_CPU),
                        EVEnsureSlotOp);

REGISTER_OP("EVSize")
    .Input("handle: resource")
    .Output("num_keys: int64")
    .Output("num_bytes: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      c->set_output(1, c->Scalar());
      return Status();
    });

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

REGISTER_KERNEL_BUILDER(Name("EVSize").Device(DEVICE_CPU), EVSizeOp);

REGISTER_OP("EVExport")
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
    .SetShapeFn([](InferenceContext* c) {
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
    });

class EVExportOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    RefCountPtr<EVStorage> ev;
    OP_REQUIRES_OK(ctx, GetEV(ctx, 0, &ev));
    // One lock for the whole snapshot: keys, values and slots agree.
    tensorflow::tf_shared_lock lock(*ev->mu());
    const std::vector<uint32_t> rows = ev->LiveRows();
    const int64_t n = rows.size();
    const int64_t dim = ev->dim();
    const int64_t s = ev->slot_names().size();
    Tensor *keys, *values, *freqs, *versions, *names, *inits, *slots, *step;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &keys));
    OP_REQUIRES_OK(ctx,
                   ctx->allocate_output(1, TensorShape({n, dim}), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({n}), &freqs));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({n}), &versions));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(4, TensorShape({s}), &names));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(5, TensorShape({s}), &inits));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(6, TensorShape({n, s * dim}),
                                             &slots));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(7, TensorShape({}), &step));
    auto k = keys->flat<int64_t>();
    auto f = freqs->flat<int64_t>();
    auto v = versions->flat<int64_t>();
    float* val = values->flat<float>().data();
    float* sl = slots->flat<float>().data();
    for (int64_t i = 0; i < s; ++i) {
      names->flat<tensorflow::tstring>()(i) = ev->slot_names()[i];
      inits->flat<float>()(i) = ev->slot_inits()[i];
    }
    for (int64_t i = 0; i < n; ++i) {
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
  }
};

REGISTER_KERNEL_BUILDER(Name("EVExport").Device(DEVICE_CPU), EVExportOp);

REGISTER_OP("EVImport")
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
    .SetShapeFn([](InferenceContext*) { return Status(); });

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
    ev->Reserve(n);
    std::vector<int> slot_index(s);
    for (int64_t j = 0; j < s; ++j) {
      const std::string name(names.flat<tensorflow::tstring>()(j));
      // The initial value travels with the slot, so keys inserted after a
      // restore (before the optimizer runs) start like uninterrupted ones.
      slot_index[j] = ev->EnsureSlot(name, inits.flat<float>()(j));
    }
    const float* val = values.flat<float>().data();
    const float* sl = slots.flat<float>().data();
    const auto k = keys.flat<int64_t>();
    const auto f = freqs.flat<int64_t>();
    const auto v = versions.flat<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = ev->FindOrInsert(k(i), val + i * dim, 1);
      *ev->Freq(r) = static_cast<uint32_t>(
          std::min<int64_t>(f(i), std::numeric_limits<uint32_t>::max()));
      *ev->Version(r) = ClampStep(v(i));
      for (int64_t j = 0; j < s; ++j) {
        std::memcpy(ev->Slot(slot_index[j], r), sl + (i * s + j) * dim,
                    sizeof(float) * dim);
      }
    }
    ev->AdvanceStep(ctx->input(8).scalar<int64_t>()());
  }
};

REGISTER_KERNEL_BUILDER(Name("EVImport").Device(DEVICE_CPU), EVImportOp);

REGISTER_OP("EVEvict")
    .Input("handle: resource")
    .Output("num_evicted: int64")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape);

class EVEvictOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    RefCountPtr<EVStorage> ev;
    OP_REQUIRES_OK(ctx, GetEV(ctx, 0, &ev));
    tensorflow::mutex_lock lock(*ev->mu());
    const EVConfig& cfg = ev->config();
    std::vector<int64_t> doomed;
    for (uint32_t r : ev->LiveRows()) {
      bool evict = false;
      if (cfg.steps_to_live > 0) {
        evict = ev->current_step() - static_cast<int64_t>(*ev->Version(r)) >
                cfg.steps_to_live;
      } else if (cfg.l2_threshold >= 0.0f) {
        const float* v = ev->Value(r);
        double ss = 0.0;
        for (int64_t d = 0; d < ev->dim(); ++d) ss += double(v[d]) * v[d];
        evict = std::sqrt(ss) < cfg.l2_threshold;
      }
      if (evict) doomed.push_back(ev->Key(r));
    }
    for (int64_t key : doomed) ev->Erase(key);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = doomed.size();
  }
};

REGISTER_KERNEL_BUILDER(Name("EVEvict").Device(DEVICE_CPU), EVEvictOp);

// ---------------------------------------------------------------------------
// Sparse updates keyed by key.  Duplicate keys are summed first (so the
// update equals the dense one); keys absent or not admitted are skipped.
// ---------------------------------------------------------------------------
class KeyDedup {
 public:
  // Fills `first` (first position of each unique key) and `summed`
  // (`[unique, dim]` summed gradients, empty when there is no duplicate).
  KeyDedup(const int64_t* keys, int64_t n, const float* grad, int64_t dim) {
    int64_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    std::vector<int64_t> table(cap, -1);
    std::vector<int64_t> slot(n);
    for (int64_t j = 0; j < n; ++j) {
      uint64_t h = Mix(static_cast<uint64_t>(keys[j])) & (cap - 1);
      while (table[h] >= 0 && keys[first_[table[h]]] != keys[j]) {
        h = (h + 1) & (cap - 1);
      }
      if (table[h] < 0) {
        table[h] = first_.size();
        first_.push_back(j);
      }
      slot[j] = table[h];
    }
    grad_ = grad;
    if (static_cast<int64_t>(first_.size()) != n) {
      summed_.assign(first_.size() * dim, 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        float* dst = summed_.data() + slot[j] * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] += grad[j * dim + d];
      }
    }
    dim_ = dim;
  }
  int64_t size() const { return first_.size(); }
  int64_t first(int64_t u) const { return first_[u]; }
  const float* grad(int64_t u) const {
    return summed_.empty() ? grad_ + first_[u] * dim_
                           : summed_.data() + u * dim_;
  }

 private:
  std::vector<int64_t> first_;
  std::vector<float> summed_;
  const float* grad_;
  int64_t dim_;
};

// Shared skeleton: lock, dedup, resolve slots, call `update(row, grad,
// slot pointers)` for every admitted key in parallel, stamp versions.
template <typename Update>
void ApplySparse(OpKernelContext* ctx, const std::vector<std::string>& slots,
                 int keys_input, Update update) {
  RefCountPtr<EVStorage> ev;
  OP_REQUIRES_OK(ctx, GetEV(ctx, 0, &ev));
  const Tensor& keys = ctx->input(keys_input);
  const Tensor& grad = ctx->input(keys_input + 1);
  const int64_t step = ctx->input(keys_input + 2).scalar<int64_t>()();
  const int64_t dim = ev->dim();
  const int64_t n = keys.NumElements();
  const std::string& var = ev->config().name;
  OP_REQUIRES(ctx, grad.NumElements() == n * dim,
              InvalidArgument(var, ": gradient must be [", n, ", ", dim,
                              "], got ", grad.shape().DebugString()));
  tensorflow::mutex_lock lock(*ev->mu());
  std::vector<int> idx;
  for (const auto& s : slots) {
    idx.push_back(ev->SlotIndex(s));
    OP_REQUIRES(ctx, idx.back() >= 0,
                InvalidArgument(var, ": optimizer slot '", s,
                                "' was not created; build the optimizer "
                                "first."));
  }
  const int64_t* k = keys.flat<int64_t>().data();
  KeyDedup dedup(k, n, grad.flat<float>().data(), dim);
  ev->AdvanceStep(step);
  std::vector<int64_t> rows(dedup.size());
  for (int64_t u = 0; u < dedup.size(); ++u) {
    const int64_t r = ev->Find(k[dedup.first(u)]);
    rows[u] = (r >= 0 && ev->Admitted(r)) ? r : -1;
    if (rows[u] >= 0) *ev->Version(r) = ClampStep(step);
  }
  auto work = [&](int64_t begin, int64_t end) {
    float* sp[4] = {nullptr, nullptr, nullptr, nullptr};
    for (int64_t u = begin; u < end; ++u) {
      if (rows[u] < 0) continue;
      for (size_t s = 0; s < idx.size(); ++s) sp[s] = ev->Slot(idx[s], rows[u]);
      update(ev->Value(rows[u]), dedup.grad(u), sp, dim);
    }
  };
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
  tensorflow::Shard(pool->num_threads, pool->workers, dedup.size(),
                    dim * 30, work);
}

#define EV_APPLY_INPUTS          \
  Input("handle: resource")      \
      .Input("keys: int64")      \
      .Input("grad: float")      \
      .Input("global_step: int64")

REGISTER_OP("EVApplySGD")
    .EV_APPLY_INPUTS.Input("lr: float")
    .SetShapeFn([](InferenceContext*) { return Status(); });

class EVApplySGDOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    const float lr = ctx->input(4).scalar<float>()();
    ApplySparse(ctx, {}, 1,
                [lr](float* v, const float* g, float**, int64_t dim) {
                  for (int64_t d = 0; d < dim; ++d) v[d] -= lr * g[d];
                });
  }
};

REGISTER_KERNEL_BUILDER(Name("EVApplySGD").Device(DEVICE_CPU), EVApplySGDOp);

// accum += g^2; var -= lr * g / sqrt(accum + epsilon)  (Keras' rule)
REGISTER_OP("EVApplyAdagrad")
    .EV_APPLY_INPUTS.Input("lr: float")
    .Input("epsilon: float")
    .Attr("slot_name: string")
    .SetShapeFn([](InferenceContext*) { return Status(); });

class EVApplyAdagradOp : public OpKernel {
 public:
  explicit EVApplyAdagradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string s;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("slot_name", &s));
    slots_ = {s};
  }
  void Compute(OpKernelContext* ctx) override {
    const float lr = ctx->input(4).scalar<float>()();
    const float eps = ctx->input(5).scalar<float>()();
    ApplySparse(ctx, slots_, 1,
                [lr, eps](float* v, const float* g, float** s, int64_t dim) {
                  float* a = s[0];
                  for (int64_t d = 0; d < dim; ++d) {
                    a[d] += g[d] * g[d];
                    v[d] -= lr * g[d] / std::sqrt(a[d] + eps);
                  }
                });
  }

 private:
  std::vector<std::string> slots_;
};

REGISTER_KERNEL_BUILDER(Name("EVApplyAdagrad").Device(DEVICE_CPU),
                        EVApplyAdagradOp);

// m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
// var -= alpha * m / (sqrt(v) + epsilon), alpha bias-corrected by caller.
REGISTER_OP("EVApplyAdam")
    .EV_APPLY_INPUTS.Input("alpha: float")
    .Input("beta1: float")
    .Input("beta2: float")
    .Input("epsilon: float")
    .Attr("slot_names: list(string)")
    .SetShapeFn([](InferenceContext*) { return Status(); });

class EVApplyAdamOp : public OpKernel {
 public:
  explicit EVApplyAdamOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("slot_names", &slots_));
    OP_REQUIRES(ctx, slots_.size() == 2,
                InvalidArgument("EVApplyAdam needs 2 slots (m, v)."));
  }
  void Compute(OpKernelContext* ctx) override {
    const float alpha = ctx->input(4).scalar<float>()();
    const float b1 = ctx->input(5).scalar<float>()();
    const float b2 = ctx->input(6).scalar<float>()();
    const float eps = ctx->input(7).scalar<float>()();
    ApplySparse(ctx, slots_, 1,
                [=](float* v, const float* g, float** s, int64_t dim) {
                  float* m = s[0];
                  float* u = s[1];
                  for (int64_t d = 0; d < dim; ++d) {
                    m[d] += (g[d] - m[d]) * (1.0f - b1);
                    u[d] += (g[d] * g[d] - u[d]) * (1.0f - b2);
                    v[d] -= alpha * m[d] / (std::sqrt(u[d]) + eps);
                  }
                });
  }

 private:
  std::vector<std::string> slots_;
};

REGISTER_KERNEL_BUILDER(Name("EVApplyAdam").Device(DEVICE_CPU),
                        EVApplyAdamOp);

// TF's ApplyFtrlV2 on the touched rows (slots: accumulator, linear).
REGISTER_OP("EVApplyFtrl")
    .EV_APPLY_INPUTS.Input("lr: float")
    .Input("l1: float")
    .Input("l2: float")
    .Input("l2_shrinkage: float")
    .Input("lr_power: float")
    .Attr("slot_names: list(string)")
    .SetShapeFn([](InferenceContext*) { return Status(); });

class EVApplyFtrlOp : public OpKernel {
 public:
  explicit EVApplyFtrlOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("slot_names", &slots_));
    OP_REQUIRES(ctx, slots_.size() == 2,
                InvalidArgument("EVApplyFtrl needs 2 slots."));
  }
  void Compute(OpKernelContext* ctx) override {
    const float lr = ctx->input(4).scalar<float>()();
    const float l1 = ctx->input(5).scalar<float>()();
    const float l2 = ctx->input(6).scalar<float>()();
    const float shrink = ctx->input(7).scalar<float>()();
    const float power = ctx->input(8).scalar<float>()();
    auto pw = [power](float x) {
      return power == -0.5f ? std::sqrt(x) : std::pow(x, -power);
    };
    ApplySparse(ctx, slots_, 1,
                [=](float* v, const float* g, float** s, int64_t dim) {
                  float* acc = s[0];
                  float* lin = s[1];
                  for (int64_t d = 0; d < dim; ++d) {
                    const float gs = g[d] + 2.0f * shrink * v[d];
                    const float na = acc[d] + g[d] * g[d];
                    lin[d] += gs - (pw(na) - pw(acc[d])) / lr * v[d];
                    const float clipped = std::min(std::max(lin[d], -l1), l1);
                    const float quad = pw(na) / lr + 2.0f * l2;
                    v[d] = (clipped - lin[d]) / quad;
                    acc[d] = na;
                  }
                });
  }

 private:
  std::vector<std::string> slots_;
};

REGISTER_KERNEL_BUILDER(Name("EVApplyFtrl").Device(DEVICE_CPU),
                        EVApplyFtrlOp);

}  // namespace group_embedding_ev

#ifndef GROUP_EMBEDDING_OPS_CUDA_EV_HOST_TIER_H_
#define GROUP_EMBEDDING_OPS_CUDA_EV_HOST_TIER_H_

// The host-memory tier of a StorageType.HBM_DRAM EmbeddingVariable: the
// keys the GPU table (ev_table.h) gave up when full, each with its whole
// state (row, optimizer slots, freq, version), so that none is lost. A key
// is in exactly one tier: the adaptor (tf_ev_table_kernels.cc) moves a
// key's record here when the GPU table evicts it by capacity and back
// (Take) before any lookup or update of the key, so the GPU table sees
// every key of a call with its state, as if it had never left.
//
// Plain C++ (no framework, no CUDA), used under the owning table's lock.
// Records live in one record-major array (row, then each slot's entry):
// one record a cache line or two at small dims, reused through a free
// list, indexed by an unordered_map. 64-bit counts throughout.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory_resource>
#include <unordered_map>
#include <vector>

namespace group_embedding {
namespace gpu_kernels {

// Records in the GPU table's import / export layout: keys, freq, version
// [n], rows [n, dim], slots [num_slots, n, dim] (one plane a slot), in
// memory from `mem` (the adaptor's staging: pinned where the GPU copies
// them).
struct EvTierRecords {
  explicit EvTierRecords(
      std::pmr::memory_resource* mem = std::pmr::get_default_resource())
      : keys(mem), freq(mem), version(mem), rows(mem), slots(mem) {}

  std::pmr::vector<int64_t> keys, freq, version;
  std::pmr::vector<float> rows, slots;

  int64_t size() const { return static_cast<int64_t>(keys.size()); }
  void Resize(int64_t n, int64_t dim, int64_t num_slots) {
    keys.resize(n);
    freq.resize(n);
    version.resize(n);
    rows.resize(n * dim);
    slots.resize(num_slots * n * dim);
  }
};

class EvHostTier {
 public:
  explicit EvHostTier(int64_t dim) : dim_(dim) {}

  int64_t size() const { return static_cast<int64_t>(index_.size()); }
  bool empty() const { return index_.empty(); }
  // Calls of Put that stored keys and of Clear: a key may have left the
  // GPU table since this count was read only if it changed.
  uint64_t puts() const { return puts_; }
  int64_t num_slots() const { return num_slots_; }
  // Bytes the records take (live and free), for size reports.
  int64_t bytes() const {
    return static_cast<int64_t>(data_.size() * sizeof(float) +
                                keys_.size() * 3 * sizeof(int64_t));
  }

  // Appends a slot to every record, each entry `init` (an optimizer's
  // new slot: the GPU table gives its keys the same).
  void AddSlot(float init) {
    const int64_t old_stride = Stride();
    ++num_slots_;
    const int64_t stride = Stride();
    const int64_t records = static_cast<int64_t>(keys_.size());
    std::vector<float> data(records * stride, init);
    for (int64_t r = 0; r < records; ++r) {
      std::copy(data_.begin() + r * old_stride,
                data_.begin() + (r + 1) * old_stride,
                data.begin() + r * stride);
    }
    data_.swap(data);
  }

  // Drops every record; records get `num_slots` slots from now on.
  void Clear(int64_t num_slots) {
    index_.clear();
    keys_.clear();
    freq_.clear();
    version_.clear();
    data_.clear();
    free_.clear();
    num_slots_ = num_slots;
    ++puts_;
  }

  // Stores records i in [0, in.size()) of `in` (slots planes of `in.size()`
  // entries), replacing a key's record if present.
  void Put(const EvTierRecords& in) {
    const int64_t n = in.size();
    if (n > 0) ++puts_;
    index_.reserve(index_.size() + n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = Slot(in.keys[i]);
      freq_[r] = in.freq[i];
      version_[r] = in.version[i];
      float* dst = data_.data() + r * Stride();
      std::memcpy(dst, in.rows.data() + i * dim_, sizeof(float) * dim_);
      for (int64_t s = 0; s < num_slots_; ++s) {
        std::memcpy(dst + (1 + s) * dim_,
                    in.slots.data() + (s * n + i) * dim_,
                    sizeof(float) * dim_);
      }
    }
  }

  // Moves the records of those of `keys[0..n)` present here (each once,
  // in first-occurrence order) into `out`, removing them.
  void Take(const int64_t* keys, int64_t n, EvTierRecords* out) {
    std::vector<int64_t> found;
    for (int64_t i = 0; i < n; ++i) {
      auto it = index_.find(keys[i]);
      if (it == index_.end()) continue;
      found.push_back(it->second);
      index_.erase(it);  // a repeat is not found again
    }
    Copy(found, out);
    for (int64_t r : found) free_.push_back(r);
  }

  // Every record, in record order, into `out`.
  void Export(EvTierRecords* out) const {
    std::vector<int64_t> live;
    live.reserve(index_.size());
    for (const auto& kv : index_) live.push_back(kv.second);
    std::sort(live.begin(), live.end());
    Copy(live, out);
  }

  // The eviction policy on this tier's keys, with the GPU table's rules
  // (ge_ev_evict): GlobalStepEvict when steps_to_live > 0 (now - version >
  // steps_to_live, now = max(step, 0)), else L2WeightEvict when
  // l2_threshold >= 0 (half the squared L2 norm of the row, in double,
  // below it). Appends the removed keys to `removed`; returns how many.
  int64_t Evict(int64_t step, int64_t steps_to_live, float l2_threshold,
                std::vector<int64_t>* removed) {
    if (steps_to_live == 0 && !(l2_threshold >= 0.0f)) return 0;
    const int64_t now = step < 0 ? 0 : step;
    std::vector<int64_t> doomed;
    for (const auto& kv : index_) {
      const int64_t r = kv.second;
      bool out;
      if (steps_to_live > 0) {
        out = now - version_[r] > steps_to_live;
      } else {
        const float* row = data_.data() + r * Stride();
        double ss = 0.0;
        for (int64_t d = 0; d < dim_; ++d) {
          ss += static_cast<double>(row[d]) * row[d];
        }
        out = 0.5 * ss < l2_threshold;
      }
      if (out) doomed.push_back(kv.first);
    }
    for (int64_t key : doomed) {
      auto it = index_.find(key);
      free_.push_back(it->second);
      index_.erase(it);
      removed->push_back(key);
    }
    return static_cast<int64_t>(doomed.size());
  }

 private:
  int64_t Stride() const { return dim_ * (1 + num_slots_); }

  // The record of `key`, made if absent.
  int64_t Slot(int64_t key) {
    auto it = index_.find(key);
    if (it != index_.end()) return it->second;
    int64_t r;
    if (!free_.empty()) {
      r = free_.back();
      free_.pop_back();
    } else {
      r = static_cast<int64_t>(keys_.size());
      keys_.push_back(0);
      freq_.push_back(0);
      version_.push_back(0);
      data_.resize(data_.size() + Stride());
    }
    keys_[r] = key;
    index_.emplace(key, r);
    return r;
  }

  void Copy(const std::vector<int64_t>& records, EvTierRecords* out) const {
    const int64_t n = static_cast<int64_t>(records.size());
    out->Resize(n, dim_, num_slots_);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = records[i];
      out->keys[i] = keys_[r];
      out->freq[i] = freq_[r];
      out->version[i] = version_[r];
      const float* src = data_.data() + r * Stride();
      std::memcpy(out->rows.data() + i * dim_, src, sizeof(float) * dim_);
      for (int64_t s = 0; s < num_slots_; ++s) {
        std::memcpy(out->slots.data() + (s * n + i) * dim_,
                    src + (1 + s) * dim_, sizeof(float) * dim_);
      }
    }
  }

  const int64_t dim_;
  int64_t num_slots_ = 0;
  std::unordered_map<int64_t, int64_t> index_;  // key -> record
  std::vector<int64_t> keys_, freq_, version_;
  std::vector<float> data_;     // [records, dim * (1 + num_slots)]
  std::vector<int64_t> free_;   // records no key holds
  uint64_t puts_ = 0;
};

}  // namespace gpu_kernels
}  // namespace group_embedding

#endif  // GROUP_EMBEDDING_OPS_CUDA_EV_HOST_TIER_H_

#ifndef GROUP_EMBEDDING_OPS_KERNELS_WORK_QUEUE_H_
#define GROUP_EMBEDDING_OPS_KERNELS_WORK_QUEUE_H_

// Work items of very different costs (the tables of a group: a one-hot
// feature with 4k ids next to a multi-hot one with 40k) over the intra-op
// pool. tensorflow::Shard splits the items into equal CONTIGUOUS blocks,
// which on the criteo-like group gave one thread the 13 one-hot tables and
// the other the 13 multi-hot ones (85% of the ids). Here the threads take
// the items one at a time, largest first (greedy longest-processing-time
// order), from a shared counter, so that they finish within about one
// small item of each other.
//
// The calling thread works too, so the items progress even when the pool
// is busy with other ops or the machine with other processes; items must
// not lock (see ev_lookup_ops.cc's locking rule).

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"

namespace group_embedding {

// Total cost below which the items run on the calling thread only
// (a thread hand-off costs a few microseconds).
constexpr int64_t kMinParallelCost = 20000;

// Runs `work(i)` once for every item i of `costs` (rough nanoseconds,
// >= 0), on up to the pool's thread count, largest items first. Returns
// once every item is done, NOT once the helper threads ran: on a loaded
// machine a helper may start late, after the caller did all the work
// alone; it then finds no item left and touches nothing of this call but
// the shared state it holds a reference to.
template <typename Work>
void RunUneven(::tensorflow::OpKernelContext* ctx,
               const std::vector<int64_t>& costs, Work work) {
  const int64_t n = static_cast<int64_t>(costs.size());
  if (n == 0) return;
  const int64_t total = std::accumulate(costs.begin(), costs.end(),
                                        int64_t{0});
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
  const int64_t threads = std::min<int64_t>(
      {static_cast<int64_t>(pool->num_threads), n,
       total / kMinParallelCost + 1});
  struct Shared {
    std::vector<int64_t> order;
    std::function<void(int64_t)> work;
    std::atomic<int64_t> next{0};
    std::mutex mu;
    std::condition_variable cv;
    int64_t done = 0;  // items finished, under mu
  };
  auto shared = std::make_shared<Shared>();
  shared->order.resize(n);
  std::iota(shared->order.begin(), shared->order.end(), 0);
  std::stable_sort(shared->order.begin(), shared->order.end(),
                   [&costs](int64_t a, int64_t b) {
                     return costs[a] > costs[b];
                   });
  if (threads <= 1) {
    for (int64_t i : shared->order) work(i);
    return;
  }
  shared->work = [&work](int64_t i) { work(i); };
  auto drain = [](Shared* s, int64_t n) {
    int64_t finished = 0;
    for (int64_t i = s->next.fetch_add(1); i < n; i = s->next.fetch_add(1)) {
      s->work(s->order[i]);
      ++finished;
    }
    if (finished == 0) return;
    std::lock_guard<std::mutex> l(s->mu);
    s->done += finished;
    if (s->done == n) s->cv.notify_all();
  };
  for (int64_t w = 1; w < threads; ++w) {
    pool->workers->Schedule([shared, n, drain]() { drain(shared.get(), n); });
  }
  drain(shared.get(), n);
  std::unique_lock<std::mutex> l(shared->mu);
  shared->cv.wait(l, [&]() { return shared->done == n; });
}

// One task handed to the pool that its caller may still run itself:
// Wait() runs it on the calling thread when no worker has started it yet,
// else waits for the worker that did. So a caller holding a lock never
// waits on a pool whose threads are busy with other work (perhaps work
// that needs that lock): the task must not lock. The shared state outlives
// a worker that starts after the caller ran the task.
class Handoff {
 public:
  Handoff(const ::tensorflow::DeviceBase::CpuWorkerThreads* pool,
          std::function<void()> task)
      : state_(std::make_shared<State>()) {
    state_->task = std::move(task);
    std::shared_ptr<State> state = state_;
    pool->workers->Schedule([state]() { state->Claim(); });
  }
  Handoff(const Handoff&) = delete;
  Handoff& operator=(const Handoff&) = delete;
  ~Handoff() { Wait(); }

  void Wait() {
    if (state_->Claim()) return;
    std::unique_lock<std::mutex> l(state_->mu);
    state_->cv.wait(l, [this] { return state_->done; });
  }

 private:
  struct State {
    std::function<void()> task;
    std::atomic<bool> claimed{false};
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;  // under mu
    // Runs the task unless another thread claimed it; true once this
    // thread ran it or it was already done.
    bool Claim() {
      if (claimed.exchange(true)) {
        std::lock_guard<std::mutex> l(mu);
        return done;
      }
      task();
      task = nullptr;
      {
        std::lock_guard<std::mutex> l(mu);
        done = true;
      }
      cv.notify_all();
      return true;
    }
  };
  std::shared_ptr<State> state_;
};

}  // namespace group_embedding

#endif  // GROUP_EMBEDDING_OPS_KERNELS_WORK_QUEUE_H_

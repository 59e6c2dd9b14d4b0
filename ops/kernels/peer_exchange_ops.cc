// GroupEmbeddingPeerAllToAll: an alltoall of variable-size blocks over TCP
// connections that every pair of workers opened once
// (group_embedding/distributed/ transport.py builds that mesh and hands the
// sockets in as file descriptors).
//
// Why not Horovod's alltoall: every Horovod collective is negotiated
// through rank 0 by a background thread that wakes once per cycle, and
// its alltoall sends the splits in a separate round before the data; on
// the collective lookup's chain (ids -> rows -> gradients) that latency,
// not the bytes, dominated the step. Here every worker runs the same ops
// in the same order (the Python side chains them with control
// dependencies), so no negotiation is needed: each message carries a
// header (magic, tag, rows, bytes per row) that the receiver checks, and a
// mismatch (two workers at different collectives) is an error, never a
// silent mix-up. A header's row count is bounded by what the receiver
// expects (the exact count where the caller knows it, e.g. gradients go
// back the way rows came, else the caller's byte cap per peer) before
// anything is allocated: a peer never picks the size of an allocation.
// The cap counts each row received plus `derived_bytes_per_row`, what the
// caller will allocate for it afterwards (an id's embedding rows), so a
// small message cannot turn into a large allocation downstream.
//
// Peers on the same host may also share memory (transport.py creates one
// memfd per pair and passes its descriptor in; the op maps it once and
// checks its size and its seals: a peer cannot shrink it under a mapping,
// which would turn the next copy into SIGBUS): a block that fits is copied
// into the sender's half of the region and only its header travels on
// the socket, so the payload is copied twice in user space instead of
// through the kernel's socket buffers. Each direction has two buffers
// used alternately: a sender writes buffer b of exchange k + 2 only after
// its exchange k + 1 completed, which needed the peer's header of
// exchange k + 1, sent after the peer finished exchange k (reading
// buffer b). So no buffer is overwritten while it is read.
//
// All peers are served by one poll() loop that sends and receives at the
// same time, so large blocks cannot deadlock on full socket buffers. A
// peer that closes its socket (a dead worker) or sends nothing for
// `timeout_seconds` fails the op with the peer's rank; nothing hangs. A
// worker whose exchange fails shuts its connections down, so the others
// fail too instead of waiting for its data.

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "op_registration.h"

namespace group_embedding {
namespace transport {
namespace {

using ::tensorflow::DataType;
using ::tensorflow::DataTypeSize;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
namespace errors = ::tensorflow::errors;

constexpr uint64_t kMagic = 0x47455045455231ULL;  // "GEPEER1"
// Seals the shared region must carry: its size can never change.
constexpr int kRequiredSeals = F_SEAL_SHRINK | F_SEAL_GROW;

struct Header {
  uint64_t magic;
  int64_t tag;
  int64_t rows;
  int64_t row_bytes;
  // Offset of the payload in the sender's shared buffers, or -1: the
  // payload follows on the socket.
  int64_t shm_offset;
};

// One exchange at a time per process: the sockets carry one message
// stream per peer.
std::mutex& ExchangeMutex() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}

// Per socket: which of its two shared buffers the next block goes to.
// Guarded by ExchangeMutex().
std::unordered_map<int64_t, int>& NextBuffer() {
  static auto* next = new std::unordered_map<int64_t, int>;
  return *next;
}

std::mutex& MappedMutex() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}

// The shared regions mapped so far, by (fd, device, inode, size): a
// descriptor number reused for another file maps anew. Guarded by
// MappedMutex(); mappings live as long as the process.
std::map<std::tuple<int64_t, dev_t, ino_t, int64_t>, char*>& Mapped() {
  static auto* mapped =
      new std::map<std::tuple<int64_t, dev_t, ino_t, int64_t>, char*>;
  return *mapped;
}

// Maps the shared region `fd` of 4 x `cap` bytes (two buffers each way),
// checking that the file is that large.
Status MapRegion(int64_t fd, int64_t cap, int peer, char** base) {
  struct stat st;
  if (fstat(static_cast<int>(fd), &st) != 0) {
    return errors::InvalidArgument("PeerAllToAll: shared memory fd ", fd,
                                   " of worker ", peer, " is not open: ",
                                   strerror(errno));
  }
  if (cap > std::numeric_limits<int64_t>::max() / 4 ||
      static_cast<int64_t>(st.st_size) < 4 * cap) {
    return errors::InvalidArgument(
        "PeerAllToAll: shared memory fd ", fd, " of worker ", peer,
        " holds ", static_cast<int64_t>(st.st_size), " bytes, less than "
        "4 buffers of ", cap);
  }
  const int seals = fcntl(static_cast<int>(fd), F_GET_SEALS);
  if (seals < 0 || (seals & kRequiredSeals) != kRequiredSeals) {
    return errors::InvalidArgument(
        "PeerAllToAll: shared memory fd ", fd, " of worker ", peer,
        " is not sealed against shrinking and growing (seals ", seals,
        "); a peer could shrink it under the mapping");
  }
  auto key = std::make_tuple(fd, st.st_dev, st.st_ino, 4 * cap);
  std::lock_guard<std::mutex> lock(MappedMutex());
  auto it = Mapped().find(key);
  if (it != Mapped().end()) {
    *base = it->second;
    return Status();
  }
  void* at = mmap(nullptr, 4 * cap, PROT_READ | PROT_WRITE, MAP_SHARED,
                  static_cast<int>(fd), 0);
  if (at == MAP_FAILED) {
    return errors::Unavailable("PeerAllToAll: cannot map the shared "
                               "memory of worker ", peer, ": ",
                               strerror(errno));
  }
  *base = static_cast<char*>(at);
  Mapped()[key] = *base;
  return Status();
}

// After a failed exchange the streams hold unread or half-sent bytes:
// every later exchange must fail too instead of reading them as data.
// Guarded by ExchangeMutex().
std::string& BrokenReason() {
  static std::string* reason = new std::string;
  return *reason;
}

struct PeerState {
  int fd = -1;
  // Shared buffers with this peer (capacity 0: none): two of `shm_cap`
  // bytes each way.
  char* shm_out = nullptr;
  const char* shm_in = nullptr;
  int64_t shm_cap = 0;
  // Outgoing: header, then payload.
  Header out_header;
  int64_t header_sent = 0;
  const char* payload = nullptr;
  int64_t payload_bytes = 0;
  int64_t payload_sent = 0;
  // Incoming.
  Header in_header;
  int64_t header_received = 0;
  char* in_payload = nullptr;
  int64_t in_bytes = 0;
  int64_t in_received = 0;
  // Rows this peer must announce, or -1: any up to the byte cap.
  int64_t expected_rows = -1;
  bool header_done() const { return header_received == sizeof(Header); }
  bool send_done() const {
    return header_sent == sizeof(Header) && payload_sent == payload_bytes;
  }
};

class PeerAllToAllOp : public OpKernel {
 public:
  explicit PeerAllToAllOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("tag", &tag_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("timeout_seconds", &timeout_seconds_));
    OP_REQUIRES_OK(ctx,
                   ctx->GetAttr("max_bytes_per_peer", &max_bytes_per_peer_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("derived_bytes_per_row",
                                     &derived_bytes_per_row_));
    OP_REQUIRES(ctx, max_bytes_per_peer_ >= 0,
                errors::InvalidArgument("max_bytes_per_peer must be >= 0"));
    OP_REQUIRES(ctx, derived_bytes_per_row_ >= 0,
                errors::InvalidArgument(
                    "derived_bytes_per_row must be >= 0, got ",
                    derived_bytes_per_row_));
    OP_REQUIRES(ctx, timeout_seconds_ > 0,
                errors::InvalidArgument("timeout_seconds must be > 0"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& data = ctx->input(0);
    const Tensor& splits = ctx->input(1);
    const Tensor& fds = ctx->input(2);
    const Tensor& shm = ctx->input(3);
    const Tensor& expected = ctx->input(4);
    OP_REQUIRES(ctx, data.dims() >= 1,
                errors::InvalidArgument(
                    "PeerAllToAll: data must have rank >= 1, got shape ",
                    data.shape().DebugString()));
    OP_REQUIRES(ctx, splits.dims() == 1 && fds.dims() == 1 &&
                         splits.NumElements() == fds.NumElements() &&
                         fds.NumElements() >= 1,
                errors::InvalidArgument(
                    "PeerAllToAll: splits and fds must be vectors of one "
                    "entry per worker, got ", splits.shape().DebugString(),
                    " and ", fds.shape().DebugString()));
    const int n = static_cast<int>(fds.NumElements());
    OP_REQUIRES(ctx, shm.dims() == 2 && shm.dim_size(0) == n &&
                         shm.dim_size(1) == 2,
                errors::InvalidArgument(
                    "PeerAllToAll: shm must be [workers, 2] (memfd or -1, "
                    "bytes per buffer), got ", shm.shape().DebugString()));
    OP_REQUIRES(ctx, expected.dims() == 1 && expected.NumElements() == n,
                errors::InvalidArgument(
                    "PeerAllToAll: expected must be a vector of one entry "
                    "per worker (rows it must send, or -1), got ",
                    expected.shape().DebugString()));
    const auto expect = expected.vec<int64_t>();
    for (int p = 0; p < n; ++p) {
      OP_REQUIRES(ctx, expect(p) >= -1,
                  errors::InvalidArgument("PeerAllToAll: expected[", p,
                                          "] = ", expect(p), " < -1"));
    }
    const auto shm_m = shm.matrix<int64_t>();
    for (int p = 0; p < n; ++p) {
      OP_REQUIRES(ctx, shm_m(p, 1) >= 0 && (shm_m(p, 0) >= 0) ==
                                               (shm_m(p, 1) > 0),
                  errors::InvalidArgument(
                      "PeerAllToAll: shm row ", p, " = (", shm_m(p, 0), ", ",
                      shm_m(p, 1), "): a memfd needs a capacity > 0 and "
                      "a capacity needs a memfd"));
    }
    const auto split = splits.vec<int32_t>();
    const auto fd = fds.vec<int64_t>();
    int self = -1;
    int64_t total = 0;
    for (int p = 0; p < n; ++p) {
      OP_REQUIRES(ctx, split(p) >= 0,
                  errors::InvalidArgument("PeerAllToAll: splits[", p,
                                          "] = ", split(p), " < 0"));
      total += split(p);
      if (fd(p) < 0) {
        OP_REQUIRES(ctx, self < 0,
                    errors::InvalidArgument(
                        "PeerAllToAll: more than one fd is -1 (self)"));
        self = p;
      }
    }
    OP_REQUIRES(ctx, self >= 0,
                errors::InvalidArgument(
                    "PeerAllToAll: no fd is -1; the entry of this worker "
                    "must be -1"));
    const int64_t rows = data.dim_size(0);
    OP_REQUIRES(ctx, total == rows,
                errors::InvalidArgument(
                    "PeerAllToAll: splits sum to ", total,
                    " but data has ", rows, " rows"));
    TensorShape row_shape = data.shape();
    row_shape.RemoveDim(0);
    const int64_t elem_bytes = DataTypeSize(data.dtype());
    OP_REQUIRES(ctx, row_shape.num_elements() <=
                         std::numeric_limits<int64_t>::max() / elem_bytes,
                errors::InvalidArgument("PeerAllToAll: rows of shape ",
                                        row_shape.DebugString(),
                                        " overflow 64-bit byte counts"));
    const int64_t row_bytes = row_shape.num_elements() * elem_bytes;

    std::vector<PeerState> peers(n);
    const char* base = static_cast<const char*>(data.tensor_data().data());
    int64_t offset = 0;
    for (int p = 0; p < n; ++p) {
      PeerState& s = peers[p];
      s.fd = static_cast<int>(fd(p));
      s.payload = base + offset * row_bytes;
      s.payload_bytes = static_cast<int64_t>(split(p)) * row_bytes;
      s.out_header = Header{kMagic, tag_, split(p), row_bytes, -1};
      s.expected_rows = expect(p);
      offset += split(p);
    }

    // The region of a pair: the lower rank's two outgoing buffers, then
    // the higher rank's. Mapped before any I/O: a bad descriptor is an
    // input error, not a broken stream.
    for (int p = 0; p < n; ++p) {
      if (p == self || shm_m(p, 0) < 0) continue;
      PeerState& s = peers[p];
      const int64_t cap = shm_m(p, 1);
      char* base = nullptr;
      OP_REQUIRES_OK(ctx, MapRegion(shm_m(p, 0), cap, p, &base));
      char* low_to_high = base;
      char* high_to_low = base + 2 * cap;
      s.shm_out = self < p ? low_to_high : high_to_low;
      s.shm_in = self < p ? high_to_low : low_to_high;
      s.shm_cap = cap;
    }

    std::lock_guard<std::mutex> lock(ExchangeMutex());
    OP_REQUIRES(ctx, BrokenReason().empty(),
                errors::FailedPrecondition(
                    "PeerAllToAll (tag ", tag_, "): an earlier exchange "
                    "failed, so the connections between workers are out of "
                    "step; restart the job. The first failure: ",
                    BrokenReason()));
    // Blocks that fit go through the shared buffers: only the header is
    // sent on the socket.
    for (int p = 0; p < n; ++p) {
      PeerState& s = peers[p];
      if (p == self || s.shm_cap == 0 || s.payload_bytes > s.shm_cap) {
        continue;
      }
      int& next = NextBuffer()[s.fd];
      const int64_t at = next * s.shm_cap;
      next ^= 1;
      if (s.payload_bytes > 0) {
        std::memcpy(s.shm_out + at, s.payload, s.payload_bytes);
      }
      s.out_header.shm_offset = at;
      s.payload_bytes = 0;
    }
    // Phase 1: every header in (sends run meanwhile); phase 2: payloads
    // into the output, allocated once all sizes are known.
    OP_REQUIRES_OK(ctx, Poisoning(Pump(&peers, self, false), peers));
    Tensor* received_splits = nullptr;
    OP_REQUIRES_OK(ctx, Poisoning(ctx->allocate_output(
                            1, TensorShape({n}), &received_splits), peers));
    auto rsplit = received_splits->vec<int32_t>();
    int64_t in_total = 0;
    for (int p = 0; p < n; ++p) {
      if (p == self) {
        rsplit(p) = split(p);
        in_total += split(p);
        continue;
      }
      const Header& h = peers[p].in_header;
      OP_REQUIRES_OK(ctx, Poisoning(
          h.rows <= std::numeric_limits<int32_t>::max()
              ? Status()
              : errors::DataLoss("PeerAllToAll: worker ", p, " sent ",
                                 h.rows, " rows, more than int32"),
          peers));
      rsplit(p) = static_cast<int32_t>(h.rows);
      in_total += h.rows;
    }
    TensorShape out_shape = row_shape;
    out_shape.InsertDim(0, in_total);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx,
                   Poisoning(ctx->allocate_output(0, out_shape, &out), peers));
    char* out_base = const_cast<char*>(out->tensor_data().data());
    int64_t at = 0;
    for (int p = 0; p < n; ++p) {
      if (p == self) {
        if (peers[p].payload_bytes > 0) {
          std::memcpy(out_base + at, peers[p].payload,
                      peers[p].payload_bytes);
        }
        at += peers[p].payload_bytes;
        continue;
      }
      PeerState& s = peers[p];
      const int64_t bytes = s.in_header.rows * row_bytes;
      const int64_t from = s.in_header.shm_offset;
      if (from >= 0) {
        // Checked in Receive: this side has shared buffers with p and the
        // block lies inside them.
        if (bytes > 0) std::memcpy(out_base + at, s.shm_in + from, bytes);
        s.in_payload = nullptr;
        s.in_bytes = 0;
      } else {
        s.in_payload = out_base + at;
        s.in_bytes = bytes;
      }
      at += bytes;
    }
    OP_REQUIRES_OK(ctx, Poisoning(Pump(&peers, self, true), peers));
  }

 private:
  // A failed exchange leaves the streams out of step: remember why, and
  // shut every connection down so that each peer fails at once (it may
  // be waiting for a header this worker will never send) instead of
  // waiting for the timeout.
  Status Poisoning(Status st, const std::vector<PeerState>& peers) {
    if (st.ok()) return st;
    if (BrokenReason().empty()) BrokenReason() = std::string(st.message());
    for (const PeerState& p : peers) {
      if (p.fd >= 0) shutdown(p.fd, SHUT_RDWR);
    }
    return st;
  }

  // Moves bytes on every socket until the phase's goal is reached: all
  // headers received (phase 1), or everything sent and received (2).
  Status Pump(std::vector<PeerState>* peers, int self, bool payload_phase) {
    const int n = static_cast<int>(peers->size());
    std::vector<pollfd> polls;
    std::vector<int> who;
    auto last_progress = std::chrono::steady_clock::now();
    for (;;) {
      polls.clear();
      who.clear();
      for (int p = 0; p < n; ++p) {
        if (p == self) continue;
        PeerState& s = (*peers)[p];
        short events = 0;
        if (!s.send_done()) events |= POLLOUT;
        const bool want_header = !s.header_done();
        const bool want_payload =
            payload_phase && s.header_done() && s.in_received < s.in_bytes;
        if (want_header || want_payload) events |= POLLIN;
        if (events == 0) continue;
        polls.push_back(pollfd{s.fd, events, 0});
        who.push_back(p);
      }
      bool goal = true;
      for (int p = 0; p < n; ++p) {
        if (p == self) continue;
        const PeerState& s = (*peers)[p];
        if (!s.header_done()) goal = false;
        if (payload_phase && (!s.send_done() || s.in_received < s.in_bytes)) {
          goal = false;
        }
      }
      if (goal) return Status();
      if (polls.empty()) {
        return errors::Internal("PeerAllToAll: nothing to wait for but the "
                                "exchange is not complete");
      }
      const int ready = WaitReady(&polls);
      if (ready < 0) {
        if (errno == EINTR) continue;
        return errors::Unavailable("PeerAllToAll: poll failed: ",
                                   strerror(errno));
      }
      if (ready == 0) {
        const double idle = std::chrono::duration<double>(
            std::chrono::steady_clock::now() - last_progress).count();
        if (idle > timeout_seconds_) {
          std::string waiting;
          for (int w : who) {
            absl::StrAppend(&waiting, waiting.empty() ? "" : ", ", w);
          }
          return errors::DeadlineExceeded(
              "PeerAllToAll (tag ", tag_, "): no data from or to worker(s) ",
              waiting, " for ", idle, " s; a worker is stuck or runs a "
              "different collective (GROUP_EMBEDDING_TRANSPORT_TIMEOUT "
              "sets the limit)");
        }
        continue;
      }
      for (size_t i = 0; i < polls.size(); ++i) {
        PeerState& s = (*peers)[who[i]];
        const short re = polls[i].revents;
        if (re == 0) continue;
        if (re & POLLNVAL) {
          return errors::FailedPrecondition(
              "PeerAllToAll: the socket of worker ", who[i],
              " is closed in this process; call "
              "enable_distributed_strategy again");
        }
        if (re & (POLLIN | POLLHUP | POLLERR)) {
          Status st = Receive(&s, who[i], payload_phase);
          if (!st.ok()) return st;
          last_progress = std::chrono::steady_clock::now();
        }
        if ((re & POLLOUT) && !s.send_done()) {
          Status st = Send(&s, who[i]);
          if (!st.ok()) return st;
          last_progress = std::chrono::steady_clock::now();
        }
      }
    }
  }

  // poll() for the exchange's sockets: first without blocking for up to
  // kSpinMicros (yielding the core between tries), then blocking up to
  // 1 s. The peers of a step reach an exchange within a fraction of a
  // millisecond of each other; a worker that blocks at once lets its
  // virtual CPU halt and pays the wake-up (on the VM measured, the four
  // exchanges of a step took 1.5-3.7 ms once no other thread kept the
  // core busy, 1.3-1.6 ms before).
  static int WaitReady(std::vector<pollfd>* polls) {
    constexpr int64_t kSpinMicros = 1000;
    const auto until = std::chrono::steady_clock::now() +
                       std::chrono::microseconds(kSpinMicros);
    while (true) {
      const int ready = poll(polls->data(), polls->size(), 0);
      if (ready != 0) return ready;
      if (std::chrono::steady_clock::now() >= until) break;
      sched_yield();
    }
    return poll(polls->data(), polls->size(), 1000);
  }

  // Reads errno. A reset or broken pipe means the peer is gone.
  Status LinkError(const char* what, int peer) const {
    if (errno == ECONNRESET || errno == EPIPE) {
      return errors::Unavailable(
          "PeerAllToAll (tag ", tag_, "): worker ", peer,
          " closed its connection (reset while ", what, " it: it stopped, "
          "died, or its side of an exchange failed)");
    }
    return errors::Unavailable("PeerAllToAll (tag ", tag_, "): ", what,
                               " worker ", peer, " failed: ",
                               strerror(errno));
  }

  Status Send(PeerState* s, int peer) {
    while (!s->send_done()) {
      const char* ptr;
      int64_t left;
      if (s->header_sent < static_cast<int64_t>(sizeof(Header))) {
        ptr = reinterpret_cast<const char*>(&s->out_header) + s->header_sent;
        left = sizeof(Header) - s->header_sent;
      } else {
        ptr = s->payload + s->payload_sent;
        left = s->payload_bytes - s->payload_sent;
      }
      const ssize_t k = send(s->fd, ptr, left, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return Status();
        return LinkError("sending to", peer);
      }
      if (s->header_sent < static_cast<int64_t>(sizeof(Header))) {
        s->header_sent += k;
      } else {
        s->payload_sent += k;
      }
    }
    return Status();
  }

  Status Receive(PeerState* s, int peer, bool payload_phase) {
    for (;;) {
      char* ptr;
      int64_t left;
      if (!s->header_done()) {
        ptr = reinterpret_cast<char*>(&s->in_header) + s->header_received;
        left = sizeof(Header) - s->header_received;
      } else if (payload_phase && s->in_received < s->in_bytes) {
        ptr = s->in_payload + s->in_received;
        left = s->in_bytes - s->in_received;
      } else {
        return Status();
      }
      const ssize_t k = recv(s->fd, ptr, left, MSG_DONTWAIT);
      if (k == 0) {
        return errors::Unavailable(
            "PeerAllToAll (tag ", tag_, "): worker ", peer,
            " closed its connection (it stopped, died, or its side of "
            "an exchange failed)");
      }
      if (k < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return Status();
        return LinkError("receiving from", peer);
      }
      if (!s->header_done()) {
        s->header_received += k;
        if (s->header_done()) {
          const Header& h = s->in_header;
          if (h.magic != kMagic) {
            return errors::DataLoss("PeerAllToAll: worker ", peer,
                                    " sent a corrupt header");
          }
          if (h.tag != tag_) {
            return errors::FailedPrecondition(
                "PeerAllToAll: this worker runs collective ", tag_,
                " but worker ", peer, " sent collective ", h.tag,
                "; the workers run different graphs or a different order "
                "of lookups");
          }
          if (h.shm_offset >= 0 &&
              (s->shm_cap == 0 || h.shm_offset > s->shm_cap ||
               h.shm_offset % s->shm_cap != 0 ||
               h.rows > s->shm_cap / std::max<int64_t>(h.row_bytes, 1))) {
            return errors::DataLoss(
                "PeerAllToAll (tag ", tag_, "): worker ", peer,
                " announced ", h.rows, " rows in shared buffer offset ",
                h.shm_offset, ", outside this worker's shared buffers of ",
                s->shm_cap, " bytes with it");
          }
          if (h.shm_offset < -1) {
            return errors::DataLoss("PeerAllToAll: worker ", peer,
                                    " sent a corrupt header");
          }
          if (h.row_bytes != s->out_header.row_bytes) {
            return errors::InvalidArgument(
                "PeerAllToAll (tag ", tag_, "): worker ", peer, " sent ",
                h.rows, " rows of ", h.row_bytes, " bytes; this worker's "
                "rows have ", s->out_header.row_bytes,
                " bytes (row shapes or dtypes differ between workers)");
          }
          Status bound = CheckAnnouncedRows(h, s->expected_rows, peer);
          if (!bound.ok()) return bound;
        }
      } else {
        s->in_received += k;
      }
    }
  }

  // The rows a header announces, against what this worker expects of
  // `peer`: the exact count when the caller gave one, else at most
  // max_bytes_per_peer_ bytes counting each row and the
  // derived_bytes_per_row_ it turns into here (and an int32 split). Row
  // bytes already equal this worker's; the sum saturates instead of
  // wrapping, and rows * cost is checked by division.
  Status CheckAnnouncedRows(const Header& h, int64_t want, int peer) const {
    constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
    const int64_t cost = h.row_bytes > kMax - derived_bytes_per_row_
                             ? kMax
                             : h.row_bytes + derived_bytes_per_row_;
    const int64_t most_rows =
        cost > 0 ? max_bytes_per_peer_ / cost
                 : std::numeric_limits<int32_t>::max();
    if (h.rows < 0 || (want >= 0 && h.rows != want) ||
        (want < 0 && (h.rows > most_rows ||
                      h.rows > std::numeric_limits<int32_t>::max()))) {
      return errors::DataLoss(
          "PeerAllToAll (tag ", tag_, "): worker ", peer, " announced ",
          h.rows, " rows of ", h.row_bytes, " bytes",
          want < 0 && derived_bytes_per_row_ > 0
              ? absl::StrCat(", each turning into ", derived_bytes_per_row_,
                             " bytes more here")
              : "",
          "; this worker expects ",
          want >= 0 ? absl::StrCat("exactly ", want)
                    : absl::StrCat("at most ", most_rows, " (",
                                   max_bytes_per_peer_, " bytes, "
                                   "GROUP_EMBEDDING_TRANSPORT_MAX_BYTES)"),
          " from it; nothing was allocated for them");
    }
    return Status();
  }

  int64_t tag_;
  float timeout_seconds_;
  int64_t max_bytes_per_peer_;
  int64_t derived_bytes_per_row_;
};

GE_REGISTER_OP_WITH_ALIAS(
    "GroupEmbeddingPeerAllToAll", "PeerAllToAll",
    .Input("data: T")
    .Input("splits: int32")
    .Input("fds: int64")
    .Input("shm: int64")
    .Input("expected: int64")
    .Output("received: T")
    .Output("received_splits: int32")
    .Attr("T: {float, double, int32, int64}")
    .Attr("tag: int")
    .Attr("timeout_seconds: float = 600")
    .Attr("max_bytes_per_peer: int = 4294967296")
    .Attr("derived_bytes_per_row: int = 0")
    .SetIsStateful()
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      ::tensorflow::shape_inference::ShapeHandle data;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &data));
      ::tensorflow::shape_inference::ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 2, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(4), 1, &unused));
      ::tensorflow::shape_inference::ShapeHandle out;
      TF_RETURN_IF_ERROR(
          c->ReplaceDim(data, 0, c->UnknownDim(), &out));
      c->set_output(0, out);
      c->set_output(1, c->Vector(c->Dim(c->input(1), 0)));
      return Status();
    })
    .Doc(R"doc(
Alltoall of variable-size row blocks over pre-connected peer sockets.
data: rows grouped by destination worker.
splits: rows of `data` for each worker.
fds: connected socket of each peer; -1 at this worker's rank.
shm: per peer, (memfd shared with it or -1, bytes per buffer): the lower
  rank's two outgoing buffers, then the higher rank's (a sealed memfd).
expected: per worker, the rows it must send (an exchange whose counts the
  caller knows, e.g. a gradient going back), or -1: any count whose rows,
  each counted with derived_bytes_per_row, fit in max_bytes_per_peer bytes.
received: the rows sent to this worker, by source rank.
received_splits: rows received from each worker.
tag: identifies the collective; every worker must run the same tags in
  the same order.
)doc"));

GE_REGISTER_CPU_KERNEL_WITH_ALIAS(
    "GroupEmbeddingPeerAllToAll", "PeerAllToAll",
    PeerAllToAllOp);

}  // namespace
}  // namespace transport
}  // namespace group_embedding

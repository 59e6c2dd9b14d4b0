// The bare file I/O a tiered EV step cannot avoid, measured on the tier
// file itself (ev_tier_bench.py builds and runs this after its timed
// rounds, issue 36.4): every key a step needs that is not in DRAM is one
// record read from the file, and every row it displaces one record
// written. No hashing, no index, no checksum, no locking: only the
// kernel's part, so that the benchmark can say how much of the allowed
// extra time the I/O alone takes on this machine.
//
// Usage: tier_io_floor FILE HEADER_BYTES RECORD_BYTES READS THREADS REPS
// Prints one JSON object (milliseconds are medians over REPS):
//   pread_ms       READS preads of one record at random record offsets,
//                  split over THREADS threads (the tier's promotion reads)
//   hot_pread_us   one pread of a record read just before (the system
//                  call alone, data in the CPU's cache)
//   uring_ms       the same READS through io_uring (one ring per thread,
//                  up to 256 reads a submission: no system call per
//                  record), or -1 where the kernel refuses io_uring or
//                  its reads
//   mmap_fresh_ms  READS random records copied out of a fresh read-only
//                  mapping of the file, one thread (page faults included)
//   mmap_warm_ms   the same through one mapping kept across the REPS
//                  (after the first rep most pages are mapped)
//   append_ms      READS records appended to a scratch file next to FILE,
//                  4096 records a write (the spills), one thread
// Errors go to stderr with exit status 1.

#include <fcntl.h>
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "tier_io_floor: %s\n", what.c_str());
  std::exit(1);
}

// Argument i as an integer in [lo, hi] (bounded so that the buffer
// sizes below, record bytes x reads, cannot overflow).
int64_t Arg(char** argv, int i, int64_t lo, int64_t hi) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(argv[i], &end, 10);
  if (end == argv[i] || *end != '\0' || errno != 0 || v < lo || v > hi) {
    Fail(std::string("argument ") + std::to_string(i) + " ('" + argv[i] +
         "') must be an integer in [" + std::to_string(lo) + ", " +
         std::to_string(hi) + "]");
  }
  return v;
}

// A minimal io_uring (no liburing here): one ring, reads submitted in
// groups of up to kDepth and all reaped before the next group.
class Ring {
 public:
  static constexpr unsigned kDepth = 256;

  // False where the kernel or a seccomp filter refuses io_uring.
  bool Open() {
    io_uring_params p;
    std::memset(&p, 0, sizeof(p));
    fd_ = static_cast<int>(syscall(__NR_io_uring_setup, kDepth, &p));
    if (fd_ < 0) return false;
    if (!(p.features & IORING_FEAT_SINGLE_MMAP)) return false;
    ring_bytes_ = std::max<size_t>(
        p.sq_off.array + p.sq_entries * sizeof(unsigned),
        p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe));
    ring_ = mmap(nullptr, ring_bytes_, PROT_READ | PROT_WRITE,
                 MAP_SHARED | MAP_POPULATE, fd_, IORING_OFF_SQ_RING);
    sqe_bytes_ = p.sq_entries * sizeof(io_uring_sqe);
    sqes_ = static_cast<io_uring_sqe*>(
        mmap(nullptr, sqe_bytes_, PROT_READ | PROT_WRITE,
             MAP_SHARED | MAP_POPULATE, fd_, IORING_OFF_SQES));
    if (ring_ == MAP_FAILED || sqes_ == MAP_FAILED) return false;
    char* base = static_cast<char*>(ring_);
    sq_tail_ = reinterpret_cast<unsigned*>(base + p.sq_off.tail);
    sq_mask_ = *reinterpret_cast<unsigned*>(base + p.sq_off.ring_mask);
    sq_array_ = reinterpret_cast<unsigned*>(base + p.sq_off.array);
    cq_head_ = reinterpret_cast<unsigned*>(base + p.cq_off.head);
    cq_tail_ = reinterpret_cast<unsigned*>(base + p.cq_off.tail);
    cq_mask_ = *reinterpret_cast<unsigned*>(base + p.cq_off.ring_mask);
    cqes_ = reinterpret_cast<io_uring_cqe*>(base + p.cq_off.cqes);
    return true;
  }

  ~Ring() {
    if (sqes_ != nullptr && sqes_ != MAP_FAILED) munmap(sqes_, sqe_bytes_);
    if (ring_ != nullptr && ring_ != MAP_FAILED) munmap(ring_, ring_bytes_);
    if (fd_ >= 0) close(fd_);
  }

  // Reads `n` records of `rec` bytes at `offsets` into `out`; false on a
  // failed or short read.
  bool ReadAll(int file, const int64_t* offsets, int64_t n, int64_t rec,
               char* out) {
    for (int64_t done = 0; done < n;) {
      const unsigned count =
          static_cast<unsigned>(std::min<int64_t>(kDepth, n - done));
      unsigned tail = __atomic_load_n(sq_tail_, __ATOMIC_ACQUIRE);
      for (unsigned i = 0; i < count; ++i, ++tail) {
        const unsigned slot = tail & sq_mask_;
        io_uring_sqe* e = &sqes_[slot];
        std::memset(e, 0, sizeof(*e));
        e->opcode = IORING_OP_READ;
        e->fd = file;
        e->addr = reinterpret_cast<uint64_t>(out + (done + i) * rec);
        e->len = static_cast<uint32_t>(rec);
        e->off = static_cast<uint64_t>(offsets[done + i]);
        sq_array_[slot] = slot;
      }
      __atomic_store_n(sq_tail_, tail, __ATOMIC_RELEASE);
      if (syscall(__NR_io_uring_enter, fd_, count, count,
                  IORING_ENTER_GETEVENTS, nullptr, 0) < 0) {
        return false;
      }
      unsigned head = __atomic_load_n(cq_head_, __ATOMIC_ACQUIRE);
      for (unsigned reaped = 0; reaped < count;) {
        const unsigned ctail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
        if (head == ctail) {
          if (syscall(__NR_io_uring_enter, fd_, 0, 1, IORING_ENTER_GETEVENTS,
                      nullptr, 0) < 0) {
            return false;
          }
          continue;
        }
        for (; head != ctail && reaped < count; ++head, ++reaped) {
          if (cqes_[head & cq_mask_].res != rec) return false;
        }
        __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
      }
      done += count;
    }
    return true;
  }

 private:
  int fd_ = -1;
  void* ring_ = nullptr;
  size_t ring_bytes_ = 0;
  io_uring_sqe* sqes_ = nullptr;
  size_t sqe_bytes_ = 0;
  unsigned* sq_tail_ = nullptr;
  unsigned sq_mask_ = 0;
  unsigned* sq_array_ = nullptr;
  unsigned* cq_head_ = nullptr;
  unsigned* cq_tail_ = nullptr;
  unsigned cq_mask_ = 0;
  io_uring_cqe* cqes_ = nullptr;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    Fail("usage: tier_io_floor FILE HEADER_BYTES RECORD_BYTES READS "
         "THREADS REPS");
  }
  const std::string path = argv[1];
  const int64_t header = Arg(argv, 2, 0, int64_t{1} << 20);
  const int64_t rec = Arg(argv, 3, 1, int64_t{1} << 20);
  const int64_t reads = Arg(argv, 4, 1, int64_t{1} << 24);
  const int threads = static_cast<int>(Arg(argv, 5, 1, 256));
  const int reps = static_cast<int>(Arg(argv, 6, 1, 1000));
  const int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) Fail("cannot open " + path + ": " + std::strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0) Fail("cannot stat " + path);
  const int64_t size = st.st_size;
  if (size < header + rec) Fail(path + " holds no record");
  const int64_t records = (size - header) / rec;

  std::mt19937_64 rng(1);
  std::vector<int64_t> pick(reads);
  auto draw = [&] {
    for (int64_t& p : pick) p = header + static_cast<int64_t>(rng() % records) * rec;
  };
  std::vector<std::vector<char>> out(threads,
                                     std::vector<char>(rec * (reads / threads + 1)));
  std::vector<double> pread_ms, fresh_ms, warm_ms, append_ms;
  std::atomic<bool> io_error{false};
  for (int r = 0; r < reps; ++r) {
    draw();
    const auto t0 = Clock::now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        char* dst = out[t].data();
        for (int64_t i = t; i < reads; i += threads, dst += rec) {
          if (pread(fd, dst, rec, pick[i]) != rec) io_error.store(true);
        }
      });
    }
    for (std::thread& th : pool) th.join();
    pread_ms.push_back(Ms(t0, Clock::now()));
  }
  if (io_error) Fail("a pread of " + path + " came back short");

  // io_uring: each thread its own ring and its share of the reads.
  std::vector<double> uring_ms;
  {
    std::vector<Ring> rings(threads);
    bool ok = true;
    for (Ring& ring : rings) ok = ok && ring.Open();
    for (int r = 0; ok && r < reps; ++r) {
      draw();
      const auto t0 = Clock::now();
      std::vector<std::thread> pool;
      std::atomic<bool> failed{false};
      for (int t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
          const int64_t begin = reads * t / threads;
          const int64_t end = reads * (t + 1) / threads;
          if (!rings[t].ReadAll(fd, pick.data() + begin, end - begin, rec,
                                out[t].data())) {
            failed.store(true);
          }
        });
      }
      for (std::thread& th : pool) th.join();
      if (failed.load()) {
        // A kernel whose io_uring lacks plain reads (before 5.6): not
        // measured, as where io_uring is refused.
        uring_ms.clear();
        break;
      }
      uring_ms.push_back(Ms(t0, Clock::now()));
    }
  }

  // The system call alone: the same record again and again.
  const int64_t hot_reads = std::min<int64_t>(reads, 20000);
  const auto h0 = Clock::now();
  for (int64_t i = 0; i < hot_reads; ++i) {
    if (pread(fd, out[0].data(), rec, header) != rec) Fail("short pread");
  }
  const double hot_us = 1e3 * Ms(h0, Clock::now()) / hot_reads;

  std::vector<char> copy(rec * reads);
  void* warm = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  if (warm == MAP_FAILED) Fail("cannot map " + path);
  for (int r = 0; r < reps; ++r) {
    draw();
    void* fresh = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    if (fresh == MAP_FAILED) Fail("cannot map " + path);
    const auto a = Clock::now();
    for (int64_t i = 0; i < reads; ++i) {
      std::memcpy(copy.data() + i * rec, static_cast<char*>(fresh) + pick[i], rec);
    }
    const auto b = Clock::now();
    munmap(fresh, size);
    draw();
    const auto c = Clock::now();
    for (int64_t i = 0; i < reads; ++i) {
      std::memcpy(copy.data() + i * rec, static_cast<char*>(warm) + pick[i], rec);
    }
    const auto d = Clock::now();
    fresh_ms.push_back(Ms(a, b));
    warm_ms.push_back(Ms(c, d));
  }
  munmap(warm, size);
  close(fd);

  const std::string scratch = path + ".io_floor";
  const int wfd = open(scratch.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (wfd < 0) Fail("cannot create " + scratch + ": " + std::strerror(errno));
  const int64_t chunk = 4096;
  std::vector<char> buf(rec * chunk, 1);
  int64_t end = 0;
  for (int r = 0; r < reps; ++r) {
    const auto a = Clock::now();
    for (int64_t i = 0; i < reads; i += chunk) {
      const int64_t bytes = rec * std::min(chunk, reads - i);
      if (pwrite(wfd, buf.data(), bytes, end) != bytes) {
        unlink(scratch.c_str());
        Fail("a write to " + scratch + " came back short");
      }
      end += bytes;
    }
    append_ms.push_back(Ms(a, Clock::now()));
  }
  close(wfd);
  unlink(scratch.c_str());

  std::printf(
      "{\"records_in_file\": %lld, \"reads\": %lld, \"threads\": %d, "
      "\"reps\": %d, \"pread_ms\": %.4f, \"uring_ms\": %.4f, "
      "\"hot_pread_us\": %.4f, "
      "\"mmap_fresh_ms\": %.4f, \"mmap_warm_ms\": %.4f, "
      "\"append_ms\": %.4f}\n",
      static_cast<long long>(records), static_cast<long long>(reads), threads,
      reps, Median(pread_ms), uring_ms.empty() ? -1.0 : Median(uring_ms),
      hot_us, Median(fresh_ms), Median(warm_ms),
      Median(append_ms));
  return 0;
}

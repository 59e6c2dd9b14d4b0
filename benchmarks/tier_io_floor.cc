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
//   mmap_fresh_ms  READS random records copied out of a fresh read-only
//                  mapping of the file, one thread (page faults included)
//   mmap_warm_ms   the same through one mapping kept across the REPS
//                  (after the first rep most pages are mapped)
//   append_ms      READS records appended to a scratch file next to FILE,
//                  4096 records a write (the spills), one thread
// Errors go to stderr with exit status 1.

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
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

int64_t Arg(char** argv, int i, int64_t lo) {
  char* end = nullptr;
  const long long v = std::strtoll(argv[i], &end, 10);
  if (end == argv[i] || *end != '\0' || v < lo) {
    Fail(std::string("argument ") + std::to_string(i) + " ('" + argv[i] +
         "') must be an integer >= " + std::to_string(lo));
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    Fail("usage: tier_io_floor FILE HEADER_BYTES RECORD_BYTES READS "
         "THREADS REPS");
  }
  const std::string path = argv[1];
  const int64_t header = Arg(argv, 2, 0);
  const int64_t rec = Arg(argv, 3, 1);
  const int64_t reads = Arg(argv, 4, 1);
  const int threads = static_cast<int>(std::min<int64_t>(Arg(argv, 5, 1), 256));
  const int reps = static_cast<int>(std::min<int64_t>(Arg(argv, 6, 1), 1000));
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
      "\"reps\": %d, \"pread_ms\": %.4f, \"hot_pread_us\": %.4f, "
      "\"mmap_fresh_ms\": %.4f, \"mmap_warm_ms\": %.4f, "
      "\"append_ms\": %.4f}\n",
      static_cast<long long>(records), static_cast<long long>(reads), threads,
      reps, Median(pread_ms), hot_us, Median(fresh_ms), Median(warm_ms),
      Median(append_ms));
  return 0;
}

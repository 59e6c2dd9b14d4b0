// Test driver for ops/kernels/ev_ssd_tier.h: one command per stdin line,
// one answer line each (floats as C99 hex floats: bitwise exact).
//   put KEY FREQ VERSION F...  -> ok | error MSG
//   get KEY                    -> found FREQ VERSION F... | missing | error MSG
//   erase KEY                  -> 1 | 0
//   compact                    -> ok | error MSG
//   stats                      -> SIZE FILE_BYTES DEAD_BYTES RECORD_BYTES
//   crc TEXT                   -> crc32c of TEXT in hex
//   crccheck N SEED            -> ok HW | mismatch LEN OFFSET: Crc32c (the
//                                 crc32 instruction where the CPU has it,
//                                 HW 1) equals the portable table version
//                                 on N random buffers of every alignment
//   split SLOTS                -> ok: the index splits at SLOTS slots
//   tables                     -> the index's tables (1 or 256)
//   getmany KEY...             -> the records of KEY... (duplicates
//                                 allowed, missing ones skipped) through
//                                 RecordOf + ReadMany: one "KEY FREQ
//                                 VERSION F..." group per record, "|"
//                                 between, in file order | error MSG
// argv: EV_NAME PATH DIM SLOT_FLOATS
#include <algorithm>
#include <cinttypes>
#include <iostream>
#include <random>
#include <utility>
#include <vector>
#include <sstream>
#include <string>

#include "ev_ssd_tier.h"

using group_embedding::SsdTierFile;
using group_embedding::TierRecord;

int main(int argc, char** argv) {
  if (argc != 5) return 2;
  uint32_t dim = std::stoul(argv[3]), slots = std::stoul(argv[4]);
  SsdTierFile tier(argv[1], argv[2], dim, slots);
  std::string err = tier.Open();
  std::cout << (err.empty() ? "ok" : "error " + err) << std::endl;
  if (!err.empty()) return 0;
  std::string line;
  char hex[64];
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "put") {
      TierRecord r;
      in >> r.key >> r.freq >> r.version;
      std::string tok;
      for (uint32_t i = 0; i < dim + slots && in >> tok; ++i)
        (i < dim ? r.row : r.slots).push_back(std::strtof(tok.c_str(), nullptr));
      err = tier.Put(r);
      std::cout << (err.empty() ? "ok" : "error " + err) << std::endl;
    } else if (cmd == "get") {
      int64_t key;
      in >> key;
      TierRecord r;
      bool found;
      err = tier.Get(key, &r, &found);
      if (!err.empty()) {
        std::cout << "error " << err << std::endl;
      } else if (!found) {
        std::cout << "missing" << std::endl;
      } else {
        std::cout << "found " << r.freq << " " << r.version;
        for (float f : r.row) { std::snprintf(hex, sizeof hex, "%a", f); std::cout << " " << hex; }
        for (float f : r.slots) { std::snprintf(hex, sizeof hex, "%a", f); std::cout << " " << hex; }
        std::cout << std::endl;
      }
    } else if (cmd == "erase") {
      int64_t key;
      in >> key;
      std::cout << (tier.Erase(key) ? 1 : 0) << std::endl;
    } else if (cmd == "compact") {
      err = tier.Compact();
      std::cout << (err.empty() ? "ok" : "error " + err) << std::endl;
    } else if (cmd == "stats") {
      std::cout << tier.size() << " " << tier.file_bytes() << " " << tier.dead_bytes() << " "
                << tier.record_bytes() << std::endl;
    } else if (cmd == "crc") {
      std::string text;
      std::getline(in >> std::ws, text);
      std::snprintf(hex, sizeof hex, "%08x", group_embedding::Crc32c(text.data(), text.size()));
      std::cout << hex << std::endl;
    } else if (cmd == "crccheck") {
      uint64_t n = 0, seed = 0;
      in >> n >> seed;
      std::mt19937_64 rng(seed);
      std::vector<unsigned char> buf(4096 + 8);
      std::string answer = "ok " + std::to_string(group_embedding::Crc32cHardware() ? 1 : 0);
      for (uint64_t i = 0; i < n && answer[0] == 'o'; ++i) {
        for (auto& b : buf) b = static_cast<unsigned char>(rng());
        const size_t len = rng() % 4096, off = rng() % 8;
        const uint32_t seed_crc = static_cast<uint32_t>(rng());
        if (group_embedding::Crc32c(buf.data() + off, len, seed_crc) !=
            group_embedding::Crc32cPortable(buf.data() + off, len, seed_crc))
          answer = "mismatch " + std::to_string(len) + " " + std::to_string(off);
      }
      std::cout << answer << std::endl;
    } else if (cmd == "split") {
      uint64_t slots = 0;
      in >> slots;
      tier.SetIndexSplitSlots(slots);
      std::cout << "ok" << std::endl;
    } else if (cmd == "tables") {
      std::cout << tier.IndexTables() << std::endl;
    } else if (cmd == "getmany") {
      std::vector<std::pair<uint32_t, int64_t>> want;
      int64_t key;
      while (in >> key) {
        const int64_t rec = tier.RecordOf(key);
        if (rec >= 0) want.emplace_back(static_cast<uint32_t>(rec), key);
      }
      std::sort(want.begin(), want.end());
      want.erase(std::unique(want.begin(), want.end()), want.end());
      std::vector<uint32_t> recs;
      std::vector<int64_t> keys;
      for (const auto& w : want) {
        recs.push_back(w.first);
        keys.push_back(w.second);
      }
      std::vector<char> out(recs.size() * tier.record_bytes());
      err = tier.ReadMany(recs.data(), keys.data(), recs.size(), out.data());
      if (!err.empty()) {
        std::cout << "error " << err << std::endl;
        continue;
      }
      std::string line_out;
      TierRecord r;
      for (size_t i = 0; i < recs.size(); ++i) {
        tier.Decode(out.data() + i * tier.record_bytes(), &r);
        if (i) line_out += " |";
        line_out += " " + std::to_string(r.key) + " " + std::to_string(r.freq) + " " +
                    std::to_string(r.version);
        for (float f : r.row) { std::snprintf(hex, sizeof hex, "%a", f); line_out += std::string(" ") + hex; }
        for (float f : r.slots) { std::snprintf(hex, sizeof hex, "%a", f); line_out += std::string(" ") + hex; }
      }
      std::cout << "records" << line_out << std::endl;
    } else {
      std::cout << "error unknown command" << std::endl;
    }
  }
  return 0;
}

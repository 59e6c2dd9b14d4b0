// Test driver for ops/kernels/ev_ssd_tier.h: one command per stdin line,
// one answer line each (floats as C99 hex floats: bitwise exact).
//   put KEY FREQ VERSION F...  -> ok | error MSG
//   get KEY                    -> found FREQ VERSION F... | missing | error MSG
//   erase KEY                  -> 1 | 0
//   compact                    -> ok | error MSG
//   stats                      -> SIZE FILE_BYTES DEAD_BYTES RECORD_BYTES
//   crc TEXT                   -> crc32c of TEXT in hex
// argv: EV_NAME PATH DIM SLOT_FLOATS
#include <cinttypes>
#include <iostream>
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
    } else {
      std::cout << "error unknown command" << std::endl;
    }
  }
  return 0;
}

// jaxfuse: run-time settings of the CPU kernels, set from Python
// (jaxfuse/_env.py parses the environment and validates it; the native code
// never reads the environment itself).
#ifndef JAXFUSE_CPU_CONFIG_H_
#define JAXFUSE_CPU_CONFIG_H_

#include <cstdint>

namespace jaxfuse {

struct CpuSettings {
  int64_t max_threads = 0;    // 0: every thread of XLA's intra-op pool
  bool huge_pages = true;     // madvise(MADV_HUGEPAGE) on large outputs
  int streaming = 0;          // 0 off, 1 on, -1 auto (beyond the last-level cache)
};

void ConfigureCpu(const CpuSettings& settings);
CpuSettings CurrentCpuSettings();
// Bytes a call must touch before auto mode streams its output past the cache.
int64_t StreamingThresholdBytes();

// Tests only: split every large call into this many regions (0: one per
// worker, the default), whatever the pool has; and what the last split did.
void ForceRegionsForTests(int64_t regions);
struct SplitStats {
  int64_t calls;    // calls split over regions since the module loaded
  int64_t workers;  // threads the last of them offered work to (caller included)
  int64_t regions;  // regions it was split into
};
SplitStats LastSplit();

}  // namespace jaxfuse

#endif  // JAXFUSE_CPU_CONFIG_H_

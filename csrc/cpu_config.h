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

}  // namespace jaxfuse

#endif  // JAXFUSE_CPU_CONFIG_H_

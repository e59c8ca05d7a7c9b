// jaxfuse: run-time settings of the CPU kernels, set from Python
// (jaxfuse/_env.py parses the environment and validates it; the native code
// never reads the environment itself).
#ifndef JAXFUSE_CPU_CONFIG_H_
#define JAXFUSE_CPU_CONFIG_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#ifndef JAXFUSE_TEST_HOOKS
#define JAXFUSE_TEST_HOOKS 0
#endif

namespace jaxfuse {

struct CpuSettings {
  int64_t max_threads = 0;    // 0: every thread of XLA's intra-op pool
  bool huge_pages = false;    // madvise(MADV_HUGEPAGE) on large outputs
  bool prefault = true;       // the kernel faults in large outputs not yet faulted in
  int streaming = -1;         // 0 off, 1 on, -1 auto (output_reuse.h)
};

void ConfigureCpu(const CpuSettings& settings);
// Whether the AVX2 loops may run (where the CPU has AVX2, FMA and F16C): set
// from the ISA XLA targets (jaxfuse/_isa.py); and the path calls take now.
void SetVectorPath(bool avx2);
const char* VectorPath();
CpuSettings CurrentCpuSettings();
// The last-level cache auto mode measures reuse distances against.
int64_t StreamingCacheBytes();
#if JAXFUSE_TEST_HOOKS
// Test hooks, built only with JAXFUSE_TEST_HOOKS=ON (the test command's
// build); the shipping module has none of them.
// whether [p, p + bytes) is memory not yet faulted in, as the
// auto rule probes it.
bool FreshPagesForTests(uintptr_t p, size_t bytes);

// split every large call into this many regions (0: one per
// worker, the default), whatever the pool has; and what the last split did.
void ForceRegionsForTests(int64_t regions);
struct SplitStats {
  int64_t calls;    // calls split over regions since the module loaded
  int64_t workers;  // threads the last of them offered work to (caller included)
  int64_t regions;  // regions it was split into
};
SplitStats LastSplit();

// How the last call stored its output, and why (output_reuse.h), and how its
// pages were faulted in (epilogue_cpu.cc, "Pages for large outputs").
struct StoreStats {
  bool streamed;
  bool fresh_pages;        // its output was found not yet faulted in (so plain stores)
  int64_t reuse_distance;  // bytes touched since its output was last written; -1 unknown
  int pages;               // not prefaulted (0), prefaulted in 4 KiB (1) or huge (2) pages
  int64_t prefault_ns;     // CPU time prefaulting took, summed over its threads
};
StoreStats LastStore();
// the reuse distances a fresh tracker reports for a sequence of
// calls, each (output address, output bytes, bytes touched).
std::vector<int64_t> ReuseDistancesForTests(
    const std::vector<std::array<uint64_t, 3>>& calls);

#endif  // JAXFUSE_TEST_HOOKS

}  // namespace jaxfuse

#endif  // JAXFUSE_CPU_CONFIG_H_

// jaxfuse: how long ago a CPU call's output buffer was last written, in bytes
// moved since then: the input to the choice between plain and non-temporal
// stores.
//
// A plain store first reads the line it overwrites; a non-temporal store does
// not, but sends every byte to memory. So streaming saves a quarter of the
// traffic of `out = f(a, b)` when the output lines are no longer cached, and
// loses when they still are. Which one holds depends on the allocator: a loop
// that waits for each result gets the previous call's buffer back (written one
// call ago), a loop with K calls in flight cycles through K buffers.
//
// This keeps the last few output ranges, each stamped with a running count of
// the bytes jaxfuse calls touched. The count misses what XLA's own ops move in
// between, so the distance it gives is a lower bound: a wrong guess says
// "still cached" and keeps plain stores, the choice without this.
#ifndef JAXFUSE_OUTPUT_REUSE_H_
#define JAXFUSE_OUTPUT_REUSE_H_

#include <cstddef>
#include <cstdint>
#include <mutex>

namespace jaxfuse {

class RecentOutputs {
 public:
  // Records a call that writes [p, p + bytes) and touches `touched` bytes in
  // all (inputs and outputs). Returns the bytes touched since any part of that
  // range was last written, this call's included, or -1 when none of it is
  // among the remembered ranges.
  int64_t Record(uintptr_t p, size_t bytes, size_t touched) {
    std::lock_guard<std::mutex> lock(mu_);
    const uintptr_t lo = p, hi = p + bytes;
    int64_t since = -1;
    for (Entry& e : entries_) {
      if (e.hi > e.lo && e.lo < hi && lo < e.hi) {
        const int64_t d = static_cast<int64_t>(moved_ - e.stamp);
        if (since < 0 || d < since) since = d;  // the latest write counts
        if (lo <= e.lo && e.hi <= hi) e = Entry{};  // wholly rewritten now
      }
    }
    moved_ += touched;
    entries_[next_] = Entry{lo, hi, moved_};
    next_ = (next_ + 1) % kRemembered;
    return since < 0 ? -1 : since + static_cast<int64_t>(touched);
  }

 private:
  static constexpr int kRemembered = 16;
  struct Entry {
    uintptr_t lo = 0, hi = 0;
    uint64_t stamp = 0;  // moved_ just after the write
  };
  std::mutex mu_;
  Entry entries_[kRemembered];
  int next_ = 0;
  uint64_t moved_ = 0;
};

// Whether a call should stream its output: when its lines were last written
// at least 1.5 last-level caches ago, or, with no record of them, when the
// call alone touches that much. Why 1.5: below it the output was still cached
// and streaming lost, above it streaming won (docs/internals.md, "Streaming
// stores").
inline bool ShouldStream(int64_t reuse_distance, size_t touched, int64_t cache_bytes) {
  const int64_t d = reuse_distance >= 0 ? reuse_distance : static_cast<int64_t>(touched);
  return 2 * d >= 3 * cache_bytes;
}

}  // namespace jaxfuse

#endif  // JAXFUSE_OUTPUT_REUSE_H_

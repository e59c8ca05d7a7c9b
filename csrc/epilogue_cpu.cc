// jaxfuse: the CPU engine behind both FFI targets, `jaxfuse_add_relu` and
// `jaxfuse_epilogue`.
//
// Semantics: epilogue_scalar.h (bit-identical to XLA:CPU's own fusion).
// Broadcasting / validation: broadcast.h.
//
// How a call runs:
//  * The broadcast is collapsed (Collapse) and walked as "runs" along the
//    innermost dim. Inside a run every operand is contiguous, constant, or (a
//    bias row under short rows) periodic; constant and periodic operands are
//    read from small splat / tile buffers, so one contiguous block kernel per
//    (dtype, form) serves every broadcast.
//  * Block kernels: float/double are plain loops compiled twice (baseline
//    x86-64 and AVX2+FMA, picked at run time); float16 uses F16C conversions,
//    bfloat16 AVX2 integer rounding, both with the scalar definition for
//    tails and for CPUs without them.
//  * Outputs no longer in the cache are written with non-temporal stores
//    through a small L1 block: a normal store first reads the line it
//    overwrites, so streaming cuts the traffic of `out = f(a, b)` from four
//    passes to three. Where the same buffer comes back still cached it loses,
//    so by default (JAXFUSE_CPU_STREAMING=auto) a call streams only when its
//    output was last written long enough ago (output_reuse.h).
//  * An output of 8 MiB or more that is not yet faulted in (the C allocator
//    maps large blocks fresh) is faulted in by the kernel 2 MiB ahead of the
//    loop with one system call, not a trap per page ("Pages for large
//    outputs" below).
//  * Pacing: either handler accepts one operand more than it reads, and
//    ignores it. XLA:CPU runs a program it estimates under 1000 flops inline on
//    the dispatching thread, and counts a custom call as -1 flops, so a
//    program holding nothing but these calls would run synchronously, its
//    outputs allocated on the dispatching thread (jaxfuse/_lowering.py says
//    what that costs). The lowering feeds large calls a small value computed
//    by XLA, whose flops put the program back on XLA's asynchronous path.
//  * Large calls are split into chunks claimed by the calling thread and by
//    helpers on XLA's intra-op pool, each from its own contiguous region
//    first; the caller never waits for a chunk nobody has started, so this
//    cannot deadlock, and a late helper finds no work.
#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <string>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "broadcast.h"
#include "cpu_config.h"
#include "epilogue_ffi.h"
#include "epilogue_scalar.h"
#include "output_reuse.h"
#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <xmmintrin.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#endif

namespace ffi = xla::ffi;

namespace jaxfuse {
namespace {

// ---------------------------------------------------------------------------
// Settings
// ---------------------------------------------------------------------------
std::atomic<int64_t> g_max_threads{0};
std::atomic<bool> g_huge_pages{false};
std::atomic<bool> g_prefault{true};
std::atomic<int> g_streaming{-1};  // auto; jaxfuse/_env.py says why
std::atomic<bool> g_vector_avx2{true};  // jaxfuse/_isa.py: XLA may use AVX2
RecentOutputs g_recent_outputs;
// Whether this kernel takes MADV_POPULATE_WRITE (Linux 5.14 on); cleared by
// the first EINVAL, after which outputs fault in on first touch.
std::atomic<bool> g_populate_ok{true};
#if JAXFUSE_TEST_HOOKS
// Split every call into this many regions (0: one per worker), so splits the
// pool here cannot reach, and a caller whose helpers never run, get
// exercised; and what the last split and the last store did.
std::atomic<int64_t> g_forced_regions{0};
std::atomic<int64_t> g_split_calls{0};
std::atomic<int64_t> g_last_workers{0};
std::atomic<int64_t> g_last_regions{0};
std::atomic<int64_t> g_last_reuse{-1};
std::atomic<bool> g_last_streamed{false};
std::atomic<bool> g_last_fresh{false};
std::atomic<int> g_last_pages{0};
std::atomic<int64_t> g_last_prefault_ns{0};
#endif

// The last-level cache this core shares, from sysfs (what lscpu shows); glibc's
// sysconf can report a whole package's L3 instead, many times the slice a
// core sees.
int64_t LastLevelCacheBytes() {
  static const int64_t bytes = [] {
    int64_t best = -1;
#if defined(__linux__)
    for (int index = 0; index < 8; ++index) {
      std::string path = "/sys/devices/system/cpu/cpu0/cache/index" +
                         std::to_string(index) + "/size";
      FILE* f = std::fopen(path.c_str(), "r");
      if (!f) continue;
      long long v = 0;
      char unit = 0;
      int got = std::fscanf(f, "%lld%c", &v, &unit);
      std::fclose(f);
      if (got < 1 || v <= 0) continue;
      if (unit == 'K') v <<= 10;
      if (unit == 'M') v <<= 20;
      best = std::max<int64_t>(best, v);
    }
#endif
#if defined(_SC_LEVEL3_CACHE_SIZE)
    if (best <= 0) best = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
    return best > 0 ? best : int64_t{32} << 20;
  }();
  return bytes;
}

}  // namespace

void ConfigureCpu(const CpuSettings& s) {
  g_max_threads.store(s.max_threads < 0 ? 0 : s.max_threads);
  g_huge_pages.store(s.huge_pages);
  g_prefault.store(s.prefault);
  g_streaming.store(s.streaming);
}

CpuSettings CurrentCpuSettings() {
  CpuSettings s;
  s.max_threads = g_max_threads.load();
  s.huge_pages = g_huge_pages.load();
  s.prefault = g_prefault.load();
  s.streaming = g_streaming.load();
  return s;
}

int64_t StreamingCacheBytes() { return LastLevelCacheBytes(); }

#if JAXFUSE_TEST_HOOKS
void ForceRegionsForTests(int64_t regions) {
  g_forced_regions.store(regions < 0 ? 0 : regions);
}

SplitStats LastSplit() {
  return {g_split_calls.load(), g_last_workers.load(), g_last_regions.load()};
}

StoreStats LastStore() {
  return {g_last_streamed.load(), g_last_fresh.load(), g_last_reuse.load(),
          g_last_pages.load(), g_last_prefault_ns.load()};
}

std::vector<int64_t> ReuseDistancesForTests(
    const std::vector<std::array<uint64_t, 3>>& calls) {
  RecentOutputs recent;
  std::vector<int64_t> out;
  for (const auto& c : calls) out.push_back(recent.Record(c[0], c[1], c[2]));
  return out;
}
#endif  // JAXFUSE_TEST_HOOKS

namespace {

// ---------------------------------------------------------------------------
// Denormal flushing, as XLA:CPU runs its kernels (FTZ + DAZ on x86, FZ on
// AArch64). Set for the duration of each piece of work, then restored.
// ---------------------------------------------------------------------------
class ScopedFlushDenormal {
 public:
#if defined(__x86_64__) || defined(__i386__)
  ScopedFlushDenormal() : saved_(_mm_getcsr()) {
    _mm_setcsr(saved_ | 0x8040u);  // FTZ (bit 15) | DAZ (bit 6)
  }
  ~ScopedFlushDenormal() { _mm_setcsr(saved_); }

 private:
  unsigned int saved_;
#elif defined(__aarch64__)
  ScopedFlushDenormal() {
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(saved_));
    uint64_t v = saved_ | (uint64_t{1} << 24);  // FZ
    __asm__ __volatile__("msr fpcr, %0" : : "r"(v));
  }
  ~ScopedFlushDenormal() { __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_)); }

 private:
  uint64_t saved_;
#else
  ScopedFlushDenormal() {}
#endif
};

// ---------------------------------------------------------------------------
// Block kernels: n contiguous elements of each operand present.
// ---------------------------------------------------------------------------

using BlockFn = void (*)(const void* const* in, void* out, uint8_t* tie,
                         int64_t n);

#if defined(__x86_64__) && defined(__GNUC__)
#define JF_X86 1
#define JF_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define JF_X86 0
#define JF_AVX2
#endif
#define JF_INLINE inline __attribute__((always_inline))

template <class F, class T, bool Tie>
JF_INLINE void WideBody(const void* const* in, void* out, uint8_t* tie,
                        int64_t n) {
  const T* __restrict x = static_cast<const T*>(in[kX]);
  const T* __restrict m = static_cast<const T*>(in[kM]);
  const T* __restrict q = static_cast<const T*>(in[kQ]);
  const T* __restrict s = static_cast<const T*>(in[kS]);
  const T* __restrict t = static_cast<const T*>(in[kT]);
  const T* __restrict r = static_cast<const T*>(in[kR]);
  T* __restrict o = static_cast<T*>(out);
  for (int64_t i = 0; i < n; ++i) {
    T v = preactivation<F>(x[i], F::kMean ? m[i] : T(0),
                           F::kPrescale ? q[i] : T(0), F::kScale ? s[i] : T(0),
                           t[i], F::kResidual ? r[i] : T(0));
    o[i] = relu_keep_nan(v);
    if constexpr (Tie) tie[i] = v == T(0);
  }
}

template <class F, class Tag, bool Tie>
JF_INLINE void NarrowScalarBody(const void* const* in, void* out, uint8_t* tie,
                                int64_t n) {
  const uint16_t* x = static_cast<const uint16_t*>(in[kX]);
  const uint16_t* m = static_cast<const uint16_t*>(in[kM]);
  const uint16_t* q = static_cast<const uint16_t*>(in[kQ]);
  const uint16_t* s = static_cast<const uint16_t*>(in[kS]);
  const uint16_t* t = static_cast<const uint16_t*>(in[kT]);
  const uint16_t* r = static_cast<const uint16_t*>(in[kR]);
  uint16_t* o = static_cast<uint16_t*>(out);
  for (int64_t i = 0; i < n; ++i) {
    bool z;
    o[i] = epilogue<F>(Tag{}, x[i], F::kMean ? m[i] : 0, F::kPrescale ? q[i] : 0,
                       F::kScale ? s[i] : 0, t[i], F::kResidual ? r[i] : 0, &z);
    if constexpr (Tie) tie[i] = z;
  }
}

template <class F, class T, bool Tie>
void WideBase(const void* const* in, void* out, uint8_t* tie, int64_t n) {
  WideBody<F, T, Tie>(in, out, tie, n);
}
template <class F, class Tag, bool Tie>
void NarrowBase(const void* const* in, void* out, uint8_t* tie, int64_t n) {
  NarrowScalarBody<F, Tag, Tie>(in, out, tie, n);
}

#if JF_X86
template <class F, class T, bool Tie>
JF_AVX2 void WideAvx2(const void* const* in, void* out, uint8_t* tie,
                      int64_t n) {
  WideBody<F, T, Tie>(in, out, tie, n);
}

// 8 lanes of f16 / bf16 held as f32, with the same bits as the scalar code:
// widening is exact; rounding is to nearest even; a NaN lane leaves as the
// host's canonical NaN (f16 0x7e00, bf16 sign | 0x7fc0).
struct F16Lanes {
  using Tag = F16Tag;
  static JF_AVX2 JF_INLINE __m256 Load(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static JF_AVX2 JF_INLINE __m256 Round(__m256 v) {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, 0));
  }
  // 8 values to f16 with NaN lanes made canonical.
  static JF_AVX2 JF_INLINE __m128i Narrow(__m256 v) {
    __m128i h = _mm256_cvtps_ph(v, 0 /* round to nearest even */);
    __m256i nan32 = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(nan32),
                                    _mm256_extracti128_si256(nan32, 1));
    return _mm_blendv_epi8(h, _mm_set1_epi16(0x7e00), nan16);
  }
  // 16 values already representable in f16 (conversion exact, NaN canonical).
  static JF_AVX2 JF_INLINE void StoreExact16(uint16_t* p, __m256 lo, __m256 hi) {
    __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(Narrow(lo)), Narrow(hi), 1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), both);
  }
};

struct BF16Lanes {
  using Tag = BF16Tag;
  static JF_AVX2 JF_INLINE __m256 Load(const uint16_t* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  // bf16 bits in the low half of each u32 lane.
  static JF_AVX2 JF_INLINE __m256i Narrow(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i hi = _mm256_srli_epi32(u, 16);
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                         _mm256_and_si256(hi, _mm256_set1_epi32(1))),
        16);
    __m256i nan = _mm256_or_si256(_mm256_and_si256(hi, _mm256_set1_epi32(0x8000)),
                                  _mm256_set1_epi32(0x7fc0));
    return _mm256_blendv_epi8(r, nan,
                              _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  }
  static JF_AVX2 JF_INLINE __m256 Round(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(Narrow(v), 16));
  }
  // 16 values already representable in bf16 (Round made NaNs sign | 0x7fc0):
  // the upper halves are the bf16 bits, no rounding left to do.
  static JF_AVX2 JF_INLINE void StoreExact16(uint16_t* p, __m256 lo, __m256 hi) {
    __m256i a = _mm256_srli_epi32(_mm256_castps_si256(lo), 16);
    __m256i b = _mm256_srli_epi32(_mm256_castps_si256(hi), 16);
    // packus works per 128-bit lane: [a0-3 b0-3 a4-7 b4-7] -> reorder.
    __m256i h = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
};

// fma_narrow (epilogue_scalar.h) on 8 lanes: a * b + c rounded to odd, so
// that rounding it to float16 rounds the exact value once.
JF_AVX2 JF_INLINE __m256 FmaNarrow8(__m256 a, __m256 b, __m256 c) {
  __m256 p = _mm256_mul_ps(a, b);  // exact for float16 values
  __m256 s = _mm256_add_ps(p, c);
  __m256 bb = _mm256_sub_ps(s, p);
  __m256 err = _mm256_add_ps(_mm256_sub_ps(p, _mm256_sub_ps(s, bb)), _mm256_sub_ps(c, bb));
  __m256 zero = _mm256_setzero_ps();
  __m256 inexact = _mm256_cmp_ps(err, zero, _CMP_NEQ_OQ);  // false for NaN
  __m256 toward_zero = _mm256_and_ps(
      inexact, _mm256_xor_ps(_mm256_cmp_ps(err, zero, _CMP_LT_OQ), _mm256_cmp_ps(s, zero, _CMP_LT_OQ)));
  __m256i u = _mm256_castps_si256(s);
  u = _mm256_add_epi32(u, _mm256_castps_si256(toward_zero));  // -1 where nearer zero
  u = _mm256_or_si256(u, _mm256_and_si256(_mm256_castps_si256(inexact), _mm256_set1_epi32(1)));
  return _mm256_castsi256_ps(u);
}

template <class F, class L>
JF_AVX2 JF_INLINE __m256 Rnd(__m256 v) {
  if constexpr (F::kNarrowEachOp) return L::Round(v);
  return v;
}

// 8 lanes of the pre-activation, rounded to the narrow type (so the value is
// exactly representable there).
template <class F, class L>
JF_AVX2 JF_INLINE __m256 Preactivation8(const uint16_t* x, const uint16_t* m,
                                         const uint16_t* q, const uint16_t* s,
                                         const uint16_t* t, const uint16_t* r) {
  __m256 v = L::Load(x);
  if constexpr (F::kMean) v = Rnd<F, L>(_mm256_sub_ps(v, L::Load(m)));
  if constexpr (F::kPrescale) v = Rnd<F, L>(_mm256_mul_ps(v, L::Load(q)));
  if constexpr (F::kScale) {
    if constexpr (F::kContract) {
      v = F::kNarrowEachOp ? L::Round(FmaNarrow8(v, L::Load(s), L::Load(t)))
                           : _mm256_fmadd_ps(v, L::Load(s), L::Load(t));
    } else {
      v = Rnd<F, L>(_mm256_mul_ps(v, L::Load(s)));
      v = Rnd<F, L>(_mm256_add_ps(v, L::Load(t)));
    }
  } else {
    __m256 sum = _mm256_add_ps(v, L::Load(t));
    // add_xla: the first operand's NaN wins (only its sign survives bf16
    // narrowing; f16 canonicalizes), whatever order vaddps got.
    v = Rnd<F, L>(_mm256_blendv_ps(sum, v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  }
  if constexpr (F::kResidual) v = Rnd<F, L>(_mm256_add_ps(v, L::Load(r)));
  if constexpr (!F::kNarrowEachOp) v = L::Round(v);
  return v;
}

template <bool Tie>
JF_AVX2 JF_INLINE void Ties8(__m256 v, uint8_t* tie) {
  if constexpr (Tie) {
    __m256i eq = _mm256_castps_si256(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_EQ_OQ));
    __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(eq), _mm256_extracti128_si256(eq, 1));
    __m128i b = _mm_and_si128(_mm_packs_epi16(w, w), _mm_set1_epi8(1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(tie), b);
  }
}

template <class F, class L, bool Tie>
JF_AVX2 void NarrowAvx2(const void* const* in, void* out, uint8_t* tie,
                        int64_t n) {
  const uint16_t* x = static_cast<const uint16_t*>(in[kX]);
  const uint16_t* m = static_cast<const uint16_t*>(in[kM]);
  const uint16_t* q = static_cast<const uint16_t*>(in[kQ]);
  const uint16_t* s = static_cast<const uint16_t*>(in[kS]);
  const uint16_t* t = static_cast<const uint16_t*>(in[kT]);
  const uint16_t* r = static_cast<const uint16_t*>(in[kR]);
  uint16_t* o = static_cast<uint16_t*>(out);
  const __m256 zero = _mm256_setzero_ps();
  auto at = [](const uint16_t* p, int64_t k) { return p ? p + k : p; };
  int64_t i = 0;
  // 16 lanes a step: two halves, narrowed and stored with one 256-bit store.
  for (; i + 16 <= n; i += 16) {
    __m256 lo = Preactivation8<F, L>(x + i, at(m, i), at(q, i), at(s, i), t + i, at(r, i));
    __m256 hi = Preactivation8<F, L>(x + i + 8, at(m, i + 8), at(q, i + 8), at(s, i + 8),
                                     t + i + 8, at(r, i + 8));
    if constexpr (Tie) {
      Ties8<Tie>(lo, tie + i);
      Ties8<Tie>(hi, tie + i + 8);
    }
    lo = _mm256_andnot_ps(_mm256_cmp_ps(lo, zero, _CMP_LE_OQ), lo);  // relu
    hi = _mm256_andnot_ps(_mm256_cmp_ps(hi, zero, _CMP_LE_OQ), hi);
    L::StoreExact16(o + i, lo, hi);
  }
  if (i < n) {
    const void* rest[kSlots];
    for (int k = 0; k < kSlots; ++k) {
      rest[k] = in[k] ? static_cast<const uint16_t*>(in[k]) + i : nullptr;
    }
    NarrowScalarBody<F, typename L::Tag, Tie>(rest, o + i,
                                              Tie ? tie + i : nullptr, n - i);
  }
}

bool CpuHasAvx2() {
  static const bool have = __builtin_cpu_supports("avx2") &&
                           __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
  return have;
}

// The AVX2 loops run only where XLA may use AVX2 too (SetVectorPath): XLA held
// to SSE4.2 on a bigger host is then compared with the loops such a CPU runs.
bool HaveAvx2() { return g_vector_avx2.load(std::memory_order_relaxed) && CpuHasAvx2(); }
#endif  // JF_X86

// ---- the table: dtype x (mean, scale, residual, contract, each-op, tie, prescale)
enum Dtype { kF32 = 0, kF64 = 1, kF16 = 2, kBF16 = 3 };

// Keys that name a distinct kernel: valid forms (epilogue_scalar.h), with
// rounding per operation only for 2-byte types.
template <int D, int K>
constexpr bool Distinct() {
  const bool narrow = D == kF16 || D == kBF16;
  return ValidFormKey(K) && (narrow || (K & kEachOpBit) != 0);
}

template <int D, int K>
BlockFn PickOne() {
  if constexpr (!Distinct<D, K>()) {
    return nullptr;
  } else {
  using F = FormOfKey<K>;
  constexpr bool kTie = (K & kTieBit) != 0;
#if JF_X86
  if (HaveAvx2()) {
    if constexpr (D == kF32) return &WideAvx2<F, float, kTie>;
    if constexpr (D == kF64) return &WideAvx2<F, double, kTie>;
    if constexpr (D == kF16) return &NarrowAvx2<F, F16Lanes, kTie>;
    if constexpr (D == kBF16) return &NarrowAvx2<F, BF16Lanes, kTie>;
  }
#endif
  if constexpr (D == kF32) return &WideBase<F, float, kTie>;
  if constexpr (D == kF64) return &WideBase<F, double, kTie>;
  if constexpr (D == kF16) return &NarrowBase<F, F16Tag, kTie>;
  return &NarrowBase<F, BF16Tag, kTie>;
  }
}

template <int D, int... Ks>
BlockFn PickIn(int key, std::integer_sequence<int, Ks...>) {
  BlockFn fn = nullptr;
  ((key == Ks ? (fn = PickOne<D, Ks>(), 0) : 0), ...);
  return fn;
}

BlockFn PickBlock(Dtype d, int key) {
  auto keys = std::make_integer_sequence<int, kFormKeys>{};
  switch (d) {
    case kF32: return PickIn<kF32>(key, keys);
    case kF64: return PickIn<kF64>(key, keys);
    case kF16: return PickIn<kF16>(key, keys);
    case kBF16: return PickIn<kBF16>(key, keys);
  }
  return nullptr;
}

// ---------------------------------------------------------------------------
// Streaming stores: copy an L1 block to its destination with non-temporal
// stores (aligned middle; plain head and tail).
// ---------------------------------------------------------------------------
#if JF_X86
JF_AVX2 void StreamCopyAvx2(void* dst, const void* src, size_t bytes) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  size_t head = (32 - (reinterpret_cast<uintptr_t>(d) & 31)) & 31;
  head = std::min(head, bytes);
  std::memcpy(d, s, head);
  size_t i = head;
  for (; i + 32 <= bytes; i += 32) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
  }
  std::memcpy(d + i, s + i, bytes - i);
}
#endif

// ---------------------------------------------------------------------------
// Runs: the walk over the collapsed broadcast.
// ---------------------------------------------------------------------------
// Elements per block-kernel call: long enough that the call costs nothing
// against the work, short enough that splat and streaming blocks stay in L1/L2.
constexpr int64_t kBlock = 2048;
// Streamed calls stage fewer: non-temporal stores pay off from short blocks and
// not from long ones (docs/internals.md, "Streaming stores").
constexpr int64_t kStreamBlock = 256;
constexpr int64_t kTileMin = 256;  // rows shorter than this are tiled
constexpr int64_t kTileCap = 2 * kTileMin + kBlock;

struct Call {
  Collapsed c;
  int slot_of[kMaxOperands];   // operand k -> Slot
  const void* data[kMaxOperands];
  void* out;
  uint8_t* tie;                // nullptr without the tie output
  size_t itemsize;
  BlockFn block;
  bool stream;
  bool populate;               // fault the output in ahead of the loop (Prefault)
  // Derived walk: a run covers the dims from `run_from` on.
  int run_from;                // first collapsed dim inside a run
  int64_t run_len;             // elements per run
  int64_t period;              // row length for periodic operands (tiled walk)
  enum Kind : uint8_t { kContig, kConst, kPeriodic } kind[kMaxOperands];
};

// Chooses how runs are laid out: one run per innermost row, or, when rows are
// short and every operand is contiguous, constant or a row vector over the
// last two dims, one run per block of rows with the row vectors tiled.
void PlanRuns(Call* call) {
  const Collapsed& c = call->c;
  const int r = static_cast<int>(c.dims.size());
  call->period = 0;
  if (r == 0) {
    call->run_from = 0;
    call->run_len = 1;
    for (int k = 0; k < c.operands; ++k) call->kind[k] = Call::kConst;
    return;
  }
  const int64_t n = c.dims[r - 1];
  bool tile = r >= 2 && n < kTileMin;
  for (int k = 0; tile && k < c.operands; ++k) {
    bool inner = c.full[r - 1] >> k & 1u, outer = c.full[r - 2] >> k & 1u;
    if (outer && !inner) tile = false;  // a column: neither contiguous nor periodic
  }
  if (tile) {
    call->run_from = r - 2;
    call->run_len = c.dims[r - 2] * n;
    call->period = n;
    for (int k = 0; k < c.operands; ++k) {
      bool inner = c.full[r - 1] >> k & 1u, outer = c.full[r - 2] >> k & 1u;
      call->kind[k] = outer ? Call::kContig : inner ? Call::kPeriodic : Call::kConst;
    }
  } else {
    call->run_from = r - 1;
    call->run_len = n;
    for (int k = 0; k < c.operands; ++k) {
      call->kind[k] = (c.full[r - 1] >> k & 1u) ? Call::kContig : Call::kConst;
    }
  }
}

// Per-thread buffers for one range: splats, tiles and the streaming block.
struct Scratch {
  alignas(64) unsigned char splat[kMaxOperands][kBlock * 8];
  alignas(64) unsigned char tile[kMaxOperands][kTileCap * 8];
  alignas(64) unsigned char block[kBlock * 8];
  const void* splat_src[kMaxOperands];
  const void* tile_src[kMaxOperands];
};

void Splat(void* dst, const void* src, size_t itemsize, int64_t n) {
  unsigned char* d = static_cast<unsigned char*>(dst);
  std::memcpy(d, src, itemsize);
  int64_t have = 1;
  while (have < n) {  // doubling copies
    int64_t step = std::min(have, n - have);
    std::memcpy(d + have * itemsize, d, step * itemsize);
    have += step;
  }
}

// Output positions [lo, hi) (flat, row-major).
void RunRange(const Call& call, int64_t lo, int64_t hi, Scratch* sc) {
  ScopedFlushDenormal ftz;
  const Collapsed& c = call.c;
  const size_t isz = call.itemsize;
  const int outer = call.run_from;
  const int64_t L = call.run_len;
  for (int k = 0; k < kMaxOperands; ++k) {
    sc->splat_src[k] = nullptr;
    sc->tile_src[k] = nullptr;
  }
  // Outer odometer at the run holding lo.
  int64_t coord[kMaxRank];
  int64_t rem = lo / L;
  for (int d = outer - 1; d >= 0; --d) {
    coord[d] = rem % c.dims[d];
    rem /= c.dims[d];
  }
  int64_t pos = lo;
  int64_t j = lo % L;  // position inside the current run
  while (pos < hi) {
    // Operand bases at the start of this run.
    const unsigned char* base[kMaxOperands];
    for (int k = 0; k < c.operands; ++k) {
      int64_t off = 0;
      for (int d = 0; d < outer; ++d) off += coord[d] * c.strides[k][d];
      base[k] = static_cast<const unsigned char*>(call.data[k]) + off * isz;
    }
    for (int k = 0; k < c.operands; ++k) {
      if (call.kind[k] == Call::kConst && sc->splat_src[k] != base[k]) {
        Splat(sc->splat[k], base[k], isz, kBlock);
        sc->splat_src[k] = base[k];
      } else if (call.kind[k] == Call::kPeriodic && sc->tile_src[k] != base[k]) {
        // period * reps >= period + kBlock: any start has a block ahead.
        int64_t p = call.period, reps = (p + kBlock + p - 1) / p;
        for (int64_t q = 0; q < reps; ++q) {
          std::memcpy(sc->tile[k] + q * p * isz, base[k], p * isz);
        }
        sc->tile_src[k] = base[k];
      }
    }
    const int64_t run_end = std::min<int64_t>(L, j + (hi - pos));
    while (j < run_end) {
      const int64_t len = std::min(call.stream ? kStreamBlock : kBlock, run_end - j);
      const void* in[kSlots] = {};
      for (int k = 0; k < c.operands; ++k) {
        const void* p;
        switch (call.kind[k]) {
          case Call::kContig: p = base[k] + j * isz; break;
          case Call::kConst: p = sc->splat[k]; break;
          default: p = sc->tile[k] + (j % call.period) * isz; break;
        }
        in[call.slot_of[k]] = p;
      }
      unsigned char* dst = static_cast<unsigned char*>(call.out) + pos * isz;
      uint8_t* tie = call.tie ? call.tie + pos : nullptr;
#if JF_X86
      if (call.stream) {
        call.block(in, sc->block, tie, len);
        StreamCopyAvx2(dst, sc->block, len * isz);
      } else
#endif
      {
        call.block(in, dst, tie, len);
      }
      j += len;
      pos += len;
    }
    // Next run.
    j = 0;
    for (int d = outer - 1; d >= 0; --d) {
      if (++coord[d] < c.dims[d]) break;
      coord[d] = 0;
    }
  }
#if JF_X86
  if (call.stream) _mm_sfence();  // order the streamed lines before "done"
#endif
}

// Scratch (~250 KB) is allocated once per thread that ever runs a range.
Scratch* ThreadScratch() {
  thread_local std::unique_ptr<Scratch> scratch;
  if (!scratch) scratch = std::make_unique<Scratch>();
  return scratch.get();
}

// ---------------------------------------------------------------------------
// Pages for large outputs (docs/internals.md, "CPU kernel details").
//
// XLA allocates every output with the C allocator, which maps a block of
// 32 MiB or more fresh from the operating system each time (and may hand out
// smaller ones fresh too). Writing such a block takes a page fault per 4 KiB,
// more than the arithmetic at large sizes
// (benchmarks/results/cpu-loop-faults-2026-12-02.txt). So an output of 8 MiB or
// more that is not yet faulted in is faulted in by the kernel itself, 2 MiB
// at a time just ahead of the loop, with MADV_POPULATE_WRITE: one system call
// per 2 MiB rather than a trap per page, the zeroed lines still cached when
// the loop writes them; the pages are 4 KiB ones from the same free lists
// XLA's own outputs come from. Huge pages (MADV_HUGEPAGE on the 2 MiB-aligned
// interior) are only asked for where JAXFUSE_CPU_HUGE_PAGES says so: they
// faulted in for 60-110 us of CPU per MiB where a process got back the ones it
// had just freed, and for 1000-2400 where it did not (freed on one CPU and
// faulted on the other, a process's first ones), against 295-455 for 4 KiB
// pages faulted in ahead, so whether they won depended on the process
// (benchmarks/results/notes/2026-12-04.md). Advisory only: contents are
// untouched, and the advice does nothing where THP is "never".
// ---------------------------------------------------------------------------
constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kPrefaultMin = size_t{8} << 20;  // bytes

#if defined(__linux__) && !defined(MADV_POPULATE_WRITE)
#define MADV_POPULATE_WRITE 23  // Linux 5.14's value, for older headers
#endif

void AdviseHugePages(void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  uintptr_t lo = (reinterpret_cast<uintptr_t>(p) + kHugePage - 1) &
                 ~(uintptr_t)(kHugePage - 1);
  uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + bytes) &
                 ~(uintptr_t)(kHugePage - 1);
  if (hi > lo) {
    (void)madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
  }
#else
  (void)p;
  (void)bytes;
#endif
}

#if JAXFUSE_TEST_HOOKS
int64_t ThreadCpuNs() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}
#endif

// Faults in the output ahead of elements [lo, hi): from where this worker
// last got to (`*done_to`, an address) or lo, on to the end of the 2 MiB
// block hi reaches, so a worker walking its region makes one system call per
// 2 MiB. Returns the CPU time the calling thread spent in it (test-hook
// builds only; 0 otherwise). A kernel without MADV_POPULATE_WRITE says EINVAL
// once, and later calls leave their pages to the loop's first touch.
int64_t Prefault(const Call& call, int64_t total, int64_t lo, int64_t hi, uintptr_t* done_to) {
#if defined(__linux__)
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t base = reinterpret_cast<uintptr_t>(call.out);
  const uintptr_t end = (base + total * call.itemsize + page - 1) & ~(page - 1);
  const uintptr_t want = base + hi * call.itemsize;
  if (want <= *done_to) return 0;
  const uintptr_t b = std::max(base + lo * call.itemsize, *done_to) & ~(page - 1);
  const uintptr_t e = std::min(end, (want + kHugePage - 1) & ~(uintptr_t)(kHugePage - 1));
  *done_to = e;
#if JAXFUSE_TEST_HOOKS
  const int64_t t0 = ThreadCpuNs();
#endif
  if (madvise(reinterpret_cast<void*>(b), e - b, MADV_POPULATE_WRITE) != 0 &&
      errno == EINVAL) {
    g_populate_ok.store(false, std::memory_order_relaxed);
  }
#if JAXFUSE_TEST_HOOKS
  return ThreadCpuNs() - t0;
#else
  return 0;
#endif
#else
  (void)call;
  (void)total;
  (void)lo;
  (void)hi;
  (void)done_to;
  return 0;
#endif
}

// Whether the output is memory the operating system has not handed over yet:
// a block fresh from mmap, whose first touch faults in a page the kernel
// zeroes, through the cache. Plain stores then find their lines already there,
// so there is nothing for streaming to save. Probed at the middle page: the
// allocator's header shares the first one.
bool FreshPages(const void* p, size_t bytes) {
#if defined(__linux__)
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t mid = (reinterpret_cast<uintptr_t>(p) + bytes / 2) & ~(page - 1);
  unsigned char resident = 1;
  if (mincore(reinterpret_cast<void*>(mid), 1, &resident) != 0) return false;
  return (resident & 1) == 0;
#else
  (void)p;
  (void)bytes;
  return false;
#endif
}

// ---------------------------------------------------------------------------
// Parallel driver.
// ---------------------------------------------------------------------------
constexpr int64_t kChunk = 64 * 1024;  // elements per claim (line-aligned)
// Elements a worker is worth. A 4- or 8-byte loop is memory-bound, and a
// helper on XLA's pool costs a hand-off, so it needs two chunks; a 2-byte one
// converts every element and is worth a helper from one (docs/internals.md,
// "CPU kernel details", where the timings are).
constexpr int64_t kMinChunkWide = 2 * kChunk;
constexpr int64_t kMinChunkNarrow = kChunk;

// Each worker owns a contiguous region of chunks and claims them in order, so
// its loads and stores run as one long stream the hardware prefetchers follow;
// a worker whose region is empty takes the next unclaimed chunks of the
// others'. Regions were faster than chunks dealt alternately
// (docs/internals.md, "CPU kernel details").
struct alignas(64) Region {
  std::atomic<int64_t> next{0};
  int64_t end = 0;
};

struct Job {
  Call call;
  int64_t total, nchunks;
  int64_t nregions;
  std::unique_ptr<Region[]> regions;
  std::atomic<int64_t> tickets{0};
  std::atomic<int64_t> done{0};
  std::atomic<int64_t> prefault_ns{0};  // summed over workers

  void Plan(int64_t n) {
    nregions = n;
    regions = std::make_unique<Region[]>(n);
    for (int64_t r = 0; r < n; ++r) {
      regions[r].next.store(nchunks * r / n, std::memory_order_relaxed);
      regions[r].end = nchunks * (r + 1) / n;
    }
  }

  // Own region first (one per worker, or fewer workers than regions under
  // ForceRegionsForTests), then the others' in turn.
  void Work() {
    const int64_t own =
        tickets.fetch_add(1, std::memory_order_relaxed) % nregions;
    for (int64_t k = 0; k < nregions; ++k) {
      Region& reg = regions[(own + k) % nregions];
      uintptr_t done_to = 0;  // prefaulted up to here in this region
      for (;;) {
        int64_t i = reg.next.fetch_add(1, std::memory_order_relaxed);
        if (i >= reg.end) break;
        int64_t lo = i * kChunk, hi = std::min(total, lo + kChunk);
        if (call.populate) {
          prefault_ns.fetch_add(Prefault(call, total, lo, hi, &done_to),
                                std::memory_order_relaxed);
        }
        RunRange(call, lo, hi, ThreadScratch());
        done.fetch_add(1, std::memory_order_release);
      }
    }
  }
};

Dtype ToDtype(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F64: return kF64;
    case ffi::DataType::F16: return kF16;
    case ffi::DataType::BF16: return kBF16;
    default: return kF32;
  }
}

size_t Itemsize(ffi::DataType t) {
  return t == ffi::DataType::F64 ? 8 : t == ffi::DataType::F32 ? 4 : 2;
}

// The whole call once validated: operands in slot order for `slots`.
ffi::Error Execute(ffi::ThreadPool pool, const char* op,
                   const ffi::AnyBuffer* const* operands, const int* slots,
                   int n, ffi::AnyBuffer* out, ffi::AnyBuffer* tie,
                   int variant_key) {
  ffi::DataType dt = operands[0]->element_type();
  for (int k = 0; k < n; ++k) {
    if (operands[k]->element_type() != dt || out->element_type() != dt) {
      return ffi::Error::InvalidArgument(
          std::string(op) + ": operand and result dtypes must match, got " +
          DtypeString(operands[k]->element_type()) + " and " +
          DtypeString(out->element_type()));
    }
  }
  if (!SupportedDtype(dt)) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": unsupported dtype " + DtypeString(dt) +
        " (supported: float32, float64, float16, bfloat16)");
  }
  auto job = std::make_shared<Job>();
  Call& call = job->call;
  ffi::Span<const int64_t> dims[kMaxOperands];
  for (int k = 0; k < n; ++k) dims[k] = operands[k]->dimensions();
  if (ffi::Error e = Collapse(op, dims, n, out->dimensions(), &call.c);
      e.failure()) {
    return e;
  }
  if (tie != nullptr) {
    if (tie->element_type() != ffi::DataType::PRED ||
        tie->element_count() != static_cast<size_t>(call.c.total)) {
      return ffi::Error::InvalidArgument(std::string(op) +
                                         ": the tie output must be bool[out]");
    }
  }
  if (call.c.total == 0) return ffi::Error::Success();
  for (int k = 0; k < n; ++k) {
    call.slot_of[k] = slots[k];
    call.data[k] = operands[k]->untyped_data();
  }
  call.out = out->untyped_data();
  call.tie = tie ? static_cast<uint8_t*>(tie->untyped_data()) : nullptr;
  call.itemsize = Itemsize(dt);
  const Dtype d = ToDtype(dt);
  int key = variant_key | (tie ? 32 : 0);
  if (d == kF32 || d == kF64) key |= 16;  // rounding per operation: narrow types only
  call.block = PickBlock(d, key);
  if (call.block == nullptr) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": unsupported combination of attributes");
  }
  PlanRuns(&call);

  const int64_t total = call.c.total;
  const size_t out_bytes = out->size_bytes();
  size_t touched = out_bytes;
  for (int k = 0; k < n; ++k) touched += operands[k]->size_bytes();
  const int streaming = g_streaming.load(std::memory_order_relaxed);
  const int64_t reuse = g_recent_outputs.Record(
      reinterpret_cast<uintptr_t>(call.out), out_bytes, touched);
  // Whether the output is not yet faulted in, probed once, where either
  // choice below needs it.
  const bool large = out_bytes >= kPrefaultMin;
  bool fresh = false, probed = false;
  auto is_fresh = [&] {
    if (!probed) fresh = FreshPages(call.out, out_bytes);
    probed = true;
    return fresh;
  };
  call.stream = streaming == 1;
  // auto leaves 2-byte types alone: their kernels convert every element, and
  // streaming them (through the L1 block) lost at 2^23 bfloat16/float16.
  if (streaming < 0 && call.itemsize >= 4 &&
      ShouldStream(reuse, touched, StreamingCacheBytes())) {
    call.stream = !is_fresh();
  }
#if JF_X86
  call.stream = call.stream && HaveAvx2();
#else
  call.stream = false;
#endif
  // A large output not yet faulted in is faulted in ahead of the loop, in
  // huge pages only where asked ("Pages for large outputs" above).
  const bool huge = g_huge_pages.load(std::memory_order_relaxed);
  call.populate = false;
  if (large && g_prefault.load(std::memory_order_relaxed) &&
      g_populate_ok.load(std::memory_order_relaxed)) {
    call.populate = is_fresh();
    if (call.populate && huge) AdviseHugePages(call.out, out_bytes);
  } else if (large && huge) {
    // Not prefaulting (switched off, or a kernel without MADV_POPULATE_WRITE):
    // advised whatever its state, faulted in by the loop's first touch.
    AdviseHugePages(call.out, out_bytes);
  }
#if JAXFUSE_TEST_HOOKS
  g_last_reuse.store(reuse, std::memory_order_relaxed);
  g_last_streamed.store(call.stream, std::memory_order_relaxed);
  g_last_fresh.store(fresh, std::memory_order_relaxed);
  g_last_pages.store(call.populate ? (huge ? 2 : 1) : 0, std::memory_order_relaxed);
  g_last_prefault_ns.store(0, std::memory_order_relaxed);
#endif
  auto record = [&](int64_t ns) {  // what prefaulting took (test hooks)
#if JAXFUSE_TEST_HOOKS
    g_last_prefault_ns.store(ns, std::memory_order_relaxed);
#else
    (void)ns;
#endif
  };

  int64_t workers = std::max<int64_t>(1, pool.num_threads());
  const int64_t cap = g_max_threads.load(std::memory_order_relaxed);
  if (cap > 0) workers = std::min(workers, cap);
  workers = std::min<int64_t>(
      workers, total / (call.itemsize >= 4 ? kMinChunkWide : kMinChunkNarrow));
  const int64_t nchunks = (total + kChunk - 1) / kChunk;
#if JAXFUSE_TEST_HOOKS
  const int64_t forced = g_forced_regions.load(std::memory_order_relaxed);
#else
  const int64_t forced = 0;
#endif
  const int64_t nregions =
      forced > 0 ? std::min(forced, nchunks) : std::max<int64_t>(workers, 1);
  if (workers <= 1 && nregions <= 1) {
    if (!call.populate) {
      RunRange(call, 0, total, ThreadScratch());
      return ffi::Error::Success();
    }
    int64_t ns = 0;
    uintptr_t done_to = 0;
    for (int64_t lo = 0; lo < total; lo += kChunk) {
      const int64_t hi = std::min(total, lo + kChunk);
      ns += Prefault(call, total, lo, hi, &done_to);
      RunRange(call, lo, hi, ThreadScratch());
    }
    record(ns);
    return ffi::Error::Success();
  }
  // Small chunks, whatever the size: once the caller has run out of chunks
  // it waits for the ones helpers hold, at most one each, so a chunk bounds
  // that wait (docs/internals.md, "CPU kernel details").
  job->total = total;
  job->nchunks = nchunks;
  job->Plan(nregions);
#if JAXFUSE_TEST_HOOKS
  g_split_calls.fetch_add(1, std::memory_order_relaxed);
  g_last_workers.store(workers, std::memory_order_relaxed);
  g_last_regions.store(nregions, std::memory_order_relaxed);
#endif
  for (int64_t w = 1; w < workers; ++w) {
    // The task owns a reference: it may run after this handler returned, in
    // which case it finds no chunk left and touches nothing.
    pool.Schedule([job] { job->Work(); });
  }
  job->Work();
  // Every chunk is claimed now; wait only for those still running elsewhere.
  int spins = 0;
  while (job->done.load(std::memory_order_acquire) < job->nchunks) {
    if (++spins > 64) std::this_thread::yield();
  }
  record(job->prefault_ns.load(std::memory_order_relaxed));
  return ffi::Error::Success();
}

// --- jaxfuse_add_relu: max(a + b, 0) ---------------------------------------
ffi::Error AddReluCpuImpl(ffi::ThreadPool pool, ffi::AnyBuffer a,
                          ffi::AnyBuffer b, ffi::RemainingArgs pacing,
                          ffi::Result<ffi::AnyBuffer> out) {
  if (pacing.size() > 1) {
    return ffi::Error::InvalidArgument(
        "jaxfuse_add_relu: expected 2 operands and at most one pacing value, got " +
        std::to_string(2 + pacing.size()) + " operands");
  }
  const ffi::AnyBuffer* ops[2] = {&a, &b};
  const int slots[2] = {kX, kT};
  return Execute(pool, "jaxfuse_add_relu", ops, slots, 2, &*out, nullptr,
                 FormKey(false, false, false, false, false, true, false));
}

// --- jaxfuse_epilogue: relu((((x - m) * q) * s + t) + r) [, tie] ----------
ffi::Error EpilogueCpuImpl(ffi::ThreadPool pool, ffi::RemainingArgs args,
                           ffi::RemainingRets rets, bool mean, bool prescale,
                           bool scale, bool residual, bool contract,
                           bool narrow_each_op, bool tie) {
  const char* op = "jaxfuse_epilogue";
  EpilogueCall call;
  // One more operand than the flags name is a pacing value (see "Pacing").
  if (ffi::Error e = ReadEpilogueCall(op, args, rets,
                                      {mean, prescale, scale, residual, tie},
                                      /*extra=*/1, &call);
      e.failure()) {
    return e;
  }
  const ffi::AnyBuffer* ops[kMaxOperands];
  for (int k = 0; k < call.n; ++k) ops[k] = &call.operands[k];
  return Execute(pool, op, ops, call.slots, call.n, &call.results[0],
                 tie ? &call.results[1] : nullptr,
                 FormKey(mean, prescale, scale, residual, contract && scale,
                         narrow_each_op, false));
}

}  // namespace

#if JAXFUSE_TEST_HOOKS
bool FreshPagesForTests(uintptr_t p, size_t bytes) {
  return FreshPages(reinterpret_cast<const void*>(p), bytes);
}
#endif

void SetVectorPath(bool avx2) { g_vector_avx2.store(avx2); }

const char* VectorPath() {
#if JF_X86
  return HaveAvx2() ? "avx2" : "baseline";
#else
  return "baseline";
#endif
}

}  // namespace jaxfuse

XLA_FFI_DEFINE_HANDLER_SYMBOL(AddReluCpu, jaxfuse::AddReluCpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()  // a pacing value, if any
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EpilogueCpu, jaxfuse::EpilogueCpuImpl,
                              jaxfuse::WithEpilogueAttrs(
                                  ffi::Ffi::Bind()
                                      .Ctx<ffi::ThreadPool>()
                                      .RemainingArgs()
                                      .RemainingRets()));

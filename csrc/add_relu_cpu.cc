// jaxfuse: XLA FFI CPU handler for the fused `max(a + b, 0)`.
//
// Semantics: add_relu_scalar.h (bit-identical to XLA:CPU's own fusion).
// Broadcasting / validation: add_relu_common.h.
//
// Work is split into chunks of >= kMinChunk elements, claimed dynamically by
// the calling thread and by helpers scheduled on XLA's intra-op thread pool
// (ffi::ThreadPool). The caller never waits for a chunk nobody has started,
// so the scheme cannot deadlock even if the pool is busy or the caller is a
// pool thread itself; late helpers find no work and exit without touching the
// buffers.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>

#include "add_relu_common.h"
#include "add_relu_scalar.h"
#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <xmmintrin.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace ffi = xla::ffi;

namespace jaxfuse {
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
// Contiguous inner kernels. One set per storage type; written as plain loops
// that gcc/clang auto-vectorize at -O3 (check with -fopt-info-vec). On x86
// with GNU ifunc support they are also cloned for AVX2 and dispatched at load
// time (the shipped build itself needs nothing beyond the baseline ISA).
// ---------------------------------------------------------------------------
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && \
    !defined(JAXFUSE_NO_TARGET_CLONES)
#define JF_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define JF_CLONES
#endif

// NaN choice when both operands are NaN: the operand that is constant along
// the inner run (the broadcast scalar in _vs/_sv) goes first and so wins,
// which is what XLA:CPU's own loops measurably do for those broadcasts
// (e.g. (64,70000)+(64,1) gives b's NaN). Full-vs-full: a first.
#define JF_DEFINE_KERNELS(NAME, S, FN)                                       \
  JF_CLONES void NAME##_vv(const S* __restrict a, const S* __restrict b,     \
                           S* __restrict o, int64_t n) {                     \
    for (int64_t i = 0; i < n; ++i) o[i] = FN(a[i], b[i]);                   \
  }                                                                          \
  JF_CLONES void NAME##_vs(const S* __restrict a, S y, S* __restrict o,      \
                           int64_t n) {                                      \
    for (int64_t i = 0; i < n; ++i) o[i] = FN(y, a[i]);                      \
  }                                                                          \
  JF_CLONES void NAME##_sv(S x, const S* __restrict b, S* __restrict o,      \
                           int64_t n) {                                      \
    for (int64_t i = 0; i < n; ++i) o[i] = FN(x, b[i]);                      \
  }

inline float AddReluF32(float x, float y) { return add_relu(x, y); }
inline double AddReluF64(double x, double y) { return add_relu(x, y); }
inline uint16_t AddReluF16(uint16_t x, uint16_t y) {
  return add_relu(F16Tag{}, x, y);
}
inline uint16_t AddReluBF16(uint16_t x, uint16_t y) {
  return add_relu(BF16Tag{}, x, y);
}

JF_DEFINE_KERNELS(f32, float, AddReluF32)
JF_DEFINE_KERNELS(f64, double, AddReluF64)
JF_DEFINE_KERNELS(f16, uint16_t, AddReluF16)
JF_DEFINE_KERNELS(bf16, uint16_t, AddReluBF16)
#undef JF_DEFINE_KERNELS

template <typename S>
void Fill(S* o, S v, int64_t n) {
  std::fill(o, o + n, v);
}

// f16 on x86 with F16C: hardware conversions (the bit-level ones above are
// about 4x slower, which makes f16 compute-bound). Results are identical:
// vcvtph2ps is exact (f16 subnormals included; a sum of two f16 is never an
// f32 denormal, so DAZ/FTZ never matter), vcvtps2ph with imm 0 rounds to
// nearest even like f32_bits_to_f16, and NaN lanes are replaced by the same
// canonical 0x7e00 (so which operand's NaN the add kept is irrelevant).
// Selected at run time with __builtin_cpu_supports; the rest of the build
// stays baseline x86-64.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(JAXFUSE_NO_F16C)
#define JF_HAVE_F16C_PATH 1
enum F16cMode { kVV, kVS, kSV };

template <F16cMode M>
__attribute__((target("avx2,f16c"))) void F16cLoop(const uint16_t* a,
                                                   const uint16_t* b,
                                                   uint16_t* o, int64_t n) {
  const __m256 zero = _mm256_setzero_ps();
  const __m128i canon = _mm_set1_epi16(0x7e00);
  __m256 xs = _mm256_setzero_ps(), ys = _mm256_setzero_ps();
  if (M == kSV) xs = _mm256_cvtph_ps(_mm_set1_epi16((short)a[0]));
  if (M == kVS) ys = _mm256_cvtph_ps(_mm_set1_epi16((short)b[0]));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x = M == kSV ? xs
                        : _mm256_cvtph_ps(_mm_loadu_si128(
                              reinterpret_cast<const __m128i*>(a + i)));
    __m256 y = M == kVS ? ys
                        : _mm256_cvtph_ps(_mm_loadu_si128(
                              reinterpret_cast<const __m128i*>(b + i)));
    __m256 s = _mm256_add_ps(x, y);
    s = _mm256_andnot_ps(_mm256_cmp_ps(s, zero, _CMP_LE_OQ), s);  // relu
    __m128i h = _mm256_cvtps_ph(s, 0 /* round to nearest even */);
    __m256i nan32 = _mm256_castps_si256(_mm256_cmp_ps(s, s, _CMP_UNORD_Q));
    __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(nan32),
                                    _mm256_extracti128_si256(nan32, 1));
    h = _mm_blendv_epi8(h, canon, nan16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), h);
  }
  for (; i < n; ++i) {
    o[i] = add_relu(F16Tag{}, M == kSV ? a[0] : a[i], M == kVS ? b[0] : b[i]);
  }
}

bool HaveF16c() {
  static const bool have =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return have;
}

// bf16 with AVX2 (no F16C needed; same modes and same build switch as the
// f16 path above). gcc's auto-vectorization of the bit-level
// bf16 code (16 -> 32 -> 16 bit lanes) runs at ~1.3 cycles/element, which
// made large bf16 arrays compute-bound and ~12% slower than XLA (2^22..2^23
// elements, no page faults); this loop is memory-bound. Same bits as
// add_relu(BF16Tag): widening is exact, the add runs under the caller's
// DAZ/FTZ, and rounding/NaN handling mirror f32_bits_to_bf16. Only the NaN's
// sign survives narrowing (sign | 0x7fc0), so pinning "a's NaN wins" (see
// add_xla) just means taking x itself where x is NaN: the compiler may
// commute the vaddps operands, so the hardware order cannot be relied on.
#define JF_AVX2 __attribute__((target("avx2"), always_inline)) inline
JF_AVX2 __m256 Bf16Widen(const uint16_t* p) {  // 8 bf16 -> 8 f32, exact
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// 8 lanes of add_relu(BF16Tag) on widened operands; bf16 bits in u32 lanes.
JF_AVX2 __m256i Bf16AddRelu8(__m256 x, __m256 y) {
  __m256 s = _mm256_add_ps(x, y);
  s = _mm256_blendv_ps(s, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));  // a's NaN
  s = _mm256_andnot_ps(_mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_LE_OQ),
                       s);  // relu
  __m256i u = _mm256_castps_si256(s);
  __m256i hi = _mm256_srli_epi32(u, 16);
  __m256i r = _mm256_srli_epi32(  // round to nearest even
      _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                       _mm256_and_si256(hi, _mm256_set1_epi32(1))),
      16);
  __m256i nan = _mm256_or_si256(_mm256_and_si256(hi, _mm256_set1_epi32(0x8000)),
                                _mm256_set1_epi32(0x7fc0));
  return _mm256_blendv_epi8(
      r, nan, _mm256_castps_si256(_mm256_cmp_ps(s, s, _CMP_UNORD_Q)));
}
#undef JF_AVX2

template <F16cMode M>
__attribute__((target("avx2"))) void Bf16Avx2Loop(const uint16_t* a,
                                                  const uint16_t* b,
                                                  uint16_t* o, int64_t n) {
  __m256 xs = _mm256_setzero_ps(), ys = _mm256_setzero_ps();
  uint16_t splat[8];
  if (M != kVV) {
    std::fill(splat, splat + 8, M == kSV ? a[0] : b[0]);
    (M == kSV ? xs : ys) = Bf16Widen(splat);
  }
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    // The broadcast scalar is the first operand, like bf16_vs / bf16_sv.
    __m256i lo = M == kVS ? Bf16AddRelu8(ys, Bf16Widen(a + i))
                          : Bf16AddRelu8(M == kSV ? xs : Bf16Widen(a + i),
                                         Bf16Widen(b + i));
    __m256i hi = M == kVS ? Bf16AddRelu8(ys, Bf16Widen(a + i + 8))
                          : Bf16AddRelu8(M == kSV ? xs : Bf16Widen(a + i + 8),
                                         Bf16Widen(b + i + 8));
    // packus works per 128-bit lane: [lo0-3 hi0-3 lo4-7 hi4-7] -> reorder.
    __m256i h = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), h);
  }
  for (; i < n; ++i) {
    o[i] = M == kVS ? add_relu(BF16Tag{}, b[0], a[i])
                    : add_relu(BF16Tag{}, M == kSV ? a[0] : a[i], b[i]);
  }
}

bool HaveAvx2() {
  static const bool have = __builtin_cpu_supports("avx2");
  return have;
}
#endif

// Type traits tying a storage type to its kernels.
struct F32K {
  using S = float;
  static S One(S x, S y) { return add_relu(x, y); }
  static void VV(const S* a, const S* b, S* o, int64_t n) { f32_vv(a, b, o, n); }
  static void VS(const S* a, S y, S* o, int64_t n) { f32_vs(a, y, o, n); }
  static void SV(S x, const S* b, S* o, int64_t n) { f32_sv(x, b, o, n); }
};
struct F64K {
  using S = double;
  static S One(S x, S y) { return add_relu(x, y); }
  static void VV(const S* a, const S* b, S* o, int64_t n) { f64_vv(a, b, o, n); }
  static void VS(const S* a, S y, S* o, int64_t n) { f64_vs(a, y, o, n); }
  static void SV(S x, const S* b, S* o, int64_t n) { f64_sv(x, b, o, n); }
};
struct F16K {
  using S = uint16_t;
  static S One(S x, S y) { return add_relu(F16Tag{}, x, y); }
#ifdef JF_HAVE_F16C_PATH
  static void VV(const S* a, const S* b, S* o, int64_t n) {
    HaveF16c() ? F16cLoop<kVV>(a, b, o, n) : f16_vv(a, b, o, n);
  }
  static void VS(const S* a, S y, S* o, int64_t n) {
    HaveF16c() ? F16cLoop<kVS>(a, &y, o, n) : f16_vs(a, y, o, n);
  }
  static void SV(S x, const S* b, S* o, int64_t n) {
    HaveF16c() ? F16cLoop<kSV>(&x, b, o, n) : f16_sv(x, b, o, n);
  }
#else
  static void VV(const S* a, const S* b, S* o, int64_t n) { f16_vv(a, b, o, n); }
  static void VS(const S* a, S y, S* o, int64_t n) { f16_vs(a, y, o, n); }
  static void SV(S x, const S* b, S* o, int64_t n) { f16_sv(x, b, o, n); }
#endif
};
struct BF16K {
  using S = uint16_t;
  static S One(S x, S y) { return add_relu(BF16Tag{}, x, y); }
#ifdef JF_HAVE_F16C_PATH
  static void VV(const S* a, const S* b, S* o, int64_t n) {
    HaveAvx2() ? Bf16Avx2Loop<kVV>(a, b, o, n) : bf16_vv(a, b, o, n);
  }
  static void VS(const S* a, S y, S* o, int64_t n) {
    HaveAvx2() ? Bf16Avx2Loop<kVS>(a, &y, o, n) : bf16_vs(a, y, o, n);
  }
  static void SV(S x, const S* b, S* o, int64_t n) {
    HaveAvx2() ? Bf16Avx2Loop<kSV>(&x, b, o, n) : bf16_sv(x, b, o, n);
  }
#else
  static void VV(const S* a, const S* b, S* o, int64_t n) { bf16_vv(a, b, o, n); }
  static void VS(const S* a, S y, S* o, int64_t n) { bf16_vs(a, y, o, n); }
  static void SV(S x, const S* b, S* o, int64_t n) { bf16_sv(x, b, o, n); }
#endif
};

// ---------------------------------------------------------------------------
// Range workers: compute out[lo, hi) (flat output indices) for a plan.
// ---------------------------------------------------------------------------

// Bias of length < kTileMin is repeated into a small periodic tile (a few KB
// on the stack, independent of the array size) so the inner loop runs over
// long contiguous stretches instead of `inner` elements at a time.
constexpr int64_t kTileMin = 512;

template <typename K, bool kBiasIsB>
void BiasRange(const typename K::S* full, const typename K::S* bias,
               typename K::S* o, int64_t inner, int64_t lo, int64_t hi) {
  using S = typename K::S;
  auto vv = [](const S* f, const S* bb, S* out, int64_t n) {
    if (kBiasIsB) {
      K::VV(f, bb, out, n);
    } else {
      K::VV(bb, f, out, n);  // keep a as the first operand
    }
  };
  const S* src = bias;
  int64_t period_run = inner;  // longest stretch readable from `src`
  alignas(64) S tile[2 * kTileMin + 2 * kTileMin];
  if (inner < kTileMin) {
    // reps * inner >= kTileMin, plus one more period so any start offset
    // still has reps * inner elements ahead of it.
    int64_t reps = (kTileMin + inner - 1) / inner;
    for (int64_t r = 0; r <= reps; ++r) {
      std::memcpy(tile + r * inner, bias, sizeof(S) * inner);
    }
    src = tile;
    period_run = reps * inner;
  }
  int64_t pos = lo;
  while (pos < hi) {
    int64_t off = pos % inner;
    int64_t len = std::min(period_run - (inner < kTileMin ? 0 : off), hi - pos);
    vv(full + pos, src + off, o + pos, len);
    pos += len;
  }
}

template <typename K>
void GeneralRange(const typename K::S* a, const typename K::S* b,
                  typename K::S* o, const BroadcastPlan& p, int64_t lo,
                  int64_t hi) {
  const int r = static_cast<int>(p.dims.size());
  const int64_t n = p.dims[r - 1];
  const int64_t sa = p.a_strides[r - 1], sb = p.b_strides[r - 1];
  // Coordinates of lo (outer dims) and the matching operand offsets.
  int64_t coord[64];
  std::vector<int64_t> coord_heap;
  int64_t* c = coord;
  if (r > 64) {
    coord_heap.resize(r);
    c = coord_heap.data();
  }
  int64_t rem = lo / n, ia = 0, ib = 0;
  for (int d = r - 2; d >= 0; --d) {
    c[d] = rem % p.dims[d];
    rem /= p.dims[d];
    ia += c[d] * p.a_strides[d];
    ib += c[d] * p.b_strides[d];
  }
  int64_t j = lo % n;  // position in the inner run
  int64_t pos = lo;
  while (pos < hi) {
    int64_t len = std::min(n - j, hi - pos);
    const auto* ap = a + ia + j * sa;
    const auto* bp = b + ib + j * sb;
    if (sa && sb) {
      K::VV(ap, bp, o + pos, len);
    } else if (sa) {
      K::VS(ap, *bp, o + pos, len);
    } else if (sb) {
      K::SV(*ap, bp, o + pos, len);
    } else {
      Fill(o + pos, K::One(*ap, *bp), len);
    }
    pos += len;
    j = 0;
    // Advance the outer odometer by one row.
    for (int d = r - 2; d >= 0; --d) {
      ia += p.a_strides[d];
      ib += p.b_strides[d];
      if (++c[d] < p.dims[d]) break;
      ia -= c[d] * p.a_strides[d];
      ib -= c[d] * p.b_strides[d];
      c[d] = 0;
    }
  }
}

template <typename K>
void RunRange(const void* av, const void* bv, void* ov,
              const BroadcastPlan& p, int64_t lo, int64_t hi) {
  using S = typename K::S;
  const S* a = static_cast<const S*>(av);
  const S* b = static_cast<const S*>(bv);
  S* o = static_cast<S*>(ov);
  ScopedFlushDenormal ftz;
  switch (p.kind) {
    case BroadcastPlan::kEmpty:
      return;
    case BroadcastPlan::kSame:
      K::VV(a + lo, b + lo, o + lo, hi - lo);
      return;
    case BroadcastPlan::kScalarB:
      K::VS(a + lo, b[0], o + lo, hi - lo);
      return;
    case BroadcastPlan::kScalarA:
      K::SV(a[0], b + lo, o + lo, hi - lo);
      return;
    case BroadcastPlan::kScalars:
      Fill(o + lo, K::One(a[0], b[0]), hi - lo);
      return;
    case BroadcastPlan::kBiasB:
      BiasRange<K, true>(a, b, o, p.inner, lo, hi);
      return;
    case BroadcastPlan::kBiasA:
      BiasRange<K, false>(b, a, o, p.inner, lo, hi);
      return;
    case BroadcastPlan::kGeneral:
      GeneralRange<K>(a, b, o, p, lo, hi);
      return;
  }
}

using RangeFn = void (*)(const void*, const void*, void*, const BroadcastPlan&,
                         int64_t, int64_t);

// ---------------------------------------------------------------------------
// Parallel driver.
// ---------------------------------------------------------------------------
constexpr int64_t kMinChunk = 64 * 1024;  // elements
constexpr int64_t kChunkAlign = 64;       // elements; keeps chunks line-aligned

struct Job {
  RangeFn fn;
  const void* a;
  const void* b;
  void* o;
  BroadcastPlan plan;
  int64_t total, chunk, nchunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // Claims and runs chunks until none are left.
  void Work() {
    for (;;) {
      int64_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= nchunks) return;
      int64_t lo = i * chunk, hi = std::min(total, lo + chunk);
      fn(a, b, o, plan, lo, hi);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// XLA hands us a freshly allocated output buffer for every call (glibc
// malloc). Whether that is fresh mmap()ed memory or a reused, already
// populated heap block depends on malloc's history (its dynamic mmap
// threshold, which thread's arena, trimming) and can differ between XLA's own
// executable and ours in the same process. Fresh memory costs one fault per
// 4 KiB page, ~1-2 us each on the 2-vCPU VM we measured (16K faults for
// 64 MiB, more than the arithmetic). Asking for transparent huge pages on the
// buffer's 2 MiB-aligned interior makes that 1 fault per 2 MiB (plus the
// unaligned 4 KiB head/tail): 2^23 f32 on fresh memory went from ~10.5 ms to
// ~6 ms (XLA on fresh memory: ~9.5 ms). Purely advisory: contents are
// untouched, and it does nothing where THP is disabled ("never") or already
// "always".
//
// Measured and rejected alternatives:
//  * Skipping the advice when the buffer is already populated (mincore
//    probe): madvise on populated, already-advised memory costs ~0.4 us
//    (~3 us when it must split the VMA), a mincore probe ~0.9 us, and neither
//    is visible against the >= 1 ms such a call takes.
//  * MADV_POPULATE_WRITE prefaulting: ~15% cheaper than 4 KiB faults taken
//    by the kernel loop, no gain with huge pages; not worth a syscall path.
//  * Faulting from one thread: slower (2^24 f32 fresh: ~14 ms with one
//    thread vs ~9 ms with two); page faults do run in parallel.
constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kHugeAdviseMin = size_t{8} << 20;  // bytes

void AdviseHugePages(void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  static const bool enabled = std::getenv("JAXFUSE_NO_MADVISE") == nullptr;
  if (!enabled || bytes < kHugeAdviseMin) return;
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

RangeFn PickRange(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return &RunRange<F32K>;
    case ffi::DataType::F64: return &RunRange<F64K>;
    case ffi::DataType::F16: return &RunRange<F16K>;
    case ffi::DataType::BF16: return &RunRange<BF16K>;
    default: return nullptr;
  }
}

ffi::Error AddReluCpuImpl(ffi::ThreadPool pool, ffi::AnyBuffer a,
                          ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> out) {
  BroadcastPlan plan;
  if (ffi::Error e = PlanCall(a, b, *out, &plan); e.failure()) return e;
  if (plan.kind == BroadcastPlan::kEmpty) return ffi::Error::Success();

  RangeFn fn = PickRange(a.element_type());
  AdviseHugePages(out->untyped_data(), out->size_bytes());
  const int64_t total = plan.total;
  int64_t workers = std::max<int64_t>(1, pool.num_threads());
  // Optional cap, e.g. for benchmarking: JAXFUSE_CPU_MAX_THREADS=1.
  static const int64_t cap = [] {
    const char* env = std::getenv("JAXFUSE_CPU_MAX_THREADS");
    return env ? std::atoll(env) : int64_t{0};
  }();
  if (cap > 0) workers = std::min(workers, cap);
  workers = std::min<int64_t>(workers, total / kMinChunk);
  if (workers <= 1) {
    fn(a.untyped_data(), b.untyped_data(), out->untyped_data(), plan, 0,
       total);
    return ffi::Error::Success();
  }

  // A few chunks per worker for load balance, each >= kMinChunk.
  int64_t chunk = std::max<int64_t>(kMinChunk, total / (workers * 4));
  chunk = (chunk + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
  auto job = std::make_shared<Job>();
  job->fn = fn;
  job->a = a.untyped_data();
  job->b = b.untyped_data();
  job->o = out->untyped_data();
  job->plan = std::move(plan);
  job->total = total;
  job->chunk = chunk;
  job->nchunks = (total + chunk - 1) / chunk;

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
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxfuse

XLA_FFI_DEFINE_HANDLER_SYMBOL(AddReluCpu, jaxfuse::AddReluCpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

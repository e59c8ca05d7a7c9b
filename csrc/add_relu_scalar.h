// jaxfuse: the one scalar definition of the fused add+ReLU arithmetic.
//
//   out = max(a + b, 0)
//
// with exactly the semantics XLA gives `jnp.maximum(a + b, 0)` (and
// `jax.nn.relu(a + b)`), as the tests pin bit for bit against XLA:CPU
// (tests/test_primitive.py, x86-64):
//
//   * max(s, 0) is +0 for every s <= 0, including s == -0.0 (so -0 + -0 -> +0).
//   * A NaN sum propagates unchanged (no canonicalisation by the max): the NaN
//     out of the add is passed through bit for bit.
//   * The NaN out of the f32/f64 add on x86 is the hardware's: if `a` is NaN it
//     is `a` quietened, else if `b` is NaN it is `b` quietened, else
//     (inf + -inf) the default NaN 0xffc00000 (sign set). The host code below
//     pins that operand order explicitly (a C++ compiler may commute `a + b`).
//     CAVEAT: when BOTH operands are NaN, XLA:CPU's own choice of
//     payload depends on its codegen: a's NaN for same-shape operands, but
//     often the broadcast operand's NaN (e.g. (100,64)+(1,64) gives b's,
//     (300,2,700)+(1,2,700) gives a's, bf16 (64,100)+(64,1) mixes both within
//     one array). We always give a's; only the NaN payload/sign differs.
//   * +-Inf: inf -> inf, -inf -> +0, inf + -inf -> NaN (propagated).
//   * XLA:CPU runs with denormals flushed (FTZ + DAZ): a denormal f32/f64/bf16
//     input reads as 0 and a denormal sum becomes 0. That comes from the FP
//     environment (MXCSR), not from this header; the CPU kernel sets it.
//   * f16 / bf16: both widened to f32 (exact), added in f32, rounded once to
//     the narrow type (round to nearest even), then the max. f32 has
//     24 >= 2*11+2 significand bits, so this double rounding equals a single
//     correctly-rounded narrow add. NaN on narrowing:
//       - f16: canonical 0x7e00 (no sign, no payload). That is what XLA:CPU's
//         vectorized loop gives; its scalar code (arrays under ~48 elements
//         and up to 7 trailing elements of a vectorized loop) instead keeps
//         sign and payload (0x7c01 + 1 -> 0x7e01). XLA is not self-consistent
//         here; we follow the vectorized path, i.e. nearly every element.
//       - bf16: sign | 0x7fc0, payload dropped (0x7fc5 + 1 -> 0x7fc0), in
//         both XLA:CPU paths.
//
// On the CUDA device the add itself (PTX add.f32 / cvt) yields the canonical
// NaN 0x7fffffff and XLA:GPU's max passes it through, so device code just adds
// and the narrow types narrow a NaN to the canonical 0x7fff. Denormals are not
// flushed on the device (XLA:GPU does not use ftz by default; nvcc neither).
// (The device NaN bits are as the PTX ISA documents them.)
//
// No compiler _Float16 / __half is used: conversions are bit-level integer
// code, identical on host and device.
#ifndef JAXFUSE_ADD_RELU_SCALAR_H_
#define JAXFUSE_ADD_RELU_SCALAR_H_

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define JF_HD __host__ __device__ __forceinline__
#else
#define JF_HD inline __attribute__((always_inline))
#endif

// Whether the code being compiled runs on the CUDA device.
#if defined(__CUDA_ARCH__)
#define JF_DEVICE_CODE 1
#else
#define JF_DEVICE_CODE 0
#endif

namespace jaxfuse {

// ---------------------------------------------------------------------------
// Bit casts (memcpy compiles to a register move on host and device).
// ---------------------------------------------------------------------------
JF_HD uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}
JF_HD float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
JF_HD uint64_t f64_bits(double f) {
  uint64_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}
JF_HD double bits_f64(uint64_t u) {
  double f;
  memcpy(&f, &u, sizeof f);
  return f;
}

// ---------------------------------------------------------------------------
// relu of an already-formed sum: s if s > 0 or s is NaN (bits unchanged),
// else +0. `!(s <= 0)` is true exactly for s > 0 and for NaN, and it maps to
// one compare + and-not in SIMD code. Deliberately NOT fmaxf: CUDA's
// fmaxf(NaN, 0) returns 0, and x86 maxps returns its second operand on NaN.
// ---------------------------------------------------------------------------
template <typename T>
JF_HD T relu_keep_nan(T s) {
  return (s <= T(0)) ? T(0) : s;
}

// a + b with the NaN choice XLA:CPU makes on x86 (first operand's NaN wins).
// On the device the hardware canonicalises any NaN anyway, so plain add.
template <typename T>
JF_HD T add_xla(T a, T b) {
#if JF_DEVICE_CODE
  return a + b;
#else
  T s = a + b;
  // a + a of a NaN `a` is `a` quietened (payload and sign kept) on x86 and
  // AArch64 alike; for non-NaN `a` this arm is not selected.
  return (a != a) ? (a + a) : s;
#endif
}

// ---------------------------------------------------------------------------
// f16 <-> f32 (IEEE binary16), bit level.
// ---------------------------------------------------------------------------
// Written branch-free (selects only) so that host loops over it vectorize.
JF_HD uint32_t f16_to_f32_bits(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t em = h & 0x7fffu;                      // exponent + mantissa
  uint32_t exp = em & 0x7c00u;
  uint32_t normal = (em << 13) + ((127u - 15u) << 23);   // rebias 15 -> 127
  uint32_t infnan = (em << 13) | 0x7f800000u;           // payload kept
  // Subnormal (and zero): value = mant * 2^-24, exact in f32 and a normal
  // f32 (>= 2^-24), so FTZ/DAZ cannot touch it.
  uint32_t sub = f32_bits((float)(int32_t)em * 5.9604644775390625e-08f);
  uint32_t r = (exp == 0x7c00u) ? infnan : ((exp != 0u) ? normal : sub);
  return sign | r;
}

JF_HD float f16_to_f32(uint16_t h) { return bits_f32(f16_to_f32_bits(h)); }

// Round-to-nearest-even f32 -> f16, NaN -> canonical NaN (see below).
JF_HD uint16_t f32_bits_to_f16(uint32_t f) {
  uint32_t sign = (f >> 16) & 0x8000u;
  uint32_t x = f & 0x7fffffffu;
  // Every candidate is computed and one is selected (no branches), so host
  // loops over this vectorize.
  // NaN -> a positive canonical NaN, no payload: 0x7e00 on the host (what
  // XLA:CPU's vectorized f32->f16 conversion gives), 0x7fff on the device
  // (PTX cvt.rn.f16.f32).
#if JF_DEVICE_CODE
  const uint32_t nan = 0x7fffu;
#else
  const uint32_t nan = 0x7e00u;
#endif
  sign = (x > 0x7f800000u) ? 0u : sign;
  // Normal f16 (x >= 2^-14): rebias 127 -> 15, round the 13 dropped bits to
  // nearest even. Values >= 65520 round to 0x7c00 (Inf) through the carry
  // but are clamped explicitly below for clarity.
  uint32_t t = x - ((127u - 15u) << 23);
  uint32_t normal = (t + 0x0fffu + ((t >> 13) & 1u)) >> 13;
  // Subnormal / zero f16 (x < 2^-14): x + 0.5 rounds x (RNE, the default
  // mode) to a multiple of 2^-24 = the ulp of 0.5; the low bits are then the
  // f16 subnormal mantissa (0x400 if it rounded up to the smallest normal).
  // The sum is a normal f32; an f32 denormal x reads as 0 under DAZ, which
  // is also its correctly rounded f16 value.
  uint32_t sub = f32_bits(bits_f32(x) + 0.5f) - 0x3f000000u;
  uint32_t r = (x > 0x7f800000u)    ? nan
               : (x >= 0x477ff000u) ? 0x7c00u        // >= 65520 -> Inf
               : (x >= 0x38800000u) ? normal         // >= 2^-14
                                    : sub;
  return (uint16_t)(sign | r);
}

JF_HD uint16_t f32_to_f16(float f) { return f32_bits_to_f16(f32_bits(f)); }

// ---------------------------------------------------------------------------
// bf16 <-> f32, bit level.
// ---------------------------------------------------------------------------
JF_HD float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

// Round-to-nearest-even f32 -> bf16. NaN: host gives sign | 0x7fc0 (XLA:CPU),
// device gives the canonical 0x7fff (PTX cvt.rn.bf16.f32).
JF_HD uint16_t f32_bits_to_bf16(uint32_t f) {
  if ((f & 0x7fffffffu) > 0x7f800000u) {
#if JF_DEVICE_CODE
    return 0x7fffu;
#else
    return (uint16_t)(((f >> 16) & 0x8000u) | 0x7fc0u);
#endif
  }
  uint32_t t = f + 0x7fffu + ((f >> 16) & 1u);
  return (uint16_t)(t >> 16);
}

JF_HD uint16_t f32_to_bf16(float f) { return f32_bits_to_bf16(f32_bits(f)); }

// ---------------------------------------------------------------------------
// The fused op, one overload per storage type. f16 / bf16 travel as their
// raw uint16 bits; the tag types pick the format.
// ---------------------------------------------------------------------------
struct F16Tag {};
struct BF16Tag {};

JF_HD float add_relu(float a, float b) { return relu_keep_nan(add_xla(a, b)); }
JF_HD double add_relu(double a, double b) {
  return relu_keep_nan(add_xla(a, b));
}

// XLA narrows the f32 sum and then takes the max in the narrow type. We take
// the max in f32 and then narrow: narrowing is monotone, maps +-0 to +-0 and
// NaN to NaN, so both orders give identical bits (s <= 0 -> +0 either way;
// s > 0 -> narrow(s) >= +0; NaN -> the narrowed NaN), and this order keeps the
// loop in one lane width, which gcc vectorizes.
JF_HD uint16_t add_relu(F16Tag, uint16_t a, uint16_t b) {
  return f32_to_f16(relu_keep_nan(add_xla(f16_to_f32(a), f16_to_f32(b))));
}

JF_HD uint16_t add_relu(BF16Tag, uint16_t a, uint16_t b) {
  return f32_to_bf16(relu_keep_nan(add_xla(bf16_to_f32(a), bf16_to_f32(b))));
}

}  // namespace jaxfuse

#endif  // JAXFUSE_ADD_RELU_SCALAR_H_

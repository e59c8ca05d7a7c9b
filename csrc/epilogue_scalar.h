// jaxfuse: the one scalar definition of every fused epilogue.
//
//   v   = (((x - m) * q) * s + t) + r  (m, q, s, r optional; add_relu is x + t;
//                                       q: a normalization's 1/sigma before the
//                                       affine scale, as stax and equinox write it)
//   out = max(v, 0)                    (NaN kept, -0 -> +0; add_relu_scalar.h)
//   tie = (v == 0)                     (optional second output, for gradients)
//
// This is what XLA computes for the same expression written with lax ops, on
// the same platform, and the per-platform rules that make it bit-identical are
// the two switches below, as XLA:CPU (jaxlib 0.10.2 and 0.11.2, x86-64 with
// FMA) behaves; tests/test_epilogue_numerics.py pins them, and
// jaxfuse/_numerics.py states where each holds:
//
//   * kContract: XLA:CPU contracts `v * s + t` into one fused multiply-add
//     inside its loop fusions for float32 and float64, `(x - m) * s + t` as
//     fma(x - m, s, t), `x * s + t + r` as fma(x, s, t) + r. XLA:GPU does not
//     contract float32 (H200).
//   * kNarrowEachOp: for float16 / bfloat16, XLA:CPU rounds every operation to
//     the narrow type (widen both operands to f32, operate, round). It does
//     not contract there, except float16 where it targets AVX512-FP16: its
//     native half-precision code contracts `v * s + t` into one float16 FMA
//     (fma_narrow). Without kNarrowEachOp the whole expression runs in f32
//     and is rounded once at the end (XLA's "excess precision"), a rule a
//     platform may choose instead.
//
// NaN: a NaN anywhere gives a NaN; which operand's payload survives is only
// pinned for add_relu (add_relu_scalar.h). Denormals: the host runs under
// FTZ/DAZ like XLA:CPU (set by the caller), the device does not flush.
#ifndef JAXFUSE_EPILOGUE_SCALAR_H_
#define JAXFUSE_EPILOGUE_SCALAR_H_

#include <math.h>

#include "add_relu_scalar.h"

namespace jaxfuse {

// The terms a fused epilogue has, and how the platform rounds it.
template <bool Mean, bool Prescale, bool Scale, bool Residual, bool Contract,
          bool NarrowEachOp = true>
struct Form {
  static constexpr bool kMean = Mean;
  static constexpr bool kPrescale = Prescale;
  static constexpr bool kScale = Scale;
  static constexpr bool kResidual = Residual;
  static constexpr bool kContract = Contract;
  static constexpr bool kNarrowEachOp = NarrowEachOp;
};

// A form as one integer key, a bit per term: the CPU kernel table and the
// CUDA kernel's switch both index by it.
enum FormBit : int {
  kMeanBit = 1,
  kScaleBit = 2,
  kResidualBit = 4,
  kContractBit = 8,
  kEachOpBit = 16,
  kTieBit = 32,
  kPrescaleBit = 64,
};
constexpr int kFormKeys = 128;

JF_HD constexpr int FormKey(bool mean, bool prescale, bool scale, bool residual,
                            bool contract, bool each_op, bool tie) {
  return (mean ? kMeanBit : 0) | (scale ? kScaleBit : 0) |
         (residual ? kResidualBit : 0) | (contract ? kContractBit : 0) |
         (each_op ? kEachOpBit : 0) | (tie ? kTieBit : 0) |
         (prescale ? kPrescaleBit : 0);
}

// The form a key names (the tie bit is not part of the arithmetic).
template <int K>
using FormOfKey = Form<(K & kMeanBit) != 0, (K & kPrescaleBit) != 0,
                       (K & kScaleBit) != 0, (K & kResidualBit) != 0,
                       (K & kContractBit) != 0, (K & kEachOpBit) != 0>;

// Whether a key names a form with a meaning: a mean, a pre-scale or
// contraction only with a scale.
JF_HD constexpr bool ValidFormKey(int k) {
  const bool scale = (k & kScaleBit) != 0;
  return scale || (k & (kMeanBit | kPrescaleBit | kContractBit)) == 0;
}

// Operand slots of jaxfuse_epilogue, in the order its handlers receive the
// operands present (the lowering passes them in this order).
enum Slot { kX = 0, kM = 1, kQ = 2, kS = 3, kT = 4, kR = 5, kSlots = 6 };

// The slots of the operands a call with these attributes has; their count.
inline int EpilogueSlots(bool mean, bool prescale, bool scale, bool residual,
                         int* slots) {
  int n = 0;
  slots[n++] = kX;
  if (mean) slots[n++] = kM;
  if (prescale) slots[n++] = kQ;
  if (scale) slots[n++] = kS;
  slots[n++] = kT;
  if (residual) slots[n++] = kR;
  return n;
}

JF_HD float fma_any(float a, float b, float c) {
#if JF_DEVICE_CODE
  return __fmaf_rn(a, b, c);
#else
  return __builtin_fmaf(a, b, c);
#endif
}
JF_HD double fma_any(double a, double b, double c) {
#if JF_DEVICE_CODE
  return __fma_rn(a, b, c);
#else
  return __builtin_fma(a, b, c);
#endif
}

// a * b + c for float16 values a, b, c, as a float that rounds to float16 as
// the exact value does: what a float16 fused multiply-add gives (XLA:CPU's
// native float16 code on AVX512-FP16). a * b is exact in float (two 11-bit
// significands); the sum is rounded to odd (truncated, its last bit set when
// inexact), so the later rounding to float16's 11 bits is a single rounding of
// the exact value. fmaf would round twice and differ at float16 midpoints.
JF_HD float fma_narrow(float a, float b, float c) {
  float p = a * b;
  float s = p + c;
  float bb = s - p;  // TwoSum: err is exactly (p + c) - s
  float err = (p - (s - bb)) + (c - bb);
  if (err == err && err != 0.0f) {
    uint32_t u = f32_bits(s);
    if ((err < 0.0f) != (s < 0.0f)) u -= 1;  // the exact value lies nearer zero
    s = bits_f32(u | 1u);
  }
  return s;
}

// The pre-activation v in a wide type (float, double). Absent operands are
// ignored. add_xla keeps add_relu's "first operand's NaN" rule.
template <class F, class T>
JF_HD T preactivation(T x, T m, T q, T s, T t, T r) {
  T v = x;
  if constexpr (F::kMean) v = v - m;
  if constexpr (F::kPrescale) v = v * q;  // a product into a product: never contracted
  if constexpr (F::kScale) {
    if constexpr (F::kContract) {
      v = fma_any(v, s, t);
    } else {
      v = v * s;
      v = v + t;
    }
  } else {
    v = add_xla(v, t);
  }
  if constexpr (F::kResidual) v = v + r;
  return v;
}

// Rounding an f32 value to a narrow type's precision, staying in f32.
JF_HD float round_to(F16Tag, float v) { return f16_to_f32(f32_to_f16(v)); }
JF_HD float round_to(BF16Tag, float v) { return bf16_to_f32(f32_to_bf16(v)); }
JF_HD uint16_t narrow(F16Tag, float v) { return f32_to_f16(v); }
JF_HD uint16_t narrow(BF16Tag, float v) { return f32_to_bf16(v); }
JF_HD float widen(F16Tag, uint16_t h) { return f16_to_f32(h); }
JF_HD float widen(BF16Tag, uint16_t h) { return bf16_to_f32(h); }

// The pre-activation of narrow operands (already widened to f32), rounded to
// the narrow precision after each operation or, without kNarrowEachOp, once.
template <class F, class Tag>
JF_HD float preactivation_narrow(Tag tag, float x, float m, float q, float s,
                                 float t, float r) {
  auto rnd = [tag](float v) {
    return F::kNarrowEachOp ? round_to(tag, v) : v;
  };
  float v = x;
  if constexpr (F::kMean) v = rnd(v - m);
  if constexpr (F::kPrescale) v = rnd(v * q);
  if constexpr (F::kScale) {
    if constexpr (F::kContract) {
      // rounded per operation: one narrow FMA; else float's, rounded at the end
      v = F::kNarrowEachOp ? rnd(fma_narrow(v, s, t)) : fma_any(v, s, t);
    } else {
      v = rnd(v * s);
      v = rnd(v + t);
    }
  } else {
    v = rnd(add_xla(v, t));
  }
  if constexpr (F::kResidual) v = rnd(v + r);
  return round_to(tag, v);
}

// One element, every storage type: the output, and v == 0 for the tie mask.
template <class F>
JF_HD float epilogue(float x, float m, float q, float s, float t, float r,
                     bool* tie) {
  float v = preactivation<F>(x, m, q, s, t, r);
  *tie = v == 0.0f;
  return relu_keep_nan(v);
}
template <class F>
JF_HD double epilogue(double x, double m, double q, double s, double t,
                      double r, bool* tie) {
  double v = preactivation<F>(x, m, q, s, t, r);
  *tie = v == 0.0;
  return relu_keep_nan(v);
}
template <class F, class Tag>
JF_HD uint16_t epilogue(Tag tag, uint16_t x, uint16_t m, uint16_t q,
                        uint16_t s, uint16_t t, uint16_t r, bool* tie) {
  float v = preactivation_narrow<F>(tag, widen(tag, x), widen(tag, m),
                                    widen(tag, q), widen(tag, s),
                                    widen(tag, t), widen(tag, r));
  *tie = v == 0.0f;
  // max in f32, then narrow: v is already representable, so this is the
  // narrow max (see add_relu in add_relu_scalar.h for why the order is free).
  return narrow(tag, relu_keep_nan(v));
}

}  // namespace jaxfuse

#endif  // JAXFUSE_EPILOGUE_SCALAR_H_

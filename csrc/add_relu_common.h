// jaxfuse: host-side validation and broadcast planning shared by the CPU and
// CUDA handlers of `jaxfuse_add_relu`.
#ifndef JAXFUSE_ADD_RELU_COMMON_H_
#define JAXFUSE_ADD_RELU_COMMON_H_

#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxfuse {

namespace ffi = xla::ffi;

inline const char* DtypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::C64: return "complex64";
    case ffi::DataType::C128: return "complex128";
    case ffi::DataType::TOKEN: return "token";
    case ffi::DataType::F8E5M2: return "float8_e5m2";
    case ffi::DataType::F8E4M3: return "float8_e4m3";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    case ffi::DataType::F8E4M3B11FNUZ: return "float8_e4m3b11fnuz";
    case ffi::DataType::F8E5M2FNUZ: return "float8_e5m2fnuz";
    case ffi::DataType::F8E4M3FNUZ: return "float8_e4m3fnuz";
    default: return nullptr;
  }
}

inline std::string DtypeString(ffi::DataType t) {
  const char* n = DtypeName(t);
  return n ? std::string(n)
           : "dtype#" + std::to_string(static_cast<int>(t));
}

inline std::string ShapeString(ffi::Span<const int64_t> dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  if (dims.size() == 1) s += ",";
  return s + ")";
}

inline bool SupportedDtype(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::F64 ||
         t == ffi::DataType::F16 || t == ffi::DataType::BF16;
}

// Validates dtypes: all three equal and one of F32, F64, F16, BF16.
inline ffi::Error CheckDtypes(ffi::DataType a, ffi::DataType b,
                              ffi::DataType out) {
  if (a != b || a != out) {
    return ffi::Error::InvalidArgument(
        "jaxfuse_add_relu: operand and result dtypes must match, got a=" +
        DtypeString(a) + ", b=" + DtypeString(b) + ", out=" +
        DtypeString(out));
  }
  if (!SupportedDtype(a)) {
    return ffi::Error::InvalidArgument(
        "jaxfuse_add_relu: unsupported dtype " + DtypeString(a) +
        " (supported: float32, float64, float16, bfloat16)");
  }
  return ffi::Error::Success();
}

// The broadcast of N operands to one output, reduced to its essentials.
//
// Output dims of size 1 are dropped; adjacent dims that every operand
// broadcasts the same way are merged. What is left is `dims` (outermost first)
// and, per operand, element strides over them (0 where it is broadcast). Each
// operand has the output's rank, or rank 0 (a scalar, read as all-1 dims), and
// every operand dim equals the output dim or is 1.
constexpr int kMaxOperands = 6;
constexpr int kMaxRank = 64;  // the Python layer never fuses a higher rank

struct Collapsed {
  int operands = 0;
  int64_t total = 0;                            // output element count
  std::vector<int64_t> dims;                    // collapsed, outermost first
  std::vector<int64_t> strides[kMaxOperands];   // per operand, per dim
  std::vector<uint32_t> full;                   // per dim: bit k = operand k varies
};

inline std::string ShapesString(const ffi::Span<const int64_t>* dims, int n,
                                ffi::Span<const int64_t> out) {
  std::string s;
  for (int k = 0; k < n; ++k) s += (k ? ", " : "") + ShapeString(dims[k]);
  return s + " -> " + ShapeString(out);
}

inline ffi::Error Collapse(const char* op, const ffi::Span<const int64_t>* dims,
                           int n, ffi::Span<const int64_t> out, Collapsed* c) {
  auto bad = [&](const std::string& why) {
    return ffi::Error::InvalidArgument(std::string(op) + ": cannot broadcast " +
                                       ShapesString(dims, n, out) + ": " + why);
  };
  if (n < 1 || n > kMaxOperands) return bad("bad operand count");
  if (out.size() > static_cast<size_t>(kMaxRank)) {
    return bad("rank " + std::to_string(out.size()) + " exceeds " +
               std::to_string(kMaxRank));
  }
  for (int k = 0; k < n; ++k) {
    if (dims[k].size() != out.size() && dims[k].size() != 0) {
      return bad("operands must have the same rank as the result (or rank 0)");
    }
  }
  auto dim = [&](int k, size_t i) -> int64_t {
    return dims[k].size() == 0 ? 1 : dims[k][i];
  };
  int64_t total = 1;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] < 0) return bad("negative dimension");
    for (int k = 0; k < n; ++k) {
      int64_t d = dim(k, i);
      if (d < 0) return bad("negative dimension");
      if (d != out[i] && d != 1) {
        return bad("operand " + std::to_string(k) + " dim " +
                   std::to_string(i) + " is " + std::to_string(d) +
                   ", must be " + std::to_string(out[i]) + " or 1");
      }
    }
    total *= out[i];
  }
  c->operands = n;
  c->total = total;
  c->dims.clear();
  c->full.clear();
  for (int k = 0; k < kMaxOperands; ++k) c->strides[k].clear();
  if (total == 0) return ffi::Error::Success();
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] == 1) continue;
    uint32_t pat = 0;
    for (int k = 0; k < n; ++k) pat |= (dim(k, i) == out[i] ? 1u : 0u) << k;
    if (!c->full.empty() && c->full.back() == pat) {
      c->dims.back() *= out[i];
    } else {
      c->full.push_back(pat);
      c->dims.push_back(out[i]);
    }
  }
  const size_t r = c->dims.size();
  for (int k = 0; k < n; ++k) {
    c->strides[k].assign(r, 0);
    int64_t s = 1;
    for (size_t i = r; i-- > 0;) {
      if (c->full[i] >> k & 1u) {
        c->strides[k][i] = s;
        s *= c->dims[i];
      }
    }
  }
  return ffi::Error::Success();
}

// The two-operand special cases the CUDA add_relu kernel has fast paths for.
struct BroadcastPlan {
  enum Kind {
    kEmpty,    // zero elements: touch nothing
    kSame,     // a, b, out all the same size: flat loop
    kScalarB,  // a full, b a single element
    kScalarA,  // b full, a a single element
    kScalars,  // both single elements, output a fill
    kBiasB,    // b is a trailing-dims bias: b[i % inner]
    kBiasA,    // a is a trailing-dims bias: a[i % inner]
    kGeneral,  // anything else: strided walk
  };
  Kind kind = kEmpty;
  int64_t total = 0;   // output element count
  int64_t inner = 0;   // bias length for kBiasA / kBiasB
  std::vector<int64_t> dims, a_strides, b_strides;  // collapsed
};

inline ffi::Error MakeBroadcastPlan(ffi::Span<const int64_t> a_dims,
                                    ffi::Span<const int64_t> b_dims,
                                    ffi::Span<const int64_t> out,
                                    BroadcastPlan* plan) {
  const ffi::Span<const int64_t> dims[2] = {a_dims, b_dims};
  Collapsed c;
  if (ffi::Error e = Collapse("jaxfuse_add_relu", dims, 2, out, &c);
      e.failure()) {
    return e;
  }
  plan->total = c.total;
  plan->dims = c.dims;
  plan->a_strides = c.strides[0];
  plan->b_strides = c.strides[1];
  using K = BroadcastPlan;
  const size_t r = c.dims.size();
  const std::vector<uint32_t>& pat = c.full;
  if (c.total == 0) {
    plan->kind = K::kEmpty;
  } else if (r == 0) {
    plan->kind = K::kScalars;  // a single element
  } else if (r == 1) {
    static const K::Kind k1[4] = {K::kScalars, K::kScalarB, K::kScalarA,
                                  K::kSame};
    plan->kind = k1[pat[0]];
  } else if (r == 2 && pat[1] == 3 && pat[0] == 1) {
    plan->kind = K::kBiasB;
    plan->inner = c.dims[1];
  } else if (r == 2 && pat[1] == 3 && pat[0] == 2) {
    plan->kind = K::kBiasA;
    plan->inner = c.dims[1];
  } else {
    plan->kind = K::kGeneral;
  }
  return ffi::Error::Success();
}

// Everything the add_relu handlers check before touching memory, the same on
// CPU and CUDA: dtypes, then shapes, then the broadcast plan.
inline ffi::Error PlanCall(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                           const ffi::AnyBuffer& out, BroadcastPlan* plan) {
  if (ffi::Error e = CheckDtypes(a.element_type(), b.element_type(),
                                 out.element_type());
      e.failure()) {
    return e;
  }
  return MakeBroadcastPlan(a.dimensions(), b.dimensions(), out.dimensions(),
                           plan);
}

}  // namespace jaxfuse

#endif  // JAXFUSE_ADD_RELU_COMMON_H_

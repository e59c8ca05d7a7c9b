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

// The broadcast, reduced to its essentials.
//
// Output dims of size 1 are dropped; adjacent dims broadcast the same way for
// both operands are merged. What is left is `dims` (outermost first) with,
// for each operand, element strides (0 where that operand is broadcast).
struct BroadcastPlan {
  enum Kind {
    kEmpty,    // zero elements: touch nothing
    kSame,     // a, b, out all the same size: flat loop
    kScalarB,  // a full, b a single element
    kScalarA,  // b full, a a single element
    kScalars,  // both single elements, output a fill
    kBiasB,    // b is a trailing-dims bias: b[i % inner]
    kBiasA,    // a is a trailing-dims bias: a[i % inner]
    kGeneral,  // anything else: strided walk with a contiguous inner run
  };
  Kind kind = kEmpty;
  int64_t total = 0;   // output element count
  int64_t inner = 0;   // bias length for kBiasA / kBiasB
  std::vector<int64_t> dims, a_strides, b_strides;  // collapsed
};

// Validates shapes and builds the plan. Each operand has the rank of the
// output, or rank 0 (a scalar, read as all-1 dims); every operand dim equals
// the output dim or is 1.
inline ffi::Error MakeBroadcastPlan(ffi::Span<const int64_t> a_dims,
                                    ffi::Span<const int64_t> b_dims,
                                    ffi::Span<const int64_t> out,
                                    BroadcastPlan* plan) {
  auto bad = [&](const std::string& why) {
    return ffi::Error::InvalidArgument(
        "jaxfuse_add_relu: cannot broadcast a" + ShapeString(a_dims) +
        " and b" + ShapeString(b_dims) + " to out" + ShapeString(out) + ": " +
        why);
  };
  if ((a_dims.size() != out.size() && a_dims.size() != 0) ||
      (b_dims.size() != out.size() && b_dims.size() != 0)) {
    return bad("operands must have the same rank as the result (or rank 0)");
  }
  const std::vector<int64_t> ones(out.size(), 1);
  const ffi::Span<const int64_t> a =
      a_dims.size() == 0 ? ffi::Span<const int64_t>(ones.data(), ones.size())
                     : a_dims;
  const ffi::Span<const int64_t> b =
      b_dims.size() == 0 ? ffi::Span<const int64_t>(ones.data(), ones.size())
                     : b_dims;
  int64_t total = 1;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] < 0 || a[i] < 0 || b[i] < 0) return bad("negative dimension");
    if (a[i] != out[i] && a[i] != 1) {
      return bad("a dim " + std::to_string(i) + " is " + std::to_string(a[i]) +
                 ", must be " + std::to_string(out[i]) + " or 1");
    }
    if (b[i] != out[i] && b[i] != 1) {
      return bad("b dim " + std::to_string(i) + " is " + std::to_string(b[i]) +
                 ", must be " + std::to_string(out[i]) + " or 1");
    }
    total *= out[i];
  }
  plan->total = total;
  plan->dims.clear();
  plan->a_strides.clear();
  plan->b_strides.clear();
  if (total == 0) {
    plan->kind = BroadcastPlan::kEmpty;
    return ffi::Error::Success();
  }

  // Collapse. Pattern bit 0: a is full in this dim; bit 1: b is full.
  std::vector<int> pat;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] == 1) continue;
    int p = (a[i] == out[i] ? 1 : 0) | (b[i] == out[i] ? 2 : 0);
    if (!pat.empty() && pat.back() == p) {
      plan->dims.back() *= out[i];
    } else {
      pat.push_back(p);
      plan->dims.push_back(out[i]);
    }
  }
  const size_t r = plan->dims.size();
  plan->a_strides.assign(r, 0);
  plan->b_strides.assign(r, 0);
  int64_t sa = 1, sb = 1;
  for (size_t i = r; i-- > 0;) {
    if (pat[i] & 1) {
      plan->a_strides[i] = sa;
      sa *= plan->dims[i];
    }
    if (pat[i] & 2) {
      plan->b_strides[i] = sb;
      sb *= plan->dims[i];
    }
  }

  using K = BroadcastPlan;
  if (r == 0) {
    plan->kind = K::kScalars;  // a single element
  } else if (r == 1) {
    static const K::Kind k1[4] = {K::kScalars, K::kScalarB, K::kScalarA,
                                  K::kSame};
    plan->kind = k1[pat[0]];
  } else if (r == 2 && pat[1] == 3 && pat[0] == 1) {
    plan->kind = K::kBiasB;
    plan->inner = plan->dims[1];
  } else if (r == 2 && pat[1] == 3 && pat[0] == 2) {
    plan->kind = K::kBiasA;
    plan->inner = plan->dims[1];
  } else {
    plan->kind = K::kGeneral;
  }
  return ffi::Error::Success();
}

// Everything a handler checks before touching memory, the same on CPU and
// CUDA: dtypes, then shapes, then the broadcast plan.
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

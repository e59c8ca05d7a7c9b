// jaxfuse: the host side of every handler's broadcast (CPU and CUDA, both
// ops): dtype and shape names for messages, and the N-operand broadcast
// collapsed to its essentials (Collapse), which each platform then walks its
// own way.
#ifndef JAXFUSE_BROADCAST_H_
#define JAXFUSE_BROADCAST_H_

#include <cstdint>
#include <string>
#include <vector>

#include "kernel_limits.h"
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

// The broadcast of N operands to one output, reduced to its essentials.
//
// Output dims of size 1 are dropped; adjacent dims that every operand
// broadcasts the same way are merged. What is left is `dims` (outermost first)
// and, per operand, element strides over them (0 where it is broadcast). Each
// operand has the output's rank, or rank 0 (a scalar, read as all-1 dims), and
// every operand dim equals the output dim or is 1.

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

// Operand k's offset for output element i as (i / div) % mod, when the dims
// it varies in are one contiguous block of the collapsed dims (a full
// operand: div 1, mod total; a scalar: mod 1; a trailing bias: div 1); false
// when they are not, and the operand needs a strided walk.
inline bool DivMod(const Collapsed& c, int k, int64_t* div, int64_t* mod) {
  const int r = static_cast<int>(c.dims.size());
  int first = -1, last = -1;
  for (int d = 0; d < r; ++d) {
    if (c.full[d] >> k & 1u) {
      if (first < 0) first = d;
      else if (last != d - 1) return false;
      last = d;
    }
  }
  if (first < 0) {
    *div = 1;
    *mod = 1;
    return true;
  }
  int64_t inner = 1, block = 1;
  for (int d = last + 1; d < r; ++d) inner *= c.dims[d];
  for (int d = first; d <= last; ++d) block *= c.dims[d];
  *div = inner;
  *mod = block;
  return true;
}

}  // namespace jaxfuse

#endif  // JAXFUSE_BROADCAST_H_

// jaxfuse: XLA FFI CUDA handler for `jaxfuse_epilogue`,
// relu((((x - m) * q) * s + t) + r) with an optional tie mask (v == 0).
//
// Semantics: epilogue_scalar.h, the same scalar code as the CPU engine; the
// platform's rounding rules (contract, narrow_each_op) arrive as attributes.
// Validation / broadcast planning: add_relu_common.h (host side).
//
// Each operand is read at (i / div) % mod of the flat output index i, which
// covers a full operand, a scalar, a bias along the last dims and a per-channel
// vector in the middle (NCHW); any other broadcast takes the strided walk.
// The handler only validates on the host and launches one kernel on XLA's
// stream: no sync, no allocation, so it is command-buffer compatible.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "add_relu_common.h"
#include "epilogue_ffi.h"
#include "epilogue_scalar.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxfuse {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;  // grid-stride beyond that
constexpr int kMaxDeviceRank = 24;    // collapsed dims of the strided walk


struct Operand {
  const void* p;
  int64_t div, mod;   // offset = (i / div) % mod when !strided
};

struct Params {
  Operand op[kSlots];
  bool present[kSlots];
  bool strided;       // use the general walk below
  int rank;
  int64_t dims[kMaxDeviceRank];
  int64_t strides[kSlots][kMaxDeviceRank];
  int flags;  // bit 0 mean, 1 scale, 2 residual, 3 contract, 4 prescale, 5 each-op
  int64_t total;
};

__device__ __forceinline__ int64_t Offset(const Params& p, int k, int64_t i) {
  if (p.strided) {
    int64_t rem = i, off = 0;
    for (int d = p.rank - 1; d >= 0; --d) {
      const int64_t c = rem % p.dims[d];
      rem /= p.dims[d];
      off += c * p.strides[k][d];
    }
    return off;
  }
  const Operand& o = p.op[k];
  if (o.mod == 1) return 0;
  if (o.div == 1 && o.mod == p.total) return i;
  return (o.div == 1 ? i : i / o.div) % o.mod;
}

template <class S>
__device__ __forceinline__ S Get(const Params& p, int k, int64_t i) {
  if (!p.present[k]) return S(0);
  return static_cast<const S*>(p.op[k].p)[Offset(p, k, i)];
}

// The form is uniform over the grid, so this switch costs no divergence.
template <class F, class S, class Tag>
__device__ __forceinline__ S One(Tag tag, S x, S m, S q, S s, S t, S r,
                                 bool* z) {
  if constexpr (sizeof(S) == 2) {
    return epilogue<F>(tag, x, m, q, s, t, r, z);
  } else {
    return epilogue<F>(x, m, q, s, t, r, z);
  }
}

// Every valid form: without a scale there is no mean, pre-scale or
// contraction (keys 0 and 4); with one, any of them.
template <bool EachOp, class S, class Tag>
__device__ __forceinline__ S Apply(int flags, Tag tag, S x, S m, S q, S s,
                                   S t, S r, bool* z) {
  switch (flags & 31) {
#define JF_CASE(K)                                                          \
  case K:                                                                   \
    return One<Form<(K & 1) != 0, (K & 16) != 0, (K & 2) != 0,              \
                    (K & 4) != 0, (K & 8) != 0, EachOp>>(tag, x, m, q, s, t, \
                                                         r, z);
    JF_CASE(0) JF_CASE(4) JF_CASE(2) JF_CASE(3) JF_CASE(6) JF_CASE(7)
    JF_CASE(10) JF_CASE(11) JF_CASE(14) JF_CASE(15) JF_CASE(18) JF_CASE(19)
    JF_CASE(22) JF_CASE(23) JF_CASE(26) JF_CASE(27) JF_CASE(30) JF_CASE(31)
#undef JF_CASE
    default:
      return One<Form<false, false, false, false, false, EachOp>>(
          tag, x, m, q, s, t, r, z);
  }
}

struct NoTag {};

template <class S, class Tag>
__global__ void EpilogueKernel(Params p, S* __restrict__ out,
                               bool* __restrict__ tie) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const bool each_op = (p.flags & 32) != 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.total;
       i += stride) {
    S x = Get<S>(p, kX, i), m = Get<S>(p, kM, i), q = Get<S>(p, kQ, i);
    S s = Get<S>(p, kS, i), t = Get<S>(p, kT, i), r = Get<S>(p, kR, i);
    bool z;
    out[i] = each_op ? Apply<true>(p.flags, Tag{}, x, m, q, s, t, r, &z)
                     : Apply<false>(p.flags, Tag{}, x, m, q, s, t, r, &z);
    if (tie != nullptr) tie[i] = z;
  }
}

int Blocks(int64_t work) {
  int64_t blocks = (work + kThreads - 1) / kThreads;
  if (blocks < 1) blocks = 1;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  return static_cast<int>(blocks);
}

// (i / div) % mod for operand k, when its varying collapsed dims are one
// contiguous block; false otherwise.
bool DivMod(const Collapsed& c, int k, int64_t* div, int64_t* mod) {
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

ffi::Error EpilogueCudaImpl(cudaStream_t stream, ffi::RemainingArgs args,
                            ffi::RemainingRets rets, bool mean, bool prescale,
                            bool scale, bool residual, bool contract,
                            bool narrow_each_op, bool tie) {
  const char* op = "jaxfuse_epilogue (CUDA)";
  EpilogueCall call;
  if (ffi::Error e = ReadEpilogueCall(op, args, rets,
                                      {mean, prescale, scale, residual, tie},
                                      /*extra=*/0, &call);
      e.failure()) {
    return e;
  }
  const int n = call.n;
  const int* slots = call.slots;
  ffi::Span<const int64_t> dims[kMaxOperands];
  const void* data[kMaxOperands];
  const ffi::DataType dt = call.operands[0].element_type();
  for (int k = 0; k < n; ++k) {
    const ffi::AnyBuffer& arg = call.operands[k];
    if (arg.element_type() != dt) {
      return ffi::Error::InvalidArgument(std::string(op) +
                                         ": operand dtypes must match");
    }
    dims[k] = arg.dimensions();
    data[k] = arg.untyped_data();
  }
  ffi::AnyBuffer& out_buf = call.results[0];
  if (out_buf.element_type() != dt || !SupportedDtype(dt)) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": unsupported or mismatched dtype " +
        DtypeString(dt) + " (supported: float32, float64, float16, bfloat16)");
  }
  bool* tie_ptr = nullptr;
  if (tie) {
    if (call.results[1].element_type() != ffi::DataType::PRED) {
      return ffi::Error::InvalidArgument(std::string(op) +
                                         ": the tie output must be bool");
    }
    tie_ptr = static_cast<bool*>(call.results[1].untyped_data());
  }
  Collapsed c;
  if (ffi::Error e = Collapse(op, dims, n, out_buf.dimensions(), &c);
      e.failure()) {
    return e;
  }
  if (c.total == 0) return ffi::Error::Success();
  Params p{};
  p.total = c.total;
  p.flags = (mean ? 1 : 0) | (scale ? 2 : 0) | (residual ? 4 : 0) |
            (contract && scale ? 8 : 0) | (prescale ? 16 : 0) |
            (narrow_each_op ? 32 : 0);
  p.strided = false;
  for (int k = 0; k < n; ++k) {
    const int slot = slots[k];
    p.present[slot] = true;
    p.op[slot].p = data[k];
    if (!DivMod(c, k, &p.op[slot].div, &p.op[slot].mod)) p.strided = true;
  }
  if (p.strided) {
    const int r = static_cast<int>(c.dims.size());
    if (r > kMaxDeviceRank) {
      return ffi::Error::InvalidArgument(
          std::string(op) + ": broadcast with " + std::to_string(r) +
          " dimension groups after merging (max " +
          std::to_string(kMaxDeviceRank) + ")");
    }
    p.rank = r;
    for (int d = 0; d < r; ++d) p.dims[d] = c.dims[d];
    for (int k = 0; k < n; ++k) {
      for (int d = 0; d < r; ++d) p.strides[slots[k]][d] = c.strides[k][d];
    }
  }
  void* o = out_buf.untyped_data();
  const int blocks = Blocks(c.total);
  switch (dt) {
    case ffi::DataType::F32:
      EpilogueKernel<float, NoTag><<<blocks, kThreads, 0, stream>>>(
          p, static_cast<float*>(o), tie_ptr);
      break;
    case ffi::DataType::F64:
      EpilogueKernel<double, NoTag><<<blocks, kThreads, 0, stream>>>(
          p, static_cast<double*>(o), tie_ptr);
      break;
    case ffi::DataType::F16:
      EpilogueKernel<uint16_t, F16Tag><<<blocks, kThreads, 0, stream>>>(
          p, static_cast<uint16_t*>(o), tie_ptr);
      break;
    default:
      EpilogueKernel<uint16_t, BF16Tag><<<blocks, kThreads, 0, stream>>>(
          p, static_cast<uint16_t*>(o), tie_ptr);
      break;
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string(op) + ": kernel launch failed: " +
                                cudaGetErrorName(err) + ": " +
                                cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxfuse

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    EpilogueCuda, jaxfuse::EpilogueCudaImpl,
    jaxfuse::WithEpilogueAttrs(ffi::Ffi::Bind()
                                   .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                   .RemainingArgs()
                                   .RemainingRets()),
    {xla::ffi::Traits::kCmdBufferCompatible});

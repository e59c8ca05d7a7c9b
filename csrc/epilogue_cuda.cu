// jaxfuse: XLA FFI CUDA handler for `jaxfuse_epilogue`,
// relu((((x - m) * q) * s + t) + r) with an optional tie mask (v == 0).
//
// Semantics: epilogue_scalar.h, the same scalar code as the CPU engine; the
// platform's rounding rules (contract, narrow_each_op) arrive as attributes.
// The broadcast: broadcast_cuda.cuh, as the add_relu kernel reads it. The
// (i / div) % mod form covers a full operand, a scalar, a bias along the last
// dims and a per-channel vector in the middle (NCHW); any other broadcast
// takes the strided walk.
// The handler only validates on the host and launches one kernel on XLA's
// stream: no sync, no allocation, so it is command-buffer compatible.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "broadcast.h"
#include "broadcast_cuda.cuh"
#include "epilogue_ffi.h"
#include "epilogue_scalar.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxfuse {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;  // grid-stride beyond that


struct Operand {
  const void* p;
  int64_t div, mod;   // offset = (i / div) % mod when !strided
};

struct Params {
  Operand op[kSlots];
  bool present[kSlots];
  bool strided;       // use the strided walk
  DeviceShape shape;
  DeviceStrides strides[kSlots];
  int key;            // FormKey (epilogue_scalar.h), without the tie bit
  int64_t total;
};

__device__ __forceinline__ int64_t Offset(const Params& p, int k, int64_t i) {
  if (p.strided) return StridedOffset(p.shape, p.strides[k], i);
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

// Every valid form (ValidFormKey): without a scale only the residual; with
// one, any of mean, pre-scale, residual and contraction.
template <bool EachOp, class S, class Tag>
__device__ __forceinline__ S Apply(int key, Tag tag, S x, S m, S q, S s, S t,
                                   S r, bool* z) {
  switch (key & ~(kEachOpBit | kTieBit)) {
#define JF_CASE(K)                                                         \
  case K:                                                                  \
    static_assert(ValidFormKey(K), "not a form");                          \
    return One<FormOfKey<(K) | (EachOp ? kEachOpBit : 0)>>(tag, x, m, q, s, \
                                                            t, r, z);
#define JF_SCALED(K)                                                 \
  JF_CASE(kScaleBit | (K)) JF_CASE(kScaleBit | (K) | kMeanBit)       \
  JF_CASE(kScaleBit | (K) | kPrescaleBit)                            \
  JF_CASE(kScaleBit | (K) | kMeanBit | kPrescaleBit)
    JF_CASE(0) JF_CASE(kResidualBit)
    JF_SCALED(0) JF_SCALED(kResidualBit) JF_SCALED(kContractBit)
    JF_SCALED(kResidualBit | kContractBit)
#undef JF_SCALED
#undef JF_CASE
    default:
      return One<FormOfKey<EachOp ? kEachOpBit : 0>>(tag, x, m, q, s, t, r,
                                                      z);
  }
}

struct NoTag {};

template <class S, class Tag>
__global__ void EpilogueKernel(Params p, S* __restrict__ out,
                               bool* __restrict__ tie) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const bool each_op = (p.key & kEachOpBit) != 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.total;
       i += stride) {
    S x = Get<S>(p, kX, i), m = Get<S>(p, kM, i), q = Get<S>(p, kQ, i);
    S s = Get<S>(p, kS, i), t = Get<S>(p, kT, i), r = Get<S>(p, kR, i);
    bool z;
    out[i] = each_op ? Apply<true>(p.key, Tag{}, x, m, q, s, t, r, &z)
                     : Apply<false>(p.key, Tag{}, x, m, q, s, t, r, &z);
    if (tie != nullptr) tie[i] = z;
  }
}

int Blocks(int64_t work) {
  int64_t blocks = (work + kThreads - 1) / kThreads;
  if (blocks < 1) blocks = 1;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  return static_cast<int>(blocks);
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
  p.key = FormKey(mean, prescale, scale, residual, contract && scale,
                  narrow_each_op, false);
  p.strided = false;
  for (int k = 0; k < n; ++k) {
    const int slot = slots[k];
    p.present[slot] = true;
    p.op[slot].p = data[k];
    if (!DivMod(c, k, &p.op[slot].div, &p.op[slot].mod)) p.strided = true;
  }
  if (p.strided) {
    if (ffi::Error e = ToDeviceShape(op, c, &p.shape); e.failure()) return e;
    for (int k = 0; k < n; ++k) ToDeviceStrides(c, k, &p.strides[slots[k]]);
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

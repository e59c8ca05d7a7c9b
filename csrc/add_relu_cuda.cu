// jaxfuse: XLA FFI CUDA handler for the fused `max(a + b, 0)`.
//
// Semantics: add_relu_scalar.h (the same scalar code as the CPU handler).
// Validation / broadcast planning: add_relu_common.h (host side).
//
// The handler only validates on the host and launches one kernel on the
// stream XLA gives it: no host sync, no allocation, no device-memory reads on
// the host. It is therefore safe inside CUDA graphs and is declared
// kCmdBufferCompatible.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "add_relu_common.h"
#include "add_relu_scalar.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxfuse {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;  // grid-stride beyond that
constexpr int kMaxRank = 16;          // collapsed rank supported on device

// Element ops. S: storage type.
struct F32Op {
  using S = float;
  static __device__ __forceinline__ S f(S x, S y) { return add_relu(x, y); }
};
struct F64Op {
  using S = double;
  static __device__ __forceinline__ S f(S x, S y) { return add_relu(x, y); }
};
struct F16Op {
  using S = uint16_t;
  static __device__ __forceinline__ S f(S x, S y) {
    return add_relu(F16Tag{}, x, y);
  }
};
struct BF16Op {
  using S = uint16_t;
  static __device__ __forceinline__ S f(S x, S y) {
    return add_relu(BF16Tag{}, x, y);
  }
};

// 16 bytes of S.
template <typename S>
union Vec16 {
  uint4 raw;
  S e[16 / sizeof(S)];
};

// Operand access modes.
enum Mode : int {
  kFull = 0,    // same size as the output
  kScalar = 1,  // one element
  kBias = 2,    // trailing bias: x[i % inner]
};

template <Mode M, typename S>
__device__ __forceinline__ S Load(const S* __restrict__ p, int64_t i,
                                  int64_t inner) {
  if (M == kFull) return p[i];
  if (M == kScalar) return p[0];
  return p[i % inner];
}

// Vector of kPer elements starting at element i (a multiple of kPer).
// kFull/kBias pointers are 16-byte aligned and, for kBias, inner % kPer == 0
// (checked on the host before choosing the vector kernel).
template <Mode M, typename S>
__device__ __forceinline__ Vec16<S> LoadVec(const S* __restrict__ p,
                                            int64_t i, int64_t inner) {
  Vec16<S> v;
  if (M == kFull) {
    v.raw = *reinterpret_cast<const uint4*>(p + i);
  } else if (M == kBias) {
    v.raw = *reinterpret_cast<const uint4*>(p + (i % inner));
  } else {
    S s = p[0];
#pragma unroll
    for (int k = 0; k < int(16 / sizeof(S)); ++k) v.e[k] = s;
  }
  return v;
}

// Vectorized: 16-byte loads/stores, grid-stride over vectors, then the tail
// (< kPer elements) element-wise.
template <typename Op, Mode MA, Mode MB>
__global__ void AddReluVecKernel(const typename Op::S* __restrict__ a,
                                 const typename Op::S* __restrict__ b,
                                 typename Op::S* __restrict__ o, int64_t n,
                                 int64_t inner) {
  using S = typename Op::S;
  constexpr int kPer = 16 / sizeof(S);
  const int64_t nvec = n / kPer;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t v = tid; v < nvec; v += stride) {
    const int64_t i = v * kPer;
    Vec16<S> x = LoadVec<MA>(a, i, inner);
    Vec16<S> y = LoadVec<MB>(b, i, inner);
    Vec16<S> r;
#pragma unroll
    for (int k = 0; k < kPer; ++k) r.e[k] = Op::f(x.e[k], y.e[k]);
    *reinterpret_cast<uint4*>(o + i) = r.raw;
  }
  for (int64_t i = nvec * kPer + tid; i < n; i += stride) {
    o[i] = Op::f(Load<MA>(a, i, inner), Load<MB>(b, i, inner));
  }
}

// Element-wise fallback (unaligned pointers, bias length not a multiple of
// the vector width).
template <typename Op, Mode MA, Mode MB>
__global__ void AddReluKernel(const typename Op::S* __restrict__ a,
                              const typename Op::S* __restrict__ b,
                              typename Op::S* __restrict__ o, int64_t n,
                              int64_t inner) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    o[i] = Op::f(Load<MA>(a, i, inner), Load<MB>(b, i, inner));
  }
}

// General broadcast: collapsed dims with per-operand element strides.
struct GeneralParams {
  int rank;
  int64_t dims[kMaxRank];
  int64_t as[kMaxRank];
  int64_t bs[kMaxRank];
};

template <typename Op>
__global__ void AddReluGeneralKernel(const typename Op::S* __restrict__ a,
                                     const typename Op::S* __restrict__ b,
                                     typename Op::S* __restrict__ o, int64_t n,
                                     GeneralParams p) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    int64_t rem = i, ia = 0, ib = 0;
    for (int d = p.rank - 1; d >= 0; --d) {
      const int64_t c = rem % p.dims[d];
      rem /= p.dims[d];
      ia += c * p.as[d];
      ib += c * p.bs[d];
    }
    o[i] = Op::f(a[ia], b[ib]);
  }
}

int Blocks(int64_t work) {
  int64_t blocks = (work + kThreads - 1) / kThreads;
  if (blocks < 1) blocks = 1;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  return static_cast<int>(blocks);
}

bool Aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

template <typename Op, Mode MA, Mode MB>
void LaunchElementwise(cudaStream_t stream, const void* av, const void* bv,
                       void* ov, int64_t n, int64_t inner) {
  using S = typename Op::S;
  constexpr int kPer = 16 / sizeof(S);
  const S* a = static_cast<const S*>(av);
  const S* b = static_cast<const S*>(bv);
  S* o = static_cast<S*>(ov);
  auto ok = [&](Mode m, const void* p) {
    if (m == kScalar) return true;
    if (!Aligned16(p)) return false;
    return m == kFull || inner % kPer == 0;
  };
  if (Aligned16(o) && ok(MA, a) && ok(MB, b)) {
    AddReluVecKernel<Op, MA, MB>
        <<<Blocks((n + kPer - 1) / kPer), kThreads, 0, stream>>>(a, b, o, n,
                                                                 inner);
  } else {
    AddReluKernel<Op, MA, MB>
        <<<Blocks(n), kThreads, 0, stream>>>(a, b, o, n, inner);
  }
}

template <typename Op>
ffi::Error Launch(cudaStream_t stream, const BroadcastPlan& plan,
                  const void* a, const void* b, void* o) {
  const int64_t n = plan.total;
  switch (plan.kind) {
    case BroadcastPlan::kEmpty:
      return ffi::Error::Success();
    case BroadcastPlan::kSame:
      LaunchElementwise<Op, kFull, kFull>(stream, a, b, o, n, 1);
      break;
    case BroadcastPlan::kScalarB:
      LaunchElementwise<Op, kFull, kScalar>(stream, a, b, o, n, 1);
      break;
    case BroadcastPlan::kScalarA:
      LaunchElementwise<Op, kScalar, kFull>(stream, a, b, o, n, 1);
      break;
    case BroadcastPlan::kScalars:
      LaunchElementwise<Op, kScalar, kScalar>(stream, a, b, o, n, 1);
      break;
    case BroadcastPlan::kBiasB:
      LaunchElementwise<Op, kFull, kBias>(stream, a, b, o, n, plan.inner);
      break;
    case BroadcastPlan::kBiasA:
      LaunchElementwise<Op, kBias, kFull>(stream, a, b, o, n, plan.inner);
      break;
    case BroadcastPlan::kGeneral: {
      const int r = static_cast<int>(plan.dims.size());
      if (r > kMaxRank) {
        return ffi::Error::InvalidArgument(
            "jaxfuse_add_relu (CUDA): broadcast pattern too complex (" +
            std::to_string(r) + " dimension groups after merging, max " +
            std::to_string(kMaxRank) + ")");
      }
      GeneralParams p{};
      p.rank = r;
      for (int d = 0; d < r; ++d) {
        p.dims[d] = plan.dims[d];
        p.as[d] = plan.a_strides[d];
        p.bs[d] = plan.b_strides[d];
      }
      using S = typename Op::S;
      AddReluGeneralKernel<Op><<<Blocks(n), kThreads, 0, stream>>>(
          static_cast<const S*>(a), static_cast<const S*>(b),
          static_cast<S*>(o), n, p);
      break;
    }
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error::Internal(
        std::string("jaxfuse_add_relu (CUDA): kernel launch failed: ") +
        cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

ffi::Error AddReluCudaImpl(cudaStream_t stream, ffi::AnyBuffer a,
                           ffi::AnyBuffer b,
                           ffi::Result<ffi::AnyBuffer> out) {
  BroadcastPlan plan;
  if (ffi::Error e = PlanCall(a, b, *out, &plan); e.failure()) return e;
  if (plan.kind == BroadcastPlan::kEmpty) return ffi::Error::Success();
  const void* ap = a.untyped_data();
  const void* bp = b.untyped_data();
  void* op = out->untyped_data();
  switch (a.element_type()) {
    case ffi::DataType::F32: return Launch<F32Op>(stream, plan, ap, bp, op);
    case ffi::DataType::F64: return Launch<F64Op>(stream, plan, ap, bp, op);
    case ffi::DataType::F16: return Launch<F16Op>(stream, plan, ap, bp, op);
    case ffi::DataType::BF16: return Launch<BF16Op>(stream, plan, ap, bp, op);
    default:  // unreachable: CheckDtypes rejected it
      return ffi::Error::InvalidArgument(
          "jaxfuse_add_relu (CUDA): unsupported dtype " +
          DtypeString(a.element_type()));
  }
}

}  // namespace
}  // namespace jaxfuse

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AddReluCuda, jaxfuse::AddReluCudaImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Ret<ffi::AnyBuffer>(),
    {xla::ffi::Traits::kCmdBufferCompatible});

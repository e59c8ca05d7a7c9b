// jaxfuse: XLA FFI CUDA handler for the fused `max(a + b, 0)`.
//
// Semantics: add_relu_scalar.h (the same scalar code as the CPU handler).
// The broadcast: broadcast_cuda.cuh, as the epilogue kernel reads it, with
// fast paths for a full, scalar or trailing-bias operand.
//
// The handler only validates on the host and launches one kernel on the
// stream XLA gives it: no host sync, no allocation, no device-memory reads on
// the host. It is therefore safe inside CUDA graphs and is declared
// kCmdBufferCompatible.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

#include "broadcast.h"
#include "broadcast_cuda.cuh"
#include "kernel_limits.h"
#include "add_relu_scalar.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxfuse {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;  // grid-stride beyond that

// Kernel variants, chosen at run time (jaxfuse._cuda_kernels.configure, from
// JAXFUSE_CUDA_VARIANT) so a GPU can time them without a rebuild
// (benchmarks/probes/cuda_variants.py). The default stays the one validated bit for bit on
// an H200 until a measurement there picks another.
//   0  one 16-byte vector per thread per step, up to 8192 blocks
//   1  two vectors per thread per step (more bytes in flight), a grid sized to
//      the SMs (8 blocks of 256 per SM), the bias column carried forward
//      instead of a 64-bit modulo per vector
//   2  1 + streaming stores (st.global.cs); the loads are ld.global.nc in
//      every variant already (const __restrict__), so this differs in stores
//   3  2 + float16/bfloat16 through the hardware conversions (cvt), where the
//      default does the rounding in integer code
// PTX (sm_90, nvcc 13.0; benchmarks/probes/vector_access.py, tests/ops/test_cuda_vector_access.py):
// every vector kernel loads 16 bytes per operand (ld.global.nc.v4) and stores
// 16 (st.global.v4, or st.global.cs.v4 in variants 2-3; there the loads of the
// scalar tail, under one vector, lose .nc). gpu_check.sh reads the SASS where
// cuobjdump exists.
std::atomic<int> g_variant{0};

}  // namespace

void ConfigureCudaVariant(int variant) { g_variant.store(variant); }
int CudaVariant() { return g_variant.load(); }

namespace {

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

// float16 / bfloat16 through the hardware conversions (cvt.f32.f16 /
// shift-widen exact; cvt.rn.{f16,bf16}.f32 round to nearest even and give the
// canonical NaN 0x7fff): the same bits as the integer code above, the same
// instructions XLA:GPU emits.
struct F16HwOp {
  using S = uint16_t;
  static __device__ __forceinline__ S f(S x, S y) {
    float v = relu_keep_nan(__half2float(__ushort_as_half(x)) +
                            __half2float(__ushort_as_half(y)));
    return __half_as_ushort(__float2half_rn(v));
  }
};
struct BF16HwOp {
  using S = uint16_t;
  static __device__ __forceinline__ S f(S x, S y) {
    float v = relu_keep_nan(__bfloat162float(__ushort_as_bfloat16(x)) +
                            __bfloat162float(__ushort_as_bfloat16(y)));
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
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

// Variants 1-3: two vectors per thread per step. A bias operand is read at
// its column, carried forward by the grid stride modulo the bias length.
template <bool NC, typename S>
__device__ __forceinline__ Vec16<S> Fetch(const S* __restrict__ p) {
  Vec16<S> v;
  const uint4* q = reinterpret_cast<const uint4*>(p);
  v.raw = NC ? __ldg(q) : *q;
  return v;
}

template <Mode M, bool NC, typename S>
__device__ __forceinline__ Vec16<S> LoadAt(const S* __restrict__ p, int64_t i,
                                           int64_t col) {
  if (M == kFull) return Fetch<NC>(p + i);
  if (M == kBias) return Fetch<NC>(p + col);
  Vec16<S> v;
  const S s = p[0];
#pragma unroll
  for (int k = 0; k < int(16 / sizeof(S)); ++k) v.e[k] = s;
  return v;
}

template <bool NC, typename S>
__device__ __forceinline__ void Put(S* __restrict__ p, const Vec16<S>& v) {
  uint4* q = reinterpret_cast<uint4*>(p);
  if (NC) {
    __stcs(q, v.raw);
  } else {
    *q = v.raw;
  }
}

template <typename Op, Mode MA, Mode MB, bool NC>
__global__ void AddReluVec2Kernel(const typename Op::S* __restrict__ a,
                                  const typename Op::S* __restrict__ b,
                                  typename Op::S* __restrict__ o, int64_t n,
                                  int64_t inner) {
  using S = typename Op::S;
  constexpr int kPer = 16 / sizeof(S);
  constexpr bool kBiased = MA == kBias || MB == kBias;
  const int64_t nvec = n / kPer;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t step = kBiased ? (stride * kPer) % inner : 0;
  int64_t col = kBiased ? (v * kPer) % inner : 0;
  auto next = [&](int64_t c) {
    if (!kBiased) return c;
    c += step;
    return c >= inner ? c - inner : c;
  };
  for (; v + stride < nvec; v += 2 * stride) {
    const int64_t i0 = v * kPer, i1 = (v + stride) * kPer;
    const int64_t c0 = col, c1 = next(col);
    Vec16<S> x0 = LoadAt<MA, NC>(a, i0, c0), y0 = LoadAt<MB, NC>(b, i0, c0);
    Vec16<S> x1 = LoadAt<MA, NC>(a, i1, c1), y1 = LoadAt<MB, NC>(b, i1, c1);
    Vec16<S> r0, r1;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      r0.e[k] = Op::f(x0.e[k], y0.e[k]);
      r1.e[k] = Op::f(x1.e[k], y1.e[k]);
    }
    Put<NC>(o + i0, r0);
    Put<NC>(o + i1, r1);
    col = next(c1);
  }
  if (v < nvec) {
    const int64_t i0 = v * kPer;
    Vec16<S> x0 = LoadAt<MA, NC>(a, i0, col), y0 = LoadAt<MB, NC>(b, i0, col);
    Vec16<S> r0;
#pragma unroll
    for (int k = 0; k < kPer; ++k) r0.e[k] = Op::f(x0.e[k], y0.e[k]);
    Put<NC>(o + i0, r0);
  }
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
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

// Any other broadcast: the strided walk over the collapsed dims.
template <typename Op>
__global__ void AddReluGeneralKernel(const typename Op::S* __restrict__ a,
                                     const typename Op::S* __restrict__ b,
                                     typename Op::S* __restrict__ o, int64_t n,
                                     DeviceShape shape, DeviceStrides as,
                                     DeviceStrides bs) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    o[i] = Op::f(a[StridedOffset(shape, as, i)], b[StridedOffset(shape, bs, i)]);
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

// Enough blocks of kThreads to fill every SM (8 resident per SM), at most what
// the work needs; the kernels stride over the rest.
int SmGrid(int64_t vectors_per_thread_step) {
  static int sms[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) dev = 0;
  if (sms[dev] == 0) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || v <= 0) {
      v = 132;  // an H100/H200
    }
    sms[dev] = v;
  }
  int64_t need = (vectors_per_thread_step + kThreads - 1) / kThreads;
  int64_t full = int64_t(sms[dev]) * 8;
  return static_cast<int>(std::max<int64_t>(1, std::min(need, full)));
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
    const int variant = g_variant.load(std::memory_order_relaxed);
    const int64_t pairs = (n / kPer + 1) / 2;
    if (variant == 0) {
      AddReluVecKernel<Op, MA, MB>
          <<<Blocks((n + kPer - 1) / kPer), kThreads, 0, stream>>>(a, b, o, n,
                                                                   inner);
    } else if (variant == 1) {
      AddReluVec2Kernel<Op, MA, MB, false>
          <<<SmGrid(pairs), kThreads, 0, stream>>>(a, b, o, n, inner);
    } else {
      AddReluVec2Kernel<Op, MA, MB, true>
          <<<SmGrid(pairs), kThreads, 0, stream>>>(a, b, o, n, inner);
    }
  } else {
    AddReluKernel<Op, MA, MB>
        <<<Blocks(n), kThreads, 0, stream>>>(a, b, o, n, inner);
  }
}

// How one operand is read, from its (i / div) % mod form (broadcast.h).
bool ModeOf(const Collapsed& c, int k, Mode* mode, int64_t* inner) {
  int64_t div = 0, mod = 0;
  if (!DivMod(c, k, &div, &mod) || div != 1) return false;
  *mode = mod == 1 ? kScalar : mod == c.total ? kFull : kBias;
  *inner = mod;
  return true;
}

template <typename Op>
ffi::Error Launch(cudaStream_t stream, const Collapsed& c, const void* a,
                  const void* b, void* o) {
  const int64_t n = c.total;
  Mode ma = kFull, mb = kFull;
  int64_t ia = 0, ib = 0;
  // The fast paths: full, scalar, or one trailing bias beside a full operand.
  const bool fast = ModeOf(c, 0, &ma, &ia) && ModeOf(c, 1, &mb, &ib) &&
                    !(ma == kBias && mb != kFull) && !(mb == kBias && ma != kFull);
  if (!fast) {
    DeviceShape shape;
    if (ffi::Error e = ToDeviceShape("jaxfuse_add_relu (CUDA)", c, &shape);
        e.failure()) {
      return e;
    }
    DeviceStrides as, bs;
    ToDeviceStrides(c, 0, &as);
    ToDeviceStrides(c, 1, &bs);
    using S = typename Op::S;
    AddReluGeneralKernel<Op><<<Blocks(n), kThreads, 0, stream>>>(
        static_cast<const S*>(a), static_cast<const S*>(b), static_cast<S*>(o),
        n, shape, as, bs);
  } else if (ma == kFull && mb == kFull) {
    LaunchElementwise<Op, kFull, kFull>(stream, a, b, o, n, 1);
  } else if (ma == kFull && mb == kScalar) {
    LaunchElementwise<Op, kFull, kScalar>(stream, a, b, o, n, 1);
  } else if (ma == kScalar && mb == kFull) {
    LaunchElementwise<Op, kScalar, kFull>(stream, a, b, o, n, 1);
  } else if (ma == kScalar && mb == kScalar) {
    LaunchElementwise<Op, kScalar, kScalar>(stream, a, b, o, n, 1);
  } else if (ma == kFull) {
    LaunchElementwise<Op, kFull, kBias>(stream, a, b, o, n, ib);
  } else {
    LaunchElementwise<Op, kBias, kFull>(stream, a, b, o, n, ia);
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
  const ffi::DataType dt = a.element_type();
  if (b.element_type() != dt || out->element_type() != dt) {
    return ffi::Error::InvalidArgument(
        "jaxfuse_add_relu (CUDA): operand and result dtypes must match, got a=" +
        DtypeString(dt) + ", b=" + DtypeString(b.element_type()) + ", out=" +
        DtypeString(out->element_type()));
  }
  if (!SupportedDtype(dt)) {
    return ffi::Error::InvalidArgument(
        "jaxfuse_add_relu (CUDA): unsupported dtype " + DtypeString(dt) +
        " (supported: float32, float64, float16, bfloat16)");
  }
  const ffi::Span<const int64_t> dims[2] = {a.dimensions(), b.dimensions()};
  Collapsed c;
  if (ffi::Error e = Collapse("jaxfuse_add_relu (CUDA)", dims, 2,
                              out->dimensions(), &c);
      e.failure()) {
    return e;
  }
  if (c.total == 0) return ffi::Error::Success();
  const void* ap = a.untyped_data();
  const void* bp = b.untyped_data();
  void* op = out->untyped_data();
  switch (a.element_type()) {
    case ffi::DataType::F32: return Launch<F32Op>(stream, c, ap, bp, op);
    case ffi::DataType::F64: return Launch<F64Op>(stream, c, ap, bp, op);
    case ffi::DataType::F16:
      return g_variant.load() >= 3 ? Launch<F16HwOp>(stream, c, ap, bp, op)
                                   : Launch<F16Op>(stream, c, ap, bp, op);
    case ffi::DataType::BF16:
      return g_variant.load() >= 3 ? Launch<BF16HwOp>(stream, c, ap, bp, op)
                                   : Launch<BF16Op>(stream, c, ap, bp, op);
    default:  // unreachable: rejected above
      return ffi::Error::InvalidArgument(
          "jaxfuse_add_relu (CUDA): unsupported dtype " + DtypeString(dt));
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

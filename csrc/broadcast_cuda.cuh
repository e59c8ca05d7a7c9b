// jaxfuse: how both CUDA kernels read a broadcast operand. The host collapses
// the broadcast (broadcast.h); an operand whose varying dims form one block
// is read at (i / div) % mod (DivMod), any other through the strided walk
// below, over at most kMaxDeviceRank collapsed dims.
#ifndef JAXFUSE_BROADCAST_CUDA_CUH_
#define JAXFUSE_BROADCAST_CUDA_CUH_

#include <cstdint>
#include <string>

#include "broadcast.h"
#include "kernel_limits.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfuse {

// The collapsed dims, as a kernel parameter.
struct DeviceShape {
  int rank;
  int64_t dims[kMaxDeviceRank];
};

// An operand's element strides over a DeviceShape's dims.
struct DeviceStrides {
  int64_t s[kMaxDeviceRank];
};

__device__ __forceinline__ int64_t StridedOffset(const DeviceShape& shape,
                                                 const DeviceStrides& strides,
                                                 int64_t i) {
  int64_t rem = i, off = 0;
  for (int d = shape.rank - 1; d >= 0; --d) {
    const int64_t c = rem % shape.dims[d];
    rem /= shape.dims[d];
    off += c * strides.s[d];
  }
  return off;
}

// The collapsed dims of `c` as a DeviceShape; an error beyond kMaxDeviceRank
// (the Python layer lowers such a site to XLA's ops before it gets here).
inline xla::ffi::Error ToDeviceShape(const char* op, const Collapsed& c,
                                     DeviceShape* shape) {
  const int r = static_cast<int>(c.dims.size());
  if (r > kMaxDeviceRank) {
    return xla::ffi::Error::InvalidArgument(
        std::string(op) + ": broadcast with " + std::to_string(r) +
        " dimension groups after merging (max " +
        std::to_string(kMaxDeviceRank) + ")");
  }
  shape->rank = r;
  for (int d = 0; d < r; ++d) shape->dims[d] = c.dims[d];
  return xla::ffi::Error::Success();
}

inline void ToDeviceStrides(const Collapsed& c, int k, DeviceStrides* strides) {
  for (size_t d = 0; d < c.dims.size(); ++d) strides->s[d] = c.strides[k][d];
}

}  // namespace jaxfuse

#endif  // JAXFUSE_BROADCAST_CUDA_CUH_

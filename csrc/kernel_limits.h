// jaxfuse: the kernels' limits, defined once. The native modules hand them to
// Python (`limits()`), which reads them there (jaxfuse/_kernels.py) instead of
// keeping copies: a site beyond a limit lowers to XLA's own ops.
#ifndef JAXFUSE_KERNEL_LIMITS_H_
#define JAXFUSE_KERNEL_LIMITS_H_

namespace jaxfuse {

// Operands of one fused call (the epilogue's slots).
constexpr int kMaxOperands = 6;
// Rank of an output the host-side broadcast plan takes (every platform).
constexpr int kMaxRank = 64;
// Collapsed broadcast dims a CUDA kernel's strided walk carries in its
// launch parameters (a site with more lowers to XLA's ops on CUDA).
constexpr int kMaxDeviceRank = 24;
// add+ReLU CUDA kernel variants selectable at run time (0 .. kCudaVariants-1).
constexpr int kCudaVariants = 4;

}  // namespace jaxfuse

#endif  // JAXFUSE_KERNEL_LIMITS_H_

// jaxfuse: `jaxfuse_copy` on CUDA, a device-to-device cudaMemcpyAsync of its
// operand. Not a fused op: the benchmark's reference, the copy rate the card
// reaches, which no elementwise kernel (reading and writing the same bytes)
// can exceed.
#include <cuda_runtime.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxfuse {
namespace {

ffi::Error CopyCudaImpl(cudaStream_t stream, ffi::AnyBuffer in,
                        ffi::Result<ffi::AnyBuffer> out) {
  if (in.size_bytes() != out->size_bytes()) {
    return ffi::Error::InvalidArgument(
        "jaxfuse_copy: operand and result sizes differ (" +
        std::to_string(in.size_bytes()) + " vs " +
        std::to_string(out->size_bytes()) + " bytes)");
  }
  cudaError_t err =
      cudaMemcpyAsync(out->untyped_data(), in.untyped_data(), in.size_bytes(),
                      cudaMemcpyDeviceToDevice, stream);
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("jaxfuse_copy: ") +
                                cudaGetErrorName(err) + ": " +
                                cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxfuse

XLA_FFI_DEFINE_HANDLER_SYMBOL(CopyCuda, jaxfuse::CopyCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});

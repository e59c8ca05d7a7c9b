// jaxfuse._cuda_kernels: hands the CUDA FFI handlers to Python as capsules.
//
//   for name, capsule in _cuda_kernels.registrations().items():
//       jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
//
// Plain C++ (the handlers live in the .cu files). Importing the module needs
// no GPU; runtime_status() asks the CUDA driver without creating a context.
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>

#include <string>

#include "kernel_limits.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

XLA_FFI_DECLARE_HANDLER_SYMBOL(AddReluCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EpilogueCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CopyCuda);

namespace jaxfuse {
void ConfigureCudaVariant(int variant);  // add_relu_cuda.cu
int CudaVariant();
}  // namespace jaxfuse

NB_MODULE(_cuda_kernels, m) {
  m.doc() = "jaxfuse CUDA kernels (XLA FFI handlers as capsules).";
  m.def("registrations", []() {
    nb::dict d;
    d["jaxfuse_add_relu"] = nb::capsule(reinterpret_cast<void*>(AddReluCuda));
    d["jaxfuse_epilogue"] = nb::capsule(reinterpret_cast<void*>(EpilogueCuda));
    d["jaxfuse_copy"] = nb::capsule(reinterpret_cast<void*>(CopyCuda));  // the benchmark's reference
    return d;
  }, "Dict of FFI target name -> handler capsule (XLA FFI API, platform='CUDA').");
  m.def("configure", [](int variant) {
    if (variant < 0 || variant >= jaxfuse::kCudaVariants) {
      throw nb::value_error(("jaxfuse CUDA variant must be 0-" +
                             std::to_string(jaxfuse::kCudaVariants - 1)).c_str());
    }
    jaxfuse::ConfigureCudaVariant(variant);
  }, nb::arg("variant"), "Selects the add+ReLU kernel variant (read at each launch; limits()['variants']).");
  m.def("limits", []() {
    nb::dict d;
    d["max_rank"] = jaxfuse::kMaxRank;
    d["max_device_rank"] = jaxfuse::kMaxDeviceRank;
    d["variants"] = jaxfuse::kCudaVariants;
    return d;
  }, "The kernels' limits (csrc/kernel_limits.h): output rank, collapsed broadcast dims on the device, variants.");
  m.def("settings", []() {
    nb::dict d;
    d["variant"] = jaxfuse::CudaVariant();
    return d;
  }, "The settings the CUDA kernels run with.");
  m.def("runtime_status", []() {
    int driver = 0;
    if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
    nb::dict d;
    d["driver_version"] = driver;            // 0: no driver
    d["runtime_version"] = CUDART_VERSION;   // what the kernels were built with
    return d;
  }, "CUDA driver version (0 when there is none) and the runtime version the kernels need.");
}

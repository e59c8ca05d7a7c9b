// jaxfuse._cuda_kernels: hands the CUDA FFI handler to Python as a capsule.
//
//   jax.ffi.register_ffi_target("jaxfuse_add_relu",
//                               _cuda_kernels.registrations()["jaxfuse_add_relu"],
//                               platform="CUDA")
//
// This file is plain C++ (no CUDA headers); the handler lives in
// add_relu_cuda.cu. Importing the module needs no GPU.
#include <nanobind/nanobind.h>

#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

XLA_FFI_DECLARE_HANDLER_SYMBOL(AddReluCuda);

NB_MODULE(_cuda_kernels, m) {
  m.doc() = "jaxfuse CUDA kernels (XLA FFI handlers as capsules).";
  m.def("registrations", []() {
    nb::dict d;
    d["jaxfuse_add_relu"] = nb::capsule(reinterpret_cast<void*>(AddReluCuda));
    return d;
  }, "Dict of FFI target name -> handler capsule (XLA FFI API, platform='CUDA').");
}

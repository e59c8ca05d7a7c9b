// jaxfuse._cpu_kernels: hands the CPU FFI handler to Python as a capsule.
//
//   jax.ffi.register_ffi_target("jaxfuse_add_relu",
//                               _cpu_kernels.registrations()["jaxfuse_add_relu"],
//                               platform="cpu")
#include <nanobind/nanobind.h>

#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

XLA_FFI_DECLARE_HANDLER_SYMBOL(AddReluCpu);

NB_MODULE(_cpu_kernels, m) {
  m.doc() = "jaxfuse CPU kernels (XLA FFI handlers as capsules).";
  m.def("registrations", []() {
    nb::dict d;
    d["jaxfuse_add_relu"] = nb::capsule(reinterpret_cast<void*>(AddReluCpu));
    return d;
  }, "Dict of FFI target name -> handler capsule (XLA FFI API, platform='cpu').");
}

// jaxfuse._cpu_kernels: hands the CPU FFI handlers to Python as capsules, and
// takes the run-time settings jaxfuse/_env.py parsed from the environment.
//
//   for name, capsule in _cpu_kernels.registrations().items():
//       jax.ffi.register_ffi_target(name, capsule, platform="cpu")
#include <nanobind/nanobind.h>

#include "cpu_config.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

XLA_FFI_DECLARE_HANDLER_SYMBOL(AddReluCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EpilogueCpu);

NB_MODULE(_cpu_kernels, m) {
  m.doc() = "jaxfuse CPU kernels (XLA FFI handlers as capsules).";
  m.def("registrations", []() {
    nb::dict d;
    d["jaxfuse_add_relu"] = nb::capsule(reinterpret_cast<void*>(AddReluCpu));
    d["jaxfuse_epilogue"] = nb::capsule(reinterpret_cast<void*>(EpilogueCpu));
    return d;
  }, "Dict of FFI target name -> handler capsule (XLA FFI API, platform='cpu').");
  m.def("configure", [](int64_t max_threads, bool huge_pages, int streaming) {
    jaxfuse::CpuSettings s;
    s.max_threads = max_threads;
    s.huge_pages = huge_pages;
    s.streaming = streaming;
    jaxfuse::ConfigureCpu(s);
  }, nb::arg("max_threads"), nb::arg("huge_pages"), nb::arg("streaming"),
  "Run-time settings: thread cap (0: none), huge-page advice, streaming stores (-1 auto, 0 off, 1 on).");
  m.def("settings", []() {
    jaxfuse::CpuSettings s = jaxfuse::CurrentCpuSettings();
    nb::dict d;
    d["max_threads"] = s.max_threads;
    d["huge_pages"] = s.huge_pages;
    d["streaming"] = s.streaming;
    d["streaming_threshold_bytes"] = jaxfuse::StreamingThresholdBytes();
    return d;
  }, "The settings in force, and the bytes a call must touch before auto mode streams.");
  m.def("force_regions_for_tests", [](int64_t regions) {
    jaxfuse::ForceRegionsForTests(regions);
  }, nb::arg("regions"),
  "Tests only: split every large call into this many regions (0: one per worker).");
  m.def("last_split", []() {
    jaxfuse::SplitStats st = jaxfuse::LastSplit();
    nb::dict d;
    d["calls"] = st.calls;
    d["workers"] = st.workers;
    d["regions"] = st.regions;
    return d;
  }, "Calls split over regions so far, and the last one's workers and regions.");
}

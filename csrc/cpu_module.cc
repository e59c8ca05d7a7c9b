// jaxfuse._cpu_kernels: hands the CPU FFI handlers to Python as capsules, and
// takes the run-time settings jaxfuse/_env.py parsed from the environment.
//
//   for name, capsule in _cpu_kernels.registrations().items():
//       jax.ffi.register_ffi_target(name, capsule, platform="cpu")
#include <nanobind/nanobind.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/vector.h>

#include "cpu_config.h"
#include "kernel_limits.h"
#include "output_reuse.h"
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
  m.def("limits", []() {
    nb::dict d;
    d["max_rank"] = jaxfuse::kMaxRank;
    return d;
  }, "The kernels' limits (csrc/kernel_limits.h): the output rank they take.");
  m.def("configure", [](int64_t max_threads, bool huge_pages, int streaming, bool prefault) {
    jaxfuse::CpuSettings s;
    s.max_threads = max_threads;
    s.huge_pages = huge_pages;
    s.streaming = streaming;
    s.prefault = prefault;
    jaxfuse::ConfigureCpu(s);
  }, nb::arg("max_threads"), nb::arg("huge_pages"), nb::arg("streaming"), nb::arg("prefault") = true,
  "Run-time settings: thread cap (0: none), huge-page advice, streaming stores (-1 auto, 0 off, 1 on), "
  "prefaulting large fresh outputs (off: left to the loop's first touch, advised to huge pages "
  "unless the advice is off).");
  m.def("set_vector_path", [](bool avx2) { jaxfuse::SetVectorPath(avx2); }, nb::arg("avx2"),
  "Whether the AVX2 loops may run: only where XLA itself may use AVX2 (jaxfuse/_isa.py).");
  m.def("settings", []() {
    jaxfuse::CpuSettings s = jaxfuse::CurrentCpuSettings();
    nb::dict d;
    d["max_threads"] = s.max_threads;
    d["huge_pages"] = s.huge_pages;
    d["prefault"] = s.prefault;
    d["streaming"] = s.streaming;
    d["streaming_cache_bytes"] = jaxfuse::StreamingCacheBytes();
    d["vector_path"] = jaxfuse::VectorPath();
    return d;
  }, "The settings in force, and the last-level cache the auto streaming rule counts against.");
  m.attr("test_hooks") = bool(JAXFUSE_TEST_HOOKS);
#if JAXFUSE_TEST_HOOKS
  // Built only with JAXFUSE_TEST_HOOKS=ON (the test command's build).
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
  m.def("last_store", []() {
    jaxfuse::StoreStats st = jaxfuse::LastStore();
    nb::dict d;
    d["streamed"] = st.streamed;
    d["fresh_pages"] = st.fresh_pages;
    d["reuse_distance"] = st.reuse_distance;
    d["prefaulted"] = st.pages == 0 ? "" : st.pages == 2 ? "huge" : "small";
    d["prefault_ns"] = st.prefault_ns;
    return d;
  }, "Whether the last call streamed its output, its output's reuse distance in bytes (-1: unknown), "
     "whether it faulted its output in ahead of the loop ('small' or 'huge' pages; '' not) and the "
     "CPU time that took in ns, summed over its threads.");
  m.def("reuse_distances_for_tests", [](const std::vector<std::array<uint64_t, 3>>& calls) {
    return jaxfuse::ReuseDistancesForTests(calls);
  }, nb::arg("calls"),
  "Tests only: reuse distances a fresh tracker gives calls (address, output bytes, bytes touched).");
  m.def("fresh_pages_for_tests", [](uintptr_t address, size_t bytes) {
    return jaxfuse::FreshPagesForTests(address, bytes);
  }, nb::arg("address"), nb::arg("bytes"),
  "Tests only: whether the memory at address is not yet faulted in (the auto rule's probe).");
  m.def("should_stream", [](int64_t reuse_distance, size_t touched, int64_t cache_bytes) {
    return jaxfuse::ShouldStream(reuse_distance, touched, cache_bytes);
  }, nb::arg("reuse_distance"), nb::arg("touched"), nb::arg("cache_bytes"),
  "The auto rule: stream when the output was last written at least 1.5 caches of traffic ago (unknown: the call touches that much).");
#endif  // JAXFUSE_TEST_HOOKS
}

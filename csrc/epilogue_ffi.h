// jaxfuse_epilogue's FFI contract, one definition for its CPU and CUDA
// handlers: the attributes it is bound with, and how a call's operands and
// results are read and checked against them.
#ifndef JAXFUSE_EPILOGUE_FFI_H_
#define JAXFUSE_EPILOGUE_FFI_H_

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "broadcast.h"
#include "epilogue_scalar.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfuse {

// The attributes, in the order the handlers take them after the buffers
// (the lowering, jaxfuse/_lowering.py, names them).
template <typename Binding>
auto WithEpilogueAttrs(Binding binding) {
  return std::move(binding)
      .template Attr<bool>("mean")
      .template Attr<bool>("prescale")
      .template Attr<bool>("scale")
      .template Attr<bool>("residual")
      .template Attr<bool>("contract")
      .template Attr<bool>("narrow_each_op")
      .template Attr<bool>("tie");
}

struct EpilogueFlags {
  bool mean, prescale, scale, residual, tie;
};

// A call's buffers: the operands its flags name, in slot order, and its
// results (the output, then the tie output when asked for).
struct EpilogueCall {
  int n = 0;
  int slots[kMaxOperands];
  std::vector<xla::ffi::AnyBuffer> operands;
  std::vector<xla::ffi::AnyBuffer> results;
};

// Reads `args` and `rets` as the flags say. `extra`: operands a platform
// takes beyond those the flags name, and ignores (CPU: a pacing value).
inline xla::ffi::Error ReadEpilogueCall(const char* op,
                                        xla::ffi::RemainingArgs args,
                                        xla::ffi::RemainingRets rets,
                                        const EpilogueFlags& f, int extra,
                                        EpilogueCall* call) {
  namespace ffi = xla::ffi;
  call->n = EpilogueSlots(f.mean, f.prescale, f.scale, f.residual, call->slots);
  const size_t n = static_cast<size_t>(call->n);
  const size_t results = f.tie ? 2 : 1;
  if (args.size() < n || args.size() > n + static_cast<size_t>(extra) ||
      rets.size() != results) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": expected " + std::to_string(n) +
        " operands and " + std::to_string(results) +
        " results for these attributes, got " + std::to_string(args.size()) +
        " and " + std::to_string(rets.size()));
  }
  if ((f.mean || f.prescale) && !f.scale) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": a mean or a pre-scale needs a scale");
  }
  call->operands.clear();
  call->results.clear();
  for (size_t k = 0; k < n; ++k) {
    auto arg = args.get<ffi::AnyBuffer>(k);
    if (arg.has_error()) return arg.error();
    call->operands.push_back(arg.value());
  }
  for (size_t k = 0; k < results; ++k) {
    auto ret = rets.get<ffi::AnyBuffer>(k);
    if (ret.has_error()) return ret.error();
    call->results.push_back(*ret.value());
  }
  return ffi::Error::Success();
}

}  // namespace jaxfuse

#endif  // JAXFUSE_EPILOGUE_FFI_H_

"""jaxfuse: an operator-fusion pass for JAX.

`add` followed by ReLU, and the BatchNorm/residual epilogues around it, become
one custom call bound to our own kernel (C++ on CPU, CUDA on GPU), with the
same values and gradients as the unfused program.
"""

from ._version import __version__
from .ops.primitive import SERVED_DTYPES, add_relu, add_relu_p, epilogue_p, scale_shift_relu
from .ops.kernels import kernels, register_all as _register_all
from .ops import lowering as _lowering  # noqa: F401  (registers the lowerings)
from .fusion import (Match, Pattern, Report, RuleError, Site, Skipped, explain, optimize,
                     register_pattern, rule, target_platform)
from . import tuning  # policy="measure": jaxfuse.tuning.cache()

# FFI targets are registered now, before any backend exists, so a serialized
# program holding our custom calls runs in a process that only imported jaxfuse.
_register_all()

__all__ = ["__version__", "add_relu", "scale_shift_relu", "add_relu_p", "epilogue_p", "SERVED_DTYPES", "kernels",
           "optimize", "explain", "rule", "RuleError", "register_pattern", "Pattern", "Match",
           "Report", "Site", "Skipped", "target_platform", "tuning"]

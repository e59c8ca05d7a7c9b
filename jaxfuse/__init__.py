"""jaxfuse: an operator-fusion pass for JAX.

`add` followed by ReLU, and the BatchNorm/residual epilogues around it, become
one custom call bound to our own kernel (C++ on CPU, CUDA on GPU), with the
same values and gradients as the unfused program.
"""

from ._primitive import (SERVED_DTYPES, add_relu, add_relu_p, epilogue_p,  # noqa: F401
                         scale_shift_relu)
from ._kernels import kernels, register_all as _register_all
from . import _lowering  # noqa: F401  (registers the lowerings)
import sys as _sys

from ._version import __version__  # noqa: F401
from .rewrite import (Match, Pattern, Report, RuleError, Site, Skipped, explain, optimize,  # noqa: F401
                      register_pattern, rule, target_platform)  # (the fusion pass)
from .rewrite import tuning  # noqa: F401  (policy="measure": jaxfuse.tuning.cache())

# The tuner is a policy of the pass (jaxfuse/rewrite/tuning.py); users know it
# as `jaxfuse.tuning`, which `import jaxfuse.tuning` finds as this same module.
_sys.modules[__name__ + ".tuning"] = tuning

# FFI targets are registered now, before any backend exists, so a serialized
# program holding our custom calls runs in a process that only imported jaxfuse.
_register_all()

__all__ = ["add_relu", "scale_shift_relu", "add_relu_p", "epilogue_p", "SERVED_DTYPES", "kernels",
           "optimize", "explain", "rule", "RuleError", "register_pattern", "Pattern", "Match",
           "Report", "Site", "Skipped", "target_platform", "tuning"]

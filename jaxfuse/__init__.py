"""jaxfuse: an operator-fusion pass for JAX.

`add` followed by ReLU becomes one custom call bound to our own kernel (C++ on
CPU, CUDA on GPU), with the same values and gradients as the unfused program.
"""

from ._primitive import add_relu, add_relu_p, SERVED_DTYPES
from ._kernels import kernels
from . import _lowering  # noqa: F401  (registers the lowerings)
from .rewrite import Match, Pattern, Report, Site, Skipped, explain, optimize, register_pattern  # noqa: F401  (the fusion pass)

__version__ = "0.1.0"
__all__ = ["add_relu", "add_relu_p", "SERVED_DTYPES", "kernels"]

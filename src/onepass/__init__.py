"""onepass: fused single-pass Triton kernels for transformer models.

Every intermediate that is read once should never touch HBM.
"""

from onepass import ops

__version__ = "0.1.0"

__all__ = ["ops", "__version__"]

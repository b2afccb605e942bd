"""cute_fp4: NVFP4 quantize, dequantize and GEMM kernels in the CUTLASS Python DSL (CuTe DSL).

CUDA tensors run JIT-compiled CuTe DSL kernels (sm_90 runs; sm_100a is compiled only);
CPU tensors run the bit-exact torch references in `cute_fp4.ref`.
"""

# The kernel subpackage cute_fp4/gemm shares its name with the public function `gemm`. Python
# binds a subpackage onto its parent when it is first imported, so import it here, before the
# function is bound, and a later `import cute_fp4.gemm.dispatch` leaves `cute_fp4.gemm` alone.
from . import gemm as _gemm_kernels  # noqa: F401  (isort: skip)
from . import nn, ref
from .api import (dequantize, gemm, mxfp8_dequantize, quantize, quantize_dbias,
                  quantize_grouped)
from .nn import LinearRecipe, convert
from .recipe import Recipe
from .grouped import GroupedNVFP4Tensor
from .tensor import NVFP4Tensor

__version__ = "0.1.0"

__all__ = ["Recipe", "LinearRecipe", "NVFP4Tensor", "GroupedNVFP4Tensor", "quantize",
           "quantize_dbias", "quantize_grouped", "dequantize",
           "gemm", "mxfp8_dequantize", "convert", "nn", "ref", "__version__"]

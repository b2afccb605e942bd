"""Pure-torch references: the numerics contract (SPEC sections 1-3) every kernel is checked
against, and the implementation behind the public API on CPU tensors."""

from .dequantize import (dequantize, dequantize_matrix, e8m0_to_float, mxfp8_dequantize,
                         mxfp8_quantize)
from .formats import (E2M1_VALUES, decode_scale, e2m1_decode, e2m1_encode,
                      e2m1_encode_stochastic, encode_scale, pack_fp4, to_e4m3, unpack_fp4)
from .gemm import epilogue_factors, gemm, snr_db
from .philox import philox4x32, philox_bits
from .quantize import (RHT_SIGNS, amax, amax_per_token, amax_window64, block_outer_amax,
                       outer_amax, quantize, quantize_blocks, quantize_grouped, rht)
from .swizzle import swizzle_scales, swizzled_offset, swizzled_shape, unswizzle_scales

__all__ = [
    "dequantize", "dequantize_matrix", "e8m0_to_float", "mxfp8_dequantize", "mxfp8_quantize",
    "E2M1_VALUES", "decode_scale", "e2m1_decode", "e2m1_encode", "e2m1_encode_stochastic",
    "encode_scale", "pack_fp4", "to_e4m3", "unpack_fp4", "epilogue_factors", "gemm", "snr_db",
    "philox4x32", "philox_bits", "RHT_SIGNS", "amax", "amax_per_token", "amax_window64",
    "block_outer_amax", "outer_amax", "quantize", "quantize_blocks", "quantize_grouped", "rht",
    "swizzle_scales", "swizzled_offset", "swizzled_shape", "unswizzle_scales",
]

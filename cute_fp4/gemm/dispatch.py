"""Host entry points of the NVFP4 GEMMs: validation, layout preparation, kernel choice, launch."""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from ..common.jit import (KERNELS, compile_kernel, device_arch, dyn, env_stream, fake_tensor,
                          torch_to_cutlass)
from ..quant.dequantize import dequantize
from ..recipe import Recipe
from ..ref.formats import decode_scale
from ..quant.swizzle import swizzle_scales
from ..ref.swizzle import scale_shape
from ..tensor import NVFP4Tensor
from .factors import epilogue_operands, window_factors
from .operands import OuterAmax, _check_operand, _check_operands, _epilogue, _prepare_data
from .parts import epilogue_fakes, window_fake
from .sm90_mixed import (UNSCALE_W4A4, gemm_mixed_sm90, launch_mixed, launch_w4a16_mixed,
                         predecode_nvfp4)
from .sm90_w4a16 import _aligned, gemm_w4a16_sm90, launch_w4a16
from .sm90_window import gemm_window_sm90



def _w4a4_kernel(out_dtype, tile_n, stages, flags, bias_dtype, windows=(False, False),
                 decode=(None, None, None)):
    import cutlass

    from .sm90_w4a4 import Sm90GemmNVFP4

    has_alpha, has_row, has_col, has_bias = flags
    has_a_window, has_b_window = windows
    op = Sm90GemmNVFP4(torch_to_cutlass(out_dtype), tile_n=tile_n, stages=stages,
                       has_alpha=has_alpha, has_row=has_row, has_col=has_col,
                       has_bias=has_bias, has_a_window=has_a_window,
                       has_b_window=has_b_window, decode=decode)
    m, n, kh = dyn(), dyn(), dyn(16)
    args = (
        fake_tensor(cutlass.Uint8, (m, kh)),
        fake_tensor(cutlass.Uint8, (n, kh)),
        fake_tensor(cutlass.Uint8, (dyn(512),)),
        fake_tensor(cutlass.Uint8, (dyn(512),)),
        fake_tensor(torch_to_cutlass(out_dtype), (m, n), align=4 if out_dtype == torch.float32
                    else 2),
        *epilogue_fakes(flags, bias_dtype, m, n),
        window_fake(has_a_window),
        window_fake(has_b_window),
        env_stream(),
    )
    return op, args


def _window_factors(amax: Optional[torch.Tensor], rows: int, k: int, e4m3_max: int,
                    name: str, device) -> Optional[torch.Tensor]:
    """S_dec per 1x64 window (SPEC 1: 1 / S_enc(amax), the reference formula bit for bit) as a
    [rows padded to 4, K/64] FP32 view whose rows are contiguous (one TMA box per tile and
    k-tile; padding rows are 0): `factors.window_factors`, one launch."""
    if amax is None:
        return None
    _check_window_amax(amax, rows, k, name, device)
    return window_factors(amax.contiguous(), e4m3_max, device_arch(device))


def _check_window64(k: int, e4m3_max: int):
    """What every window64 GEMM needs of K and the recipe's e4m3_max."""
    if k % 64:
        raise ValueError(f"window64 operands need K % 64 == 0, got K={k}")
    if e4m3_max not in (448, 256):
        raise ValueError(f"e4m3_max must be 448 or 256, got {e4m3_max}")


def _check_window_amax(amax: torch.Tensor, rows: int, k: int, name: str, device):
    if amax.dtype != torch.float32 or tuple(amax.shape) != (rows, k // 64):
        raise ValueError(f"{name}_window_amax must be float32 [{rows}, {k // 64}], got "
                         f"{amax.dtype} {tuple(amax.shape)}")
    if amax.device != device:
        raise ValueError(f"{name}_window_amax must be on {device}, got {amax.device}")


def pick_w4a4_config(m: int, n: int, k: int, windowed: bool = False):
    """(tile_n, stages) for a problem; 128-wide N tiles when 256-wide ones leave SMs idle
    (always with window64 operands: two accumulator tiles)."""
    if windowed:
        return 128, 8
    tiles_256 = -(-m // 128) * -(-n // 256)
    if tiles_256 < 132 or n <= 128:
        return 128, 8
    return 256, 6


def gemm_nvfp4(a_data: torch.Tensor, a_scales: torch.Tensor, b_data: torch.Tensor,
               b_scales: torch.Tensor, *, alpha: Optional[torch.Tensor] = None,
               row: Optional[torch.Tensor] = None, col: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
               scales_swizzled: bool = False, out: Optional[torch.Tensor] = None,
               a_window_amax: Optional[torch.Tensor] = None,
               b_window_amax: Optional[torch.Tensor] = None, e4m3_max: int = 448,
               tile_n: Optional[int] = None, stages: Optional[int] = None,
               path: str = "auto") -> torch.Tensor:
    """D[M, N] = cast(alpha * row[m] * col[n] * sum_k a[m, k] * b[n, k] + bias[n]) for NVFP4
    operands: packed E2M1 uint8 [rows, K/2] (even element in the low nibble) with E4M3 block
    scales, compact [rows, K/16] or swizzled (SPEC 1). FP32 accumulation and epilogue. alpha
    [1], row [M] and col [N] are FP32 factors or `operands.OuterAmax` (an operand's outer
    amaxes, decoded to 1 / S_enc in the kernel's epilogue).

    1x64 local-encode (Recipe(scaling="window64")) operands: pass their FP32 window amax
    [rows, K/64] as a_window_amax / b_window_amax (either or both; K % 64 == 0) and the
    recipe's e4m3_max; a[m, k] then carries the factor S_dec(amax[m, k // 64]) =
    1 / S_enc (SPEC 1), applied in FP32 per 64-wide k-tile, so D matches ref.gemm with
    factors = scale * S_dec_window up to FP32 summation order. Their scales stay the E4M3
    block scales (not FP32 factors).
    `out` (optional, contiguous [M, N] of out_dtype) receives the result; tile_n / stages
    override the kernel configuration (benchmarks).

    sm_90a kernels (`path`): "weight_stream" (the "auto" choice without window64 operands at
    decode sizes: `stream_weights(min(M, N))`) decodes the smaller operand (A
    on ties) exactly to BF16 values e2m1 * scale (`decode_values`) and runs the weight-streaming W4A16
    kernel (`sm90_w4a16.gemm_w4a16_sm90`) with the other operand as its weights (when B is the
    smaller, A's rows are the weight rows and the kernel writes D row by row from them:
    `transposed`); "predecode" (the "auto" choice for larger operands) decodes the smaller
    operand (B on ties) once to BF16 (`sm90_mixed.predecode_nvfp4`, a temporary of min(M, N) x
    K BF16 per call) and runs `sm90_mixed.Sm90GemmMixed` with the other operand decoded in
    registers (D^T = B A^T when A is the smaller). With window64 operands, whose FP32 window
    factors are not exact in a BF16 operand: "weight_stream" where only the larger operand
    (the weights) is window64 (the streaming kernel applies its factors per window; the
    "auto" choice at decode sizes there); "predecode" with one window64 operand (the "auto"
    choice otherwise) keeps that one in registers whatever its size and decodes the other
    (`predecode_swap`), the mixed kernel applying the factors per k-tile in FP32 (x_window);
    "window" (the "auto" choice with two) decodes both operands once to BF16 block values and
    runs `sm90_window.Sm90GemmWindow`, which applies the factors per k-tile in FP32;
    "decode_both" runs `sm90_w4a4.Sm90GemmNVFP4`, which decodes
    both operands per k-tile (slower: kept as an explicit path). sm_100a devices run
    `sm100_blockscaled.gemm_nvfp4_sm100` (no window64 operands there yet)."""
    # compact scales stay compact for the weight_stream path (its kernels read either layout);
    # the TMA kernels get them swizzled (`_swizzled`)
    sfa, sfb, m, n, k, device = _check_operands(a_data, a_scales, b_data, b_scales,
                                                scales_swizzled, out_dtype, "gemm_nvfp4",
                                                to_swizzled=False)
    swz = bool(scales_swizzled)
    windowed = a_window_amax is not None or b_window_amax is not None
    if windowed:
        _check_window64(k, e4m3_max)
    if out is not None and (out.dtype != out_dtype or tuple(out.shape) != (m, n)
                            or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous [{m}, {n}] {out_dtype} tensor")
    if k == 0 and m and n:
        raise ValueError("K must be positive")
    arch = device_arch(device)
    if arch == "sm_100a":  # gemm_nvfp4_sm100 checks the epilogue vectors itself
        return _gemm_sm100(a_data, _swizzled(sfa, m, k, swz), b_data, _swizzled(sfb, n, k, swz),
                           alpha, row, col, bias, out_dtype, out, windowed, tile_n, stages)
    alpha, row, col, bias, decode = _epilogue(alpha, row, col, bias, m, n, out_dtype, device)
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=device)
    if m == 0 or n == 0:
        return out
    if arch != "sm_90a":
        raise NotImplementedError(f"gemm_nvfp4 runs on sm_90a and sm_100a (device is {arch})")
    path = pick_sm90_path(path, m, n, (a_window_amax is not None, b_window_amax is not None))
    if path == "weight_stream":
        if tile_n is not None or stages is not None:
            raise ValueError("tile_n and stages configure the wgmma kernels, not the "
                             "weight_stream path")
        w_amax, w_name, w_rows = ((a_window_amax, "a", m) if n < m
                                  else (b_window_amax, "b", n))
        if w_amax is not None:
            _check_window_amax(w_amax, w_rows, k, w_name, device)
            w_amax = w_amax.contiguous()
        return _gemm_weight_stream(a_data, sfa, b_data, sfb, alpha, row, col, bias, out, arch,
                                   decode, swz, w_amax, e4m3_max)
    sfa, sfb = _swizzled(sfa, m, k, swz), _swizzled(sfb, n, k, swz)
    if path == "predecode":
        return _gemm_predecode(a_data, sfa, b_data, sfb, alpha, row, col, bias, out, arch,
                               tile_n, stages, decode, (a_window_amax, b_window_amax), e4m3_max)
    a_win = _window_factors(a_window_amax, m, k, e4m3_max, "a", device)
    b_win = _window_factors(b_window_amax, n, k, e4m3_max, "b", device)
    if path == "window":
        if tile_n is not None or stages is not None:
            raise ValueError("tile_n and stages configure the predecode and decode_both "
                             "kernels, not the window path")
        return gemm_window_sm90(a_data, sfa, b_data, sfb, a_win, b_win, alpha, row, col, bias,
                                out, decode, arch)
    auto_tile_n, auto_stages = pick_w4a4_config(m, n, k, windowed)
    tile_n = tile_n or auto_tile_n
    stages = stages or auto_stages
    flags = (alpha is not None, row is not None, col is not None, bias is not None)
    windows = (a_win is not None, b_win is not None)
    bias_dtype = bias.dtype if bias is not None else None
    key = ("gemm_w4a4_sm90", out_dtype, tile_n, stages, flags, bias_dtype, windows, decode)

    def build():
        op, args = _w4a4_kernel(out_dtype, tile_n, stages, flags, bias_dtype, windows, decode)
        return compile_kernel(op, *args, arch=arch)

    fn = KERNELS.get(key, build)
    fn(_prepare_data(a_data), _prepare_data(b_data), sfa, sfb, out, alpha, row, col, bias,
       a_win, b_win)
    return out


SM90_PATHS = ("auto", "weight_stream", "predecode", "decode_both", "window")


def stream_weights(rows: int) -> bool:
    """Whether `rows` tokens (the smaller of M, N) x any number of weight rows run faster on the
    weight-streaming kernel (`sm90_w4a16`) than on the mixed wgmma kernel with its decode-size
    configurations: up to 16 tokens. H100, graph replays, K = 8192 (notes/gemm_w4a16.md,
    sessions 7 and 19): 16 tokens stream in 15.0-16.8 us on 1024-4096 weight rows against
    17.3-18.4 on the mixed kernel, 21.3 / 38.8 us on 8192 / 16384 rows against 25.4 / 41.0;
    from 17 tokens on the mixed kernel wins or ties (17 x 1024: 17.8 against 17.1; 32 x 4096:
    19.1 against 20.0; 64 x 4096: 20.2 against 28.3; 32 x 8192: 26.8 against 37.2; 64 x
    16384: 51.8 against 103); measured from 1024 to 28672 weight rows. The same with window64
    weights (streaming kernel with per-window partial tiles against the mixed one with
    x_window), H200 graphs, K = 8192 (perf/results/gemm_w4a16_window64_h200.md): 16 tokens
    22.9 / 78.1 us at 8192 / 28672 rows against 30.9 / 86.2, 17 tokens 37.3 / 120 against
    32.6 / 92.5, 32 tokens 37.3 / 121 against 32.9 / 93.3."""
    return rows <= 16


def pick_sm90_path(path: str, m: int, n: int, windows=(False, False)) -> str:
    """The sm_90a kernel path of gemm_nvfp4 (see its docstring) for `path` ("auto" or one of
    the named paths, checked against the operands); windows: whether A / B are window64
    operands."""
    if path not in SM90_PATHS:
        raise ValueError(f"path must be one of {SM90_PATHS}, got {path!r}")
    windowed = any(windows)
    # weight_stream decodes the smaller operand (A on ties) to BF16 values: not a window64
    # one (its factors are not exact in BF16); the streaming kernel takes the other's
    small_windowed = windows[1] if n < m else windows[0]
    if all(windows) and path == "predecode":
        raise NotImplementedError("path 'predecode' decodes one operand to BF16: it takes at "
                                  "most one window64 operand (two take 'window' or "
                                  "'decode_both')")
    if path == "weight_stream" and small_windowed:
        raise NotImplementedError("path 'weight_stream' decodes the smaller operand to BF16: "
                                  "it cannot be window64")
    if path == "window" and not windowed:
        raise ValueError("path 'window' is for window64 operands (a_window_amax / "
                         "b_window_amax)")
    if path != "auto":
        return path
    if stream_weights(min(m, n)) and not small_windowed:
        return "weight_stream"
    return "window" if all(windows) else "predecode"


def predecode_swap(m: int, n: int, windows=(False, False)) -> bool:
    """Whether the predecode path keeps B in the mixed kernel's registers (x, D^T = B A^T) and
    decodes A to BF16: where one operand is window64, that one stays in registers (its factors
    apply per k-tile in FP32, not exactly in a BF16 value), else the larger (A on ties)."""
    return windows[1] if any(windows) else m < n


def decode_values(data: torch.Tensor, scales: torch.Tensor, swizzled: bool,
                  dtype: torch.dtype) -> torch.Tensor:
    """Packed E2M1 [rows, K/2] with E4M3 block scales (compact [rows, K/16], or swizzled in any
    shape of the padded size) -> their values e2m1 * scale as `dtype` [rows, K], exactly (at
    most 6 significant bits, 2**-10 <= |v| <= 2688: exact in BF16, FP16 and FP32). The
    dequantize kernel with a unit outer scale (amax 2688: S_enc = 1)."""

    rows, k = data.shape[0], data.shape[1] * 2
    shape = scale_shape(rows, k // 16, swizzled)
    sf = scales.view(torch.float8_e4m3fn).reshape(shape)
    return dequantize(NVFP4Tensor(_aligned(data), sf, _unit_amax(data.device), None, None,
                                  None, Recipe(swizzle=swizzled), (rows, k), dtype), dtype)


_UNIT_AMAX = {}


def _unit_amax(device) -> torch.Tensor:
    """FP32 [1] amax with S_enc = 1 on `device`: made once per device, and synchronized so that
    every stream sees it; made per call while a CUDA graph is being captured (its memory then
    belongs to the graph)."""
    unit = _UNIT_AMAX.get(device)
    if unit is None:
        unit = torch.full((1,), _UNIT_SCALE_AMAX, dtype=torch.float32, device=device)
        if not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(device).synchronize()
            _UNIT_AMAX[device] = unit
    return unit


def _swizzled(sf_flat: torch.Tensor, rows: int, k: int, swizzled: bool) -> torch.Tensor:
    """Flat scales in the swizzled layout the TMA kernels read (compact ones copied into it by
    the swizzle kernel, one launch)."""
    if swizzled:
        return sf_flat
    return swizzle_scales(sf_flat.view(rows, k // 16)).reshape(-1)


def _gemm_weight_stream(a_data, sfa, b_data, sfb, alpha, row, col, bias, out, arch, decode,
                        swizzled, w_window_amax=None, e4m3_max=448):
    """The weight_stream path of gemm_nvfp4 on sm_90a: the smaller operand (A on ties) decoded
    exactly to BF16 as the W4A16 kernel's activations, the other one its weights (flat scales,
    compact or swizzled: both kernels read either; window64 weights with their checked window
    amaxes `w_window_amax`); when B is the smaller the weights are A's rows, so the kernel
    writes D from its transposed tile (`transposed`)."""

    swap = b_data.shape[0] < a_data.shape[0]
    x_data, sfx, w_data, sfw = (b_data, sfb, a_data, sfa) if swap else (a_data, sfa, b_data, sfb)
    x = decode_values(x_data, sfx, swizzled, torch.bfloat16)
    return launch_w4a16(x, w_data, sfw, out, alpha, row, col, bias, swizzled=swizzled,
                        transposed=swap, arch=arch, decode=decode, window_amax=w_window_amax,
                        e4m3_max=e4m3_max)


def predecode_operands(a_data, sfa, b_data, sfb, arch, swap):
    """The predecode path's kernel operands (x_data, sfx, y) from packed operands and their
    flat swizzled scales: one operand decoded once to BF16 (`y`: A where `swap`, see
    `predecode_swap`), the other one (`x_data`, decoded in the kernel's registers) realigned
    for TMA."""
    x_data, sfx, y_data, sfy = (b_data, sfb, a_data, sfa) if swap else (a_data, sfa, b_data, sfb)
    return _prepare_data(x_data), sfx, predecode_nvfp4(y_data, sfy, arch)


def _gemm_predecode(a_data, sfa, b_data, sfb, alpha, row, col, bias, out, arch, tile_n,
                    stages, decode, window_amaxes=(None, None), e4m3_max=448):
    """The predecode path of gemm_nvfp4 on sm_90a (see `predecode_operands`); window_amaxes:
    A's and B's (at most one), the register operand's factors then applied per k-tile
    (Sm90GemmMixed's x_window)."""
    m, n, k = a_data.shape[0], b_data.shape[0], b_data.shape[1] * 2
    swap = predecode_swap(m, n, tuple(w is not None for w in window_amaxes))
    x_data, sfx, y = predecode_operands(a_data, sfa, b_data, sfb, arch, swap)
    x_win = _window_factors(window_amaxes[swap], n if swap else m, k, e4m3_max,
                            "b" if swap else "a", out.device)
    return launch_mixed(x_data, sfx, y, out, alpha, row, col, bias, transposed=swap,
                        unscale_exp=UNSCALE_W4A4, arch=arch, tile_n=tile_n, stages=stages,
                        decode=decode, x_window=x_win)


def _gemm_sm100(a_data, sfa, b_data, sfb, alpha, row, col, bias, out_dtype, out, windowed,
                tile_n, stages):
    """The sm_100a route of gemm_nvfp4: tcgen05 block-scaled kernel (compiled only, never run
    on this project's machines), swizzled scales; a given `out` receives a copy of its
    result."""
    from .sm100_blockscaled import gemm_nvfp4_sm100

    if windowed:
        raise NotImplementedError("window64 operands are not supported by the sm_100a GEMM")
    if stages is not None:
        raise ValueError("stages is a sm_90a kernel option (the sm_100a kernel sizes its "
                         "pipeline itself)")
    d = gemm_nvfp4_sm100(a_data, sfa, b_data, sfb, alpha=alpha, row=row, col=col, bias=bias,
                         out_dtype=out_dtype, tile_n=tile_n)
    if out is None:
        return d
    out.copy_(d)
    return out


# FP16 activations with more rows than this leave the weight-streaming kernel, which reads
# the weights once per 64 tokens (0.26x cuBLAS at M = 512, notes/gemm_w4a16.md), for
# dequantize-then-cuBLAS (the mixed wgmma kernel takes BF16 activations only).
W4A16_MAX_DECODE_ROWS = 64
# gemm_w4a16's paths (its `path` argument)
W4A16_PATHS = ("auto", "stream", "mixed")
# S_enc = 448 * 6 / 2688 = 1: the dequantize kernel then returns e2m1 * scale exactly.
_UNIT_SCALE_AMAX = 2688.0


def gemm_w4a16(a: torch.Tensor, b_data: torch.Tensor, b_scales: torch.Tensor, *,
               alpha: Optional[torch.Tensor] = None, col: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
               scales_swizzled: bool = False, b_window_amax: Optional[torch.Tensor] = None,
               e4m3_max: int = 448, path: str = "auto") -> torch.Tensor:
    """BF16/FP16 activations [M, K] x NVFP4 weights [N, K/2] (E4M3 block scales, compact or
    swizzled): D = cast(alpha * col[n] * sum_k a[m, k] * b[n, k] + bias[n]); alpha and col
    are FP32 factors or `operands.OuterAmax` (the weights' outer amaxes, decoded in the
    kernel). 1x64 local-encode (window64) weights: their FP32 window amax [N, K/64] as
    b_window_amax with the recipe's e4m3_max (K % 64 == 0); b[n, k] then carries the factor
    S_dec(amax[n, k // 64]), applied in FP32 per window (sm_90a only: NotImplementedError
    elsewhere): where `stream_weights(M)` (up to 16 tokens) by the streaming kernel
    (`sm90_w4a16`, window), else by the mixed kernel (`sm90_mixed`, x_window).
    path (sm_90a; W4A16_PATHS): "auto", or "stream" / "mixed" (those kernels at any M).

    On sm_90a, BF16 and FP16 activations run the weight-streaming W4A16 kernel (`sm90_w4a16`)
    where `stream_weights(M)` says it is faster (up to 16 tokens) and the mixed wgmma kernel
    (`sm90_mixed.gemm_mixed_sm90`: weights decoded in registers to the activations' dtype,
    activations by TMA, narrow tiles and clusters at decode sizes) otherwise. Both accumulate exact products in FP32. On sm_100a the weights are dequantized
    once (exact e2m1 * scale, in the activation dtype) and cuBLAS runs, then the epilogue in
    FP32: the same sum up to its rounding (the dense GEMM rounds its result to the activation
    dtype before the epilogue when out_dtype is 16-bit; fp32 outputs use an FP32 GEMM)."""
    if path not in W4A16_PATHS:
        raise ValueError(f"path must be one of {W4A16_PATHS}, got {path!r}")
    if b_window_amax is not None:
        return _gemm_w4a16_window(a, b_data, b_scales, b_window_amax, e4m3_max, alpha, col,
                                  bias, out_dtype, scales_swizzled, path)
    sm90 = a.dim() == 2 and a.is_cuda and device_arch(a.device) == "sm_90a"
    if path != "auto" and not sm90:
        raise NotImplementedError(f"path {path!r} runs on sm_90a CUDA devices only")
    if sm90:
        if path == "mixed" or (path == "auto" and not stream_weights(a.shape[0])):
            return gemm_mixed_sm90(b_data, b_scales, a, alpha=alpha, col=col, bias=bias,
                                   out_dtype=out_dtype, scales_swizzled=scales_swizzled)
        return gemm_w4a16_sm90(a, b_data, b_scales, alpha=alpha, col=col, bias=bias,
                               out_dtype=out_dtype, scales_swizzled=scales_swizzled)
    n, k = b_data.shape[0], b_data.shape[1] * 2
    if a.dim() != 2 or a.shape[1] != k:
        raise ValueError(f"a must be [M, {k}], got {tuple(a.shape)}")
    gemm_dtype = a.dtype if out_dtype == a.dtype else torch.float32
    weights = decode_values(b_data, b_scales, scales_swizzled, gemm_dtype)
    with torch.autocast(a.device.type, enabled=False):  # the caller's autocast: not here
        acc = (a.to(gemm_dtype) @ weights.t()).to(torch.float32)
    alpha, col = (decode_scale(v.amax, v.e4m3_max) if isinstance(v, OuterAmax) else v
                  for v in (alpha, col))
    if alpha is not None:
        acc = acc * alpha.to(torch.float32).reshape(())
    if col is not None:
        acc = acc * col.to(torch.float32).view(1, n)
    if bias is not None:
        acc = acc + bias.to(torch.float32).view(1, n)
    return acc.to(out_dtype)


def _gemm_w4a16_window(a, b_data, b_scales, b_window_amax, e4m3_max, alpha, col, bias,
                       out_dtype, swizzled, path):
    """gemm_w4a16 with window64 weights: checks, then `_launch_w4a16_window`."""
    if not a.is_cuda or device_arch(a.device) != "sm_90a":
        raise NotImplementedError("W4A16 with window64 weights runs on sm_90a CUDA devices only")
    if a.dtype not in (torch.bfloat16, torch.float16) or a.dim() != 2:
        raise TypeError(f"a must be a 2D bfloat16 or float16 tensor, got {a.dtype} "
                        f"{tuple(a.shape)}")
    sfb = _check_operand(b_data, b_scales, "b", swizzled, to_swizzled=False)
    m, n, k = a.shape[0], b_data.shape[0], b_data.shape[1] * 2
    if a.shape[1] != k:
        raise ValueError(f"a must be [M, {k}], got {tuple(a.shape)}")
    if b_data.device != a.device:
        raise ValueError("gemm_w4a16 needs a and b_data on one CUDA device")
    _check_window64(k, e4m3_max)
    _check_window_amax(b_window_amax, n, k, "b", a.device)
    alpha, _, col, bias, decode = _epilogue(alpha, None, col, bias, m, n, out_dtype, a.device)
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    return _launch_w4a16_window(a.contiguous(), b_data, sfb, swizzled,
                                b_window_amax.contiguous(), e4m3_max, alpha, col, bias, out,
                                decode, device_arch(a.device), path)


def _launch_w4a16_window(a, b_data, sfb, swizzled, window_amax, e4m3_max, alpha, col, bias,
                         out, decode, arch, path="auto"):
    """W4A16 with window64 weights, checked operands (flat scales `sfb`, contiguous window
    amaxes [N, K/64]) on `path` (gemm_w4a16's): "auto" is the streaming kernel where
    `stream_weights(M)` (it decodes the window factors), else the mixed kernel with x_window
    (factors by `window_factors`)."""
    m, n, k = a.shape[0], b_data.shape[0], b_data.shape[1] * 2
    if path == "auto":
        path = "stream" if stream_weights(m) else "mixed"
    if path == "stream":
        return launch_w4a16(a, b_data, sfb, out, alpha, None, col, bias, swizzled=swizzled,
                            transposed=False, arch=arch, decode=decode, window_amax=window_amax,
                            e4m3_max=e4m3_max)
    return launch_w4a16_mixed(_prepare_data(b_data), _swizzled(sfb, n, k, swizzled), a, out,
                              alpha, None, col, bias, arch=arch, decode=decode,
                              x_window=window_factors(window_amax, e4m3_max, arch))


class PreparedWeights:
    """NVFP4 weights [N, K/2] checked once for repeated W4A16 GEMM calls with other
    activations (`cute_fp4.gemm` keeps one per weight NVFP4Tensor, `prepared_weights`; NVFP4
    activations take the per-configuration plans of `gemm.plan`): what `gemm_w4a16_sm90` /
    `gemm_mixed_sm90` check and derive per call about the weights (dtypes, shapes, the flat
    scales, their epilogue OuterAmax vectors, the device's arch and SM count) is done here,
    so a call checks only its activation (W4A16: ~20 us less host time per call on the H100).
    Nothing is copied: the kernels read the weights', scales' and amax's current values on
    every call. Built only on sm_90a, for contiguous data, contiguous scales and tensor /
    token / window64 outer amaxes (`prepared_weights` returns None otherwise)."""

    def __init__(self, data: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor,
                 scaling: str, e4m3_max: int, swizzled: bool):
        self.sf = _check_operand(data, scales, "b", swizzled, to_swizzled=False)
        self.data, self.scales, self.swizzled = data, scales, bool(swizzled)
        self.amax, self.scaling, self.e4m3_max = amax, scaling, e4m3_max
        self.n, self.k = data.shape[0], data.shape[1] * 2
        self.device = data.device
        self.arch = device_arch(self.device)
        self.window = scaling == "window64"
        if self.window:
            _check_window64(self.k, e4m3_max)
            _check_window_amax(amax, self.n, self.k, "b", self.device)
        self.alpha, _, self.col = epilogue_operands("dense", None, 448, scaling, amax, e4m3_max,
                                                    self.arch)
        vectors = _epilogue(self.alpha, None, self.col, None, 1, self.n, torch.float32,
                            self.device)
        self.alpha_t, self.col_t, self.decode = vectors[0], vectors[2], vectors[4]
        # the mixed kernel reads the weights and swizzled scales by TMA: only when they are
        # usable as they are (else those calls take gemm_mixed_sm90, which prepares copies)
        self.tma_ready = self.swizzled and _prepare_data(data) is data

    def w4a16(self, a: torch.Tensor, out_dtype: torch.dtype,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """D [M, N] for a CUDA activation a [M, K] (bf16 / fp16, contiguous, on the weights'
        device) and an optional bias [N] (out_dtype or float32, contiguous, on that device):
        the caller checks them."""
        m = a.shape[0]
        out = torch.empty((m, self.n), dtype=out_dtype, device=self.device)
        if m == 0 or self.n == 0:
            return out
        if self.window:
            return _launch_w4a16_window(a, self.data, self.sf, self.swizzled, self.amax,
                                        self.e4m3_max, None, None, bias, out, self.decode,
                                        self.arch)
        if stream_weights(m):
            return launch_w4a16(a, self.data, self.sf, out, self.alpha_t, None, self.col_t,
                                bias, swizzled=self.swizzled, transposed=False, arch=self.arch,
                                decode=self.decode)
        if not self.tma_ready:
            return gemm_mixed_sm90(self.data, self.scales, a, alpha=self.alpha, col=self.col,
                                   bias=bias, out_dtype=out_dtype, scales_swizzled=self.swizzled,
                                   out=out)
        return launch_w4a16_mixed(self.data, self.sf, a, out, self.alpha_t, None, self.col_t,
                                  bias, arch=self.arch, decode=self.decode)


# id(NVFP4Tensor) -> (weak reference to it, its fields when prepared, PreparedWeights)
_PREPARED_WEIGHTS = {}


def prepared_weights(t: NVFP4Tensor) -> Optional[PreparedWeights]:
    """The PreparedWeights of a weight NVFP4Tensor's rowwise data, made on first use and kept
    while the tensor lives and its data / scales / amax / recipe stay the same objects at the
    same addresses; None where the fast path does not apply (not an sm_90a CUDA tensor,
    unsupported scales, non-contiguous fields). Fields the kernels cannot take (scales or
    window64 amaxes of the wrong shape, K % 64 != 0 with window64) raise the general path's
    ValueError. The entry holds the fields it was made from: a field replaced on a live
    tensor is released at its next GEMM call (or when the tensor goes)."""
    key = id(t)
    entry = _PREPARED_WEIGHTS.get(key)
    fields = (t.data, t.scales, t.amax, t.recipe)
    if entry is not None and entry[0]() is t:
        old = entry[1]
        if (all(x is y for x, y in zip(fields, old[:4]))
                and t.data.data_ptr() == old[4] and t.scales.data_ptr() == old[5]):
            return entry[2]
    weights = None
    data, scales, amax, recipe = fields
    if (data is not None and data.is_cuda and recipe.scaling in ("tensor", "token", "window64")
            and device_arch(data.device) == "sm_90a" and data.dtype == torch.uint8
            and data.dim() == 2 and data.is_contiguous() and scales.is_contiguous()
            and amax.dtype == torch.float32 and amax.is_contiguous()):
        weights = PreparedWeights(data, scales, amax, recipe.scaling, recipe.e4m3_max,
                                  recipe.swizzle)
    ptrs = (data.data_ptr() if data is not None else 0,
            scales.data_ptr() if scales is not None else 0)
    _PREPARED_WEIGHTS[key] = (weakref.ref(t, lambda _, k=key: _PREPARED_WEIGHTS.pop(k, None)),
                              fields + ptrs, weights)
    return weights

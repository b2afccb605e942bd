"""Compiling and caching CuTe DSL kernels.

Kernels are compiled once per configuration against fake (symbolic-shape) tensors with TVM-FFI
enabled, so a call passes torch tensors straight to the compiled function (no per-call
`from_dlpack`) and the launch goes to torch's current stream. Compiled functions are kept in
memory by configuration key, for the life of the process. There is no disk cache: the DSL
skips its file cache for `cute.compile` (a compile-only call, base_dsl/dsl.py), so a new
process compiles again; `python -m cute_fp4.perf compile` measures it (0.16-0.9 s per kernel
on a 2-CPU host, the first and a second process alike).
"""

from __future__ import annotations

import functools
import tempfile
import threading
import time
from typing import Callable, Dict, Hashable, Optional

import torch

SUPPORTED_ARCHS = ("sm_90a", "sm_100a")


def torch_to_cutlass(dtype: torch.dtype):
    """The cutlass numeric type for a torch dtype."""
    import cutlass

    table = {
        torch.float32: cutlass.Float32,
        torch.bfloat16: cutlass.BFloat16,
        torch.float16: cutlass.Float16,
        torch.uint8: cutlass.Uint8,
        torch.int32: cutlass.Int32,
        torch.float8_e4m3fn: cutlass.Float8E4M3FN,
        torch.float8_e5m2: cutlass.Float8E5M2,
    }
    if dtype not in table:
        raise TypeError(f"no CuTe DSL type for torch dtype {dtype}")
    return table[dtype]


def device_arch(device: Optional[torch.device] = None) -> str:
    """The compile target for a CUDA device: sm_90a on Hopper, sm_100a on Blackwell."""
    index = device.index if isinstance(device, torch.device) else device
    return _arch_of(torch.cuda.current_device() if index is None else index)


@functools.lru_cache(maxsize=None)
def _arch_of(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    if major == 9:
        return "sm_90a"
    if major == 10:
        return "sm_100a"
    raise RuntimeError(f"cute_fp4 kernels need an sm_90 or sm_100 GPU, found sm_{major}{minor}")


def num_sms(device: Optional[torch.device] = None) -> int:
    """The SM count of a CUDA device (cached): the size of persistent grids."""
    index = device.index if isinstance(device, torch.device) else device
    return _sms_of(torch.cuda.current_device() if index is None else index)


@functools.lru_cache(maxsize=None)
def _sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def dyn(divisibility: int = 1):
    """A dynamic extent for `fake_tensor`, known to be a multiple of `divisibility`."""
    import cutlass.cute as cute

    return cute.sym_int(divisibility=divisibility)


def fake_tensor(dtype, shape, *, stride_order=None, align: int = 16):
    """A compact gmem tensor for compilation, row-major unless `stride_order` says otherwise
    (0 marks the stride-1 mode). `shape` entries are ints (static), None (dynamic) or `dyn(d)`
    (dynamic, a multiple of d)."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    dims = tuple(dyn() if d is None else d for d in shape)
    if stride_order is None:
        stride_order = tuple(reversed(range(len(dims))))
    return make_fake_compact_tensor(dtype, dims, stride_order=stride_order, assumed_align=align)


def env_stream():
    """Placeholder stream argument: the compiled function launches on torch's current stream."""
    from cutlass.cute.runtime import make_fake_stream

    return make_fake_stream(use_tvm_ffi_env_stream=True)


def compile_kernel(fn: Callable, *args, arch: str, keep_ptx: bool = False):
    """cute.compile for `arch` with TVM-FFI calling. With keep_ptx the PTX is kept on the
    result (`.__ptx__`); the files the DSL dumps with it go to a temporary folder."""
    import cutlass.cute as cute

    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch must be one of {SUPPORTED_ARCHS}, got {arch!r}")
    opts = f"--enable-tvm-ffi --gpu-arch {arch}"
    if not keep_ptx:
        return cute.compile(fn, *args, options=opts)
    with tempfile.TemporaryDirectory(prefix="cute_fp4_ptx_") as dump:
        return cute.compile(fn, *args, options=f"{opts} --keep-ptx --dump-dir {dump}")


def ffi_function(compiled):
    """The tvm_ffi.Function under a compiled kernel: called positionally, without the DSL's
    Python wrapper (~0.5-1.5 us less host time per call on the H100's host)."""
    fn = compiled.__tvm_ffi_object__()
    if fn is None:
        raise RuntimeError("cute_fp4: the compiled kernel has no TVM-FFI function (was it "
                           "compiled for another architecture?)")
    return fn


class KernelCache:
    """Compiled kernels by configuration key, with the compile time of each recorded."""

    def __init__(self):
        self._fns: Dict[Hashable, Callable] = {}
        self._ffis: Dict[Hashable, Callable] = {}
        self.compile_seconds: Dict[Hashable, float] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, build: Callable[[], Callable]) -> Callable:
        fn = self._fns.get(key)
        if fn is None:
            with self._lock:
                fn = self._fns.get(key)
                if fn is None:
                    start = time.perf_counter()
                    fn = build()
                    self.compile_seconds[key] = time.perf_counter() - start
                    self._fns[key] = fn
        return fn

    def ffi(self, key: Hashable, build: Callable[[], Callable]) -> Callable:
        """`get`'s kernel as its TVM-FFI function (`ffi_function`), kept beside it."""
        fn = self._ffis.get(key)
        if fn is None:
            fn = self._ffis[key] = ffi_function(self.get(key, build))
        return fn

    def clear(self):
        self._fns.clear()
        self._ffis.clear()
        self.compile_seconds.clear()


KERNELS = KernelCache()

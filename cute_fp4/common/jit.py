"""Compiling and caching CuTe DSL kernels.

Kernels are compiled once per configuration against fake (symbolic-shape) tensors with TVM-FFI
enabled, so a call passes torch tensors straight to the compiled function (no per-call
`from_dlpack`) and the launch goes to torch's current stream. Compiled functions are kept in
memory by configuration key, for the life of the process. The DSL skips its own file cache
for `cute.compile` (a compile-only call, base_dsl/dsl.py), so a new process compiles again
(0.2-1.1 s per kernel on a 2-CPU host, `python -m cute_fp4.perf compile`). So cute_fp4 keeps
its own disk cache: each kernel compiled is also exported as an object file (the DSL's
`export_to_c`) named by a hash of its configuration key and the arch, in a directory named by
a hash of cute_fp4's sources + the DSL version; a later process loads it
(`cute.runtime.load_module`: the same JITLink loading the DSL does for every compile, ~22 ms)
instead of compiling. The cache lives in $CUTE_FP4_KERNEL_CACHE, by default
$XDG_CACHE_HOME/cute_fp4/kernels (~/.cache/cute_fp4/kernels); CUTE_FP4_KERNEL_CACHE=0 turns it
off. Directories of other code versions unused for 30 days are removed.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
import threading
import time
import warnings
from pathlib import Path
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
    _COMPILED_ARCH.arch = arch
    if not keep_ptx:
        return cute.compile(fn, *args, options=opts)
    with tempfile.TemporaryDirectory(prefix="cute_fp4_ptx_") as dump:
        return cute.compile(fn, *args, options=f"{opts} --keep-ptx --dump-dir {dump}")


def ffi_function(compiled):
    """The tvm_ffi.Function under a compiled kernel: called positionally, without the DSL's
    Python wrapper (~0.5-1.5 us less host time per call on the H100's host). A kernel loaded
    from the disk cache already is one."""
    unwrap = getattr(compiled, "__tvm_ffi_object__", None)
    if unwrap is None:
        return compiled
    fn = unwrap()
    if fn is None:
        raise RuntimeError("cute_fp4: the compiled kernel has no TVM-FFI function (was it "
                           "compiled for another architecture?)")
    return fn


# The arch of this thread's last compile_kernel (the disk cache names files by it).
_COMPILED_ARCH = threading.local()
KERNEL_CACHE_ENV = "CUTE_FP4_KERNEL_CACHE"
_EXPORTED_NAME = "cute_fp4_kernel"


@functools.lru_cache(maxsize=1)
def _code_version() -> str:
    """A hash of cute_fp4's Python sources and the DSL / TVM-FFI versions: a cached kernel is
    only reused by the exact code that compiled it."""
    import cutlass
    import tvm_ffi

    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    for module in (cutlass, tvm_ffi):
        digest.update(str(getattr(module, "__version__", "")).encode())
    return digest.hexdigest()


def kernel_cache_root() -> Optional[Path]:
    """The disk cache's directory: $CUTE_FP4_KERNEL_CACHE, else $XDG_CACHE_HOME/cute_fp4/kernels
    (~/.cache/cute_fp4/kernels); None when CUTE_FP4_KERNEL_CACHE=0."""
    root = os.environ.get(KERNEL_CACHE_ENV)
    if root == "0":
        return None
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cute_fp4" / "kernels"


_STALE_SECONDS = 30 * 24 * 3600
_VERSION_DIRS_SEEN = set()


def _version_dir(root: Path) -> Path:
    """This code version's directory under `root`. The first use in a process marks it used
    (mtime) and removes sibling versions unused for 30 days: without that, every upgrade or
    source edit would leave a full set of kernels behind."""
    path = root / _code_version()[:24]
    if path not in _VERSION_DIRS_SEEN:
        _VERSION_DIRS_SEEN.add(path)
        try:
            path.mkdir(parents=True, exist_ok=True)
            os.utime(path)
            cutoff = time.time() - _STALE_SECONDS
            for other in root.iterdir():
                if other != path and other.is_dir() and other.stat().st_mtime < cutoff:
                    shutil.rmtree(other, ignore_errors=True)
        except OSError as e:
            warnings.warn(f"cute_fp4: could not prepare the kernel cache {path} ({e})",
                          RuntimeWarning)
    return path


def _current_arch() -> Optional[str]:
    """The arch runtime compiles target here: the current CUDA device's, else the DSL's
    CUTE_DSL_ARCH (compiling without a GPU), else None (no disk cache)."""
    if torch.cuda.is_available():
        return device_arch()
    return os.environ.get("CUTE_DSL_ARCH") or None


class KernelCache:
    """Compiled kernels by configuration key, with the compile time of each recorded (disk
    loads included: the time a call waited for its kernel)."""

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
                    fn = self._load(key)
                    if fn is None:
                        _COMPILED_ARCH.arch = None
                        fn = build()
                        self._save(key, fn, getattr(_COMPILED_ARCH, "arch", None))
                    self.compile_seconds[key] = time.perf_counter() - start
                    self._fns[key] = fn
        return fn

    @staticmethod
    def _path(key: Hashable, arch: Optional[str]) -> Optional[Path]:
        root = kernel_cache_root()
        if root is None or arch is None:
            return None
        name = hashlib.sha256(f"{arch}|{key!r}".encode()).hexdigest()
        return _version_dir(root) / f"{name}.o"

    def _load(self, key: Hashable) -> Optional[Callable]:
        path = self._path(key, _current_arch())
        if path is None or not path.is_file():
            return None
        from cutlass.cute.runtime import load_module

        try:
            return getattr(load_module(str(path), enable_tvm_ffi=True), _EXPORTED_NAME)
        except Exception as e:  # a damaged file: compile again (and overwrite it)
            warnings.warn(f"cute_fp4: could not load the cached kernel {path} ({e}); "
                          "compiling it again", RuntimeWarning)
            return None

    def _save(self, key: Hashable, fn: Callable, arch: Optional[str]):
        path = self._path(key, arch)
        if path is None or not hasattr(fn, "export_to_c"):
            return
        try:
            tmp = path.with_name(f"{path.stem}.{os.getpid()}.{threading.get_ident()}.o")
            fn.export_to_c(str(tmp), function_name=_EXPORTED_NAME)
            os.replace(tmp, path)
        except OSError as e:
            warnings.warn(f"cute_fp4: could not write the kernel cache {path} ({e})",
                          RuntimeWarning)

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

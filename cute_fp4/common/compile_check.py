"""Compile a kernel for a target on any machine (no GPU needed) and return its PTX, so tests can
assert the instructions a kernel relies on (TMA, wgmma, tcgen05, cvt ...)."""

from __future__ import annotations

import re
from typing import Callable, Iterable

from .jit import compile_kernel


def compile_ptx(fn: Callable, *fake_args, arch: str) -> str:
    """PTX of `fn` (a @cute.jit function or a kernel object's __call__) compiled for `arch`
    ("sm_90a" or "sm_100a") against fake tensors."""
    compiled = compile_kernel(fn, *fake_args, arch=arch, keep_ptx=True)
    ptx = compiled.__ptx__
    if not ptx:
        raise RuntimeError("the DSL returned no PTX (was --keep-ptx honoured?)")
    return ptx


def ptx_target(ptx: str) -> str:
    match = re.search(r"^\.target\s+(\S+)", ptx, re.MULTILINE)
    return match.group(1) if match else ""


def missing_instructions(ptx: str, patterns: Iterable[str]) -> list:
    """The regular expressions among `patterns` that match no line of `ptx`."""
    return [p for p in patterns if not re.search(p, ptx)]

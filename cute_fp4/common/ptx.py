"""Inline PTX for the kernels: one builder (`inline_asm`) and the raw memory accessors built on
it (shared memory by 32-bit shared-window address, global memory by 64-bit generic address).

The accessors state what changes the generated code, at every call:
- `clobber`: a "memory" clobber, a compiler barrier: no memory access the compiler sees moves
  across the instruction (the GEMM decode stages, whose shared-memory traffic goes through raw
  addresses and TMA, rely on it).
- `volatile`: the asm has side effects: it is never deleted, merged with an identical one or
  moved across other volatile asm (stores always are).
- `ty`: the PTX type of the access (`b32`, `u32`, `f32`; `u8` / `u16` loads zero-extend,
  `b8` stores the low byte); `dtype`: the DSL type of the 32-bit words read (Int32 or Uint32).
- global loads: `nc` (the read-only data path), `no_allocate` (the `L1::no_allocate` cache
  hint: data read once), `l2_prefetch` (64 / 128 / 256: the `L2::<n>B` prefetch-size hint, L2
  fetches that aligned block around the access: fewer, larger DRAM requests for data that
  neighbouring warps read next), `cache_policy` (an `l2_policy` word: the `L2::cache_hint`
  eviction priority of the lines read) and `pred` (a predicate word: the load runs where it
  is nonzero and reads zeros elsewhere; a store with `pred` runs where it is nonzero).
"""

from __future__ import annotations

from typing import Optional

from cutlass import Float32, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

# constraint letter -> (DSL type, MLIR type name)
_REGS = {"r": (Int32, "i32"), "l": (Int64, "i64"), "f": (Float32, "f32")}


def inline_asm(code: str, constraints: str, args, *, volatile: bool = False, out_dtype=None,
               loc=None, ip=None):
    """One llvm.inline_asm of `code` (AT&T dialect, operands $0, $1, ...). `constraints` in LLVM
    syntax: outputs `=r` / `=f`, then one input per entry of `args` (`r`, `l`, `f`, or the
    index of the output it is tied to), then clobbers (`~{memory}`); each argument is
    converted to the DSL type of its constraint, and an integer one that is a constant goes in
    as an immediate (`n`). Returns None, the output, or a tuple of the outputs (as `out_dtype`
    where given, else the type of their constraint)."""
    codes = constraints.split(",")
    outs = [c[1:] for c in codes if c.startswith("=")]
    ins = codes[len(outs):len(outs) + len(args)]
    operands = []
    for j, (c, a) in enumerate(zip(ins, args)):
        value = _REGS[outs[int(c)] if c.isdigit() else c][0](a).ir_value(loc=loc, ip=ip)
        if c in ("r", "l") and getattr(value.owner, "name", None) == "arith.constant":
            codes[len(outs) + j] = "n"
        operands.append(value)
    constraints = ",".join(codes)
    names = [_REGS[c][1] for c in outs]
    res_ty = None
    if len(outs) == 1:
        res_ty = ir.Type.parse(names[0])
    elif outs:
        res_ty = ir.Type.parse(f"!llvm.struct<({', '.join(names)})>")
    res = llvm.inline_asm(res_ty, operands, code, constraints, has_side_effects=volatile,
                          is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc,
                          ip=ip)
    if not outs:
        return None
    types = [out_dtype or _REGS[c][0] for c in outs]
    if len(outs) == 1:
        return types[0](res)
    return tuple(ty(llvm.extractvalue(ir.Type.parse(name), res, [j], loc=loc, ip=ip))
                 for j, (ty, name) in enumerate(zip(types, names)))


def _regs(first: int, count: int) -> str:
    """PTX operand list $first..$(first + count - 1): one operand, or a {vector}."""
    regs = ", ".join(f"${first + j}" for j in range(count))
    return regs if count == 1 else f"{{{regs}}}"


def _vec(count: int) -> str:
    return "" if count == 1 else f".v{count}"


def _clobber(clobber: bool) -> str:
    return ",~{memory}" if clobber else ""


def _store_code(space: str, ty: str, count: int, pred: bool = False) -> str:
    """PTX storing operands $1.. to the `space` address $0: `count` values of type `ty`, or
    with ty "b8" the low byte of the 32-bit word $1; with pred only where the word after
    them is nonzero."""
    guard = decl = ""
    if pred:
        guard = "@p "
        decl = f".reg .pred p;\nsetp.ne.b32 p, ${1 + count}, 0;\n"
    if ty == "b8":
        return f"{{\n{decl}.reg .b16 h;\ncvt.u16.u32 h, $1;\n{guard}st.{space}.b8 [$0], h;\n}}"
    code = f"{guard}st.{space}{_vec(count)}.{ty} [$0], {_regs(1, count)};"
    return f"{{\n{decl}{code}\n}}" if pred else code


@dsl_user_op
def ld_shared(addr: Int32, count: int = 1, *, clobber: bool, dtype=Int32, loc=None, ip=None):
    """`count` (1, 2 or 4) 32-bit words from a shared address aligned to their size (volatile):
    one word, or a tuple."""
    code = f"ld.shared{_vec(count)}.b32 {_regs(0, count)}, [${count}];"
    return inline_asm(code, "=r," * count + "r" + _clobber(clobber), [addr], volatile=True,
                      out_dtype=dtype, loc=loc, ip=ip)


@dsl_user_op
def st_shared(addr: Int32, *words, clobber: bool, ty: str = "b32", loc=None, ip=None):
    """1, 2 or 4 32-bit words to a shared address aligned to their size, or with `ty="b8"`
    the low byte of one word."""
    code = _store_code("shared", ty, len(words))
    inline_asm(code, ",".join("r" * (1 + len(words))) + _clobber(clobber), [addr, *words],
               volatile=True, loc=loc, ip=ip)


@dsl_user_op
def ld_shared_cluster(addr: Int32, rank: Int32, *, loc=None, ip=None) -> Float32:
    """One FP32 word at shared address `addr` of the cluster's CTA `rank` (DSMEM: mapa, then
    ld.shared::cluster; volatile, so it stays after the cluster barrier that publishes it)."""
    code = ("{\n\t.reg .b32 ra;\n\tmapa.shared::cluster.u32 ra, $1, $2;\n\t"
            "ld.shared::cluster.f32 $0, [ra];\n\t}")
    return inline_asm(code, "=f,r,r", [addr, rank], volatile=True, loc=loc, ip=ip)


L2_PRIORITIES = ("evict_first", "evict_normal", "evict_last")


@dsl_user_op
def l2_policy(priority: str, *, loc=None, ip=None) -> Int64:
    """The 64-bit L2 cache policy giving every line an access touches `priority` (one of
    L2_PRIORITIES): the operand of `L2::cache_hint` loads and the TMA load's cache_policy."""
    if priority not in L2_PRIORITIES:
        raise ValueError(f"priority must be one of {L2_PRIORITIES}, got {priority!r}")
    return inline_asm(f"createpolicy.fractional.L2::{priority}.b64 $0, 1.0;", "=l", [],
                      loc=loc, ip=ip)


@dsl_user_op
def ld_global(addr: Int64, count: int = 1, *, volatile: bool, ty: str = "b32", nc: bool = False,
              no_allocate: bool = False, l2_prefetch: int = 0,
              cache_policy: Optional[Int64] = None, pred: Optional[Int32] = None, dtype=Int32,
              loc=None, ip=None):
    """`count` (1, 2 or 4) values of PTX type `ty` from a global address aligned to their size:
    one value, or a tuple (Float32 for `f32`, else `dtype` words)."""
    if l2_prefetch not in (0, 64, 128, 256):
        raise ValueError(f"l2_prefetch must be 0, 64, 128 or 256, got {l2_prefetch}")
    path = ((".nc" if nc else "") + (".L1::no_allocate" if no_allocate else "")
            + (".L2::cache_hint" if cache_policy is not None else "")
            + (f".L2::{l2_prefetch}B" if l2_prefetch else ""))
    policy = "" if cache_policy is None else f", ${count + 1}"
    code = f"ld.global{path}{_vec(count)}.{ty} {_regs(0, count)}, [${count}]{policy};"
    reg = "f" if ty == "f32" else "r"
    constraints = f"={reg}," * count + "l"
    args = [addr]
    if cache_policy is not None:
        constraints += ",l"
        args.append(cache_policy)
    if pred is not None:
        # outputs zeroed first, the load only where the predicate word is nonzero
        zero = "".join(f"mov.b32 ${j}, 0;\n\t" for j in range(count))
        code = (f"{{\n\t.reg .pred p;\n\tsetp.ne.b32 p, ${len(args) + count}, 0;\n\t{zero}"
                f"@p {code}\n\t}}")
        constraints += ",r"
        args.append(pred)
    return inline_asm(code, constraints, args, volatile=volatile,
                      out_dtype=Float32 if ty == "f32" else dtype, loc=loc, ip=ip)


@dsl_user_op
def st_global(addr: Int64, *words, clobber: bool, ty: str = "b32", pred: Optional[Int32] = None,
              loc=None, ip=None):
    """1, 2 or 4 32-bit words to a global address aligned to their size, or with `ty="b8"`
    the low byte of one word; with `pred` (a predicate word) only where it is nonzero, as one
    predicated instruction (an `if` around a store may become a branch, whose reconvergence
    region ptxas does not schedule across)."""
    code = _store_code("global", ty, len(words), pred is not None)
    constraints = "l" + ",r" * len(words)
    args = [addr, *words]
    if pred is not None:
        constraints += ",r"
        args.append(pred)
    inline_asm(code, constraints + _clobber(clobber), args, volatile=True, loc=loc, ip=ip)


@dsl_user_op
def red_max_u32(addr: Int64, value, *, loc=None, ip=None):
    """Global atomic max without return (relaxed, gpu scope)."""
    inline_asm("red.relaxed.gpu.global.max.u32 [$0], $1;", "l,r", [addr, value], volatile=True,
               loc=loc, ip=ip)


@dsl_user_op
def red_shared_max_u32(addr: Int32, value, *, loc=None, ip=None):
    """Shared-memory atomic max without return (relaxed, CTA scope; a barrier orders it)."""
    inline_asm("red.relaxed.cta.shared.max.u32 [$0], $1;", "r,r", [addr, value], volatile=True,
               loc=loc, ip=ip)


@dsl_user_op
def prmt(a: Int32, b: Int32, sel, *, loc=None, ip=None) -> Int32:
    """prmt.b32: bytes of (a, b) picked by the 4 nibbles of sel (a Python int: an immediate;
    else a run-time register)."""
    if isinstance(sel, int):
        return inline_asm(f"prmt.b32 $0, $1, $2, 0x{sel:04X};", "=r,r,r", [a, b], loc=loc, ip=ip)
    return inline_asm("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel], loc=loc, ip=ip)


@dsl_user_op
def mma_16816(a, b, c, *, fp16: bool, loc=None, ip=None):
    """mma.sync m16n8k16 (row.col), BF16 or FP16 inputs, FP32 accumulators c -> d."""
    ty = "f16" if fp16 else "bf16"
    asm = (f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 "
           "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")
    return inline_asm(asm, "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3", [*a, *b, *c], loc=loc, ip=ip)


@dsl_user_op
def ldmatrix_x4_trans(addr: Int32, *, loc=None, ip=None):
    """ldmatrix .x4 .trans: four 8x8 16-bit matrices, matrix j's rows at the 16-byte shared
    addresses of lanes 8j .. 8j + 7; register j of lane (g = lane / 4, q = lane % 4) holds
    elements (2q, g) and (2q + 1, g) of matrix j (volatile, like ld_shared)."""
    return inline_asm("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, [$4];",
                      "=r,=r,=r,=r,r", [addr], volatile=True, loc=loc, ip=ip)

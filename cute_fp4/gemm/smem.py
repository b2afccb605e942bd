"""Raw memory accessors for the decode stages: shared memory by 32-bit shared-window address,
global memory by 64-bit generic address (16-byte vectors)."""

from __future__ import annotations

from typing import Tuple

from cutlass import Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _asm(res_ty, operands, asm, constraints, side_effects, loc, ip):
    return llvm.inline_asm(
        res_ty,
        operands,
        asm,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def st_shared_v4(addr: Int32, a: Int32, b: Int32, c: Int32, d: Int32, *, loc=None, ip=None):
    """Four 32-bit words to a 16-byte aligned shared address."""
    ops = [Int32(x).ir_value(loc=loc, ip=ip) for x in (addr, a, b, c, d)]
    _asm(None, ops, "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r,~{memory}", True,
         loc, ip)


@dsl_user_op
def ld_shared_u32(addr: Int32, *, loc=None, ip=None) -> Int32:
    """One 32-bit word from a 4-byte aligned shared address."""
    res = _asm(T.i32(), [Int32(addr).ir_value(loc=loc, ip=ip)],
               "ld.shared.b32 $0, [$1];", "=r,r,~{memory}", True, loc, ip)
    return Int32(res)


@dsl_user_op
def ld_shared_v4(addr: Int32, *, loc=None, ip=None) -> Tuple[Int32, Int32, Int32, Int32]:
    """Four 32-bit words from a 16-byte aligned shared address."""
    ty = ir.Type.parse("!llvm.struct<(i32, i32, i32, i32)>")
    res = _asm(ty, [Int32(addr).ir_value(loc=loc, ip=ip)],
               "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r,~{memory}", True,
               loc, ip)
    i32 = T.i32()
    return tuple(Int32(llvm.extractvalue(i32, res, [j], loc=loc, ip=ip)) for j in range(4))


@dsl_user_op
def ld_global_v4(addr: Int64, *, loc=None, ip=None) -> Tuple[Int32, Int32, Int32, Int32]:
    """Four 32-bit words from a 16-byte aligned global address."""
    ty = ir.Type.parse("!llvm.struct<(i32, i32, i32, i32)>")
    res = _asm(ty, [Int64(addr).ir_value(loc=loc, ip=ip)],
               "ld.global.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", False, loc, ip)
    i32 = T.i32()
    return tuple(Int32(llvm.extractvalue(i32, res, [j], loc=loc, ip=ip)) for j in range(4))


@dsl_user_op
def st_global_v4(addr: Int64, a: Int32, b: Int32, c: Int32, d: Int32, *, loc=None, ip=None):
    """Four 32-bit words to a 16-byte aligned global address."""
    ops = [Int64(addr).ir_value(loc=loc, ip=ip)] + [Int32(x).ir_value(loc=loc, ip=ip)
                                                     for x in (a, b, c, d)]
    _asm(None, ops, "st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r,~{memory}", True,
         loc, ip)

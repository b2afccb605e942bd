"""`python -m cute_fp4.perf {quant,gemm,linear,dequant,gemm_w4a16,quant_recipes} [options]`: the benchmark sweeps."""

import importlib
import sys

COMMANDS = ("quant", "gemm", "linear", "dequant", "gemm_w4a16", "quant_recipes")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m cute_fp4.perf {{{','.join(COMMANDS)}}} [options]", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(f"cute_fp4.perf.{argv[0]}")
    except ModuleNotFoundError:
        print(f"the '{argv[0]}' benchmark is not implemented yet", file=sys.stderr)
        return 2
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())

"""`python -m cute_fp4.perf {quant,gemm,linear,dequant,gemm_w4a16,quant_recipes,compile} [options]`:
the benchmark sweeps (`compile`: JIT compile times, runs without a GPU).

`quant` with a recipe option (--rht, --sr, --2d, --grouped N, --four-over-six {mae,mse},
--fast-math, --window64, --suite) runs the recipe benchmark (`quant_recipes`), which reports the
recipe kernels against the plain cast measured in the same run.
"""

import importlib
import sys

COMMANDS = ("quant", "gemm", "linear", "dequant", "gemm_w4a16", "quant_recipes", "compile")
RECIPE_FLAGS = ("--rht", "--sr", "--2d", "--grouped", "--four-over-six", "--fast-math",
                "--window64", "--suite")


def _module_name(argv):
    if argv[0] == "quant" and any(a.split("=", 1)[0] in RECIPE_FLAGS for a in argv[1:]):
        return "quant_recipes"
    return argv[0]


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m cute_fp4.perf {{{','.join(COMMANDS)}}} [options]", file=sys.stderr)
        return 2
    name = _module_name(argv)
    try:
        module = importlib.import_module(f"cute_fp4.perf.{name}")
    except ModuleNotFoundError:
        print(f"the '{name}' benchmark is not implemented yet", file=sys.stderr)
        return 2
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())

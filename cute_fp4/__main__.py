"""Demo: `python -m cute_fp4 [--rows M] [--cols K] [--cpu]`.

Quantizes an LLM-like activation (normal values with a few outlier channels, as seen in
transformer hidden states) with several NVFP4 recipes and prints the SNR of each output and of
a GEMM against a weight, on the GPU kernels when CUDA is present (a recipe the kernels do not
cover yet runs on the reference, and the table says so) or on the torch references.
"""

from __future__ import annotations

import argparse

import torch

from . import Recipe, dequantize, ref
from .snr import gemm_with_path, quantize_with_path

RECIPES = {
    "per-tensor": Recipe(columnwise=True),
    "per-token": Recipe(scaling="token", columnwise=True),
    "1x64 window": Recipe(scaling="window64", columnwise=True),
    "16x16 blocks": Recipe(block=(16, 16), columnwise=True),
    "per-tensor + RHT twin": Recipe(rht=True, columnwise=True),
    "stochastic rounding": Recipe(stochastic_rounding=True, columnwise=True),
    "4over6 (mse)": Recipe(four_over_six="mse", columnwise=True),
    "4over6 (mae, e4m3 256)": Recipe(four_over_six="mae", e4m3_max=256, columnwise=True),
}


def activation_like(m: int, k: int, device, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(m, k, generator=gen, device="cpu")
    outlier_cols = torch.randperm(k, generator=gen)[: max(1, k // 256)]
    x[:, outlier_cols] *= 40.0
    x *= torch.exp(0.5 * torch.randn(m, 1, generator=gen))  # per-token magnitude spread
    return x.to(device=device, dtype=torch.bfloat16)


def run(m: int, k: int, n: int, device: str):
    from tabulate import tabulate

    gen = torch.Generator().manual_seed(0)
    x = activation_like(m, k, device, gen)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(device=device, dtype=torch.bfloat16)
    w_q, _ = quantize_with_path(w, Recipe(block=(16, 16)))
    y_ref = x.double() @ w.double().t()
    rows = []
    for name, recipe in RECIPES.items():
        t, path = quantize_with_path(x, recipe, seed=1234)
        x_hat = dequantize(t, torch.float32)
        xt = ref.rht(x.t().contiguous()) if recipe.rht else x.t()
        twin = dequantize(t.t(), torch.float32)
        y = gemm_with_path(t, w_q)
        rows.append({"recipe": name, "path": path,
                     "rowwise SNR dB": ref.snr_db(x.float(), x_hat),
                     "columnwise SNR dB": ref.snr_db(xt.float(), twin),
                     "GEMM SNR dB (vs fp64 x @ w.T)": ref.snr_db(y_ref.cpu(), y.cpu())})
    print(f"NVFP4 recipes on an activation-like [{m}, {k}] bf16 tensor "
          f"({'GPU: ' + torch.cuda.get_device_name() if device == 'cuda' else 'CPU references'})")
    print(tabulate(rows, headers="keys", tablefmt="github", floatfmt=".2f"))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m cute_fp4", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--cols", type=int, default=1024)
    p.add_argument("--out-features", type=int, default=256)
    p.add_argument("--cpu", action="store_true", help="use the references even with a GPU")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    run(args.rows, args.cols, args.out_features, device)


if __name__ == "__main__":
    main()

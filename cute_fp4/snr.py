"""`python -m cute_fp4.snr`: SNR (dB) of the three training GEMMs per NVFP4 recipe, and of
inference's forward GEMM per weight recipe.

Training: for each recipe, fprop y = x @ w.T, dgrad dx = dy @ w and wgrad dw = dy.T @ x with
every operand quantized as `cute_fp4.nn.Linear` would (same twins, RHT, stochastic rounding),
against a float64 ground truth, next to a plain BF16 baseline. Inference: y = x @ w.T with the
weight quantized once per weight recipe (`convert(weight_recipe=)`: rowwise only), the
activations in BF16 (W4A16) or quantized per token (W4A4, `convert`'s default). Inputs: random
activations with outlier rows and channels, and a random weight or a real layer's weight from
a checkpoint (`--checkpoint`).
"""

from __future__ import annotations

import argparse
import json
from typing import Dict, Optional

import torch

from . import api, ref
from .nn import LinearRecipe, _with_outputs
from .recipe import Recipe

RECIPES: Dict[str, LinearRecipe] = {
    "per-tensor": LinearRecipe.per_tensor(rht=False, stochastic_rounding=False),
    "per-token": LinearRecipe.per_token(rht=False, stochastic_rounding=False),
    "per-tensor +RHT": LinearRecipe.per_tensor(rht=True, stochastic_rounding=False),
    "per-tensor +RHT +SR (TE)": LinearRecipe.per_tensor(rht=True, stochastic_rounding=True),
    "per-token +RHT +SR": LinearRecipe.per_token(rht=True, stochastic_rounding=True),
    "4over6 mse": LinearRecipe.per_tensor(rht=False, stochastic_rounding=False,
                                          four_over_six="mse"),
    "1x64 window": LinearRecipe.window64(),
}

# inference weights (rowwise only), as `convert(weight_recipe=)` quantizes them
INFERENCE_WEIGHTS: Dict[str, Recipe] = {
    "per-tensor": Recipe(columnwise=False),
    "per-token (rows)": Recipe(scaling="token", columnwise=False),
    "16x16 blocks": Recipe(block=(16, 16), columnwise=False),
    "1x64 window": Recipe(scaling="window64", columnwise=False),
    "4over6 mse": Recipe(four_over_six="mse", columnwise=False),
}


def quantize_with_path(x: torch.Tensor, recipe: Recipe, **kw):
    """Quantize on the kernels where they cover the recipe, else on the reference; returns
    (tensor, which path ran)."""
    if not x.is_cuda:
        return api.quantize(x, recipe, **kw), "reference"
    try:
        return api.quantize(x, recipe, **kw), "kernel"
    except NotImplementedError:
        return ref.quantize(x, recipe, **kw), "reference (no kernel yet)"


def gemm_with_path(a, b):
    """FP32 GEMM on the kernels where they cover the operands, else on the reference."""
    try:
        return api.gemm(a, b, out_dtype=torch.float32)
    except NotImplementedError:
        return api.gemm(a.to("cpu"), b.to("cpu"), out_dtype=torch.float32).to(b.device)


def outlier_activations(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(m, k, generator=gen)
    x[torch.randperm(m, generator=gen)[: max(1, m // 64)]] *= 20.0  # outlier rows (tokens)
    x[:, torch.randperm(k, generator=gen)[: max(1, k // 128)]] *= 30.0  # outlier channels
    return x


def load_weight(path: str, name: Optional[str]) -> torch.Tensor:
    """A 2D weight (dims multiples of 16) from a torch or safetensors checkpoint."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
        state = state.get("state_dict", state) if isinstance(state, dict) else state
    if name is not None:
        return state[name].float()
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[0] % 16 == 0 \
                and value.shape[1] % 64 == 0:
            return value.float()
    raise ValueError(f"no 2D weight with rows % 16 == 0 and cols % 64 == 0 in {path}")


def report(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, seed: int = 0):
    xd, wd, dyd = x.double(), w.double(), dy.double()
    truth = {"fprop": xd @ wd.t(), "dgrad": dyd @ wd, "wgrad": dyd.t() @ xd}
    xb, wb, dyb = x.bfloat16(), w.bfloat16(), dy.bfloat16()
    bf16 = {"fprop": xb @ wb.t(), "dgrad": dyb @ wb, "wgrad": dyb.t() @ xb}
    rows = [{"recipe": "BF16 operands", "path": "torch",
             **{f"{g} dB": ref.snr_db(truth[g].cpu(), bf16[g].float().cpu()) for g in truth}}]
    for name, rec in RECIPES.items():
        xq, p1 = quantize_with_path(x, _with_outputs(rec.activation, True, True))
        wq, p2 = quantize_with_path(w, _with_outputs(rec.weight, True, True))
        dyq, p3 = quantize_with_path(dy, _with_outputs(rec.grad, True, True), seed=seed,
                                     offset=1)
        got = {"fprop": gemm_with_path(xq, wq), "dgrad": gemm_with_path(dyq, wq.t()),
               "wgrad": gemm_with_path(dyq.t(), xq.t())}
        paths = sorted({p1, p2, p3})
        rows.append({"recipe": name, "path": "+".join(paths),
                     **{f"{g} dB": ref.snr_db(truth[g].cpu(), got[g].cpu()) for g in truth}})
    return rows


def inference_report(x: torch.Tensor, w: torch.Tensor):
    """Rows of the inference table: y = x @ w.T against float64 per weight recipe, W4A16
    (BF16 activations) and W4A4 (activations per token)."""
    truth = (x.double() @ w.double().t()).cpu()
    xb = x.bfloat16()
    xq, x_path = quantize_with_path(x, Recipe(scaling="token", columnwise=False))
    rows = [{"weights": "BF16", "path": "torch",
             "W4A16 dB": ref.snr_db(truth, (xb @ w.bfloat16().t()).float().cpu()),
             "W4A4 dB": None}]
    for name, recipe in INFERENCE_WEIGHTS.items():
        wq, w_path = quantize_with_path(w, recipe)
        rows.append({"weights": name, "path": "+".join(sorted({w_path, x_path})),
                     "W4A16 dB": ref.snr_db(truth, gemm_with_path(xb, wq).cpu()),
                     "W4A4 dB": ref.snr_db(truth, gemm_with_path(xq, wq).cpu())})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m cute_fp4.snr", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=512, help="M: rows of x and dy")
    p.add_argument("--in-features", type=int, default=1024, help="K")
    p.add_argument("--out-features", type=int, default=512, help="N")
    p.add_argument("--checkpoint", help="torch/safetensors file: use one of its 2D weights")
    p.add_argument("--tensor", help="the weight's name in the checkpoint")
    p.add_argument("--cpu", action="store_true", help="run on the references even with a GPU")
    p.add_argument("--markdown", default="snr_report.md")
    p.add_argument("--json", default="snr_report.json")
    args = p.parse_args(argv)
    from tabulate import tabulate

    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    gen = torch.Generator().manual_seed(0)
    if args.checkpoint:
        w = load_weight(args.checkpoint, args.tensor)
        source = f"weight {args.tensor or '(first 2D)'} of {args.checkpoint}"
    else:
        w = torch.randn(args.out_features, args.in_features, generator=gen) * 0.02
        source = "random weight N(0, 0.02^2)"
    n, k = w.shape
    x = outlier_activations(args.tokens, k, gen)
    dy = torch.randn(args.tokens, n, generator=gen) * 1e-3
    rows = report(x.to(device), w.to(device), dy.to(device))
    inference = inference_report(x.to(device), w.to(device))
    title = (f"NVFP4 GEMM SNR vs float64 (M={args.tokens}, N={n}, K={k}; {source}; "
             f"activations with outlier rows/channels; {device})")
    inference_title = ("Inference forward GEMM SNR vs float64 per weight recipe (the same x and "
                       "w; W4A16: BF16 activations, W4A4: activations per token)")
    text = "\n\n".join([
        f"## {title}", tabulate(rows, headers="keys", tablefmt="github", floatfmt=".2f"),
        f"## {inference_title}",
        tabulate(inference, headers="keys", tablefmt="github", floatfmt=".2f",
                 missingval="-")])
    print(text)
    with open(args.markdown, "w") as f:
        f.write(text + "\n")
    with open(args.json, "w") as f:
        json.dump({"title": title, "rows": rows, "inference_title": inference_title,
                   "inference_rows": inference}, f, indent=1)


if __name__ == "__main__":
    main()

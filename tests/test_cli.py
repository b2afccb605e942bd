"""The command-line entry points run and print real tables (CPU references here)."""

import json

import pytest

from cute_fp4.__main__ import main as demo_main
from cute_fp4.perf.__main__ import main as perf_main
from cute_fp4.snr import main as snr_main


def test_demo_prints_every_recipe(capsys):
    demo_main(["--rows", "64", "--cols", "128", "--out-features", "64", "--cpu"])
    out = capsys.readouterr().out
    for name in ("per-tensor", "per-token", "1x64 window", "16x16 blocks", "RHT",
                 "stochastic rounding", "4over6 (mse)"):
        assert name in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "reference" in line]
    assert len(rows) == 8
    for line in rows:
        snrs = [float(v) for v in line.strip("|").split("|")[2:]]
        assert all(8.0 < v < 40.0 for v in snrs), line


def test_snr_report_files(tmp_path, capsys):
    md, js = tmp_path / "r.md", tmp_path / "r.json"
    snr_main(["--tokens", "64", "--in-features", "128", "--out-features", "64", "--cpu",
              "--markdown", str(md), "--json", str(js)])
    data = json.loads(js.read_text())
    names = [r["recipe"] for r in data["rows"]]
    assert names[0] == "BF16 operands" and "1x64 window" in names and len(names) == 8
    bf16 = data["rows"][0]
    for row in data["rows"][1:]:
        for g in ("fprop dB", "dgrad dB", "wgrad dB"):
            assert 10.0 < row[g] < bf16[g], (row["recipe"], g)
    assert "| per-token" in md.read_text()
    inference = data["inference_rows"]
    assert [r["weights"] for r in inference] == [
        "BF16", "per-tensor", "per-token (rows)", "16x16 blocks", "1x64 window", "4over6 mse"]
    for row in inference[1:]:
        assert 10.0 < row["W4A4 dB"] < row["W4A16 dB"] < inference[0]["W4A16 dB"], row
    assert "Inference forward GEMM SNR" in md.read_text()


def test_snr_checkpoint_weight(tmp_path, capsys):
    import torch

    path = tmp_path / "ckpt.pt"
    torch.save({"layer.weight": torch.randn(64, 128) * 0.02, "bias": torch.zeros(64)}, path)
    snr_main(["--checkpoint", str(path), "--tokens", "64", "--cpu", "--markdown",
              str(tmp_path / "a.md"), "--json", str(tmp_path / "a.json")])
    title = json.loads((tmp_path / "a.json").read_text())["title"]
    assert "N=64, K=128" in title and "ckpt.pt" in title


def test_perf_usage_errors(capsys):
    assert perf_main([]) == 2
    assert perf_main(["nope"]) == 2
    assert "usage" in capsys.readouterr().err


def test_graph_sets_fill_four_l2s(monkeypatch):
    """Graph timings rotate over enough operand sets to fill four times the L2 (H100: 50 MB),
    at least one and at most `limit`."""
    import types

    import torch

    from cute_fp4.perf.common import graph_sets

    props = types.SimpleNamespace(L2_cache_size=50 << 20)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: props)
    assert graph_sets(37_748_736) == 6  # W4A16 8192 x 8192 weights + scales
    assert graph_sets(132_120_576) == 2  # 28672 x 8192
    assert graph_sets(200 << 20) == 1
    assert graph_sets(201 << 20) == 1
    assert graph_sets(199 << 20) == 2
    assert graph_sets(1 << 20) == 8
    assert graph_sets(1 << 20, limit=3) == 3


@pytest.mark.gpu
def test_demo_on_gpu(capsys):
    demo_main(["--rows", "128", "--cols", "256", "--out-features", "128"])
    assert "GPU" in capsys.readouterr().out


def test_perf_compile_cpu(tmp_path, capsys):
    """`perf compile` runs without a GPU: one row per kernel, cold compile seconds, with the
    disk cache's export, its load in a later process (faster than compiling) and the
    in-memory hit."""
    path = tmp_path / "compile.json"
    assert perf_main(["compile", "--kernels", "amax_token,dequantize", "--arch", "sm_90a",
                      "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["kernel"] for r in rows] == ["amax_token", "dequantize"]
    for r in rows:
        assert 0 < r["cold s"] < 60 and 0 < r["cold + export s"] < 60
        assert 0 < r["from disk s"] < r["cold s"]
        assert 0 < r["in-memory hit us"] < 1e4
    assert "JIT compile time per kernel" in capsys.readouterr().out


@pytest.mark.parametrize("m", [4096, 32768])
def test_perf_grouped_splits(m):
    """The benchmark's grouped splits: 8 uneven groups summing to M, multiples of 128 rows (no
    swizzled padding) or, ragged, multiples of 16 rows none of which is one of 128."""
    from cute_fp4.perf.quant_recipes import _splits
    even, ragged = _splits(m, 8, 16), _splits(m, 8, 16, ragged=True)
    assert sum(even) == sum(ragged) == m
    assert len(set(even)) == 3 and all(s % 128 == 0 for s in even)
    assert all(s % 16 == 0 and s % 128 != 0 for s in ragged)
    assert max(ragged) - min(ragged) < m // 4


@pytest.mark.parametrize("flag", ["--ragged", "--host-only"])
def test_perf_grouped_flags_need_grouped(flag, capsys):
    with pytest.raises(SystemExit):
        perf_main(["quant_recipes", flag])
    assert f"{flag} needs --grouped" in capsys.readouterr().err


@pytest.mark.parametrize("args,rule", [(["--host-k", "100"], "--host-k must be"),
                                       (["--host-rows", "16"], "--host-rows must be")])
def test_perf_grouped_host_sizes_checked(args, rule, capsys):
    with pytest.raises(SystemExit):
        perf_main(["quant_recipes", "--grouped", "8", "--host-only"] + args)
    assert rule in capsys.readouterr().err


@pytest.mark.gpu
def test_perf_grouped_host_table(tmp_path, capsys):
    """`perf quant_recipes --grouped N --host-only`: host microseconds per grouped call for N
    and ROW_GROUPS_MAX groups, cached and new split sizes and a single-tensor call (not
    compared: the device host's timings are too noisy for an order to hold every time), each
    without and with the groups' views."""
    out = tmp_path / "host.json"
    assert perf_main(["quant_recipes", "--grouped", "4", "--host-only", "--host-k", "128",
                      "--host-rows", "64", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["groups"] for r in rows] == [4, 64]
    assert [(r["rows"], r["K"]) for r in rows] == [(256, 128), (4096, 128)]
    for r in rows:
        assert all(0 < r[c] < 1e5 for c in ("one quantize_recipe", "cached sizes", "new sizes",
                                             "cached sizes + views", "new sizes + views"))
    assert "Host time per grouped call" in capsys.readouterr().out

"""The rank config, the random weights, the CLI's argument checks and the record writer."""

import json
import math

import pytest
import torch

from benchmarks.rank import main as bench_main
from benchmarks.rank.record import markdown, summarize
from benchmarks.rank.shapes import rank_config, small_rank_config
from benchmarks.rank.spec import BenchArgsError, SweepSpec
from benchmarks.rank.sweep import Rig, run_sweep
from benchmarks.rank.weights import E4M3_MASK, random_weights, weight_bytes
from iquestrt import cli
from reference.config import FULL, SLIDING
from reference.params import BLOCK, FP32, all_specs


def test_rank_config_is_one_tp8_rank():
    t, d = rank_config().target, rank_config().draft
    assert (t.num_attention_heads, t.num_key_value_heads, t.head_dim) == (6, 1, 128)
    assert (t.q_size, t.kv_size, t.hidden_size) == (768, 128, 3072)
    assert (t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size) == (256, 8, 192)
    assert (t.intermediate_size, t.vocab_size, t.num_hidden_layers) == (1536, 20000, 88)
    assert t.layer_types.count(FULL) == 25 and t.layer_types.count(SLIDING) == 63
    assert (d.num_experts, d.moe_intermediate_size, d.sliding_window) == (256, 192, 512)


@pytest.mark.slow
def test_random_weights_have_the_loader_shapes_and_finite_values():
    cfg = small_rank_config()
    specs = all_specs(cfg)
    w = random_weights(cfg, "cpu", 0, 128)
    lay = w.layers[2]
    assert lay.window == cfg.target.sliding_window and w.layers[1].window is None
    assert tuple(lay.attn.qkv.w.shape) == specs["model.layers.2.self_attn.qkv_proj.weight"].shape
    assert tuple(lay.moe.fc.shape) == specs["model.layers.2.mlp.experts.fc"].shape
    assert tuple(lay.moe.proj_s.shape) == (48, 2, 2)  # ⌈256/128⌉ × ⌈192/128⌉
    assert tuple(w.draft.eh_proj.shape) == specs["mtp.eh_proj.weight"].shape
    fc = lay.moe.fc
    assert fc.dtype == torch.float8_e4m3fn and torch.isfinite(fc.float()).all()
    assert fc.float().abs().max() <= 1.875
    assert (fc.view(torch.uint8) & ~E4M3_MASK & 0xFF).sum() == 0
    again = random_weights(cfg, "cpu", 0, 128)
    assert torch.equal(again.layers[5].moe.proj.view(torch.uint8), w.layers[5].moe.proj.view(
        torch.uint8))
    other = random_weights(cfg, "cpu", 1, 128)
    assert not torch.equal(other.layers[5].moe.proj.view(torch.uint8),
                           w.layers[5].moe.proj.view(torch.uint8))
    want = sum(math.prod(s.shape) * (1 if s.kind == BLOCK else 4 if s.kind == FP32 else 2)
               + (4 * math.prod(s.scale_shape) if s.kind == BLOCK else 0) for s in specs.values())
    assert weight_bytes(w) == want  # every tensor of the checkpoint layout, nothing else


@pytest.mark.parametrize("argv, message", [
    (["--widths", "3"], "each width must be an integer in 4..8"),
    (["--widths", "6", "9"], "each width must be an integer in 4..8"),
    (["--contexts", "1K", "2K"], "unknown ['2K']; choose from"),
    (["--baseline", "fast"], "--baseline: 'fast'; choose one of"),
    (["--rounds", "2"], "--rounds: 2 outside 4..4096"),
    (["--reduce", "tree"], "--reduce: 'tree'; choose one of ['stacked', 'table', 'ring']"),
    (["--reduce", "ring"], "--reduce ring with --tp 1: 'ring' is the real ring of --tp N >= 2"),
    (["--tp", "2", "--reduce", "table"], "--reduce table with --tp 2: 'ring' is the real ring"),
    (["--tp", "9"], "--tp: 9; must be an integer in 1..8"),
    (["--tp", "2"], "--tp 2: 1 processes (WORLD_SIZE); start it as torchrun --nproc-per-node 2"),
    (["--pdl", "yes"], "--pdl: 'yes'; choose one of ['auto', 'off', 'on', 'ab']"),
    (["--launch", "moe.nope=1"], "--launch 'moe.nope=1': launch override moe.nope: unknown field"),
    (["--launch", "sampler.tile=3000"], "SamplerLaunch.tile: power of two >= 16, got 3000"),
    (["--launch", "gpu.tile=1"],
     "family one of ['attention', 'linear', 'moe', 'qkv', 'sampler', 'tails']"),
    (["--launch", ","], "--launch ',': overrides nothing"),
    (["--launch", "moe.down_rows=1", "--launch", "moe.down_rows=on"], "the same overrides twice"),
])
def test_bad_arguments_get_a_clear_error(tmp_path, capsys, argv, message):
    assert bench_main.main(["--out", str(tmp_path / "o"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert cli.main(["bench", "round", "--out", str(tmp_path / "o"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_without_a_gpu_it_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_main.main(["--out", str(tmp_path / "o"), "--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_quick_is_one_context_one_width():
    p = __import__("argparse").ArgumentParser()
    bench_main.add_arguments(p)
    s = bench_main.spec_from_args(p.parse_args(["--out", "x", "--quick"]))
    assert (s.widths, s.contexts, s.adaptive, s.baseline) == ((6,), ("1K",), False, "eager")
    with pytest.raises(BenchArgsError):
        SweepSpec(widths=())


@pytest.mark.slow
def test_sweep_writes_the_record_on_the_twins(tmp_path):
    out = tmp_path / "rec"
    out.mkdir()
    (out / "record.json").write_text("{}")  # an earlier record: replaced whole, not merged
    (out / "stale.txt").write_text("old")
    spec = SweepSpec(widths=(4, 6), adaptive=True, contexts=("1K",), rounds=4, reps=1,
                     baseline="none", profile="none", eager=False)
    rec = run_sweep(spec, out, "test", Rig(small_rank_config(), "cpu", "twins", 4.24e12))
    assert sorted(p.name for p in out.iterdir()) == ["record.json", "round_vs_context.svg",
                                                    "round_vs_width.svg", "summary.md"]
    data = json.loads((out / "record.json").read_text())
    assert [c["policy"] for c in data["configs"]] == ["W4", "W6", "adaptive"]
    for c in data["configs"]:
        assert "error" not in c, c.get("error")
        assert c["reps"][0]["rounds"] == 3 and c["floor_bytes"] > 0
        assert c["shape"]["rows"] == (4.0 if c["policy"] != "W6" else 6.0)
    assert data["routing"]["distinct"]["uniform_expected"]["1"] == pytest.approx(8.0)
    assert "| 1K | W6 |" in (out / "summary.md").read_text()
    assert (out / "round_vs_width.svg").read_text().startswith("<svg")
    floor = data["configs"][1]["floor_bytes"] / 4.24e12
    assert rec["configs"][1]["floor_s"] == pytest.approx(floor)


def _record(round_1k, round_192k, compiled_s):
    def row(ctx, name, r, f):
        return {"context": ctx, "context_name": name, "policy": "W6", "round_s": r,
                "floor_s": f, "ratio": r / f, "loop_round_s": r, "floor_bytes": f * 4e12,
                "shape": {"rows": 6.0, "depth": 5.0, "distinct": 37.7}}
    return {"spec": {"headline_width": 6, "routing": "traces"}, "bandwidth": 4e12,
            "command": "x", "wall_s": 1.0, "peak_allocated_bytes": 0,
            "env": {"revision": "r", "dirty_files": [], "torch": "t", "triton": "t"},
            "routing": {"mapping": "primary", "distinct": {"uniform": {"6": 44.4}}},
            "configs": [row(1024, "1K", round_1k, 2e-3), row(196608, "192K", round_192k, 2.6e-3)],
            "baseline": {"context": 1024, "depth": 5, "subset_layers": [], "scaled_to": 88,
                         "variants": {"compile-gather": {"scaled_round_s": compiled_s}}}}


def test_targets_are_judged_against_the_issue():
    kv_s = 2.6025e9 / 4e12  # the extra KV bytes 1K → 192K at 6 rows, at 4 TB/s
    s = summarize(_record(3e-3, 3e-3 + 1.2 * kv_s * 0.99, 15e-3))
    assert s["headline"]["ok"] and s["growth"]["ok"] and s["speedup"]["ok"]
    assert s["headline"]["ratio"] == pytest.approx(1.5)
    assert s["speedup"]["vs"]["compile-gather"] == pytest.approx(5.0)
    s = summarize(_record(3.1e-3, 3.1e-3 + 1.2 * kv_s * 1.01, 15e-3))
    assert not s["headline"]["ok"] and not s["growth"]["ok"] and not s["speedup"]["ok"]
    assert "not met" in markdown(_record(3.1e-3, 4e-3, 1e-3))
    rec = _record(3e-3, 4e-3, 1e-3)
    assert "programmatic dependent launch" not in markdown(rec)  # records from before the field
    rec["rig"], rec["spec"]["pdl"] = {"pdl": True}, "auto"
    assert "Control launches with programmatic dependent launch (--pdl auto)." in markdown(rec)


def test_a_failed_configuration_fails_the_run(tmp_path, capsys, monkeypatch):
    """The record keeps every part's error, and the exit status says the run is not complete
    (a failing `--reduce table` row must not exit 0:
    reports/benchmarks/h200-2026-11-30/session7/rank_table_call2_failed.log)."""
    import benchmarks.rank.sweep as sweep

    rows = [{"context_name": "1K", "policy": "W6", "round_s": 1e-3},
            {"context_name": "4K", "policy": "W6", "error": "EngineError: readiness"}]
    record = {"configs": rows, "eager": {"error": "RuntimeError: x"},
              "baseline": {"variants": {"compile-gather": {"error": "no compile"}}}}
    assert bench_main.failures(record) == ["4K W6", "eager"]  # a baseline may not compile
    assert bench_main.failures({"configs": rows[:1], "eager": None}) == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sweep, "run_sweep", lambda spec, out, command: record)
    code = bench_main.main(["--out", str(tmp_path / "r"), "--quick"])
    assert code == bench_main.EXIT_FAILED
    assert "2 part(s) failed" in capsys.readouterr().err


def test_variants_alternate_and_pair_rows():
    from benchmarks.rank.record import _variants_md, variant_pairs
    from benchmarks.rank.sweep import run_order, variants

    names = ["W4", "W4+pdl", "W6", "W6+pdl"]
    assert run_order(names, 2, 0) == names
    assert run_order(names, 2, 1) == ["W4+pdl", "W4", "W6+pdl", "W6"]
    assert run_order(["W4", "W6"], 1, 1) == ["W4", "W6"]
    assert run_order(["a", "b", "c"], 3, 1) == ["c", "b", "a"]
    got = variants(SweepSpec(pdl="ab", launch=("moe.down_rows=1,sampler.tile=2048",)), True)
    assert [(s, p, o.label()) for s, p, o in got] == [
        ("", False, ""), ("+pdl", True, ""),
        ("+moe.down_rows=1,sampler.tile=2048", False, "moe.down_rows=1,sampler.tile=2048")]
    assert [(s, p) for s, p, _ in variants(SweepSpec(pdl="on", launch=("tails.unroll_k=1",)),
                                           False)] == [("", True), ("+tails.unroll_k=1", True)]
    # the default follows the runtime: PDL wherever it can run, off elsewhere
    assert SweepSpec().pdl == "auto"
    for available in (True, False):
        assert [(s, p) for s, p, _ in variants(SweepSpec(launch=("tails.unroll_k=1",)),
                                               available)] == [("", available),
                                                               ("+tails.unroll_k=1", available)]
        assert [p for _, p, _ in variants(SweepSpec(pdl="off"), available)] == [False]
    assert [p for _, p, _ in variants(SweepSpec(tp=2, reduce="ring"), True)] == [False]
    brk = {"breakdown": {"launches": 1161}}
    rows = [{"context_name": "1K", "policy": "W6", "round_s": 0.010, **brk},
            {"context_name": "1K", "policy": "W6+pdl", "round_s": 0.009},
            {"context_name": "1K", "policy": "W6+moe.down_rows=1", "round_s": 0.011,
             "breakdown": {"launches": 1069}},
            {"context_name": "4K", "policy": "W6+pdl", "error": "x"},
            {"context_name": "4K", "policy": "W4", "error": "x"},
            {"context_name": "4K", "policy": "W4+pdl", "round_s": 0.009}]
    pairs = variant_pairs({"configs": rows})
    assert [(p["policy"], p["variant"], round(p["ratio"], 6), p["launches"]) for p in pairs] == [
        ("W6", "pdl", 0.9, (1161, None)), ("W6", "moe.down_rows=1", 1.1, (1161, 1069))]
    assert variant_pairs({"configs": rows[:1]}) == []
    md = "\n".join(_variants_md({"configs": rows}))
    assert "| 1K | W6 | pdl | 10.000 | 9.000 | 0.900 | — |" in md
    assert "| 1K | W6 | moe.down_rows=1 | 10.000 | 11.000 | 1.100 | 1161 → 1069 |" in md


@pytest.mark.slow
def test_sweep_with_launch_overrides_on_the_twins_is_refused(tmp_path):
    """Launch overrides configure the Triton kernels: on the twins the variant's engine is
    refused when it is built — the sweep does not time the control twice under two names."""
    spec = SweepSpec(widths=(4,), adaptive=False, contexts=("1K",), rounds=4, baseline="none",
                     profile="none", eager=False, launch=("moe.down_rows=1",))
    with pytest.raises(ValueError, match="launch overrides need the 'kernels' backend"):
        run_sweep(spec, tmp_path / "r", "test", Rig(small_rank_config(), "cpu", "twins", 4.24e12))


@pytest.mark.slow
def test_sweep_with_pdl_ab_on_the_twins_is_refused_per_configuration(tmp_path):
    """PDL needs compiled kernels on a GPU: on the twins every '+pdl' engine is refused when it
    is built, before any timing — the sweep does not quietly run without it."""
    spec = SweepSpec(widths=(4,), adaptive=False, contexts=("1K",), rounds=4, baseline="none",
                     profile="none", eager=False, pdl="ab")
    with pytest.raises(ValueError, match="pdl"):
        run_sweep(spec, tmp_path / "r", "test", Rig(small_rank_config(), "cpu", "twins", 4.24e12))
    assert not (tmp_path / "r").exists()


def test_sweep_refuses_a_folder_it_did_not_write_before_running(tmp_path):
    from iquestrt.outputs import OutputError

    out = tmp_path / "notes"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    spec = SweepSpec(widths=(4,), adaptive=False, contexts=("1K",), rounds=4, reps=1,
                     baseline="none", profile="none", eager=False)
    with pytest.raises(OutputError, match="only a folder this command wrote"):
        run_sweep(spec, out, "test", Rig(small_rank_config(), "cpu", "twins", 4.24e12))
    assert (out / "mine.txt").read_text() == "keep"

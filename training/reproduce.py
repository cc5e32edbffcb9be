"""Reproduce a trained model's run from its training report and compare the held-out losses:

    python -m corpus.shards --out DATA          # the stdlib split's shards (this Python's Lib)
    python -m training.reproduce --report models/mini/training_report.json --data DATA --out DIR

The run repeats the recorded TrainConfig, seed, preset and schedule length (`--max-steps` =
the report's steps, so the schedule does not depend on this machine's speed); the data must
hold the recorded token counts (checked before any training). DIR/run/ is the new run's output;
DIR/reproduce.json and DIR/reproduce.md compare the held-out target and per-depth draft losses
with the report's: the verdict passes when every |Δ| ≤ --tolerance. Exit status 1 when it does
not, 2 on bad input.

Tolerance: DEFAULT_TOLERANCE_NATS below. On the CPU a rerun is bit-identical (training/train.py's
determinism; tests/training/test_reproduce.py); on a GPU torch's deterministic algorithms are
requested with warn_only, so ops without one may move the losses a little. The default is a
bound on that noise, not a measurement of it: the records state Δ, so it can be tightened once
reruns on the GPU have been measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_TOLERANCE_NATS = 0.02  # ≈ 0.8 % of the mini card's held-out target loss (2.47 nats)
SHARD_BYTES = 2  # uint16 tokens


class ReproduceError(ValueError):
    """The report or the data cannot drive a reproduction; the message names what is wrong."""


def load_report(path: Path) -> dict:
    try:
        rep = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ReproduceError(f"{path}: not a readable training report: {e}") from None
    for key in ("train_config", "steps", "heldout_loss", "data"):
        if key not in rep:
            raise ReproduceError(f"{path}: the training report has no {key!r}")
    return rep


def check_data(data: Path, rep: dict, report_path: Path) -> None:
    """The shards must hold the report's token counts (another split or tokenizer would not)."""
    for part, key in (("train", "train_tokens"), ("heldout", "heldout_tokens")):
        f = Path(data) / f"{part}.bin"
        want = rep["data"][key]
        if not f.is_file():
            raise ReproduceError(f"{f}: missing; build the shards with `python -m corpus.shards "
                                 f"--out {data}`")
        got = f.stat().st_size // SHARD_BYTES
        if got != want:
            raise ReproduceError(f"{f}: {got} tokens, {report_path} was trained on {want} (another "
                                 f"split, tokenizer or Python's Lib?)")


def train_argv(rep: dict, data: Path, out: Path, tokenizer: Path, device: str | None) -> list:
    """training.train's arguments that repeat the report's run."""
    cfg = rep["train_config"]
    argv = ["--data", str(data), "--out", str(out), "--preset", cfg["preset"], "--seed",
            str(cfg["seed"]), "--max-steps", str(rep["steps"]), "--minutes", "100000",
            "--tokenizer", str(tokenizer)]
    for name, value in sorted(cfg.items()):
        if name in ("preset", "seed"):
            continue
        argv += ["--" + name.replace("_", "-"), str(value).lower() if isinstance(value, bool)
                 else str(value)]
    return argv + (["--device", device] if device else [])


def compare(card: dict, new: dict, tolerance: float) -> list[dict]:
    """Rows (metric, card, reproduced, delta, within) for the target and every draft depth."""
    pairs = [("target", card["target"], new["target"])]
    pairs += [(f"draft depth {j + 1}", c, n)
              for j, (c, n) in enumerate(zip(card["draft"], new["draft"], strict=True))]
    return [{"metric": m, "card": c, "reproduced": n, "delta": n - c,
             "within": abs(n - c) <= tolerance} for m, c, n in pairs]


def render(rows: list[dict], tolerance: float, report_path: Path) -> str:
    exact = all(r["delta"] == 0 for r in rows)
    ok = all(r["within"] for r in rows)
    lines = [f"# Reproduction of {report_path}", "",
             f"Verdict: **{'pass' if ok else 'FAIL'}** (|Δ| ≤ {tolerance} nats"
             + ("; bit-identical" if exact else "") + ")", "",
             "| held-out loss (nats/token) | card | reproduced | Δ | within |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['metric']} | {r['card']:.6f} | {r['reproduced']:.6f} | {r['delta']:+.2e} | "
              f"{'yes' if r['within'] else 'NO'} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.reproduce",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--report", type=Path, default=Path("models/mini/training_report.json"))
    ap.add_argument("--data", type=Path, required=True, help="folder with train.bin, heldout.bin")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, help="default: tokenizer.json beside the report")
    ap.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE_NATS,
                    help="largest |Δ| of a held-out loss, nats/token")
    ap.add_argument("--device", help="default: cuda when available, else cpu")
    a = ap.parse_args(argv)
    try:
        if not a.tolerance >= 0:
            raise ReproduceError(f"--tolerance: must be >= 0, got {a.tolerance}")
        rep = load_report(a.report)
        check_data(a.data, rep, a.report)
        tokenizer = a.tokenizer or a.report.parent / "tokenizer.json"
        if not tokenizer.is_file():
            raise ReproduceError(f"{tokenizer}: tokenizer missing (pass --tokenizer)")
    except ReproduceError as e:
        print(f"training.reproduce: {e}", file=sys.stderr)
        return 2
    from training.train import main as train

    new = train(train_argv(rep, a.data, a.out / "run", tokenizer, a.device))
    rows = compare(rep["heldout_loss"], new["heldout_loss"], a.tolerance)
    record = {"report": str(a.report), "tolerance_nats": a.tolerance, "rows": rows,
              "run": {k: new[k] for k in ("command", "device", "steps", "train_seconds",
                                          "torch") if k in new}}
    a.out.mkdir(parents=True, exist_ok=True)
    tmp = a.out / "reproduce.json.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    (a.out / "reproduce.md").write_text(render(rows, a.tolerance, a.report))
    tmp.replace(a.out / "reproduce.json")
    print(render(rows, a.tolerance, a.report))
    return 0 if all(r["within"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

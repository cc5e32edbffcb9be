"""Train a preset (default `mini`) on token shards and export a servable E4M3 checkpoint.

    python -m training.train --data DIR --out DIR [--minutes 12] [--max-steps N] [--seed 0]
                             [--resume]

DIR holds train.bin, heldout.bin (uint16 token ids) and tokenizer.json (or pass --tokenizer).
Outputs under --out: state/train_state.pt (model, AdamW, step, schedule length, data cursor, RNG
states; written every --ckpt-every steps and at the end), checkpoint/ and checkpoint-bf16/
(export.py), training_report.json.

Schedule length. With --max-steps the cosine schedule spans exactly that many steps. Without it,
steps 5 … 20 of the run are timed (they fall inside the warm-up, whose learning rate does not
depend on the length) and the length is set to what fits in --minutes, capped at max_epochs;
that length is saved, so a resumed run keeps it. --minutes also stops the loop early (report:
stopped_by "time"), keeping ~10% (≤ 60 s) for evaluation and export.

Determinism. Initialization and data order come from --seed only (explicit generators); nothing
draws from the global RNG. Given the saved state a resumed run performs the same arithmetic as an
uninterrupted one (bit-identical on CPU: tests/training/test_train.py). On CUDA the script asks
torch for deterministic algorithms (warn_only: an op without one warns instead of failing).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from reference.config import PRESETS, preset
from training import data as D
from training.config import TrainConfig, TrainConfigError, lr_at
from training.export import REPORT, TOKENIZER, export_checkpoint, param_counts
from training.loss import compute_losses, evaluate
from training.model import TrainModel, init_params

STATE = Path("state") / "train_state.pt"
CALIB = (5, 20)  # run steps between which a calibrating run measures its step time
STATE_FORMAT = 1


class ResumeError(ValueError):
    """The saved state cannot continue this run; the message names the mismatch."""


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m training.train",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, type=Path, help="folder with train.bin, heldout.bin")
    ap.add_argument("--out", required=True, type=Path, help="output folder")
    ap.add_argument("--minutes", type=float, default=12.0, help="wall budget of the whole run")
    ap.add_argument("--max-steps", type=int, help="schedule length (default: fit --minutes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true", help="continue from --out/state")
    ap.add_argument("--preset", default="mini", choices=PRESETS)
    ap.add_argument("--tokenizer", type=Path, help=f"default: DATA/{TOKENIZER}")
    ap.add_argument("--device", help="default: cuda when available, else cpu")
    ap.add_argument("--stop-after", type=int, help="stop this invocation after N steps, saving "
                    "the state without exporting (an interruption, for --resume)")
    defaults = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("preset", "seed"):
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            ap.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"),
                            default=f.default, metavar="BOOL")
        else:
            kind = type(getattr(defaults, f.name))
            ap.add_argument(flag, type=kind, default=f.default)
    return ap.parse_args(argv)


def _optimizer(model: TrainModel, cfg: TrainConfig) -> torch.optim.AdamW:
    decay, plain = [], []
    for name, p in model.named_parameters():
        no_decay = p.dim() < 2 or name.endswith(("embed_tokens.weight", "router.weight", "sink_k"))
        (plain if no_decay else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def _save_state(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # never a half-written state file


class _Window:
    """Running sums of the losses since the last progress line (kept on the device)."""

    def __init__(self):
        self.sums, self.n, self.t0 = None, 0, time.perf_counter()

    def add(self, loss) -> None:
        v = torch.cat([loss.target[None], loss.aux[None], loss.draft]).detach().float()
        self.sums = v if self.sums is None else self.sums + v
        self.n += 1

    def means(self) -> dict:
        m = (self.sums / self.n).tolist()
        return {"target": m[0], "aux": m[1], "draft": m[2:], "steps": self.n}


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})
    mcfg = preset(cfg.preset)
    cfg.validate(mcfg.draft.num_draft_slots)
    tokenizer = args.tokenizer or args.data / TOKENIZER
    if not tokenizer.is_file():
        raise FileNotFoundError(f"{tokenizer}: tokenizer JSON missing (pass --tokenizer)")
    if args.max_steps is not None and args.max_steps < 1:
        raise TrainConfigError(f"--max-steps={args.max_steps}: must be >= 1")
    if args.max_steps is None and cfg.warmup_steps < CALIB[1]:
        raise TrainConfigError(f"warmup_steps={cfg.warmup_steps}: without --max-steps it must "
                               f"be >= {CALIB[1]} (the timing calibration runs inside warm-up)")
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    v = mcfg.target.vocab_size
    train_tokens = D.load_shard(args.data / "train.bin", v, cfg.seq_len + 1)
    heldout_tokens = D.load_shard(args.data / "heldout.bin", v, cfg.seq_len + 1)
    order = D.BatchOrder(train_tokens, cfg.seq_len, cfg.batch_size, cfg.seed)
    model = TrainModel(mcfg, init_params(mcfg, cfg.seed)).to(dev)
    opt = _optimizer(model, cfg)
    st = {"step": 0, "total_steps": args.max_steps, "tokens": 0, "elapsed": 0.0, "history": []}
    state_path = args.out / STATE
    if args.resume:
        _resume(state_path, st, cfg, args, model, opt, order)
    elif state_path.exists():
        raise ResumeError(f"{state_path}: a run already exists; pass --resume or another --out")

    autocast = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if dev.type == "cuda"
                else contextlib.nullcontext)
    budget = args.minutes * 60.0
    reserve = min(60.0, 0.1 * budget)
    t_run = time.perf_counter() - st["elapsed"]

    def elapsed() -> float:
        return time.perf_counter() - t_run

    def snapshot() -> dict:
        return {"format": STATE_FORMAT, "train_config": dataclasses.asdict(cfg),
                "model": {k: t.detach().cpu() for k, t in model.state_dict().items()},
                "optimizer": opt.state_dict(), "cursor": dataclasses.asdict(order.cursor),
                "rng": _rng_states(dev), **st, "elapsed": elapsed()}

    n_tok = cfg.batch_size * cfg.seq_len
    print(f"training {cfg.preset}: {param_counts(mcfg)['total'] / 1e6:.2f}M parameters, "
          f"{len(train_tokens) / 1e6:.2f}M train tokens, {n_tok} tokens/step, device {dev}",
          flush=True)
    window, run_steps, stopped_by, calib_t = _Window(), 0, "steps", {}
    while st["total_steps"] is None or st["step"] < st["total_steps"]:
        if elapsed() > budget - reserve:
            stopped_by = "time"
            break
        if args.stop_after is not None and run_steps >= args.stop_after:
            stopped_by = "stop_after"
            break
        batch = order.next_batch().to(dev)
        lr = lr_at(cfg, st["step"], st["total_steps"])
        for g in opt.param_groups:
            g["lr"] = lr
        with autocast():
            loss = compute_losses(model, batch, cfg)
        opt.zero_grad(set_to_none=True)
        loss.total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        st["step"] += 1
        st["tokens"] += n_tok
        run_steps += 1
        window.add(loss)
        if st["total_steps"] is None and run_steps in CALIB:
            _sync(dev)
            calib_t[run_steps] = time.perf_counter()
            if run_steps == CALIB[1]:
                st["total_steps"] = _calibrated_total(cfg, st["step"], calib_t, budget - reserve
                                                      - elapsed(), order.steps_per_epoch)
                print(f"schedule: {st['total_steps']} steps", flush=True)
        if st["step"] % cfg.log_every == 0:
            window = _log(window, st, lr, n_tok, order, elapsed())
        if st["step"] % cfg.ckpt_every == 0:
            _save_state(state_path, snapshot())
    if window.n:
        window = _log(window, st, lr_at(cfg, max(0, st["step"] - 1), st["total_steps"]), n_tok,
                      order, elapsed())
    _save_state(state_path, snapshot())
    if stopped_by == "stop_after":
        return {"stopped_by": stopped_by, "step": st["step"]}

    model.eval()
    held = evaluate(model, (b.to(dev) for b in D.heldout_batches(
        heldout_tokens, cfg.seq_len, cfg.batch_size, cfg.eval_tokens)), cfg, autocast)
    print(f"held-out: target {held['target']:.4f} | draft "
          + " ".join(f"{x:.3f}" for x in held["draft"]) + f" ({held['tokens']} tokens)", flush=True)
    last = st["history"][-1] if st["history"] else None
    secs = elapsed()
    report = {
        "command": "python -m training.train " + shlex.join(argv),
        "preset": cfg.preset, "seed": cfg.seed, "device": str(dev), "torch": torch.__version__,
        "steps": st["step"], "total_steps": st["total_steps"], "stopped_by": stopped_by,
        "tokens": st["tokens"], "epochs": order.epochs_done, "train_seconds": secs,
        "tokens_per_s": st["tokens"] / secs if secs > 0 else None,
        "train_loss": last, "heldout_loss": held, "params": param_counts(mcfg),
        "data": {"train_tokens": len(train_tokens), "heldout_tokens": len(heldout_tokens)},
        "train_config": dataclasses.asdict(cfg), "history": st["history"],
    }
    ckpt = export_checkpoint(args.out, mcfg, model.export_params(), tokenizer, report)
    print(f"exported {ckpt} ({report['params']['total'] / 1e6:.2f}M params); report "
          f"{args.out / REPORT}", flush=True)
    return report


def _resume(path, st, cfg, args, model, opt, order) -> None:
    if not path.is_file():
        raise ResumeError(f"{path}: no saved state to resume")
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if saved.get("format") != STATE_FORMAT:
        raise ResumeError(f"{path}: state format {saved.get('format')!r}, expected {STATE_FORMAT}")
    now = dataclasses.asdict(cfg)
    diff = sorted(k for k in now if saved["train_config"].get(k) != now[k])
    if diff:
        raise ResumeError(f"{path}: saved run used different settings for {diff} "
                          f"(saved {[saved['train_config'].get(k) for k in diff]})")
    if args.max_steps is not None and saved["total_steps"] not in (None, args.max_steps):
        raise ResumeError(f"--max-steps={args.max_steps} disagrees with the saved schedule "
                          f"length {saved['total_steps']}")
    if saved["total_steps"] is None and args.max_steps is None and saved["step"] > 0:
        raise ResumeError(f"{path}: stopped before its schedule length was calibrated; "
                          "pass --max-steps")
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    order.cursor = D.Cursor(**saved["cursor"])
    torch.set_rng_state(saved["rng"]["torch"])
    if saved["rng"].get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["rng"]["cuda"])
    for k in ("step", "tokens", "elapsed", "history"):
        st[k] = saved[k]
    st["total_steps"] = saved["total_steps"] or args.max_steps
    print(f"resumed {path} at step {st['step']}", flush=True)


def _rng_states(dev) -> dict:
    """Global RNG states (nothing here draws from them; saved so a resume restores them too)."""
    cuda = torch.cuda.get_rng_state_all() if dev.type == "cuda" else None
    return {"torch": torch.get_rng_state(), "cuda": cuda}


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _calibrated_total(cfg, step, calib_t, seconds_left, steps_per_epoch) -> int:
    per_step = (calib_t[CALIB[1]] - calib_t[CALIB[0]]) / (CALIB[1] - CALIB[0])
    by_time = step + int(0.97 * max(0.0, seconds_left) / per_step)
    by_epochs = math.ceil(cfg.max_epochs * steps_per_epoch)
    return max(step + 1, min(by_time, by_epochs))


def _log(window, st, lr, n_tok, order, secs) -> _Window:
    m = window.means()
    dt = time.perf_counter() - window.t0
    rate = window.n * n_tok / dt if dt > 0 else float("nan")
    entry = {"step": st["step"], "lr": lr, "tokens_per_s": rate, "epoch": order.epochs_done,
             "seconds": secs, **m}
    st["history"].append(entry)
    total = st["total_steps"] or "?"
    print(f"step {st['step']}/{total} | {rate / 1e3:.1f}k tok/s | lr {lr:.2e} | "
          f"loss {m['target']:.4f} | draft " + " ".join(f"{x:.3f}" for x in m["draft"])
          + f" | aux {m['aux']:.3f} | epoch {order.epochs_done:.2f} | {secs:.0f}s", flush=True)
    return _Window()


def cli() -> int:
    try:
        main()
    except (TrainConfigError, D.DataError, ResumeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())

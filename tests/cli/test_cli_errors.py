"""Every failure a user can cause ends in one line and a non-zero exit (iquestrt/cli.py _fail),
and what could otherwise pass silently is refused by name: non-finite or unbounded config
values, huge resource arguments, links leaving the checkpoint, unreadable optional files."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from iquestrt.cli import main
from iquestrt.engine import EngineError

REPO = Path(__file__).resolve().parents[2]
GEN = ["--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--quiet"]


@pytest.fixture
def ck(tiny, tmp_path) -> Path:
    """A private copy to corrupt."""
    return Path(shutil.copytree(tiny, tmp_path / "ck"))


def one_line(argv, capsys, code=2) -> str:
    capsys.readouterr()
    try:
        got = main(argv)
    except SystemExit as e:  # argparse's own refusals
        got = e.code
    err = capsys.readouterr().err.strip()
    assert got == code, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("iquestrt: error:"), err
    return err


def _edit(path: Path, **fields) -> None:
    d = json.loads(path.read_text())
    d.update(fields)
    path.write_text(json.dumps(d))


@pytest.mark.parametrize("text, says", [
    ('{"rope_theta": Infinity}', "Infinity is not a finite number"),
    ('{"rope_theta": NaN}', "NaN is not a finite number"),
    ('{"rope_theta": 1e999}', "1e999 is not a finite number"),
    ("[" * 200_000 + "]" * 200_000, "nested too deeply"),
])
def test_config_json_that_is_not_finite_or_too_deep_is_one_line(ck, text, says, capsys):
    if text.startswith("{"):  # the rest of the config stays valid
        d = json.loads((ck / "config.json").read_text())
        key = json.loads(text.replace("Infinity", "0").replace("NaN", "0").replace("1e999", "0"))
        d.pop(next(iter(key)))
        text = json.dumps(d)[:-1] + ", " + text[1:]
    (ck / "config.json").write_text(text)
    err = one_line(["generate", "--checkpoint", str(ck), *GEN], capsys)
    assert str(ck / "config.json") in err and says in err


@pytest.mark.parametrize("field, value, says", [
    ("rope_theta", 1.0, "config.rope_theta: must be in (1, 1e+12]"),
    ("rope_theta", 1e300, "config.rope_theta: must be in (1, 1e+12]"),
    ("rms_norm_eps", 2.0, "config.rms_norm_eps: must be in (0, 1)"),
])
def test_unbounded_config_values_are_refused(ck, field, value, says, capsys):
    _edit(ck / "config.json", **{field: value})
    assert says in one_line(["generate", "--checkpoint", str(ck), *GEN], capsys)


def test_huge_ring_pad_is_refused_before_any_allocation(tiny, capsys):
    err = one_line(["generate", "--checkpoint", str(tiny), "--backend", "runtime", "--ring-pad",
                    "1000000000", *GEN], capsys)
    assert "ring_pad" in err and "4096" in err


def test_a_shard_linked_from_outside_the_checkpoint_is_refused(ck, tmp_path, capsys):
    shard = next(ck.glob("*.safetensors"))
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(shard, outside)
    shard.symlink_to(outside)
    err = one_line(["generate", "--checkpoint", str(ck), *GEN], capsys)
    assert f"{shard}: resolves to {outside}, outside the checkpoint folder" in err
    inside = ck / "shard.bin"  # a link within the folder is fine
    shutil.move(outside, inside)
    shard.unlink()
    shard.symlink_to(inside)
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(ck), *GEN]) == 0


@pytest.mark.parametrize("make, says", [
    (lambda p: p.mkdir(), "a folder, not a readable file"),
    (lambda p: (p.symlink_to(p.with_name("loop2")), p.with_name("loop2").symlink_to(p)),
     "symlink loop"),
    (lambda p: p.symlink_to(p.with_name("gone")), "dangling symlink"),
])
def test_an_unreadable_tokenizer_is_named_not_dropped(ck, make, says, capsys):
    make(ck / "tokenizer.json")
    err = one_line(["generate", "--checkpoint", str(ck), *GEN], capsys)
    assert str(ck / "tokenizer.json") in err and says in err


def test_a_depth_policy_that_is_a_folder_is_named(ck, capsys):
    (ck / "depth_policy.json").mkdir()
    err = one_line(["generate", "--checkpoint", str(ck), *GEN[:-1], "--draft-depth",
                    "adaptive"], capsys)
    assert f"{ck / 'depth_policy.json'}: a folder" in err


def test_a_truncated_prefetch_predictor_is_named(capsys, tmp_path):
    from iquestrt import assets

    mini = Path(shutil.copytree(assets.default_model(), tmp_path / "mini"))
    pred = mini / "prefetch" / "prefetch.safetensors"
    if not pred.is_file():
        pytest.skip("the shipped model has no prefetch predictor")
    pred.write_bytes(pred.read_bytes()[:100])
    err = one_line(["generate", "--checkpoint", str(mini), "--backend", "runtime", *GEN],
                   capsys)
    assert f"{pred}: unreadable safetensors file" in err


def test_seed_width_is_checked_and_every_bit_is_used(tiny, capsys):
    err = one_line(["generate", "--checkpoint", str(tiny), "--seed", str(2**64), *GEN], capsys)
    assert "[0, 2^64)" in err
    one_line(["generate", "--checkpoint", str(tiny), "--seed", "-1", *GEN], capsys)
    outs = {}
    for seed in (5, 5 + 2**63, 2**64 - 1):
        # the twins are the matched reference bit for bit on any device (gate 3b); the compiled
        # kernels on a GPU lie within gate 1's band of it, not on its bits
        for backend, extra in (("reference", ["--precision", "matched"]),
                               ("runtime", ["--ops", "twins"])):
            capsys.readouterr()
            assert main(["generate", "--checkpoint", str(tiny), "--seed", str(seed),
                         "--backend", backend, *extra, "--prompt-ids", "1,2,3",
                         "--max-new-tokens", "8", "--quiet"]) == 0
            outs[seed, backend] = capsys.readouterr().out.splitlines()[0]
    for seed in (5, 5 + 2**63, 2**64 - 1):  # the runtime draws the matched reference's bits
        assert outs[seed, "reference"] == outs[seed, "runtime"], seed
    assert outs[5, "reference"] != outs[5 + 2**63, "reference"]  # the top bit counts


def test_a_runtime_fault_is_one_line_exit_1(tiny, monkeypatch, capsys):
    from iquestrt import api

    def fault(self, *a, **k):
        raise EngineError("prefill: readiness failure flag raised by target layer 1 (round 0)")

    monkeypatch.setattr(api.LLM, "run", fault)
    err = one_line(["generate", "--checkpoint", str(tiny), "--backend", "runtime", *GEN],
                   capsys, code=1)
    assert "readiness failure flag raised by target layer 1" in err


def test_an_internal_error_is_one_line_exit_70_and_shows_its_traceback_on_request(
        tiny, monkeypatch, capsys):
    import iquestrt.run

    def bug(a):
        raise KeyError("oops")

    monkeypatch.setattr(iquestrt.run, "generate_from_args", bug)
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tiny), *GEN]) == 70
    err = capsys.readouterr().err.strip()
    assert err == "iquestrt: internal error: KeyError: 'oops' (IQUESTRT_TRACEBACK=1 shows the " \
                  "traceback)"
    monkeypatch.setenv("IQUESTRT_TRACEBACK", "1")
    with pytest.raises(KeyError):
        main(["generate", "--checkpoint", str(tiny), *GEN])


def _sigint_default() -> None:
    """In the child before exec: Ctrl-C as a terminal's foreground process gets it. A runner
    started in the background of a non-interactive shell (`cmd &`) ignores SIGINT, children
    inherit that, and Python then installs no KeyboardInterrupt handler at all."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cli(*args, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "iquestrt.cli", *args], cwd=kw.get("cwd"),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_sigint_default)


@pytest.mark.slow
def test_stream_into_a_closed_pipe_stops_quietly(tiny, tmp_path):
    p = _cli("generate", "--checkpoint", str(tiny), "--prompt-ids", "1,2,3",
             "--max-new-tokens", "48", "--stream", "--quiet", cwd=tmp_path)
    p.stdout.read(1)
    p.stdout.close()  # `| head -c 1`
    err = p.stderr.read()
    assert p.wait(timeout=300) == 141, err
    assert "Traceback" not in err and "Exception ignored" not in err, err


@pytest.mark.slow
def test_ctrl_c_is_one_line_exit_130(tiny, tmp_path):
    p = _cli("generate", "--checkpoint", str(tiny), "--prompt-ids", "1,2,3",
             "--max-new-tokens", "3000", "--ignore-eos", "--stream", "--quiet", cwd=tmp_path)
    p.stdout.read(1)  # decoding has started
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 130, err
    assert err.strip().splitlines()[-1] == "iquestrt: interrupted"
    assert "Traceback" not in err, err


def test_serve_on_a_busy_port_is_one_line_before_the_model_loads(capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.perf_counter()
        err = one_line(["serve", "--port", str(port)], capsys)
    assert f"--port {port}: cannot listen there" in err
    assert time.perf_counter() - t0 < 30  # refused before the model loads


def test_caches_beyond_free_memory_are_refused_before_allocation(tiny, monkeypatch, capsys):
    import iquestrt.engine_options as eo

    monkeypatch.setattr(eo, "free_bytes", lambda device: 1 << 20)
    err = one_line(["generate", "--checkpoint", str(tiny), "--backend", "runtime", *GEN], capsys)
    assert "the weights and caches need" in err and "0.00 GiB is free on cpu" in err


def test_the_cache_estimate_is_what_the_caches_allocate(tiny):
    from iquestrt.cache import RuntimeCaches
    from iquestrt.config import RuntimeConfig
    from reference.config import ModelConfig

    cfg = ModelConfig.load(tiny)
    for capacity, pad in ((64, 8), (1000, 64)):
        rcfg = RuntimeConfig(ring_pad=pad)
        c = RuntimeCaches.create(cfg, rcfg, capacity, "cpu")
        made = sum(t.nbytes for lay in [*c.target, c.draft]
                   for t in (lay.k, lay.v, lay.slot_pos))
        assert RuntimeCaches.nbytes(cfg, rcfg, capacity) == made

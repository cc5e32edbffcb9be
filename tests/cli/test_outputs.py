"""iquestrt/outputs.py and its writers: no `--out` ever touches an input, every output appears in
one rename, an interrupted or failed run leaves the target as it was and nothing beside it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from iquestrt import outputs
from iquestrt.cli import main
from tests.helpers.ckpt_helpers import tree_digest

SPEC = outputs.OutputSpec("--out", "record.json")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def with_prompts(tiny) -> Path:
    (tiny.parent / "prompts.jsonl").write_text('{"prompt_ids": [1, 2, 3]}\n')
    return tiny


def _one_line_exit(argv, capsys, code=2) -> str:
    capsys.readouterr()
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("iquestrt: error:"), err
    return err


@pytest.mark.parametrize("where, relation", [
    ("{ck}", "is the --checkpoint"),
    ("{ck}/mtp", "lies inside the --checkpoint"),
    ("{parent}", "contains the --checkpoint"),
])
def test_report_out_touching_the_checkpoint_is_refused_even_with_force(with_prompts, where,
                                                                        relation, capsys):
    tiny = with_prompts
    before = tree_digest(tiny.parent)
    out = where.format(ck=tiny, parent=tiny.parent)
    err = _one_line_exit(["report", "acceptance", "--checkpoint", str(tiny), "--prompts",
                          str(tiny.parent / "prompts.jsonl"), "--out", out, "--force",
                          "--quiet"], capsys)
    assert relation in err
    assert tree_digest(tiny.parent) == before


@pytest.mark.parametrize("out, relation", [("set", "contains the --prompts"),
                                           ("set/p.jsonl", "is the --prompts")])
def test_report_out_onto_the_prompts_file_is_refused(tiny, tmp_path, capsys, out, relation):
    prompts = tmp_path / "set" / "p.jsonl"
    prompts.parent.mkdir()
    prompts.write_text('{"prompt_ids": [1, 2, 3]}\n')
    err = _one_line_exit(["report", "acceptance", "--checkpoint", str(tiny), "--prompts",
                          str(prompts), "--out", str(tmp_path / out), "--force"], capsys)
    assert relation in err and prompts.is_file()


def test_report_out_inside_a_request_set_folder_is_refused(tiny, tmp_path, capsys):
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "completion.jsonl").write_text('{"prompt_ids": [1, 2, 3]}\n')
    err = _one_line_exit(["report", "acceptance", "--checkpoint", str(tiny), "--prompts",
                          str(tmp_path / "set"), "--out", str(tmp_path / "set" / "r")], capsys)
    assert "lies inside the --prompts" in err


def test_experiment_out_onto_the_checkpoint_is_refused(with_prompts, capsys):
    tiny = with_prompts
    before = tree_digest(tiny)
    err = _one_line_exit(["experiment", "--checkpoint", str(tiny), "--prompts",
                          str(tiny.parent / "prompts.jsonl"), "--control", "depth=1",
                          "--candidate", "depth=2", "--out", str(tiny), "--force"], capsys)
    assert "is the --checkpoint" in err and tree_digest(tiny) == before


def test_convert_onto_its_input_is_refused(tmp_path, capsys):
    bf16 = tmp_path / "bf16"
    assert main(["make-checkpoint", "--preset", "tiny", "--format", "bf16", "--out",
                 str(bf16)]) == 0
    before = tree_digest(bf16)
    for out in (bf16, bf16 / "sub"):
        err = _one_line_exit(["convert", "--checkpoint", str(bf16), "--out", str(out),
                              "--quantize"], capsys)
        assert "the --checkpoint" in err
    assert tree_digest(bf16) == before


@pytest.mark.parametrize("inside", ["iquestrt", "reference/x", "kernels"])
def test_out_inside_the_source_tree_is_refused(inside):
    with pytest.raises(outputs.OutputError, match="source package"):
        outputs.check(REPO / inside, SPEC)


def test_out_that_is_or_contains_the_checkout_is_refused():
    if not (REPO / "pyproject.toml").is_file():
        pytest.skip("not run from a checkout")
    for out in (REPO, REPO.parent):
        with pytest.raises(outputs.OutputError, match="the source checkout|source package"):
            outputs.check(out, SPEC, force=True)
    assert outputs.check(REPO / "reports" / "new-record", SPEC) == REPO / "reports" / "new-record"


def test_force_replaces_only_a_folder_the_writer_made(tmp_path):
    mine, other = tmp_path / "mine", tmp_path / "other"
    mine.mkdir()
    (mine / "record.json").write_text("{}")
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(outputs.OutputError, match="already exists"):
        outputs.check(mine, SPEC)
    assert outputs.check(mine, SPEC, force=True) == mine
    with pytest.raises(outputs.OutputError, match="only a folder this command wrote"):
        outputs.check(other, SPEC, force=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert outputs.check(empty, SPEC) == empty  # an empty folder is taken without --force


def test_out_under_a_regular_file_or_without_room_is_refused(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(outputs.OutputError, match="is a file, not a folder"):
        outputs.check(tmp_path / "file" / "out", SPEC)
    with pytest.raises(outputs.OutputError, match="exists and is not a directory"):
        outputs.check(tmp_path / "file", SPEC, force=True)
    big = outputs.OutputSpec("--out", "record.json", need_bytes=1 << 62)
    with pytest.raises(outputs.OutputError, match=r"MiB free on .* needs about"):
        outputs.check(tmp_path / "new", big)


def test_unwritable_parent_is_refused_before_any_work(tmp_path, monkeypatch):
    # root may write anywhere, so the permission answer is what os.access reports
    monkeypatch.setattr(outputs.os, "access", lambda path, mode: False)
    with pytest.raises(outputs.OutputError, match="is not writable"):
        outputs.check(tmp_path / "new", SPEC)


def test_a_failure_while_writing_leaves_the_old_folder_and_nothing_beside_it(tmp_path):
    out = tmp_path / "rec"
    out.mkdir()
    (out / "record.json").write_text("old")
    with pytest.raises(OSError, match="disk full"):
        with outputs.writing(outputs.check(out, SPEC, force=True)) as tmp:
            (tmp / "record.json").write_text("new")
            raise OSError(28, "disk full")
    assert (out / "record.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rec"]
    with outputs.writing(outputs.check(out, SPEC, force=True)) as tmp:
        (tmp / "record.json").write_text("new")
    assert (out / "record.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rec"]


def test_a_symlinked_out_is_written_through_and_no_stale_link_is_left(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "record.json").write_text("old")
    link = tmp_path / "link"
    link.symlink_to(real)
    with outputs.writing(outputs.check(link, SPEC, force=True)) as tmp:
        (tmp / "record.json").write_text("new")
    assert link.is_symlink() and (link / "record.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


def test_leftovers_of_a_killed_run_are_removed_by_the_next(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    pid = int(dead.stdout)  # a process that has exited
    (tmp_path / f".rec.tmp-{pid}").mkdir()
    (tmp_path / f".rec.tmp-{pid}" / "half").write_text("x")
    (tmp_path / f".other.tmp-{pid}").mkdir()  # another target's: not ours to remove
    live = tmp_path / f".rec.tmp-{os.getppid()}"  # a live process's: kept
    live.mkdir()
    with outputs.writing(tmp_path / "rec") as tmp:
        (tmp / "record.json").write_text("{}")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([f".other.tmp-{pid}", live.name, "rec"])


SIGTERM_WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from iquestrt import outputs
    from iquestrt.cli import _fail
    out = Path(sys.argv[1])
    try:
        with outputs.writing(outputs.check(out, outputs.OutputSpec("--out", "record.json"),
                                           force=True)) as tmp:
            (tmp / "record.json").write_text("half")
            print("writing", flush=True)
            time.sleep(60)
    except BaseException as e:
        raise SystemExit(_fail(e))
""")


def test_sigterm_while_writing_cleans_up_and_exits_143(tmp_path):
    out = tmp_path / "rec"
    out.mkdir()
    (out / "record.json").write_text("old")
    p = subprocess.Popen([sys.executable, "-c", SIGTERM_WRITER, str(out)], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "writing"
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143, err
    assert err.strip() == "iquestrt: interrupted"
    assert (out / "record.json").read_text() == "old"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["rec"]


def test_make_checkpoint_interrupted_leaves_nothing_and_can_be_rerun(tmp_path, monkeypatch,
                                                                      capsys):
    import reference.checkpoint as ck

    real_write = ck._write_part

    def interrupted(*args, **kwargs):
        real_write(*args, **kwargs)
        raise KeyboardInterrupt  # Ctrl-C after the first part's shards

    out = tmp_path / "ck"
    monkeypatch.setattr(ck, "_write_part", interrupted)
    assert main(["make-checkpoint", "--preset", "tiny", "--out", str(out)]) == 130
    assert capsys.readouterr().err.strip() == "iquestrt: interrupted"
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(ck, "_write_part", real_write)
    assert main(["make-checkpoint", "--preset", "tiny", "--out", str(out)]) == 0
    assert (out / "config.json").is_file() and (out / "mtp" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_an_os_error_while_writing_is_one_line_exit_1(tmp_path, monkeypatch, capsys):
    import reference.checkpoint as ck

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / "x.safetensors"))

    monkeypatch.setattr(ck, "_write_part", full)
    out = tmp_path / "ck"
    capsys.readouterr()
    assert main(["make-checkpoint", "--preset", "tiny", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"iquestrt: error: {tmp_path / 'x.safetensors'}: No space left on device"
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_output_needs_room_for_its_shards(tmp_path, monkeypatch, capsys):
    from reference import config
    from reference.checkpoint_validate import stored_bytes

    need = stored_bytes(config.preset("tiny"), "fp8")
    assert need > 0
    usage = outputs.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(outputs.shutil, "disk_usage",
                        lambda p: usage._replace(free=need))  # less than shards + headroom
    err = _one_line_exit(["make-checkpoint", "--preset", "tiny", "--out",
                          str(tmp_path / "ck")], capsys)
    assert "MiB free" in err and not (tmp_path / "ck").exists()

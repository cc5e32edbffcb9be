"""qualification/repeat.py: N qualify runs compared gate by gate."""


def test_repeat_compares_every_gate_of_every_run(tmp_path, monkeypatch):
    from qualification import repeat

    a = [("0 x", "pass", "10%"), ("5 y", "pass", "p = 0.3")]
    assert repeat.compare([a, list(a), list(a)]) == []
    b = [("0 x", "pass", "10%"), ("5 y", "FAIL", "p = 1e-5")]
    assert repeat.compare([a, a, b]) == ["run 3, 5 y: FAIL / p = 1e-5 vs run 1: pass / p = 0.3"]
    assert repeat.compare([a, a[:1]]) == ["run 2: other gates than run 1"]
    runs = iter([a, a, b])
    monkeypatch.setattr(repeat, "one_run", lambda quick, out, t: next(runs))
    out = tmp_path / "r.md"
    assert repeat.main(["--runs", "3", "--out", str(out)]) == 1
    assert "DIFFERENT results" in out.read_text() and "run 3, 5 y" in out.read_text()
    runs = iter([a, a])
    assert repeat.main(["--runs", "2", "--quick", "--out", str(out)]) == 0
    assert "identical verdicts and margins" in out.read_text()
    assert "| 5 y | pass | p = 0.3 |" in out.read_text()

"""`qualify --quick` on this machine: every built gate passes, the report is whole, and the
gates that decode the mini model show the evidence that makes their pass mean something (their
planted defects fail them in tests/qualification_extra/). Its own file: the longest single test
of the suite, so pytest-xdist can run it beside the rest."""

import json

from qualification.qualify import main


def test_qualify_quick_passes_and_reports(tmp_path, capsys):
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "0 reference consistency" in out and "7 acceptance" in out
    rep = json.loads((tmp_path / "qualify.json").read_text())
    gates = rep["gates"]
    built = [g["verdict"] for g in gates if g["verdict"] not in ("not built", "GPU only")]
    assert len(built) >= 4 and set(built) == {"pass"}
    assert rep["model"].startswith("mini (models/mini")
    ev = {g["gate"]: " ".join(g["evidence"]) for g in gates}
    assert "program built 1, reused 2" in ev["3f engine reuse"]
    assert "uniforms differ at 192/192" in ev["6b seed width"]
    assert "every seed reproduces and equals the reference" in ev["6b seed width"]
    assert "1b lockstep kernels vs twins" in ev and "comparisons over" in ev[
        "1b lockstep kernels vs twins"]
    assert "every device decision equals the reference's" in ev["7b adaptive depth decisions"]

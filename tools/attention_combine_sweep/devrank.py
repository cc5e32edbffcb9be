"""One-off: run benchmarks.rank with HEAD's attention (base) or the combine's trip size / warps
overridden (new).

Run from the repository root (PYTHONPATH=.); "base" execs devbase/attention_combine.py and
devbase/attention.py, copies of kernels/ at the base revision (1573ba9, as the record
reports/benchmarks/h200-2026-12-01/session10/README.md names it) that are not in the repository: see
devrun3.sh beside this file for how to make them."""
import dataclasses
import sys

import kernels.attention as A
import kernels.attention.combine as AC

mode = sys.argv[1]
if mode == "base":
    for mod, path in ((AC, "devbase/attention_combine.py"), (A, "devbase/attention.py")):
        exec(compile(open(path).read(), path, "exec"), mod.__dict__)
else:
    full_sb, full_w, ring_sb, ring_w = (int(x) for x in sys.argv[2:6])
    orig = A.pick_config

    def patched(head_dim, capacity, ring):
        c = orig(head_dim, capacity, ring)
        if head_dim <= 64:
            return c
        if ring:
            return dataclasses.replace(c, combine_splits=ring_sb, combine_warps=ring_w)
        return dataclasses.replace(c, combine_splits=full_sb, combine_warps=full_w)

    A.pick_config = patched
from benchmarks.rank.main import main  # noqa: E402

raise SystemExit(main(sys.argv[2 if mode == "base" else 6:]))

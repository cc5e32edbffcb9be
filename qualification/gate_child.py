"""One qualify gate in this process, started by qualification/gate_pool.py: builds its own
models, runs the gate, and prints the result as one JSON line after gate_pool.RESULT_TAG."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from qualification.gate_pool import RESULT_TAG


def main(argv: list[str] | None = None) -> int:
    """One gate in this process: `python -m qualification.gate_child NAME [qualify options]`."""
    from qualification import qualify
    from qualification.gate_models import _models

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in qualify.GATE_NAMES:
        print(f"gate_child: name one gate of {', '.join(qualify.GATE_NAMES)}", file=sys.stderr)
        return 2
    name, q = argv[0], qualify.parse(argv[1:])
    import torch

    torch.set_num_threads(1)
    res = qualify.run_gate(dict(zip(qualify.GATE_NAMES, qualify.GATES, strict=True))[name], q,
                           _models(q))
    print(RESULT_TAG + json.dumps(asdict(res)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

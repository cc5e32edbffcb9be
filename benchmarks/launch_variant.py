"""`--variant FIELD=V,…` of the kernel benchmarks (bench_moe, bench_linear): a pinned launch
configuration (a frozen dataclass) with named fields changed, checked before any GPU work."""

from __future__ import annotations

import dataclasses


def parse_variant(text: str, pinned) -> tuple[str, object]:
    """"down_rows=1,down_block_n=128" → (that text, the pinned launch configuration with those
    fields changed); bool fields take 0/1, int fields ints; an unknown field or bad value
    raises SystemExit naming it."""
    fields = {f.name: f.type for f in dataclasses.fields(pinned)}
    changes = {}
    for part in text.split(","):
        key, eq, value = part.strip().partition("=")
        if not eq or key not in fields:
            raise SystemExit(f"--variant {text!r}: {part!r} is not FIELD=VALUE with FIELD one of "
                             f"{', '.join(fields)}")
        old = getattr(pinned, key)
        try:
            changes[key] = bool(int(value)) if isinstance(old, bool) else int(value)
        except ValueError:
            raise SystemExit(f"--variant {text!r}: {key} takes an integer, got {value!r}") from None
    try:
        return text, dataclasses.replace(pinned, **changes)
    except ValueError as e:
        raise SystemExit(f"--variant {text!r}: {e}") from None

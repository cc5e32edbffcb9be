"""The shipped trained mini model on the runtime, for the engine-level gates 3c (padded vs exact
width), 4b (cache settlement) and 7 (acceptance): its checkpoint, its tokenizer, fixed prompts
from the versioned request set, and a twins engine on the CPU (the same on every machine).

Prompts: for each request kind (completion, docstring, edit), the kind's median-length record
(sorted by prompt tokens, then id), cut to its last `tokens` tokens — a prompt that starts mid-file,
as the model card's are.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from corpus.requests import DEFAULT_REQUESTS, KINDS, load_requests
from corpus.tokenizer import load_tokenizer
from iquestrt import assets
from reference.checkpoint import INDEX, Checkpoint, load_checkpoint
from reference.config import SamplingDefaults
from reference.depth import FixedDepth

MINI = assets.default_model()
SAMPLING = SamplingDefaults(temperature=1.0, top_k=20, top_p=0.95)  # the model's defaults
RING_PAD = 8  # rings of window + 8 slots: the smallest legal pad at width 8, so rings wrap early


@dataclass(frozen=True)
class Prompt:
    id: str  # the request record's id
    ids: tuple[int, ...]


def load_mini(directory: Path = MINI) -> Checkpoint:
    if not (Path(directory) / "config.json").is_file():
        raise FileNotFoundError(f"{directory}: no checkpoint (the trained mini model ships in "
                                "models/mini)")
    return load_checkpoint(directory)


def checkpoint_digest(directory: Path = MINI) -> str:
    """sha256 over what load_checkpoint reads: each part's config, index and listed shards
    (other files in the folder — cards, logs, side data — do not count)."""
    h = hashlib.sha256()
    for part in (Path(directory), Path(directory) / "mtp"):
        index = part / INDEX
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        for p in (part / "config.json", index, *(part / s for s in shards)):
            h.update(p.relative_to(directory).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def prompts(tokens: int, directory: Path = MINI, requests: Path = DEFAULT_REQUESTS,
            kinds: tuple[str, ...] = KINDS) -> list[Prompt]:
    tok = load_tokenizer(Path(directory) / "tokenizer.json")
    out = []
    for kind in kinds:
        recs = sorted(load_requests(requests, kind), key=lambda r: (r["prompt_tokens"], r["id"]))
        rec = recs[len(recs) // 2]
        ids = tok.encode(rec["prompt"], add_special_tokens=False).ids
        if len(ids) < tokens:
            raise ValueError(f"{requests}/{kind}.jsonl: {rec['id']} has {len(ids)} tokens, "
                             f"{tokens} wanted")
        out.append(Prompt(rec["id"], tuple(ids[-tokens:])))
    return out


def first_difference(a: list, b: list) -> int | None:
    """Index of the first differing element (the shorter length if one is a prefix), or None."""
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    return i if i is not None or len(a) == len(b) else min(len(a), len(b))


def engine(ckpt: Checkpoint, depth: int, max_width: int = 8, max_positions: int = 512):
    from iquestrt.config import RuntimeConfig
    from iquestrt.engine import Engine
    from iquestrt.weights import from_checkpoint

    rcfg = RuntimeConfig(ops="twins", device="cpu", max_width=max_width, ring_pad=RING_PAD,
                         max_positions=max_positions, policy=FixedDepth(depth))
    return Engine(from_checkpoint(ckpt, "cpu", max_positions), rcfg)

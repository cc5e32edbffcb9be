"""The per-rank IQuest-Q1 round benchmark: one TP8 rank of the full model at real
shapes with random E4M3 weights, timed through the engine against its memory floor. Entry
points: `python -m benchmarks.rank` and `iquestrt bench round` (benchmarks/rank/main.py)."""

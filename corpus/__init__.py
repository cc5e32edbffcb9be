"""Text corpus for IQuest-Q1 mini models: CPython stdlib source, its file-level split, the
byte-level BPE tokenizer, flat token shards and the versioned request (prompt) sets.

Committed artifacts live in `data/`: `corpus_split.json`, `tokenizer.json`, `requests/v1/`.
Token shards are generated (`python -m corpus.shards --out DIR`) and not committed.
"""

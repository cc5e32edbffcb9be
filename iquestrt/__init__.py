"""IQuestRT: a single-request speculative-decoding runtime for IQuest-Q1.

    from iquestrt import LLM, SamplingParams      (iquestrt/api.py)

The API is imported on first use, so `import iquestrt.<module>` stays light.
"""

from __future__ import annotations

__all__ = ["LLM", "SamplingParams", "EngineOptions", "RequestOutput", "SpecDecodeStats",
           "RequestTiming", "TextStream"]


def __getattr__(name: str):
    if name == "EngineOptions":
        from iquestrt.engine_options import EngineOptions

        return EngineOptions
    if name in __all__:
        from iquestrt import api

        return getattr(api, name)
    raise AttributeError(f"module 'iquestrt' has no attribute {name!r}")

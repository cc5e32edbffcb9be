"""The chat template used when the checkpoint ships none (the mini tokenizer has none): each
message as "<role>: <content>" on its own lines, then "assistant:" for the reply.

    system: You write Python.
    user: Add two numbers.
    assistant:
"""

from __future__ import annotations

from iquestrt.server.schema import Message


def render(messages: list[Message]) -> str:
    return "".join(f"{m.role}: {m.content}\n" for m in messages) + "assistant:"

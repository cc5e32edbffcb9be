"""The exception families a user of the CLI, the Python API or the server can meet.

  * ValueError subclasses — bad input, found before any device work: ConfigError and
    CheckpointError (a checkpoint's files), SamplingError and ValueError (request fields),
    RuntimeConfigError (engine settings), OutputError (an output folder), PrefetchError,
    SnapshotError. The message names the file / tensor / field and the allowed range.
  * RuntimeFault subclasses — a fault found while decoding or while driving the machine:
    EngineError (a readiness flag, non-finite logits, a token outside the vocabulary; names the
    round and layer), DeviceLoopError (a CUDA driver call), TPError (a process group or a
    collective), ExperimentError (an experiment that cannot be trusted).
The CLI prints either as one line `iquestrt: error: …` (exit 2 and 1); the server answers 400
and 500 with an OpenAI-style error body and goes on serving.
"""

from __future__ import annotations


class RuntimeFault(RuntimeError):
    """A fault while decoding or driving the device; the message says where."""

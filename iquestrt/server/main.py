"""`iquestrt serve`: the arguments and the uvicorn run."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="checkpoint directory (default: the shipped mini model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--model-name", default=None,
                   help="the model id clients send (default: the checkpoint folder's name)")
    p.add_argument("--max-queue", type=int, default=8,
                   help="requests waiting behind the running one before 429 (default 8)")
    p.add_argument("--backend", choices=("runtime", "reference"), default="runtime")
    p.add_argument("--ops", choices=("auto", "kernels", "twins"), default="auto")
    p.add_argument("--draft-depth", default="3", help="0 … 7 or 'adaptive' (default 3)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + new tokens a request may hold (default 4096)")
    p.add_argument("--no-graphs", action="store_true", help="runtime on a GPU: eager rounds")


def run_from_args(a) -> int:
    import uvicorn

    from iquestrt import assets
    from iquestrt.api import LLM
    from iquestrt.engine_options import EngineOptions
    from iquestrt.server.app import ServerConfig, create_app

    if not 0 <= a.port < 65536:
        raise ValueError(f"--port: must be in [0, 65535], got {a.port}")
    if a.max_queue < 0:
        raise ValueError(f"--max-queue: must be >= 0, got {a.max_queue}")
    _can_listen(a.host, a.port)  # before the model loads
    checkpoint = a.checkpoint or assets.default_model()
    opts = EngineOptions(backend=a.backend, ops=a.ops, draft_depth=a.draft_depth,
                         max_model_len=a.max_model_len,
                         graphs=False if a.no_graphs or a.backend == "reference" else None)
    llm = LLM(checkpoint, opts)
    cfg = ServerConfig(model_name=a.model_name or Path(checkpoint).name, max_queue=a.max_queue)
    uvicorn.run(create_app(llm, cfg), host=a.host, port=a.port, log_level="info")
    return 0


def _can_listen(host: str, port: int) -> None:
    """Bind (host, port) as uvicorn will (SO_REUSEADDR) and let go; a busy port or an address
    not of this machine is named at once instead of after the model has loaded."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise ValueError(f"--host {host} --port {port}: cannot listen there: "
                         f"{e.strerror or e}") from None

"""Running the server: uvicorn over ``api.create_app``, with a graceful SIGTERM.

The engine's loop runs on the main thread and uvicorn on another (``Engine.run``: OpenMP's parallel regions
are fast on the thread that loaded the model). On SIGTERM (or SIGINT) the engine stops accepting at once (new
requests: 503), the requests already accepted run on for up to ``drain_timeout`` seconds and then end with a
final "abort" event, uvicorn closes its listening socket and waits for the open responses, and the process
exits 0. The signal handler runs on the main thread, between any two bytecodes of whatever it was doing -
possibly ``Engine.submit`` holding the engine's lock - so it only sets flags (``Engine.drain`` takes no lock,
uvicorn's ``handle_exit`` sets ``should_exit``).
"""

from __future__ import annotations

import signal
import sys
import threading
import time

from subquad.serve.api import MAX_BODY_MB, create_app
from subquad.serve.engine import Engine

MEMORY_FRACTION = 0.5   # the default --memory-mb: this share of the memory available once the model is loaded


def available_memory_bytes(device) -> int | None:
    """Memory free for states on ``device`` now: CUDA's free memory, else the host's MemAvailable from
    /proc/meminfo; None where neither can be read (no default budget then)."""
    import torch

    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def default_memory_mb(device) -> float | None:
    """``--memory-mb``'s default: ``MEMORY_FRACTION`` of ``available_memory_bytes`` (None: unknown, no bound)."""
    free = available_memory_bytes(device)
    return None if not free else MEMORY_FRACTION * free / 2 ** 20


def make_server(engine: Engine, model_name: str, *, host: str = "127.0.0.1", port: int = 8000, chat_template=None,
                api_key: str | None = None, drain_timeout: float = 10.0, log_level: str = "warning",
                max_body_mb: float = MAX_BODY_MB):
    """The uvicorn server for ``engine``, whose exit handler drains the engine (module doc)."""
    import uvicorn

    app = create_app(engine, model_name, chat_template, api_key, max_body_mb)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=drain_timeout + 5, lifespan="off")

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            """SIGTERM/SIGINT: drain (flags only: see the module doc), then uvicorn's own shutdown."""
            engine.drain(drain_timeout)        # before uvicorn waits on the open streams: let them end
            super().handle_exit(sig, frame)
            self._captured_signals.clear()     # uvicorn re-raises the signal once shut down; we exit 0 instead

    return Server(config)


def run(engine: Engine, model_name: str, *, host: str = "127.0.0.1", port: int = 8000, chat_template=None,
        api_key: str | None = None, drain_timeout: float = 10.0, log_level: str = "warning",
        max_body_mb: float = MAX_BODY_MB) -> int:
    """Serve until SIGTERM/SIGINT, drain, stop the engine; returns the exit status (0; 1 when uvicorn could not
    start, e.g. the port is taken)."""
    server = make_server(engine, model_name, host=host, port=port, chat_template=chat_template, api_key=api_key,
                         drain_timeout=drain_timeout, log_level=log_level, max_body_mb=max_body_mb)
    failed = []

    def serve_http():
        try:
            server.run()
        except BaseException as e:  # noqa: BLE001 - a port that cannot be bound ends uvicorn with SystemExit
            failed.append(e)

    http = threading.Thread(target=serve_http, name="subquad-http", daemon=True)
    for sig in (signal.SIGTERM, signal.SIGINT):      # uvicorn listens for signals on the main thread only
        signal.signal(sig, server.handle_exit)
    mb = None if engine.budget is None else engine.budget / 2 ** 20
    budget = "no memory budget" if mb is None else f"memory budget {mb:,.{0 if mb >= 10 else 2}f} MB"   # 0.5: not "0"
    from subquad.models.quant import weights_name

    weights = weights_name(engine.model)
    spec = engine.speculative
    spec = "" if spec is None else (f", speculative {spec if isinstance(spec, str) else 'draft model'} "
                                    f"({engine.draft_tokens} tokens)")
    print(f"subquad serve: {model_name} on http://{host}:{port}/v1 ({weights} weights{spec}, max batch "
          f"{engine.max_batch}, max context {engine.max_context}, state {engine.row_bytes(engine.max_context):,} bytes "
          f"per stream at the max context, {budget})", file=sys.stderr, flush=True)
    http.start()
    engine.run(until=lambda: not http.is_alive())     # until uvicorn has shut down (module doc)
    engine.drain(0)
    end = time.monotonic() + drain_timeout + 5
    engine.run(until=lambda: engine.drained.is_set() or time.monotonic() > end)
    return 0 if server.started and not failed else 1

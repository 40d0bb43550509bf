"""Running the server: uvicorn over ``api.create_app``, with a graceful SIGTERM.

On SIGTERM (or SIGINT) the engine stops accepting at once (new requests: 503), the requests already
accepted run on for up to ``drain_timeout`` seconds and then end with a final "abort" event, uvicorn closes
its listening socket and waits for the open responses, and the process exits 0.
"""

from __future__ import annotations

import sys

from subquad.serve.api import create_app
from subquad.serve.engine import Engine


def run(engine: Engine, model_name: str, *, host: str = "127.0.0.1", port: int = 8000, chat_template=None,
        api_key: str | None = None, drain_timeout: float = 10.0, log_level: str = "warning") -> int:
    import uvicorn

    app = create_app(engine, model_name, chat_template, api_key)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=drain_timeout + 5, lifespan="off")

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            engine.drain(drain_timeout)        # before uvicorn waits on the open streams: let them end
            super().handle_exit(sig, frame)
            self._captured_signals.clear()     # uvicorn re-raises the signal once shut down; we exit 0 instead

    server = Server(config)
    engine.start()
    print(f"subquad serve: {model_name} on http://{host}:{port}/v1 (max batch {engine.max_batch}, max context "
          f"{engine.max_context}, state {engine.row_bytes(engine.max_context):,} bytes per stream at the max context)",
          file=sys.stderr, flush=True)
    server.run()
    engine.drain(0)
    engine.drained.wait(drain_timeout + 5)
    engine.stop()
    return 0

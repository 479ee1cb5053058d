"""The OpenAI-compatible server: `metrale serve` builds an engine, runs it on its own thread
(`engine_loop`) and serves the HTTP API (`app`) with uvicorn."""

from __future__ import annotations

import contextlib
import gc
import logging
import signal
from pathlib import Path

from metrale.api import engine_config_from
from metrale.engine.llm import LLMEngine

log = logging.getLogger(__name__)


def build(
    model: str | Path | None,
    api_key: str | None = None,
    max_waiting: int = 256,
    served_name: str | None = None,
    **engine_options,
):
    """(FastAPI app, EngineLoop) for a model directory (the default model when None)."""
    from metrale.server.app import create_app
    from metrale.server.engine_loop import EngineLoop

    if model is None:
        from metrale.default_model import default_model_dir

        model = default_model_dir()
    engine = LLMEngine(model, engine_config_from(engine_options))
    loop = EngineLoop(engine, max_waiting=max_waiting)
    app = create_app(loop, served_name or Path(model).name, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        # The engine lives as long as the process: keep its model, caches and graphs out of the
        # cyclic collector's full passes, which would otherwise stall steps for milliseconds
        # (vLLM's engine process does the same).
        gc.collect()
        gc.freeze()
        loop.start()
        yield
        # NOTE: graceful shutdown (SIGTERM): in-flight requests end with finish_reason "abort".
        loop.stop()

    app.router.lifespan_context = lifespan
    return app, loop


def serve(
    model=None,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    **engine_options,
) -> None:
    """Serve until SIGINT or SIGTERM, then shut down gracefully and return (exit status 0)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises the signal after its shutdown (exit status -15); here a signal
            # only asks for the graceful shutdown, and `serve` then returns normally.
            def stop(*_):
                self.should_exit = True

            previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    app, _ = build(model, api_key, **engine_options)
    log.info("serving on http://%s:%d", host, port)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30
    )
    Server(config).run()

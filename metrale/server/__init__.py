"""The OpenAI-compatible server: `metrale serve` builds an engine, runs it on its own thread
(`engine_loop`) and serves the HTTP API (`app`) with uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from pathlib import Path

from metrale.api import engine_config_from
from metrale.engine.heap import freeze_startup_heap
from metrale.engine.llm import LLMEngine
from metrale.hub import is_hub_id

log = logging.getLogger(__name__)


def build(
    model: str | Path | None,
    api_key: str | None = None,
    max_waiting: int = 256,
    served_name: str | None = None,
    max_body_bytes: int = 32 << 20,
    access_log: bool = False,
    allowed_origins: tuple[str, ...] = (),
    reasoning_parser: str | None = None,
    **engine_options,
):
    """(FastAPI app, EngineLoop) for a model directory (the default model when None)."""
    from metrale.server.app import create_app
    from metrale.server.engine_loop import EngineLoop

    check_api_key(api_key)

    if model is None:
        from metrale.default_model import default_model_dir

        model = default_model_dir()
    engine = LLMEngine(model, engine_config_from(engine_options))
    loop = EngineLoop(engine, max_waiting=max_waiting)
    # a Hub id is served under its own name, a directory under its last component (resolved:
    # "." or "dir/.." have none of their own, and an empty name matched no request's `model`)
    name = served_name or (str(model) if is_hub_id(model) else Path(model).resolve().name)
    app = create_app(
        loop,
        name,
        api_key,
        max_body_bytes,
        access_log=access_log,
        allowed_origins=allowed_origins,
        reasoning_parser=reasoning_parser,
    )
    loop.model_name = name

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        # The engine lives as long as the process: keep its model, caches and graphs out of the
        # cyclic collector's full passes, which would otherwise stall steps for milliseconds
        # (vLLM's engine process does the same).
        freeze_startup_heap()  # one engine for the process: no full collections mid-run
        loop.start()
        yield
        # NOTE: graceful shutdown: `serve` drained first (no admission, a grace period, then
        # every request aborted with finish_reason "abort"); this ends whatever is left.
        loop.stop()
        engine.shutdown()  # tensor-parallel workers, if any

    app.router.lifespan_context = lifespan
    return app, loop


HEADER_TIMEOUT = 30.0  # seconds a new connection may take to send its request's headers


def http_protocol(header_timeout: float = HEADER_TIMEOUT):
    """uvicorn's h11 protocol with a deadline for a new connection's request headers: uvicorn
    has none, so a client that sends half a request would hold its connection forever (idle
    keep-alive connections already close after uvicorn's timeout_keep_alive)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadlineH11(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._deadline = None
            self._arm()

        def _arm(self) -> None:
            """Start the clock for the next request: it must arrive complete in time."""
            self._waiting_for = self.cycle  # the cycle a new request will replace
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = asyncio.get_running_loop().call_later(header_timeout, self._late)

        def _late(self) -> None:
            self._deadline = None
            if self.cycle is self._waiting_for and not self.transport.is_closing():
                log.info("closing a connection that sent no complete request in time")
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not self._waiting_for and self._deadline is not None:
                self._deadline.cancel()  # a complete request came
                self._deadline = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # a kept-alive connection gets the same deadline again

        def connection_lost(self, exc) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

    return HeaderDeadlineH11


def startup_banner(loop, host: str, port: int, keyed: bool) -> str:
    """What `metrale serve` prints before it takes requests: where, what and how."""
    engine = loop.engine
    runner, cfg, spec = engine.runner, engine.config, engine.spec
    pages = engine.allocator.num_usable
    drafting = "off"
    if spec is not None:
        dcut = "D-Cut" if spec.cfg.dcut else "fixed depth"
        drafting = f"{spec.drafter.name}, up to {spec.cfg.num_drafts} drafts, {dcut}"
    keyed_note = ", API key required" if keyed else ""
    device = f"{runner.device}, {str(runner.dtype).removeprefix('torch.')}"
    if cfg.tensor_parallel_size > 1:
        split = "experts split across ranks" if cfg.expert_parallel else "each expert split"
        moe = f", {split}" if engine.model_config.hybrid is not None else ""
        device += f", tensor parallel over {cfg.tensor_parallel_size} ranks{moe}"
    return "\n".join(
        [
            f"metrale serve: http://{host}:{port}/v1 (OpenAI API{keyed_note})",
            f"  model       {loop.model_name} ({engine.model_dir})",
            f"  device      {device}",
            f"  KV pool     {pages} pages x {cfg.page_size} rows ({pages * cfg.page_size} tokens)",
            f"  limits      max_model_len {engine.context_len}, max_num_seqs {cfg.max_num_seqs}",
            f"  speculation {drafting}",
        ]
    )


def check_api_key(api_key) -> None:
    """An API key is None (no key) or a non-empty string: an empty one turned authentication
    off while the banner said a key was required (found in review)."""
    if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
        raise ValueError("api_key must be a non-empty string (leave it out to serve without one)")


def check_serve_options(
    port, max_body_bytes, shutdown_grace, host: str = "127.0.0.1", api_key=None
) -> None:
    """Refuse bad listener settings before the model loads (minutes, on a large one): uvicorn
    would only fail on them at bind time (a host that does not resolve, a port in use, in its
    own words), or accept a negative body limit or grace period."""
    check_api_key(api_key)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an integer in [0, 65535], got {port!r}")
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int):
        raise ValueError(f"max_body_bytes must be a positive integer, got {max_body_bytes!r}")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be a positive integer, got {max_body_bytes!r}")
    grace = shutdown_grace
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not 0 <= grace < 1e9:
        raise ValueError(f"shutdown_grace must be a finite number of seconds >= 0, got {grace!r}")
    _probe_listen(host, port)  # (last: the cheaper checks first)


def _probe_listen(host: str, port: int) -> None:
    """Bind, as uvicorn's server will (asyncio's `create_server`: every address the host
    resolves to, "" for all interfaces, IPv6 sockets v6-only, SO_REUSEADDR), and let go."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"host: {host!r} does not resolve to an address ({e})") from None
    probes = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            try:
                probe = socket.socket(family, kind, proto)
            except OSError:  # (an IPv6 address where IPv6 is off: asyncio skips it too)
                continue
            probes.append(probe)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as e:
                where = f"[{address[0]}]" if family == socket.AF_INET6 else address[0]
                raise ValueError(f"port: cannot listen on {where}:{port} ({e.strerror})") from None
    finally:
        for probe in probes:
            probe.close()


def serve(
    model=None,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_body_bytes: int = 32 << 20,
    shutdown_grace: float = 30.0,
    access_log: bool = True,
    allowed_origins: tuple[str, ...] = (),
    reasoning_parser: str | None = None,
    served_name: str | None = None,
    **engine_options,
) -> None:
    """Serve until SIGINT or SIGTERM, then drain and return (exit status 0): the listener closes
    (new connections are refused, as vLLM's are), in-flight requests have `shutdown_grace`
    seconds to finish, then each remaining one ends with finish_reason "abort" in a well-formed
    response or final chunk. `served_name`: the model's name in the API (`--served-model-name`;
    by default the Hub id, or the directory's name)."""
    check_serve_options(port, max_body_bytes, shutdown_grace, host, api_key)
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises the signal after its shutdown (exit status -15); here a signal
            # only asks for the graceful shutdown, and `serve` then returns normally.
            def stop(*_):
                if loop.draining:  # a second signal: stop now, as uvicorn does
                    self.force_exit = True
                else:
                    loop.drain(shutdown_grace)
                self.should_exit = True

            previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    app, loop = build(
        model,
        api_key,
        max_body_bytes=max_body_bytes,
        access_log=access_log,
        allowed_origins=allowed_origins,
        reasoning_parser=reasoning_parser,
        served_name=served_name,
        **engine_options,
    )
    print(startup_banner(loop, host, port, api_key is not None), file=sys.stderr, flush=True)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        # past the grace period the drain aborts what is left; those responses then finish
        timeout_graceful_shutdown=shutdown_grace + 10,
        http=http_protocol(),
    )
    Server(config).run()

"""The engine on its own thread, fed through queues, so the HTTP event loop never waits on a step.

Handlers validate a request on their own thread (`LLMEngine.validate` reads no engine state),
then `submit` it; the engine thread adds it before its next step and pushes every RequestOutput
of it to the request's asyncio queue. `abort` ends a request from any thread (a client that went
away), and admission is bounded by sequences (a request of n choices counts n): past
`max_waiting` sequences beyond `max_num_seqs`, `submit` raises `Busy`. `drain` stops admitting
(Busy: "shutting down") and, after a grace period, aborts whatever is still in flight, so each
client gets a well-formed response ending with finish_reason "abort".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import uuid
from dataclasses import dataclass

from metrale.config import SamplingParams
from metrale.distributed.parallel import DistributedError
from metrale.engine.llm import LLMEngine
from metrale.outputs import RequestOutput

log = logging.getLogger(__name__)


class Busy(Exception):
    """The waiting queue is full; the client should retry later."""


@dataclass
class _Pending:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    outputs: asyncio.Queue
    loop: asyncio.AbstractEventLoop


class EngineLoop:
    def __init__(self, engine: LLMEngine, max_waiting: int = 256) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.model_name = "metrale"  # the served name (metric labels); `build` sets it
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("add", _Pending) | ("abort", id)
        self._live: dict[str, _Pending] = {}
        self._live_seqs = 0  # sequences of the live requests (each request's n)
        self._admission = threading.Lock()  # _live and _live_seqs change on two threads
        self.draining = False
        # why the engine can run no more (a tensor-parallel rank failed): health says so, new
        # requests get a 503, the ones in flight end with finish_reason "abort"
        self.fatal: str | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrale-engine", daemon=True)
        # Guards the telemetry/allocator reads of /metrics against the engine thread's writes.
        self.lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is in flight (clients see finish_reason "abort") and join the thread."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def new_id(self, prefix: str) -> str:
        """A unique request id, as OpenAI's (`chatcmpl-<hex>`)."""
        return f"{prefix}-{uuid.uuid4().hex}"

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams) -> asyncio.Queue:
        """Queue an already validated request; returns the queue its outputs arrive on."""
        return self.submit_all([(request_id, prompt, params)])[0]

    def submit_all(
        self, requests: list[tuple[str, list[int], SamplingParams]]
    ) -> list[asyncio.Queue]:
        """Queue already validated requests together (a completions call's prompts): all are
        admitted or none (Busy). As one request of n sequences, they may exceed the capacity
        when nothing else is live: admitted one by one, the later ones were refused by the
        earlier ones, so on an idle server such a call got a 503 "retry later" every time."""
        if self.fatal is not None:
            raise Busy(f"the engine stopped: {self.fatal}")
        if self.draining:
            raise Busy("the server is shutting down")
        capacity = self.max_waiting + self.engine.config.max_num_seqs
        loop = asyncio.get_running_loop()
        pendings = [_Pending(r, p, params, asyncio.Queue(), loop) for r, p, params in requests]
        seqs = sum(p.params.n for p in pendings)
        with self._admission:
            if self._live and self._live_seqs + seqs > capacity:
                raise Busy(f"{self._live_seqs} sequences in flight; retry later")
            for pending in pendings:
                self._live[pending.request_id] = pending
            self._live_seqs += seqs
        for pending in pendings:
            self._inbox.put(("add", pending))
        self._wake.set()
        return [pending.outputs for pending in pendings]

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def drain(self, grace: float) -> None:
        """Stop admitting; after `grace` seconds abort every request still in flight."""
        self.draining = True
        timer = threading.Timer(grace, self._abort_all)
        timer.daemon = True
        timer.start()

    def _abort_all(self) -> None:
        for request_id in list(self._live):
            self.abort(request_id)

    def _forget(self, request_id: str) -> _Pending | None:
        with self._admission:
            pending = self._live.pop(request_id, None)
            if pending is not None:
                self._live_seqs -= pending.params.n
        return pending

    def _deliver(self, pending: _Pending, item: RequestOutput | Exception) -> None:
        # (RuntimeError: its event loop is closed, nobody is left to answer)
        with contextlib.suppress(RuntimeError):
            pending.loop.call_soon_threadsafe(pending.outputs.put_nowait, item)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    with self.lock:  # /metrics reads what this changes
                        self.engine.add_request(item.request_id, item.prompt, item.params)
                except Exception as e:  # noqa: BLE001 (that request's failure alone)
                    # ValueError: validated already, a race with the pool, say (a 400). Anything
                    # else is the engine's fault (a 500): it used to escape `_run` and end the
                    # engine thread, every client then waiting forever while /health said ok
                    if not isinstance(e, ValueError):
                        log.exception("adding request %s failed", item.request_id)
                    self._forget(item.request_id)
                    self._deliver(item, e)
            else:
                self._end(item)

    def _end(self, request_id: str) -> None:
        """Abort a request and give its client the final output (finish_reason "abort")."""
        try:
            with self.lock:
                out = self.engine.abort_request(request_id)
        except Exception as e:  # noqa: BLE001 (the client still gets an answer)
            log.exception("aborting request %s failed", request_id)
            out = e
        pending = self._forget(request_id)
        if pending is not None and out is not None:
            self._deliver(pending, out)

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 (the thread ends here: say so to everyone)
            # (what the step's own net does not catch: health turns 503, new requests too)
            log.exception("the engine thread stopped")
            self.fatal = f"the engine thread stopped: {type(e).__name__}: {e}"
            self.draining = True
        finally:
            # (requests still in the inbox are added first, so that aborting them answers
            # their clients too: left there, they were never answered)
            try:
                self._drain_inbox()
            finally:
                for request_id in list(self._live):
                    self._end(request_id)

    def _serve(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                with self.lock:
                    outputs = self.engine.step()
            except DistributedError as e:  # no step can run again
                log.error("engine stopped: %s", e)
                self.fatal, self.draining = str(e), True
                break
            except Exception:  # noqa: BLE001 (the engine isolates sequences; this is a last net)
                log.exception("engine step failed")
                continue
            for out in outputs:
                pending = self._live.get(out.request_id)
                if pending is None:
                    continue
                self._deliver(pending, out)
                if out.finished:
                    self._forget(out.request_id)

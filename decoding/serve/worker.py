"""The engine's step loop in one background thread, handing tokens to asyncio consumers.

The :class:`~decoding.engine.Engine` is not thread-safe, so only the worker thread touches it.
The event loop hands it commands (submit, abort) through a locked list and wakes it; the worker
runs them between steps, steps while any request is waiting or running, and delivers each
request's new tokens to that request's ``asyncio.Queue`` with ``loop.call_soon_threadsafe``.

Each queue item is ``(index, kind, payload)``: ``index`` the choice within its HTTP request,
``kind`` one of ``"tokens"`` (``(new ids, their sampling.TokenLogprob records or None)``: records
when the choice was submitted with ``logprobs``), ``"done"`` (the request finished in the
engine) or ``"error"`` (an exception: the submission was rejected, the engine failed
repeatedly, or the worker stopped). A consumer that stops listening (a client disconnected, a
stop string matched) calls :meth:`Worker.abort`; its pages return to the pool at the worker's
next command drain, before the next step.

After every step the worker publishes ``engine.stats()`` as :attr:`Worker.stats` (a dict
replaced, never mutated, so other threads may read it) for ``/health`` and ``/metrics``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time

from decoding.engine import Engine
from decoding.sampling import SamplingConfig

log = logging.getLogger("decoding.serve")

# Consecutive failed steps after which the requests in the engine are failed rather than
# recomputed again (the engine rebuilds itself and keeps every request after a failed step).
MAX_STEP_FAILURES = 3


@dataclasses.dataclass(eq=False)
class Handle:
    """One choice of one HTTP request: where its tokens go, and its timing."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int
    rid: int | None = None  # the engine's id, once submitted
    closed: bool = False  # aborted by its consumer; deliver nothing more
    submitted: float = 0.0
    last: float | None = None  # when its previous tokens were delivered

    def put(self, kind: str, payload) -> None:
        if self.closed:
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, kind, payload))
        except RuntimeError:  # the event loop is closed: nobody is listening
            self.closed = True


class Observer:
    """What the worker reports to (``metrics.Metrics`` implements it); the default is a no-op."""

    def first_token(self, seconds: float) -> None: ...

    def inter_token(self, seconds: float, count: int) -> None: ...

    def generated(self, count: int) -> None: ...


class Worker:
    """Runs ``engine`` in a daemon thread (started by :meth:`start`, stopped by :meth:`close`).

    ``max_queue`` bounds the choices submitted and not finished (waiting or running):
    :meth:`full` says when a new request of ``n`` choices would pass it.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_queue: int = 256,
        observer: Observer | None = None,
        idle_step_s: float | None = None,
    ):
        self.engine = engine
        # A decoding.distributed.DistributedEngine: the other processes wait inside its step's
        # broadcast, so an idle worker still steps every idle_step_s (their heartbeat) and
        # shuts the engine down when it stops (they return from serve_followers).
        self.idle_step_s = idle_step_s
        self.max_queue = max_queue
        self.observer = observer or Observer()
        self._cv = threading.Condition()
        self._commands: list = []
        self._handles: dict[int, Handle] = {}  # engine id -> handle (worker thread only)
        self._pending = 0  # choices submitted and not finished or aborted (event loop thread)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)
        self.stats: dict = engine.stats()
        self.step_failures = 0

    # ----------------------------------------------------------------------------- event loop

    def full(self, n: int) -> bool:
        return self._pending + n > self.max_queue

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(
        self,
        queue: asyncio.Queue,
        index: int,
        prompt: list[int],
        max_new_tokens: int,
        *,
        sampling: SamplingConfig,
        eos_id: int | None,
        seed: int | None,
        logprobs: int | None = None,
    ) -> Handle:
        """Queues one choice; its tokens arrive on ``queue`` tagged with ``index``
        (``logprobs``: ``Engine.submit``'s)."""
        handle = Handle(asyncio.get_running_loop(), queue, index, submitted=time.perf_counter())
        self._pending += 1

        def command():
            try:
                handle.rid = self.engine.submit(
                    prompt,
                    max_new_tokens,
                    sampling=sampling,
                    eos_id=eos_id,
                    seed=seed,
                    logprobs=logprobs,
                )
            except Exception as e:  # a request the server's own checks let through
                handle.put("error", e)
                return
            self._handles[handle.rid] = handle

        self._send(command)
        return handle

    def abort(self, handle: Handle) -> None:
        """Stops ``handle``'s request (nothing more is delivered); its pages are freed before the
        next step. Idempotent; a finished request is left alone."""
        if handle.closed:
            return
        handle.closed = True
        self._pending -= 1

        def command():
            if handle.rid is not None and self._handles.pop(handle.rid, None) is handle:
                self.engine.abort(handle.rid)

        self._send(command)

    def finished(self, handle: Handle) -> None:
        """The consumer saw ``done`` (or ``error``) for ``handle``: it no longer counts."""
        if not handle.closed:
            handle.closed = True
            self._pending -= 1

    def _send(self, command) -> None:
        with self._cv:
            self._commands.append(command)
            self._cv.notify()

    # ----------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 30.0) -> dict:
        """Aborts every request still in the engine (its consumer gets an ``error``), stops the
        thread and returns the engine's final stats (``pages_used`` is 0 when nothing leaked)."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return self.stats

    # ----------------------------------------------------------------------------- worker thread

    def _run(self) -> None:
        while True:
            with self._cv:
                idle = False
                while not (self._commands or self._stopping or self.engine.busy or idle):
                    idle = not self._cv.wait(self.idle_step_s) and self.idle_step_s is not None
                commands, self._commands = self._commands, []
                stopping = self._stopping
            for command in commands:
                try:
                    command()
                except Exception:
                    log.exception("engine command failed")
            if stopping:
                self._abort_all(RuntimeError("the server is shutting down"))
                self.stats = self.engine.stats()
                if self.idle_step_s is not None:
                    self.engine.shutdown()
                return
            if self.engine.busy or self.idle_step_s is not None:
                self._step()
            self.stats = self.engine.stats()

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as e:
            # The engine rebuilt itself and still holds every request: retry a few times, then
            # fail the requests it holds (the cause cannot be pinned on one of them).
            self.step_failures += 1
            log.exception("engine step failed (%d in a row)", self.step_failures)
            if self.step_failures >= MAX_STEP_FAILURES:
                self._abort_all(e)
            return
        self.step_failures = 0
        records = self.engine.pop_logprobs()  # of exactly the tokens in events
        now = time.perf_counter()
        count = 0
        for rid, tokens in events.items():
            handle = self._handles.get(rid)
            if handle is None:
                continue
            if handle.last is None:
                self.observer.first_token(now - handle.submitted)
            else:
                self.observer.inter_token(now - handle.last, len(tokens))
            handle.last = now
            count += len(tokens)
            handle.put("tokens", (tokens, records.get(rid)))
        if count:
            self.observer.generated(count)
        for rid in self.engine.pop_finished():
            handle = self._handles.pop(rid, None)
            if handle is not None:
                handle.put("done", None)

    def _abort_all(self, error: BaseException) -> None:
        for rid, handle in list(self._handles.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("aborting request %d failed", rid)
            handle.put("error", error)
        self._handles.clear()
        self.engine.pop_finished()

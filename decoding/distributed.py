"""The engine as one SPMD program over ``jax.distributed`` processes.

With a model sharded over a mesh that spans processes (``models.shard``), every jitted step is
a collective: every process must call it, with the same inputs, in the same order. So every
process runs its own :class:`~decoding.Engine` (scheduler, page allocator, block tables) on the
same requests, and the schedulers, being deterministic, make the same decisions step by step.

How a request reaches the other processes: only process 0 (the leader) talks to clients.
``submit`` and ``abort`` on the leader apply to its engine at once (so a malformed request is
refused there, before it is queued) and are appended to a log of commands. At the start of
every :meth:`DistributedEngine.step`, the leader encodes the commands logged since the last
step into fixed-size int32 blocks (:data:`RECORD` header fields + ``max_seq_len`` token slots
per command, :data:`SLOTS` commands per block) and sends them with
``jax.experimental.multihost_utils.broadcast_one_to_all``: first a count, then one block per
``SLOTS`` commands. The other processes (followers) decode the blocks and replay the commands
on their engines in the leader's order, which also gives the same request ids. Then every
process steps its engine: the same scheduler state, the same host inputs to the same jitted
steps, the same tokens (every process gets the whole result, ``models.sharding.to_host``).

    eng = DistributedEngine(model, num_pages=256)  # on every process, same arguments
    if eng.is_leader:
        rid = eng.submit(prompt, 64)
        while eng.busy:
            eng.step()
        print(eng.pop_finished()[rid])
        eng.shutdown()  # followers return from serve_followers()
    else:
        eng.serve_followers()

A follower blocks inside the broadcast until the leader steps: a leader with nothing to do
should still call ``step()`` now and then (an empty step costs one small broadcast), and
``shutdown()`` before it exits. A process that dies is detected by ``jax.distributed``'s
heartbeat (``decoding.launch --heartbeat-timeout``): the others then exit with an error.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

from decoding.engine import Engine
from decoding.sampling import SamplingConfig

SLOTS = 8  # commands per broadcast block: the buffer size is fixed, so no retrace per step
# Header of one command record: kind, request id, prompt length, max_new_tokens, eos id,
# seed, top_k, then temperature, top_p and min_p as float32 bits, then logprobs (-1: None).
RECORD = 11
_NONE, _SUBMIT, _ABORT, _STOP = 0, 1, 2, 3


def _bits(x: float) -> int:
    return int(np.float32(x).view(np.int32))


def _float(bits) -> float:
    return float(np.int32(bits).view(np.float32))


class DistributedEngine:
    """An :class:`~decoding.Engine` replicated on every process of ``jax.distributed``.

    Args:
      model: a ``models.Transformer``, sharded over a mesh of every process's devices (or
        not sharded: then every process computes alone, which is only useful for testing).
      **engine_args: :class:`~decoding.Engine`'s keyword arguments; the same on every process.
        A ``draft`` needs a fixed ``num_draft_tokens``.

    ``submit``, ``abort``, ``run_until_done`` and ``shutdown`` are the leader's (process 0);
    the followers call :meth:`serve_followers`, which makes the same broadcasts and steps as the
    leader's :meth:`step` calls. ``busy`` and ``pop_finished`` work on every process.
    """

    def __init__(self, model, **engine_args):
        if engine_args.get("draft") is not None and engine_args.get("num_draft_tokens") is None:
            # k chosen from step times measured on each process could differ between them,
            # and so would the programs they run: a deadlock in the first collective.
            raise ValueError(
                "num_draft_tokens must be given with a draft: each process choosing its own k "
                "from its own timings would run different steps"
            )
        self.engine = Engine(model, **engine_args)
        self.is_leader = jax.process_index() == 0
        self._log: list[np.ndarray] = []
        self._stopped = False
        self._width = RECORD + self.engine.max_seq_len

    def warmup(self) -> float:
        """:meth:`Engine.warmup` -> seconds; every process calls it at the same point (its
        steps are the same programs, in the same order, on every process)."""
        return self.engine.warmup()

    # ----------------------------------------------------------------------------- leader

    def _check_leader(self, what: str) -> None:
        if not self.is_leader:
            raise RuntimeError(
                f"{what}() is the leader's (process 0); process {jax.process_index()} only "
                "steps: call serve_followers()"
            )

    def submit(
        self,
        prompt_tokens,
        max_new_tokens: int,
        *,
        sampling: SamplingConfig | None = None,
        eos_id: int | None = None,
        seed: int | None = None,
        logprobs: int | None = None,
    ) -> int:
        """:meth:`Engine.submit` on the leader -> the request id; the followers get the request
        at the next :meth:`step`. Raises what ``Engine.submit`` raises, and nothing is sent."""
        self._check_leader("submit")
        rid = self.engine.submit(
            prompt_tokens,
            max_new_tokens,
            sampling=sampling,
            eos_id=eos_id,
            seed=seed,
            logprobs=logprobs,
        )
        req = self.engine.scheduler.waiting[-1]  # the request just queued
        s = req.sampling
        rec = np.zeros(self._width, np.int32)
        rec[:RECORD] = [
            _SUBMIT,
            rid,
            len(req.tokens),
            req.max_new,
            -1 if req.eos_id is None else req.eos_id,
            np.uint32(req.seed).view(np.int32),  # seeds span [0, 2**32)
            s.top_k,
            _bits(s.temperature),
            _bits(s.top_p),
            _bits(s.min_p),
            -1 if logprobs is None else logprobs,
        ]
        rec[RECORD : RECORD + len(req.tokens)] = req.tokens
        self._log.append(rec)
        return rid

    def abort(self, rid) -> list[int]:
        """:meth:`Engine.abort` on the leader; the followers abort at the next :meth:`step`."""
        self._check_leader("abort")
        out = self.engine.abort(rid)
        rec = np.zeros(self._width, np.int32)
        rec[:2] = [_ABORT, rid]
        self._log.append(rec)
        return out

    def shutdown(self) -> None:
        """Tells the followers to return from :meth:`serve_followers` (a last broadcast)."""
        self._check_leader("shutdown")
        rec = np.zeros(self._width, np.int32)
        rec[0] = _STOP
        self._log.append(rec)
        self._exchange()

    # ----------------------------------------------------------------------------- everyone

    def _exchange(self) -> None:
        """Broadcasts the leader's command log; followers replay it on their engines. Every
        process makes the same broadcasts: the count, then one block per ``SLOTS`` commands."""
        log, self._log = self._log, []
        count = int(multihost_utils.broadcast_one_to_all(np.int32(len(log))))
        for start in range(0, count, SLOTS):
            block = np.zeros((SLOTS, self._width), np.int32)
            if self.is_leader:
                part = log[start : start + SLOTS]
                block[: len(part)] = part
            block = np.asarray(multihost_utils.broadcast_one_to_all(block))
            for rec in block[: min(SLOTS, count - start)]:
                self._replay(rec)

    def _replay(self, rec: np.ndarray) -> None:
        kind = int(rec[0])
        if kind == _STOP:
            self._stopped = True
        if self.is_leader or kind not in (_SUBMIT, _ABORT):
            return  # the leader applied its commands when they were made
        if kind == _ABORT:
            self.engine.abort(int(rec[1]))
            return
        rid, n, max_new, eos, seed, top_k = (int(x) for x in rec[1:7])
        seed = int(np.int32(seed).view(np.uint32))
        sampling = SamplingConfig(
            temperature=_float(rec[7]), top_k=top_k, top_p=_float(rec[8]), min_p=_float(rec[9])
        )
        logprobs = int(rec[10])
        got = self.engine.submit(
            rec[RECORD : RECORD + n].tolist(),
            max_new,
            sampling=sampling,
            eos_id=None if eos < 0 else eos,
            seed=seed,
            logprobs=None if logprobs < 0 else logprobs,
        )
        if got != rid:
            raise RuntimeError(f"request ids diverged: leader {rid}, process got {got}")

    def step(self) -> dict[int, list[int]]:
        """Every process: receive the leader's commands, then one :meth:`Engine.step` ->
        ``{request id: [new tokens]}``, the same on every process."""
        self._exchange()
        return self.engine.step()

    @property
    def busy(self) -> bool:
        """:attr:`Engine.busy` (the same on every process after a step)."""
        return self.engine.busy

    @property
    def stopped(self) -> bool:
        """The leader called :meth:`shutdown`."""
        return self._stopped

    def pop_finished(self) -> dict[int, list[int]]:
        """:meth:`Engine.pop_finished` (every process holds the same results)."""
        return self.engine.pop_finished()

    def pop_logprobs(self) -> dict:
        """:meth:`Engine.pop_logprobs` (every process holds the same records)."""
        return self.engine.pop_logprobs()

    def stats(self) -> dict:
        """:meth:`Engine.stats` of this process's engine."""
        return self.engine.stats()

    # What a front end (the server) reads of the engine, the same on every process.
    config = property(lambda self: self.engine.config)
    allocator = property(lambda self: self.engine.allocator)
    max_seq_len = property(lambda self: self.engine.max_seq_len)
    page_size = property(lambda self: self.engine.page_size)

    def run_until_done(self) -> dict[int, list[int]]:
        """The leader: steps until no request is waiting or running -> ``pop_finished()``
        (the followers step along inside :meth:`serve_followers`)."""
        self._check_leader("run_until_done")
        while self.engine.busy:
            self.step()
        return self.pop_finished()

    def serve_followers(self, max_steps: int | None = None) -> int:
        """A follower's loop: step until the leader's :meth:`shutdown` (or ``max_steps``) ->
        the number of steps taken."""
        steps = 0
        while not self._stopped and (max_steps is None or steps < max_steps):
            self._exchange()
            if self._stopped:
                break
            self.engine.step()
            steps += 1
        return steps

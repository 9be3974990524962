"""The engine's scheduler: pure Python, no device work. Who runs this step, with which pages.

It owns the requests (waiting, running, finished), the page allocator and block tables, and the
prefix cache's bookkeeping (``decoding.paging``): admission with prefix hits, prefill chunks,
growth of decoding rows, preemption, retirement, abort, and the reset after a failed step.

One engine step is three calls (``decoding.engine``)::

    plan = scheduler.schedule(ahead)        # host decisions, pages taken: a StepPlan
    out = runner.run(plan)                  # device work only (decoding.runner)
    emitted = scheduler.postprocess(plan, out.tokens)  # tokens fed back, pages registered

``schedule`` decides the whole step before any device work: it admits, cuts prefill chunks,
grows the decoding rows and preempts, advancing each request's ``computed`` as if the plan had
run (so a request whose prefill ends in this plan decodes in it too). What it returns is all the
runner needs: the page copies (copy on write) to apply first, the prefill chunks in order, the
rows to decode. A request preempted while planning leaves the plan with its chunks and copies:
its pages may already serve another row in the same plan, so nothing of it may run.

Pages are registered in the prefix cache only in ``postprocess``, once the plan ran: a page is
promised to later prefix hits only when its keys and values are in the pool.

Sliding-window layers that keep rings (``models.kv_cache``): a prefix hit shares only the global
layers' pages, so the request's ring must be rebuilt for the positions before the hit that later
queries still see through the window. A hit at position ``h`` leaves ``replay =
min(h, replay_tokens)`` positions to recompute first (a replay chunk: the global layers read
their cached pages); the engine sets ``replay_tokens`` to ``n_s * (W - 1)`` for ``n_s`` sliding
layers of window W (why that many: ``decoding.engine``).

Invariant kept for the engine's recovery (``reset``): at every bytecode a request is live
(``live``: waiting, running or between the two) or finished, never neither.
"""

from __future__ import annotations

import collections
import dataclasses

from decoding.paging import BlockTables, PageAllocator, block_hashes, pages_for
from decoding.sampling import SamplingConfig


@dataclasses.dataclass(eq=False)
class Request:
    rid: int
    prompt_len: int
    max_new: int
    sampling: SamplingConfig
    eos_id: int | None
    seed: int
    tokens: list[int]  # prompt, then the generated tokens
    computed: int = 0  # leading positions whose keys/values are in the cache
    replay: int = 0  # positions before `computed` whose ring keys are yet to be recomputed
    registered: int = 0  # leading pages registered in the prefix cache
    row: int = -1  # batch row while admitted
    admitted: int = -1  # admission number; larger is more recent
    hashes: list[bytes] = dataclasses.field(default_factory=list)  # full pages' chain hashes
    # The runner's prompt-lookup index of ``tokens`` (drafts.NgramIndex), made on first use.
    lookup: object = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def out(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def decoding(self) -> bool:
        """Everything but the last token is cached (rings rebuilt): the next decode step feeds
        it."""
        return self.computed == len(self.tokens) - 1 and not self.replay

    @property
    def done(self) -> bool:
        n = len(self.tokens) - self.prompt_len
        return n >= self.max_new or (n > 0 and self.tokens[-1] == self.eos_id)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Positions ``[start, stop)`` of ``req`` in one prefill forward (``Tq = stop - start``).

    ``pages``: the row's pages for positions ``[0, stop)``, the ones being written private.
    ``replay``: a ring replay (module doc): the sliding layers' rings are rewritten, nothing is
    written to the pool and the request's ``computed`` does not move.
    """

    req: Request
    start: int
    stop: int
    pages: tuple[int, ...]
    replay: bool = False


@dataclasses.dataclass(frozen=True)
class DecodeRow:
    """A decoding request's row in this step: it feeds ``req.tokens[-1]`` at position
    ``req.computed`` (a verification: its last token and k drafts, positions up to
    ``computed + ahead - 1``), reading and writing ``pages``, its row's pages."""

    req: Request
    pages: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One engine step, as the scheduler decided it: what the runner executes, in this order.

    copies: ``(src, dst)`` page copies (copy on write), applied before any chunk or row; no two
      share a ``dst`` and no ``src`` is written by this plan.
    prefill: the prefill chunks, in admission order, at most ``max_prefill_tokens`` tokens.
    decode: the decoding rows, in admission order (batch row ``row.req.row``).
    ahead: positions each decode row may write (1; ``k + 1`` for a speculative verification).
    admitted, preempted: requests that got a row, lost it (back at the head of the queue).
    aborted: ids of the requests aborted since the last plan (their pages freed already).
    """

    copies: tuple[tuple[int, int], ...] = ()
    prefill: tuple[Chunk, ...] = ()
    decode: tuple[DecodeRow, ...] = ()
    ahead: int = 1
    admitted: tuple[Request, ...] = ()
    preempted: tuple[Request, ...] = ()
    aborted: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        """Nothing for the device to do."""
        return not (self.copies or self.prefill or self.decode)


class Scheduler:
    """Requests and pages for ``max_batch`` rows over ``num_pages`` pages of ``page_size``.

    ``counts`` is the engine's counter (prefix_cache_hits, preemptions, prefill_tokens,
    replay_tokens, generated_tokens, finished, aborted); ``max_prefill_tokens`` bounds the
    prefill tokens of one plan and each chunk; ``replay_tokens``: positions before a prefix hit
    whose ring keys are recomputed (0: no rings; module doc); ``hash_lookahead``: tokens after
    a page that its prefix-cache hash covers too (1 for an EAGLE head, whose pool pairs each
    position with the token after it: ``decoding.eagle``), so a hit also agrees on them.
    """

    def __init__(
        self,
        *,
        max_batch: int,
        num_pages: int,
        page_size: int,
        max_pages: int,
        prefix_caching: bool,
        max_prefill_tokens: int,
        counts: collections.Counter | None = None,
        replay_tokens: int = 0,
        hash_lookahead: int = 0,
    ):
        self.max_batch, self.num_pages, self.page_size = max_batch, num_pages, page_size
        self.max_pages, self.prefix_caching = max_pages, prefix_caching
        self.max_prefill_tokens = max_prefill_tokens
        self.counts = collections.Counter() if counts is None else counts
        self.replay_tokens, self.hash_lookahead = replay_tokens, hash_lookahead
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # admission order
        self.live: dict[int, Request] = {}  # submitted, neither finished nor aborted
        self.finished: dict[int, list[int]] = {}  # results not yet handed out
        self.admissions = 0
        self._copies: list[tuple[Request, int, int]] = []  # the plan being made: (owner, src, dst)
        self._preempted: list[Request] = []
        self._aborted: list[int] = []  # since the last plan
        self.new_pages()

    def new_pages(self) -> None:
        """A fresh allocator (an empty prefix cache) and block tables."""
        self.allocator = PageAllocator(self.num_pages, self.page_size)
        self.tables = BlockTables(self.allocator, self.max_batch, self.max_pages)

    def add(self, req: Request) -> None:
        self.live[req.rid] = req
        self.waiting.append(req)

    # ----------------------------------------------------------------------------- the step

    def schedule(self, ahead: int = 1) -> StepPlan:
        """Plans one step (module doc): admission, prefill chunks, then the decoding rows' pages
        for their next ``ahead`` positions, preempting while the pool is short."""
        self._copies, self._preempted = [], []
        running = set(self.running)
        self.admit()
        admitted = tuple(r for r in self.running if r not in running)
        chunks = self._chunks()
        rows = self.grow_decoding_rows(ahead)
        live = set(self.running)  # a request preempted above leaves the plan
        plan = StepPlan(
            copies=tuple((s, d) for r, s, d in self._copies if r in live),
            prefill=tuple(c for c in chunks if c.req in live),
            decode=tuple(DecodeRow(r, tuple(self.tables.rows[r.row])) for r in rows),
            ahead=ahead,
            admitted=tuple(r for r in admitted if r in live),
            preempted=tuple(self._preempted),
            aborted=tuple(self._aborted),
        )
        self._copies, self._preempted, self._aborted = [], [], []
        return plan

    def postprocess(self, plan: StepPlan, sampled) -> list[list[int]]:
        """After the runner ran ``plan``: ``sampled[i]``, the tokens ``plan.decode[i]``'s row
        produced (one; a verification's accepted drafts and its next token), are appended up
        to the request's end -> the tokens each row emitted. Registers the newly computed full
        pages in the prefix cache, retires finished requests (pages released)."""
        if len(sampled) != len(plan.decode):
            raise ValueError(f"{len(sampled)} rows of tokens for {len(plan.decode)} decode rows")
        for c in plan.prefill:
            self.counts["replay_tokens" if c.replay else "prefill_tokens"] += c.stop - c.start
            self.register(c.req)
        emitted = []
        for row, tokens in zip(plan.decode, sampled, strict=True):
            req, out = row.req, []
            for token in tokens:
                req.tokens.append(int(token))
                req.computed += 1
                out.append(int(token))
                if req.done:
                    break
            self.counts["generated_tokens"] += len(out)
            emitted.append(out)
            self.register(req)
            if req.done:
                self.retire(req)
        return emitted

    # ----------------------------------------------------------------------------- admission

    def admit(self) -> None:
        """Admits waiting requests, first come first served, while a row and pages are free."""
        while self.waiting and len(self.running) < self.max_batch:
            if not self._try_admit(self.waiting[0]):
                return
            self.waiting.popleft()

    def _try_admit(self, req: Request) -> bool:
        """Gives ``req`` a row and pages for all its known tokens, reusing cached prefix pages.

        Keeps one spare page per running request so that admissions do not starve decoding.
        """
        P, n = self.page_size, len(req.tokens)
        row = min(set(range(self.max_batch)) - {r.row for r in self.running})
        hits = []
        if self.prefix_caching:
            hashable = (n - self.hash_lookahead) // P
            self._extend_hashes(req, hashable)
            hits = self.allocator.lookup(req.hashes[:hashable])
            if req.hashes[len(hits) : len(hits) + 1] and req.hashes[len(hits)] in self._pending():
                return False  # a running request is computing our next page: wait and share it
        # A fully cached sequence still feeds its last token: that write copies the last page
        # (copy on write); if the pool cannot spare the copy, recompute that page instead.
        for use in dict.fromkeys([len(hits), min(len(hits), (n - 1) // P)]):
            start = min(use * P, n - 1)
            self.tables.adopt(row, hits[:use])
            spare = self.allocator.num_available - self.tables.pages_to_write(row, start, n)
            if spare >= len(self.running):
                break
            self.tables.free(row)
        else:
            return False
        req.row = row
        self._make_writable(req, start, n)
        req.computed, req.registered = start, use
        req.replay = min(start, self.replay_tokens)
        req.admitted, self.admissions = self.admissions, self.admissions + 1
        self.counts["prefix_cache_hits"] += use
        self.running.append(req)
        return True

    def _pending(self) -> set[bytes]:
        """Hashes of the full prompt pages running requests will compute but have not yet."""
        P = self.page_size
        return {h for r in self.running for h in r.hashes[r.registered : (len(r.tokens) - 1) // P]}

    def _extend_hashes(self, req: Request, num_pages: int) -> None:
        P, have = self.page_size, len(req.hashes)
        if num_pages > have:
            parent = req.hashes[-1] if req.hashes else b""
            tokens = req.tokens[have * P : num_pages * P + self.hash_lookahead]
            req.hashes += block_hashes(tokens, P, parent, self.hash_lookahead)

    def register(self, req: Request) -> None:
        """Registers the request's newly completed pages in the prefix cache."""
        full = req.computed // self.page_size
        if not self.prefix_caching or full <= req.registered:
            return
        self._extend_hashes(req, full)
        pages = self.tables.rows[req.row]
        for i in range(req.registered, full):
            self.allocator.register(pages[i], req.hashes[i])
        req.registered = full

    # ----------------------------------------------------------------------------- prefill

    def _chunks(self) -> list[Chunk]:
        """Chunks of at most ``max_prefill_tokens`` in admission order, within the step's
        budget of as many tokens; a request's ring replay (module doc) first. A chunk's bounds
        depend only on its request, never on what else is batched."""
        budget, out = self.max_prefill_tokens, []
        for req in list(self.running):
            while not req.decoding:
                left = req.replay or len(req.tokens) - 1 - req.computed
                n = min(left, self.max_prefill_tokens)
                if n > budget:
                    return out
                out.append(self._chunk(req, n))
                budget -= n
        return out

    def _chunk(self, req: Request, n: int) -> Chunk:
        """The next ``n`` positions of ``req`` (its replay first), ``computed`` advanced."""
        if req.replay:  # rings only: nothing is written to the pool, no page is made writable
            start = req.computed - req.replay
            req.replay -= n
            replay = True
        else:
            start, replay = req.computed, False
            self._make_writable(req, start, start + n)
            req.computed += n
        pages = tuple(self.tables.rows[req.row][: pages_for(start + n, self.page_size)])
        return Chunk(req, start, start + n, pages, replay)

    # ----------------------------------------------------------------------------- pages

    def _make_writable(self, req: Request, start: int, stop: int) -> None:
        """Readies positions [start, stop) of ``req``'s row for writing; the page copies go to
        the plan."""
        copies = self.tables.make_writable(req.row, start, stop)
        self._copies += [(req, src, dst) for src, dst in copies]

    def grow_decoding_rows(self, ahead: int = 1) -> list[Request]:
        """Gives each decoding row (oldest first) the pages its next ``ahead`` positions need
        (a speculative step writes k + 1; never past the request's last cached position,
        prompt + max_new - 2), preempting the most recently admitted request while the pool is
        short. Returns the rows to decode."""
        for req in [r for r in self.running if r.decoding]:
            while req.row >= 0:
                pos = req.computed
                stop = max(min(pos + ahead, req.prompt_len + req.max_new - 1), pos + 1)
                if self.tables.pages_to_write(req.row, pos, stop) <= self.allocator.num_available:
                    self._make_writable(req, pos, stop)
                    break
                self.preempt(max(self.running, key=lambda r: r.admitted))
        return [r for r in self.running if r.decoding]

    def _release_row(self, req: Request) -> None:
        self.tables.free(req.row)
        self.running.remove(req)
        req.row = -1

    def retire(self, req: Request) -> None:
        # Result first, then release: at every point the request is live or finished.
        self.finished[req.rid] = req.out
        del self.live[req.rid]
        self.counts["finished"] += 1
        self._release_row(req)

    def preempt(self, req: Request) -> None:
        """Frees the request's pages; it is recomputed from its tokens when readmitted."""
        self.waiting.appendleft(req)
        self._release_row(req)
        req.computed = req.registered = req.replay = 0
        self._preempted.append(req)
        self.counts["preemptions"] += 1

    def abort(self, rid) -> list[int]:
        """Drops request ``rid`` (waiting, running, or finished and not handed out) -> its
        tokens so far; ``KeyError`` naming it otherwise."""
        if rid in self.finished:
            return self.finished.pop(rid)
        req = self.live.get(rid)
        if req is None:
            raise KeyError(f"no request with id {rid!r} is waiting, running or finished")
        if req in self.running:
            self._release_row(req)
        if req in self.waiting:
            self.waiting.remove(req)
        del self.live[rid]
        self._aborted.append(rid)
        self.counts["aborted"] += 1
        return req.out

    def reset(self) -> None:
        """A fresh allocator and block tables; every unfinished live request back to the queue,
        running ones first in admission order, to be recomputed from its tokens (as after a
        preemption)."""
        running = sorted(self.running, key=lambda r: r.admitted)
        order = running + list(self.waiting) + list(self.live.values())
        order = [r for r in dict.fromkeys(order) if self.live.get(r.rid) is r]
        self.new_pages()
        for r in order:
            r.computed = r.registered = r.replay = 0
            r.row, r.hashes = -1, []
        # A request whose last token was appended but whose retirement the exception cut short
        # is finished, not recomputed (readmitted, it would decode one token past its end).
        self.running, self.waiting = [], collections.deque(r for r in order if not r.done)
        for r in order:
            if r.done:
                self.finished[r.rid] = r.out
                del self.live[r.rid]
                self.counts["finished"] += 1
        self._copies, self._preempted = [], []

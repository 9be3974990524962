"""The engine's scheduler: pure Python, no device work. Who runs this step, with which pages.

It owns the requests (waiting, running, finished), the page allocator and block tables, and the
prefix cache's bookkeeping (``decoding.paging``): admission with prefix hits, growth of decoding
rows, preemption, retirement, abort, and the reset after a failed step. Page copies for copy on
write go to the ``copy`` callback the engine gives it (the device side), at the point they are
needed. See ``decoding.engine`` for the step these serve.

Sliding-window layers that keep rings (``models.kv_cache``): a prefix hit shares only the global
layers' pages, so the request's ring must be rebuilt for the positions before the hit that later
queries still see through the window. A hit at position ``h`` leaves ``replay =
min(h, replay_tokens)`` positions to recompute first (the engine replays them with the global
layers reading their cached pages); the engine sets ``replay_tokens`` to ``n_s * (W - 1)`` for
``n_s`` sliding layers of window W (why that many: ``decoding.engine``).

Invariant kept for the engine's recovery (``reset``): at every bytecode a request is live
(``live``: waiting, running or between the two) or finished, never neither.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

from decoding.paging import BlockTables, PageAllocator, block_hashes
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


class Scheduler:
    """Requests and pages for ``max_batch`` rows over ``num_pages`` pages of ``page_size``.

    ``copy(copies)`` applies ``[(src, dst)]`` page copies on the device; ``counts`` is the
    engine's counter (prefix_cache_hits, preemptions, finished, aborted); ``replay_tokens``:
    positions before a prefix hit whose ring keys are recomputed (0: no rings; module doc).
    """

    def __init__(
        self,
        *,
        max_batch: int,
        num_pages: int,
        page_size: int,
        max_pages: int,
        prefix_caching: bool,
        copy: Callable,
        counts: collections.Counter,
        replay_tokens: int = 0,
    ):
        self.max_batch, self.num_pages, self.page_size = max_batch, num_pages, page_size
        self.max_pages, self.prefix_caching = max_pages, prefix_caching
        self.copy, self.counts, self.replay_tokens = copy, counts, replay_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # admission order
        self.live: dict[int, Request] = {}  # submitted, neither finished nor aborted
        self.finished: dict[int, list[int]] = {}  # results not yet handed out
        self.admissions = 0
        self.new_pages()

    def new_pages(self) -> None:
        """A fresh allocator (an empty prefix cache) and block tables."""
        self.allocator = PageAllocator(self.num_pages, self.page_size)
        self.tables = BlockTables(self.allocator, self.max_batch, self.max_pages)

    def add(self, req: Request) -> None:
        self.live[req.rid] = req
        self.waiting.append(req)

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
            self._extend_hashes(req, n // P)
            hits = self.allocator.lookup(req.hashes[: n // P])
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
        self.copy(self.tables.make_writable(row, start, n))
        req.row, req.computed, req.registered = row, start, use
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
            req.hashes += block_hashes(req.tokens[have * P : num_pages * P], P, parent)

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

    # ----------------------------------------------------------------------------- pages

    def make_writable(self, req: Request, start: int, stop: int) -> list[int]:
        """Pages of ``req``'s row readied for writing positions [start, stop) (copies applied)."""
        self.copy(self.tables.make_writable(req.row, start, stop))
        return self.tables.rows[req.row]

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
                    self.make_writable(req, pos, stop)
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
        self.counts["aborted"] += 1
        return req.out

    def reset(self) -> None:
        """A fresh allocator and block tables; every live request back to the queue, running
        ones first in admission order, to be recomputed from its tokens (as after a preemption)."""
        running = sorted(self.running, key=lambda r: r.admitted)
        order = running + list(self.waiting) + list(self.live.values())
        order = [r for r in dict.fromkeys(order) if self.live.get(r.rid) is r]
        self.new_pages()
        for r in order:
            r.computed = r.registered = r.replay = 0
            r.row, r.hashes = -1, []
        self.running, self.waiting = [], collections.deque(order)

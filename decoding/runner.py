"""The engine's device side: runs a ``scheduler.StepPlan`` on the page pool.

A :class:`Runner` owns what lives on the device or feeds it: the model's parameters and their
CPU-packed copies (``decoding.packing``), the jitted steps (``decoding.engine_steps``), the K and
V page pools (one scratch page more, for padding writes), where sliding-window layers keep
rings (``models.kv_cache``) their per-slot rings, and a draft's own state: a Medusa draft's
per-slot hidden states, a draft model's page pool (at the target's page ids: the scheduler's
pages and copies serve both pools). It makes no decision: which request runs,
with which pages, is the plan's (``decoding.scheduler``); the engine (``decoding.engine``) feeds
the sampled tokens back to the scheduler.

One :meth:`Runner.run` applies the plan's page copies (``COPY_BATCH`` per call, padded, so one
compiled shape), runs the prefill chunks as ``Tq = C`` forwards (C the chunk's bucket,
``chunk_bucket``; a long chunk that its bucket would pad much as pieces, ``prefill_pieces``;
chunks of one bucket together where the packed products serve them: ``prefill_chunks``), then one decode step (or, with a draft, one verification of k
drafts) for every decoding row: a decode step at ``decode_batch(rows)`` (the smallest power of
two holding them, on an unsharded model; a row's tokens do not depend on it), a verification at
``max_batch`` (prompt lookup without rings, unsharded: at the decode batch plus one row per
draft token, ``verify_ragged``); padding rows read the scratch page and decode greedily, the
cheapest. From a decode batch of ``MIX_MIN_BATCH`` on (CPU, no rings; no draft, or prompt lookup's plain steps),
the chunks that fit in the step's free rows are computed inside the decode step instead, a row
per token (``fold``).
:meth:`Runner.warmup` compiles every one of those shapes up front (``Engine.warmup``).
"""

from __future__ import annotations

import collections
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from decoding import engine_steps
from decoding.drafts import MAX_K, ModelDraft, NgramIndex, PromptLookup
from decoding.eagle import EagleDraft
from decoding.medusa import MedusaDraft
from decoding.packing import packed_weights
from decoding.paging import pages_for
from decoding.sampling import SamplingConfig, SamplingParams
from decoding.scheduler import Chunk, DecodeRow, StepPlan
from decoding.speculative import draft_kind
from models import KVCache
from models.kv_cache import ring_pages_for
from models.linear import DECODE_MAX_ROWS
from models.rows_matmul import ROW_BLOCK
from models.sharding import mesh_of, to_host

GREEDY = SamplingConfig()
MIN_CHUNK = 8  # the smallest prefill chunk bucket, and the step between buckets up to FINE_CHUNKS
FINE_CHUNKS = 64
SPLIT_PADDING = 16  # padded tokens beyond which a long chunk runs as two calls (prefill_pieces)
COPY_BATCH = 8  # page copies per copy_pages call (padded, so one compiled shape)
# Prompt chunks ride in the decode step (``Runner.fold``) from this decode batch on: below it
# the separate prefill call costs little more, and each (batch, rows) pair is a compiled shape.
MIX_MIN_BATCH = 8


def chunk_bucket(n: int) -> int:
    """The prefill chunk length C compiled for n tokens: a multiple of ``MIN_CHUNK`` up to
    ``FINE_CHUNKS``, a power of two above. Short prompts are most of a server's (SmolLM2's
    serving mix: 15% fewer padded rows than powers of two, +4.5% requests/s at saturation); the
    more shapes this makes are compiled before serving by ``Engine.warmup``."""
    if n <= FINE_CHUNKS:
        return max(MIN_CHUNK, -(-n // MIN_CHUNK) * MIN_CHUNK)
    return 1 << (n - 1).bit_length()


def draft_bucket(n: int, batch: int = 0) -> int:
    """The draft rows a ragged verification of n drafted tokens runs (``Runner.verify_ragged``):
    a power of two below ``MIN_CHUNK``, else ``chunk_bucket``'s. At a small batch a row costs
    about a twentieth of the step (SmolLM2 at batch 1: 20.4 ms at one row, 29.6 at eight), so a
    draft of two tokens is not padded to eight. With the decode ``batch`` given, no more than
    fills its rows up to the next multiple of ``ROW_BLOCK``: the packed products take rows in
    blocks of 8 and a block's first row costs most (at batch 1 on an AVX2 host, 3 to 8 rows
    cost 34-37 ms a step and 9 rows 45 ms), so 5 drafted tokens at batch 1 run 7 rows, not 8."""
    rows = 1 << (n - 1).bit_length() if n < MIN_CHUNK else chunk_bucket(n)
    if batch:
        rows = min(rows, -(-(batch + n) // ROW_BLOCK) * ROW_BLOCK - batch)
    return rows


def prefill_pieces(n: int) -> list[int]:
    """The lengths of the prefill calls a chunk of n tokens runs as (in order): a chunk longer
    than ``FINE_CHUNKS`` whose bucket would pad it by more than ``SPLIT_PADDING`` tokens splits
    off half its bucket, repeatedly. A call costs a pass over the weights (about 13 padded tokens'
    compute on SmolLM2 in float32) plus its padded tokens: a 154-token prompt ran as one 256-token
    call in 400 ms, and as 128 + 32 in 263."""
    out = []
    while n > FINE_CHUNKS and chunk_bucket(n) - n > SPLIT_PADDING:
        out.append(chunk_bucket(n) // 2)
        n -= out[-1]
    return out + [n]


def lost_buffers(*pools) -> bool:
    """Whether any buffer of the pools was donated and deleted, or holds an execution error."""
    try:
        jax.block_until_ready(pools)
        return any(x.is_deleted() for pool in pools for x in pool)
    except Exception:  # an execution error surfaced in the pool's buffers
        return True


class RunOutput(NamedTuple):
    """What running a ``StepPlan`` produced: ``tokens[i]``, the tokens ``plan.decode[i]``'s row
    sampled (one; a verification's accepted drafts, then its next token); ``accepted[i]`` the
    drafts it accepted (0 without a draft); ``logprobs[i]`` their host ``sampling.Logprobs``
    (leading axis: token), or None when no row asked; ``verified``, whether drafts were
    verified (a plan with a draft may run a plain step: ``Runner.run``); ``seconds``, the
    wall time of the decode or verification call until its tokens were on the host (None when
    it compiled, when prompt chunks ran before it in the same plan, or without decode rows:
    the device runs what was queued first, so the call's time would hold theirs: at batch 8 on
    SmolLM2 a first verification timed at 1 s where the next took 50 ms); ``found[i]``, with
    prompt lookup, whether row i's known tokens had an n-gram match before the step
    (``drafts.lookup_found``; None without it) and ``nexts[i]`` the first token its draft would
    propose from them (None where none matched); ``proposed[i]``, the draft tokens row i
    verified, where rows drafted apart (``Runner.verify_ragged``; None where each verified k);
    ``k``, the draft tokens each row verified (0: a plain step; a ragged verification's most).
    ``found`` and ``nexts`` also come with ``Medusa(heads, lookup_ngram=n)``'s n-gram."""

    tokens: list[list[int]]
    accepted: list[int]
    logprobs: list | None
    verified: bool = False
    seconds: float | None = None
    found: list[bool] | None = None
    proposed: list[int] | None = None
    nexts: list[int | None] | None = None
    k: int = 0


class Runner:
    """Device state and steps for ``max_batch`` rows over a pool of ``num_pages`` pages of
    ``page_size`` (page ``num_pages`` is the scratch page); block tables ``max_pages`` wide
    (``table_width`` for verifications, which write up to ``MAX_K`` positions more).

    Attributes: ``ring_pages``, R pages per batch slot of each sliding layer's ring, or None
    when every layer is on the pool; ``pool_layers``, the layers the pool's pages hold;
    ``replay_tokens``, the positions a prefix hit replays to rebuild a ring (``decoding.engine``
    says why); ``k``, ``v``, the pools (per layer); ``compile_s``, seconds spent in calls that
    traced a step.
    """

    def __init__(
        self,
        model,
        *,
        max_batch: int,
        num_pages: int,
        page_size: int,
        max_pages: int,
        max_seq_len: int,
        max_prefill_tokens: int,
        draft=None,
        logprobs_mode: str = "raw",
        counts: collections.Counter | None = None,
    ):
        self.config, self.max_batch, self.page_size = model.config, max_batch, page_size
        self.max_pages, self.max_seq_len = max_pages, max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        # A draft runs as its static kind with its params passed apart. Medusa: each slot keeps
        # the target's hidden state at its row's last accepted position (``hidden``), and
        # ``_hidden_of[slot]`` says whose: (request id, its token count then). A draft model:
        # its own pool (``draft_k``, ``draft_v``), written by its prefill and verifications.
        self.draft, self.draft_params = (None, None) if draft is None else draft_kind(draft)
        self._reset_hidden()
        self.logprobs_mode, self.scratch = logprobs_mode, num_pages
        self.counts = collections.Counter() if counts is None else counts
        self.graphdef, self.params = nnx.split(model)
        self.kernels = packed_weights(model, self.params)  # few-row steps (CPU)
        # Decode steps run at the smallest power-of-two batch that holds their rows (each size
        # compiles once), except on a sharded model, whose batch is split over the mesh.
        self.compact = mesh_of(model) is None
        self.prefill_fn, self.decode_fn = engine_steps.jitted(self.graphdef, logprobs_mode)
        # A verification writes up to k positions past a row's last needed one (dropped later),
        # so the device block table is wider, its extra entries the scratch page.
        self.table_width = pages_for(max_seq_len - 1 + (MAX_K if draft else 0), page_size)
        self._plan_rings(model, max_prefill_tokens)
        # Prompt chunks ride in decode steps (``fold``) where the packed products serve both; with
        # prompt lookup, in its plain steps (k = 0, or nothing to propose): a verification's
        # rows and a Medusa or model draft's state do not take them.
        self.mixes = (
            bool(self.kernels)
            and self.compact
            and self.ring_pages is None
            and (draft is None or isinstance(self.draft, PromptLookup))
        )
        # Prompt lookup drafts on the host, so each row verifies only its own draft, a row of
        # one token per draft token (verify_ragged): a row without one costs one row. Not with
        # rings or on a sharded model (their steps take whole rows of k + 1).
        self.ragged = (
            isinstance(self.draft, PromptLookup) and self.compact and self.ring_pages is None
        )
        if self.ragged:
            self.ragged_fn = engine_steps.jitted_ragged(self.graphdef, logprobs_mode)
        self.k, self.v = self.new_pool()
        self.draft_k = self.draft_v = ()
        if isinstance(self.draft, ModelDraft):
            self.draft_prefill = engine_steps.jitted(self.draft.graphdef)[0]
        if isinstance(self.draft, EagleDraft):
            self.eagle_prefill = engine_steps.jitted_eagle_prefill(self.graphdef, self.draft)
            self.decode_fn = engine_steps.jitted_eagle_decode(
                self.graphdef, self.draft, logprobs_mode
            )
        if isinstance(self.draft, ModelDraft | EagleDraft):
            self.draft_k, self.draft_v = self.new_draft_pool()
        self.compile_s = 0.0

    def _plan_rings(self, model, max_prefill_tokens: int) -> None:
        """Whether the sliding layers keep rings (``decoding.engine``'s module doc): R or None,
        the layers on the pool and the positions a prefix hit replays. Not on a sharded model
        (``models.shard``): its attention runs per device through ``jax.shard_map``, which the
        replay's read-only global layers do not go through."""
        c, P = self.config, self.page_size
        sliding = [i for i in range(c.num_layers) if c.is_sliding(i)]
        if mesh_of(model) is not None:
            sliding = []
        self.ring_pages, self.replay_tokens = None, 0
        self.pool_layers = tuple(range(c.num_layers))
        if sliding:
            longest = max(chunk_bucket(max_prefill_tokens), MAX_K + 1 if self.draft else 1)
            R = ring_pages_for(c.sliding_window, longest, P)
            if R < self.max_pages:
                self.ring_pages, self.replay_tokens = R, len(sliding) * (c.sliding_window - 1)
                self.pool_layers = tuple(i for i in range(c.num_layers) if i not in sliding)
        self._ring_scratch = self.max_batch * (self.ring_pages or 0)

    def new_pool(self):
        """Zeroed K and V pools of ``num_pages + 1`` pages (the last one scratch); with rings,
        each sliding layer's entry is its ``max_batch * R + 1`` ring pages (the last scratch)."""
        rows = np.zeros((self.max_batch, 1), np.int32)
        ring = dict(ring_pages=self.ring_pages, ring_scratch=True) if self.ring_pages else {}
        pool = KVCache.paged(self.config, self.scratch + 1, self.page_size, rows, **ring)
        return pool.k, pool.v

    def new_draft_pool(self):
        """A draft model's zeroed K and V pools: ``num_pages + 1`` pages of every layer of it
        (no rings: its sliding layers, if any, mask); an EAGLE head's, of its one layer."""
        if isinstance(self.draft, EagleDraft):
            return self.draft.engine_pool(self.draft_params, self.scratch + 1, self.page_size)
        rows = np.zeros((self.max_batch, 1), np.int32)
        pool = KVCache.paged(self.draft.config, self.scratch + 1, self.page_size, rows)
        return pool.k, pool.v

    def _reset_hidden(self) -> None:
        self.hidden = None
        if isinstance(self.draft, MedusaDraft | EagleDraft):
            self.hidden = jnp.zeros((self.max_batch, self.config.dim), self.config.jnp_dtype)
        self._hidden_of: list = [None] * self.max_batch

    def recover(self) -> None:
        """After an exception in a step: a fresh pool (and draft pool) when the old one's
        buffers were donated and lost (or hold an execution error); no slot's hidden state is
        trusted."""
        self._reset_hidden()
        if lost_buffers(self.k, self.v):
            self.k = self.v = ()
            self.k, self.v = self.new_pool()
        if self.draft_k and lost_buffers(self.draft_k, self.draft_v):
            self.draft_k = self.draft_v = ()
            self.draft_k, self.draft_v = self.new_draft_pool()

    def _call(self, fn, *args):
        """``fn(*args)``, its time counted as compilation when it traced (``engine_steps.TRACES``)."""
        traces, t0 = engine_steps.TRACES.total(), time.perf_counter()
        out = fn(*args)
        if engine_steps.TRACES.total() != traces:
            self.compile_s += time.perf_counter() - t0
        return out

    def _tables(self, table, slots, replay: bool = False):
        """A step's tables: the block table [B', W] itself, or with rings an
        ``engine_steps.RingTables`` whose window table maps row b's real pages (those not
        scratch) to its slot ``slots[b]``'s ring, ``slot * R + i % R``, the rest to the rings'
        scratch page."""
        if self.ring_pages is None:
            return table
        R = self.ring_pages
        ring = np.asarray(slots, np.int32)[:, None] * R + np.arange(table.shape[1]) % R
        window = np.where(table != self.scratch, ring, self._ring_scratch).astype(np.int32)
        return engine_steps.RingTables(table, window, R, replay)

    def warmup(self, draft_lengths=()) -> None:
        """Compiles every step shape :meth:`run` can call, by running each once on padding rows
        (their reads and writes on the scratch page; no real page changes): the page copies,
        each prefill (chunk bucket, rows per call), ring replays, each decode batch and a
        verification of each k in ``draft_lengths``. The counters are left as they were;
        ``compile_s`` grows by what compiled. For an idle runner only: a verification also
        rewrites the slots' Medusa hidden states, which are then reset."""
        saved = self.counts.copy()
        self.copy([(self.scratch, self.scratch)])
        longest = min(self.max_prefill_tokens, self.max_seq_len - 1)
        for C in sorted({chunk_bucket(n) for n in range(1, longest + 1)}):
            # A call holds one chunk per request (at most max_batch) up to the packed rows.
            most = min(DECODE_MAX_ROWS // C if self.kernels else 1, self.max_batch)
            rows = 1
            while True:
                self.prefill([], C, rows=rows)
                if rows >= most:
                    break
                rows *= 2
            if self.ring_pages is not None:  # replays: one chunk per call
                self.prefill([], C, replay=True, rows=1)
        for B in sorted({self.decode_batch(n) for n in range(1, self.max_batch + 1)}):
            self.decode((), frozenset(), batch=B)
            if self.mixes and B >= MIX_MIN_BATCH:  # each number of folded rows
                for rows in range(MIN_CHUNK, DECODE_MAX_ROWS - B + 1, MIN_CHUNK):
                    self.decode((), frozenset(), batch=B, fold_rows=rows)
        if self.ragged and draft_lengths:  # each (decode batch, draft rows) pair
            for B in sorted({self.decode_batch(n) for n in range(1, self.max_batch + 1)}):
                most = min(B * max(draft_lengths), self.draft_room(B))
                if self.mixes and B >= MIX_MIN_BATCH:  # and prompt rows (fold)
                    most = self.draft_room(B)
                for E in sorted({draft_bucket(n, B) for n in range(1, most + 1)}):
                    self.verify_ragged((), [], frozenset(), batch=B, extra=E)
        else:
            for k in draft_lengths:
                self.verify((), k, frozenset())
        self._reset_hidden()
        self.counts.clear()
        self.counts.update(saved)

    # ----------------------------------------------------------------------------- a plan

    def run(
        self,
        plan: StepPlan,
        logprobs: set[int] = frozenset(),
        plain: bool = False,
        caps: dict[int, int] | None = None,
        ks: tuple[int, int] | None = None,
    ) -> RunOutput:
        """Executes ``plan``: its page copies, its prefill chunks, then one decode (or
        verification of k = ``plan.ahead - 1`` drafts, unless ``plain``) step for its decode
        rows; logprobs are computed for the rows of the request ids in ``logprobs``. ``caps``:
        a ragged verification's most draft tokens per request id (default k). ``ks``, with
        ``Medusa(heads, lookup_ngram=n)``: k where some row's n-gram matched, k where none
        did (each at most ``plan.ahead - 1``; 0: a plain step)."""
        self.copy(plan.copies)
        nexts = self._lookup_nexts(plan.decode)
        found = None if nexts is None else [t is not None for t in nexts]
        k = plan.ahead - 1
        if ks is not None and found is not None:
            k = ks[0] if any(found) else ks[1]
        verify = (
            self.draft is not None
            and k > 0
            and not plain
            and bool(plan.decode)
            and (not isinstance(self.draft, PromptLookup) or any(found))
        )
        drafts = None
        if verify and self.ragged:
            drafts = self.lookup_drafts(plan.decode, k, caps)
            verify = any(drafts)  # a match may have no room left before the rows' ends
        if verify and drafts is None:  # a Medusa or model draft's rows take no prompt rows
            folded, chunks = [], list(plan.prefill)
        else:  # a ragged verification's free rows take them as a plain step's do
            folded, chunks = self.fold(plan, sum(map(len, drafts)) if verify else 0)
        self.prefill_chunks(chunks)
        if not plan.decode:
            return RunOutput([], [], None)
        if verify and drafts is not None:
            out = self.verify_ragged(plan.decode, drafts, logprobs, folded=folded)
        elif verify:
            out = self.verify(plan.decode, k, logprobs)
        else:
            out = self.decode(plan.decode, logprobs, folded=folded)  # a draft's k = 0: plain
        if chunks:  # queued before the step, the chunks ran inside its timed call
            out = out._replace(seconds=None)
        return out._replace(found=found, nexts=nexts, k=k if out.verified else 0)

    def fold(self, plan: StepPlan, drafted: int = 0) -> tuple[list[Chunk], list[Chunk]]:
        """(chunks computed inside the plan's decode step, the rest, run before it by
        ``prefill_chunks``). On CPU with packed weights, at a decode batch B of at least
        ``MIX_MIN_BATCH``, without rings, in a plain step or a ragged verification of
        ``drafted`` draft rows (``mixes``), the chunks whose tokens fit in the step's
        ``DECODE_MAX_ROWS - B`` free rows (less the draft rows; in plan order; not a request's
        with a ring replay) join it as rows of one token each (``engine_steps.decode_rows``'
        ``prefill``, ``verify_ragged_rows``' rows without an owner): at 8-16 rows a step's
        products are compute-bound, so a separate prefill call pays its own pass over the
        weights (about 10 ms of a 16-token chunk's 24 on SmolLM2) on top of what its rows cost
        inside the step. With prompt lookup, whose rows finish apart, most admissions are one
        request's: a prefill call each."""
        chunks = list(plan.prefill)
        B = self.decode_batch(len(plan.decode)) if plan.decode else 0
        if not self.mixes or B < MIX_MIN_BATCH:
            return [], chunks
        replayed = {c.req.rid for c in chunks if c.replay}
        # the folded rows are padded to a multiple of MIN_CHUNK (a verification's, with its
        # draft rows, to draft_bucket's): room for that many
        folded, rest = [], []
        room = (DECODE_MAX_ROWS - B) // MIN_CHUNK * MIN_CHUNK
        if drafted:
            room = self.draft_room(B) - drafted
        for c in chunks:
            n = c.stop - c.start
            if not c.replay and c.req.rid not in replayed and n <= room:
                folded.append(c)
                room -= n
            else:
                rest.append(c)
        return folded, rest

    def _folded_inputs(self, chunks, rows: int | None = None):
        """``decode_rows``' ``prefill`` for ``chunks``: (tokens, positions, tables) of their
        tokens, padded to a multiple of ``MIN_CHUNK`` rows (or to ``rows``) on the scratch page."""
        n = sum(c.stop - c.start for c in chunks)
        N = rows or chunk_bucket(n)  # n <= the step's free rows < FINE_CHUNKS
        tokens, positions = np.zeros(N, np.int32), np.zeros(N, np.int32)
        table = np.full((N, self.max_pages), self.scratch, np.int32)
        i = 0
        for c in chunks:
            j = i + c.stop - c.start
            tokens[i:j] = c.req.tokens[c.start : c.stop]
            positions[i:j] = np.arange(c.start, c.stop)
            table[i:j, : len(c.pages)] = c.pages
            i = j
        return tokens, positions, table

    def _index(self, req) -> NgramIndex:
        """``req``'s prompt-lookup index (``drafts.NgramIndex``), kept with the request: its
        tokens only grow, so each step indexes the new ones alone."""
        if req.lookup is None:
            if isinstance(self.draft, PromptLookup):
                req.lookup = NgramIndex(self.draft.min_ngram, self.draft.max_ngram)
            else:  # Medusa's lookup_ngram n: drafts.lookup's rule at n .. n
                req.lookup = NgramIndex(self.draft.lookup_ngram, self.draft.lookup_ngram)
        return req.lookup

    def _lookup_nexts(self, rows: tuple[DecodeRow, ...]) -> list[int | None] | None:
        """With prompt lookup (or Medusa's ``lookup_ngram``), each row's first draft token from
        its known tokens, None where no suffix n-gram occurred before (``drafts.lookup_found``);
        None without a lookup. Where no row has a match prompt lookup's drafts would be
        filler, so a plain step (one token per row) does the same for less; the engine counts
        the rows that draft from these and, while they do not, whether the first token would
        have been kept. Medusa's heads draft there instead, at their own k (``run``'s ``ks``)."""
        medusa = isinstance(self.draft, MedusaDraft) and self.draft.lookup_ngram is not None
        if not (isinstance(self.draft, PromptLookup) or medusa) or not rows:
            return None
        firsts = [self._index(row.req).draft(row.req.tokens, 1) for row in rows]
        return [f[0] if f else None for f in firsts]

    def copy(self, copies) -> None:
        """Applies ``[(src, dst)]`` page copies to the pool's layers (rings are never shared)."""
        for i in range(0, len(copies), COPY_BATCH):
            part = list(copies[i : i + COPY_BATCH])
            pad = [(self.scratch, self.scratch)] * (COPY_BATCH - len(part))
            src, dst = np.array(part + pad, np.int32).T
            layers = None if self.ring_pages is None else self.pool_layers
            self.k, self.v = self._call(engine_steps.copy_pages, self.k, self.v, src, dst, layers)
            if self.draft_k:
                self.draft_k, self.draft_v = self._call(
                    engine_steps.copy_pages, self.draft_k, self.draft_v, src, dst
                )
            self.counts["page_copies"] += len(part)

    def prefill_chunks(self, chunks) -> None:
        """Runs a step's prefill chunks, those of one bucket C together in calls of up to
        ``DECODE_MAX_ROWS // C`` rows (a power of two, padded with scratch rows) where the packed
        few-row products serve them: at 16-64 rows a call costs far less than its chunks apart
        (four 16-token chunks in one call about half as much), and each row's products are bit
        for bit those of the chunk alone, so a request's keys never depend on what was batched
        with it. Elsewhere (no packed weights: GPU, sharded) and for ring replays, one call per
        chunk. A request's chunks (a ring replay, then its prefill) run in their order, in
        separate calls: a later one reads what the earlier wrote."""
        calls: list[tuple[int, bool, list[Chunk]]] = []  # in order: (C, replay, chunks)
        after: dict[int, int] = {}  # request id -> the call after its latest chunk's
        for chunk in self._pieces(chunks):
            C = chunk_bucket(chunk.stop - chunk.start)
            per = DECODE_MAX_ROWS // C if self.kernels and not chunk.replay else 1
            rid = chunk.req.rid
            j = next(
                (
                    j
                    for j in range(after.get(rid, 0), len(calls))
                    if calls[j][:2] == (C, chunk.replay) and len(calls[j][2]) < per
                ),
                len(calls),
            )
            if j == len(calls):
                calls.append((C, chunk.replay, []))
            calls[j][2].append(chunk)
            after[rid] = j + 1
        for C, replay, part in calls:
            self.prefill(part, C, replay)

    def _pieces(self, chunks):
        """``chunks`` with each one that is not a ring replay cut at ``prefill_pieces``' lengths,
        each piece with the pages up to its end (an unpadded piece writes only its own)."""
        for chunk in chunks:
            if chunk.replay:
                yield chunk
                continue
            start = chunk.start
            for n in prefill_pieces(chunk.stop - chunk.start):
                pages = chunk.pages[: pages_for(start + n, self.page_size)]
                yield Chunk(chunk.req, start, start + n, pages)
                start += n

    def prefill(self, chunks, C: int, replay: bool = False, rows: int | None = None) -> None:
        """One prefill forward of ``chunks`` (rows of C tokens, right-padded; rows padded to a
        power of two with scratch rows, or to ``rows``) into their rows' pages (and a draft
        model's, at the same page ids; a ring replay is the target's alone)."""
        n = rows or 1 << (len(chunks) - 1).bit_length()
        tokens = np.zeros((n, C), np.int32)
        table = np.full((n, self.max_pages), self.scratch, np.int32)
        start = np.zeros(n, np.int32)
        for i, chunk in enumerate(chunks):
            tokens[i, : chunk.stop - chunk.start] = chunk.req.tokens[chunk.start : chunk.stop]
            table[i, : len(chunk.pages)] = chunk.pages
            start[i] = chunk.start
        slots = [c.req.row for c in chunks] + [0] * (n - len(chunks))
        if isinstance(self.draft, EagleDraft) and not replay:
            self._eagle_prefill(chunks, tokens, start, self._tables(table, slots, replay))
            return
        self.k, self.v = self._call(
            self.prefill_fn,
            self.params,
            self.kernels,
            self.k,
            self.v,
            tokens,
            start,
            self._tables(table, slots, replay),
        )
        if self.draft_k and not replay:
            self.draft_k, self.draft_v = self._call(
                self.draft_prefill,
                *self.draft_params,
                self.draft_k,
                self.draft_v,
                tokens,
                start,
                table,
            )

    def _eagle_prefill(self, chunks, tokens, start, tables) -> None:
        """:meth:`prefill` with an EAGLE head: each chunk's pairs (its target hidden states, the
        tokens after them, all known: a prefill ends before the prompt's last token) into the
        head's pool, and its feature at its last token kept in the request's slot."""
        n, C = tokens.shape
        nexts, last = np.zeros((n, C), np.int32), np.zeros(n, np.int32)
        slots = np.full(n, self.max_batch, np.int32)  # padding rows: dropped
        for i, chunk in enumerate(chunks):
            nexts[i, : chunk.stop - chunk.start] = chunk.req.tokens[
                chunk.start + 1 : chunk.stop + 1
            ]
            last[i], slots[i] = chunk.stop - chunk.start - 1, chunk.req.row
        self.k, self.v, self.draft_k, self.draft_v, self.hidden = self._call(
            self.eagle_prefill,
            self.params,
            self.kernels,
            self.k,
            self.v,
            self.draft_params,
            self.draft_k,
            self.draft_v,
            tokens,
            nexts,
            start,
            tables,
            last,
            self.hidden,
            slots,
        )
        for chunk in chunks:  # valid while the request has chunk.stop + 1 tokens
            self._hidden_of[chunk.req.row] = (chunk.req.rid, chunk.stop + 1)

    def decode_batch(self, n: int) -> int:
        """The batch a decode step of n rows runs at: the smallest power of two >= n (at most
        ``max_batch``) where ``compact``, else ``max_batch``."""
        if not self.compact:
            return self.max_batch
        return min(self.max_batch, 1 << (n - 1).bit_length())

    def _row_inputs(self, rows: tuple[DecodeRow, ...], width: int, logprobs: set[int], B=None):
        """The per-row inputs of a decode or verification step in the steps' order: tables
        (block table [B, width]), seeds, new-token indices, sampling settings, whether logprobs
        are wanted [B] bool; padding rows read the scratch page and decode greedily (the
        cheapest). Row b is slot b (``B`` None: ``max_batch`` rows), or with ``B`` given the
        b-th of ``rows`` (a compact decode step: ``decode_batch``)."""
        compact = B is not None
        B = B or self.max_batch
        table = np.full((B, width), self.scratch, np.int32)
        seeds, index = np.zeros(B, np.uint32), np.zeros(B, np.int32)
        settings, wanted = [GREEDY] * B, np.zeros(B, bool)
        for i, row in enumerate(rows):
            req = row.req
            b = i if compact else req.row
            table[b, : len(row.pages)] = row.pages
            seeds[b], index[b] = req.seed, len(req.tokens) - req.prompt_len
            settings[b], wanted[b] = req.sampling, req.rid in logprobs
        slots = [r.req.row for r in rows] + [0] * (B - len(rows)) if compact else np.arange(B)
        tables = self._tables(table, slots)
        return tables, seeds, index, SamplingParams.rows(settings), wanted

    def decode(
        self, rows: tuple[DecodeRow, ...], logprobs: set[int], batch=None, folded=(), fold_rows=None
    ) -> RunOutput:
        """One jitted decode step for every row (``engine_steps.decode_rows``), at ``batch`` or
        ``decode_batch(len(rows))`` rows: a row's tokens are the same at any batch (each row's
        products, attention and draw are its own), and a step of few rows costs less. The
        ``folded`` chunks (``fold``; or ``fold_rows`` padding rows) are computed in it."""
        B = batch or self.decode_batch(len(rows))
        prefill = None
        if folded or fold_rows:
            prefill = self._folded_inputs(folded, fold_rows)
        pos = [i if self.compact else r.req.row for i, r in enumerate(rows)]
        last, lengths = np.zeros(B, np.int32), np.zeros(B, np.int32)
        for b, row in zip(pos, rows, strict=True):
            last[b], lengths[b] = row.req.tokens[-1], row.req.computed
        inputs = self._row_inputs(rows, self.max_pages, logprobs, B if self.compact else None)
        states, head = None, ()
        # Each row's state kept in its slot, as after a verification: Medusa's hidden state, or
        # an EAGLE head's feature with the step's pair fed into its pool (padding: dropped).
        if isinstance(self.draft, MedusaDraft | EagleDraft):
            slots = np.full(B, self.max_batch, np.int32)
            for b, row in zip(pos, rows, strict=True):
                slots[b] = row.req.row
            states = (self.hidden, slots)
        if isinstance(self.draft, EagleDraft):
            head = (self.draft_params, self.draft_k, self.draft_v)
        t0, compiled = time.perf_counter(), self.compile_s
        new, lp, self.k, self.v, *kept = self._call(
            self.decode_fn,
            self.params,
            self.kernels,
            self.k,
            self.v,
            last,
            lengths,
            *inputs,
            prefill,
            states,
            *head,
        )
        wanted = inputs[-1]
        new = to_host(new)  # whole on every process, also when rows span processes
        seconds = time.perf_counter() - t0 if self.compile_s == compiled else None
        self.counts["decode_steps"] += 1
        if kept:
            self.hidden = kept[0]
            if head:
                self.draft_k, self.draft_v = kept[1], kept[2]
            for row in rows:  # its state once the step's token is appended
                self._hidden_of[row.req.row] = (row.req.rid, len(row.req.tokens) + 1)
        tokens = [[int(new[b])] for b in pos]
        if not wanted.any():  # zeros: not worth a transfer
            return RunOutput(tokens, [0] * len(rows), None, seconds=seconds)
        lp = to_host(lp)
        parts = [jax.tree.map(lambda x, b=b: x[[b]], lp) for b in pos]
        return RunOutput(tokens, [0] * len(rows), parts, seconds=seconds)

    def verify(self, rows: tuple[DecodeRow, ...], k: int, logprobs: set[int]) -> RunOutput:
        """One speculative step of k drafts for every row (``engine_steps.verify_rows``)."""
        seq = np.zeros((self.max_batch, self.max_seq_len), np.int32)
        lengths = np.zeros(self.max_batch, np.int32)
        for row in rows:
            seq[row.req.row, : len(row.req.tokens)] = row.req.tokens
            lengths[row.req.row] = row.req.computed
        inputs = self._row_inputs(rows, self.table_width, logprobs)
        state = ()
        if self.hidden is not None:  # a slot's hidden state serves its own request only
            ok = np.zeros(self.max_batch, bool)
            for row in rows:
                ok[row.req.row] = self._hidden_of[row.req.row] == (row.req.rid, len(row.req.tokens))
            state = (self.draft_params, (self.hidden, ok))
            if self.draft_k:  # EAGLE: the head's pool too
                state = (self.draft_params, (self.draft_k, self.draft_v, self.hidden, ok))
        elif self.draft_k:
            state = (self.draft_params, (self.draft_k, self.draft_v))
        fn = engine_steps.jitted_verify(self.graphdef, self.draft, k, self.logprobs_mode)
        t0, compiled = time.perf_counter(), self.compile_s
        drafted, n, nxt, lp, self.k, self.v, new_state = self._call(
            fn, self.params, self.kernels, self.k, self.v, seq, lengths, *inputs, *state
        )
        if isinstance(self.draft, ModelDraft):
            self.draft_k, self.draft_v = new_state
        elif isinstance(self.draft, EagleDraft):
            self.draft_k, self.draft_v, new_state = new_state
        wanted = inputs[-1]
        drafted, n, nxt = to_host((drafted, n, nxt))  # whole on every process
        seconds = time.perf_counter() - t0 if self.compile_s == compiled else None
        self.counts["decode_steps"] += 1
        bs = [row.req.row for row in rows]
        if self.hidden is not None:
            self.hidden = new_state
            for row in rows:
                b = row.req.row
                self._hidden_of[b] = (row.req.rid, len(row.req.tokens) + int(n[b]) + 1)
        tokens = [[*drafted[b, : n[b]].tolist(), int(nxt[b])] for b in bs]
        accepted = [int(n[b]) for b in bs]
        if not wanted.any():
            return RunOutput(tokens, accepted, None, True, seconds)
        lp = to_host(lp)  # sampled token j sits at verified position j of row b
        parts = [jax.tree.map(lambda x, b=b: x[b], lp) for b in bs]
        return RunOutput(tokens, accepted, parts, True, seconds)

    def draft_room(self, B: int) -> int:
        """Draft rows a ragged verification at decode batch B may add: with packed weights
        (CPU) the packed products' rows left, in whole ``MIN_CHUNK``s (past them a step is
        compute-bound and no draft pays), else k = ``MAX_K`` for every row."""
        if self.kernels:
            return max(DECODE_MAX_ROWS - B, 0) // MIN_CHUNK * MIN_CHUNK
        return B * MAX_K

    def lookup_drafts(self, rows: tuple[DecodeRow, ...], k: int, caps=None) -> list[list[int]]:
        """Each row's prompt-lookup draft for a ragged verification (``drafts.lookup_draft``):
        up to k tokens (or ``caps[rid]``, where given), none past what the request may still
        emit (a row emits its accepted drafts and one token more, at most ``max_new`` in all),
        and, where the drafts overflow ``draft_room``, the longest ones cut first (their last
        tokens are the least likely to be accepted)."""
        out = []
        for row in rows:
            req = row.req
            left = req.prompt_len + req.max_new - len(req.tokens) - 1
            most = k if caps is None else min(k, caps.get(req.rid, k))
            out.append(self._index(req).draft(req.tokens, min(most, left)))
        excess = sum(map(len, out)) - self.draft_room(self.decode_batch(len(rows)))
        for _ in range(max(excess, 0)):
            longest = max(out, key=len)
            del longest[-1]
        return out

    def verify_ragged(
        self,
        rows: tuple[DecodeRow, ...],
        drafts,
        logprobs: set[int],
        batch=None,
        extra=None,
        folded=(),
    ) -> RunOutput:
        """One step verifying each row's own draft ``drafts[i]`` (``lookup_drafts``), each
        draft token a row of one token (``engine_steps.verify_ragged_rows``): at ``batch`` or
        ``decode_batch(len(rows))`` rows, whose padding rows take the first draft tokens, plus
        the tokens left padded to ``draft_bucket``'s rows (at least one; or ``extra``). On a
        memory-bound model a row is cheap, so a row without a draft costs one row instead of
        a verification's k + 1; a row's tokens depend only on its own draft. The ``folded``
        chunks' tokens (``fold``) are rows after the draft tokens, owned by no row (their keys
        and values written, their logits unused). At 5 rows (a decode batch of 8) a draft of
        3 tokens runs 8 + 1 rows, not 8 + 4: rows cost per row, padding rows too."""
        B = batch or self.decode_batch(len(rows))
        # Draft and prompt tokens take the decode batch's padding rows first (a row is a row:
        # its token, position and table are what an extra row's would be), then extra rows.
        free = list(range(len(rows), B))
        spill = sum(map(len, drafts)) + sum(c.stop - c.start for c in folded) - len(free)
        E = extra or draft_bucket(max(spill, 1), B)
        N = B + E
        last, lengths = np.zeros(B, np.int32), np.zeros(B, np.int32)
        tokens, positions = np.zeros(E, np.int32), np.zeros(E, np.int32)
        tables = np.full((E, self.max_pages), self.scratch, np.int32)
        owner, step = np.zeros(N, np.int32), np.full(N, -1, np.int32)
        where, count = np.zeros((B, MAX_K), np.int32), np.zeros(B, np.int32)
        owner[:B], step[:B] = np.arange(B), 0
        inputs = self._row_inputs(rows, self.max_pages, logprobs, B)
        slots = iter(free + list(range(B, N)))

        def put(token, position, pages, who, place):  # -> the row it took
            i = next(slots)
            if i < B:
                last[i], lengths[i], inputs[0][i, : len(pages)] = token, position, pages
            else:
                tokens[i - B], positions[i - B], tables[i - B, : len(pages)] = (
                    token,
                    position,
                    pages,
                )
            owner[i], step[i] = who, place
            return i

        for b, (row, draft) in enumerate(zip(rows, drafts, strict=True)):
            req = row.req
            last[b], lengths[b], count[b] = req.tokens[-1], req.computed, len(draft)
            for j, token in enumerate(draft):
                where[b, j] = put(token, req.computed + 1 + j, row.pages, b, j + 1)
        for c in folded:  # owner 0, step -1: as padding rows, on the request's pages
            for t in range(c.start, c.stop):
                put(c.req.tokens[t], t, c.pages, 0, -1)
        drafted = (tokens, positions, tables, owner, step, where, count)
        t0, compiled = time.perf_counter(), self.compile_s
        n, nxt, lp, self.k, self.v = self._call(
            self.ragged_fn,
            self.params,
            self.kernels,
            self.k,
            self.v,
            last,
            lengths,
            *inputs,
            drafted,
        )
        n, nxt = to_host((n, nxt))
        # not a draft row's cost where prompt rows or padding rows held some (_row_costs)
        timed = self.compile_s == compiled and not folded and not free
        seconds = time.perf_counter() - t0 if timed else None
        self.counts["decode_steps"] += 1
        out = [[*draft[: n[b]], int(nxt[b])] for b, draft in enumerate(drafts)]
        accepted, proposed = [int(n[b]) for b in range(len(rows))], list(map(len, drafts))
        parts = None
        if inputs[-1].any():  # row b's inputs: its last token, then its draft's
            lp = to_host(lp)
            picks = [[b, *where[b, : count[b]]] for b in range(len(rows))]
            parts = [jax.tree.map(lambda x, p=p: x[p], lp) for p in picks]
        return RunOutput(out, accepted, parts, True, seconds, proposed=proposed)

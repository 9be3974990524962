"""Continuous batching over the paged KV cache: requests join and leave between steps.

``Engine.step()`` is three calls: the scheduler (``decoding.scheduler``, pure Python) plans
the step, the runner (``decoding.runner``: the page pool, the CPU-packed weights and the jitted
steps of ``decoding.engine_steps``) executes the plan on the device, and the scheduler
post-processes what came back; this module holds the requests' streams, logprobs, the choice of
k and the recovery::

    plan = self.scheduler.schedule(ahead)             # a scheduler.StepPlan
    out = self.runner.run(plan, wants_logprobs)       # copies, prefill chunks, one decode step
    emitted = self.scheduler.postprocess(plan, out.tokens)

The plan is made in this order, before any device work:

1. admit waiting requests (first come, first served) while a batch row is free and the pool can
   hold their tokens: full pages of the prompt seen before are taken from the prefix cache by
   reference (hash of the token-block chain), the rest are allocated; a request whose next page
   a running request is still prefilling waits for it instead of computing it twice;
2. cut prefill chunks of at most ``max_prefill_tokens`` tokens per step, each chunk one
   ``Tq > 1`` cached forward into the request's own pages (chunk boundaries depend only on the
   request, never on what else is batched);
3. grow every decoding row (those whose prefill ends in this plan too) by the pages its next
   token needs (``ahead`` = k + 1 tokens for a verification); when the pool runs out, preempt
   the most recently admitted request (its pages are freed, it leaves the plan and goes back to
   the head of the queue, recomputed from its prompt and the tokens it already has when
   readmitted);
4. the runner applies the plan's page copies (copy on write), runs its chunks, then one jitted
   decode step for all decoding rows (at the smallest power-of-two batch that holds them, up
   to ``max_batch``; a verification at ``max_batch``; on CPU, from a batch of 8 on, the chunks
   that fit ride in the decode step as rows of one token: ``Runner.fold``); post-processing feeds
   each sampled token back, registers the newly computed full pages in the prefix cache and
   retires finished rows (``eos_id`` or ``max_new_tokens``), their pages released in the same
   step.

Sliding-window layers (Gemma 3's local layers, every layer of a Mistral-style model) do not keep
pool pages: each batch slot has a private ring of ``R = ring_pages_for(W, T, P)`` pages per
sliding layer (``models.kv_cache``), T the longest step (the largest prefill chunk bucket, a
verification's ``MAX_K + 1``), so their memory is O(W + T) per slot, not O(context); the pool,
its pages, the prefix cache and the copies on write serve the global layers only. A model with
no sliding layer (or whose rings would be no smaller than a row's pages, or sharded by
``models.shard``) keeps every layer on the pool, with the same steps as before. A prefix hit at position h reuses the global layers'
pages; the slot's ring then lacks the keys before h, so the request first replays the last
``min(h, n_s * (W - 1))`` positions (``n_s`` sliding layers): a forward over them in which the
global layers read their cached keys and write nothing and the sliding layers write their ring
(``KVCache.replay``). Why that many: a sliding layer's key at position p depends on the layers
below it at p, and each sliding layer below reaches W - 1 positions back, so keys that the ring
got wrong (whatever the slot held before the replay) reach at most ``(s - 1) * (W - 1)``
positions into the replay at the s-th sliding layer; with ``n_s * (W - 1)`` replayed, every key
a query past h can see, ``[h - W + 1, h)``, is computed from the right inputs (the global
layers read only cached keys, so they never spread an error). Preemption and the rebuild after
a failed step recompute requests from their tokens as before; a request's ring is rewritten as
it is recomputed.

A request's tokens depend only on itself: its PRNG key is ``fold_in(key(seed), i)`` for its
``i``-th new token and it is sampled alone under its own ``SamplingConfig``, passed to the one
compiled decode step as data (see ``engine_steps``). A shared or cached page is never written: a
write to one goes to a private copy.

Results are handed out once: ``step()`` returns each new token once (for streaming),
``pop_finished()`` each finished request's tokens once (``run_until_done()`` steps, then pops).
A request submitted with ``logprobs=n`` also gets a ``sampling.TokenLogprob`` per generated
token (its log-probability and the ``n`` most likely alternatives, under ``logprobs_mode``:
see ``sampling.token_logprobs``); ``pop_logprobs()`` hands out those of the tokens ``step()``
has returned, each once. Speculative rows report them too: each accepted token's under the
target's distribution at its position. Only steps where some row asks compute them.
``abort(rid)`` cancels a waiting or running request and frees its pages at once.

Failure: Ctrl-C (SIGINT, main thread) during ``step()`` is held until the step is complete and
consistent, then raised; the interrupted step's tokens come with the next ``step()``. Any other
exception inside ``step()`` (an asynchronous one included) leaves the pool possibly donated and
deleted and the page tables possibly mid-change, so the engine rebuilds both from the requests'
tokens (the one source of truth) before re-raising: every unfinished request goes back to the
queue and is recomputed when readmitted, exactly as after a preemption, so its tokens are
unchanged; one whose last token was already appended finishes as it is; tokens appended before
the exception come with the next ``step()``; the prefix cache starts empty. If that rebuild fails, every later call raises
``RuntimeError`` saying so.

Example::

    eng = Engine(model, num_pages=256)
    rid = eng.submit([1, 2, 3], max_new_tokens=20, seed=0)
    while eng.busy:
        events = eng.step()  # {request id: [new tokens]}, for streaming
    out = eng.pop_finished()  # {request id: generated tokens}, each handed out once
"""

from __future__ import annotations

import collections
import functools
import time

import jax
import numpy as np

from decoding.checks import check_bool, check_int, check_model, check_optional_int, is_int
from decoding.drafts import (
    MAX_K,
    AcceptanceEstimate,
    ObservedCosts,
    PromptLookup,
    measured_costs,
)
from decoding.eagle import Eagle
from decoding.medusa import Medusa
from decoding.paging import pages_for
from decoding.runner import Runner, RunOutput, draft_bucket
from decoding.sampling import (
    MAX_LOGPROBS,
    SamplingConfig,
    TokenLogprob,
    check_logprobs_mode,
    logprob_records,
)
from decoding.scheduler import Request, Scheduler, StepPlan
from decoding.speculative import chosen_num_draft_tokens, draft_step_costs
from models import Transformer
from models.interrupts import deferred_interrupts
from models.sharding import mesh_of

# Verification steps between re-choices of k (num_draft_tokens=None): each k compiles once.
RECHOOSE_STEPS = 16
# While prompt lookup drafts, one step in EXPLORE_STEPS runs plain until the engine has timed a
# few plain steps, then one in EXPLORE_EVERY: the k rule compares its own steps' costs.
EXPLORE_STEPS = 16
EXPLORE_EVERY = 256
# While a Medusa or EAGLE head's k is 0 (plain steps), one decode step in PROBE_EVERY verifies
# one draft token per row: the heads' guesses are only judged by verifying them, and the rule
# needs the rate.
PROBE_EVERY = 32
# What a request's own acceptance rate starts from: the engine's, worth this many tested tokens.
ROW_PRIOR_WEIGHT = 4.0


def _check_sampling(name: str, sampling) -> SamplingConfig | None:
    if sampling is not None and not isinstance(sampling, SamplingConfig):
        raise TypeError(f"{name} must be a SamplingConfig or None, got {type(sampling).__name__}")
    return sampling


class Engine:
    """Continuous-batching generation with a paged KV cache, prefix caching and preemption.

    Args:
      model: a ``models.Transformer``.
      max_batch: B, rows decoded together at most (a decode step runs at the smallest power of
        two that holds its rows, each such batch compiled once: ``Runner.decode_batch``).
      num_pages: pages in the pool (one more, a scratch page, is allocated for padding writes).
      page_size: P, positions per page.
      prefix_caching: reuse cached full pages of earlier prompts (and generated text).
      max_prefill_tokens: prompt tokens prefilled per step, over all requests; also the largest
        chunk.
      sampling: the default ``SamplingConfig`` of requests (default greedy).
      max_seq_len: the longest request (prompt + max_new_tokens) accepted; default the model's
        ``max_position``. It sets the block table's width, ``pages_for(max_seq_len)``, a fixed
        shape of every step; the XLA attention path reads that many positions per row, so a
        tighter bound makes CPU steps cheaper (the Pallas kernel only reads a row's own pages).
      draft: None (one token per row per step), ``decoding.PromptLookup(...)`` or
        ``decoding.Medusa(heads[, lookup_ngram=n])`` (a chain; heads trained on this model):
        every step drafts k tokens for each decoding row and verifies them all in the same
        jitted step (Tq = k + 1 for every row); each row keeps what it accepted (greedy:
        exactly the tokens of plain decoding; sampled: exactly the target's distribution), its
        pages grow by what the step writes and rejected positions are dropped by length.
        Medusa's heads read the row's hidden state at its last accepted position, which the
        verification returns and the runner keeps per batch slot; a row's first step (and the
        first after a preemption moved it) drafts from zeros instead; heads with a root token
        (``MedusaHeads(root_token=True)``) also read the row's last token. The heads' drafts are
        their argmax tokens (deterministic, verified against a one-hot q: exact for sampled
        rows too, and independent of the batch). ``decoding.Eagle(head[, lookup_ngram=n,
        head_tokens=m])``: the head's one-layer pool at the target's page ids (pairs of the
        target's hidden state at each position and the token after it: every prefill chunk
        and every verification's kept positions feed it in the same call, as does a plain
        decode step its one position, so it is complete up to the row's length) and each
        slot's head feature at its row's last position; a
        step drafts the head's argmax chain from that feature (at most m tokens, then its
        last repeated; with n, prompt lookup's continuation where the n-gram matched), verified
        against a one-hot q like Medusa's. Its prefix-cache pages are shared only where the
        token after the page agrees too (the pair at a page's last position reads it). Or a
        draft ``models.Transformer`` (same
        vocabulary, smaller): its own page pool at the target's page ids (the same pages,
        copies and prefix hits; ``page_bytes`` counts both), prefilled with the target's chunks;
        each step it re-feeds the row's last two tokens and draws k tokens under the row's own
        settings and key, verified against its distributions (exact, batch-independent).
        Prompt lookup on an unsharded engine without rings verifies ragged drafts
        (``Runner.verify_ragged``): each row drafts on the host and its draft tokens are rows
        of one token after the batch's, so a row without a match costs one row, not k + 1.
      num_draft_tokens: k; None = chosen from the target's step costs at ``max_batch`` rows
        (measured once, then the engine's own steps' times as they run:
        ``drafts.ObservedCosts``) and the batch's running acceptance rate
        (``speculative.chosen_num_draft_tokens``), re-chosen every ``RECHOOSE_STEPS``
        decode steps (each k in use compiles its step once). With prompt lookup the rule also
        weighs the share of rows that have a match (the others emit one token at a
        verification's cost), and the choice may be 0, plain decode steps, where no k pays;
        the estimate then follows the draft's first token against each row's new token
        (what ``drafts.lookup_next`` proposes), so k can come back; and a step where no running row's
        n-gram matched (``drafts.lookup_found``) is a plain decode step whatever k is.
        With ragged drafts the rule still prices a verification as every row's k + 1 tokens
        (an upper bound: pricing it at ``1 + f k`` tokens per row, f the rows with a match,
        drafted at batch 8 on SmolLM2 and ran at 0.73x), and while it drafts each row's
        length is its own, up to k: the j tokens whose chance of being kept at the request's
        running rate, a^j, is at least a draft row's cost against a plain step's per row
        (timed at the decode batch; measured before: ``_row_caps``). A fixed k drafts k for
        every row with a match. With Medusa or EAGLE the rule may choose 0 too: decode steps
        then also return each row's hidden state (the Medusa heads' input; an EAGLE head's
        pair is fed into its pool and its feature kept), and one step in ``PROBE_EVERY``
        verifies a draft token per row so that the acceptance estimate follows the heads.
        ``Medusa(heads, lookup_ngram=n)`` keeps a k per source, each chosen on its own
        running acceptance: ``num_draft_tokens`` for steps where some row's n-gram matched
        (those rows draft the lookup's continuation, the others the heads' tokens) and
        ``heads_draft_tokens`` for steps where none did (the heads alone); which one a step
        verifies is read from the rows' tokens before it (``drafts.NgramIndex``). The
        lookup's k goes up to ``drafts.MAX_K`` (rows without a match then draft past the last
        head), the heads' to ``num_heads``. A fixed k serves both (the heads' at most
        ``num_heads``).
      logprobs_mode: what ``submit(logprobs=n)`` reports: ``"raw"`` (default: the model's
        distribution, as vLLM's default and OpenAI's API) or ``"processed"`` (the tempered,
        filtered distribution the token was drawn from); ``sampling.token_logprobs``.

    Attributes (besides the arguments): ``scheduler``, its ``scheduler.Scheduler`` (requests,
    pages); ``runner``, its ``runner.Runner`` (the device side); ``ring_pages``, R pages per
    batch slot of each sliding-window layer's ring, or None when every layer is on the pool;
    ``pool_layers``, the layers whose keys and values the pool's pages hold (module doc).
    """

    def __init__(
        self,
        model,
        *,
        max_batch: int = 8,
        num_pages: int,
        page_size: int = 16,
        prefix_caching: bool = True,
        max_prefill_tokens: int = 512,
        sampling: SamplingConfig | None = None,
        max_seq_len: int | None = None,
        draft=None,
        num_draft_tokens: int | None = None,
        logprobs_mode: str = "raw",
    ):
        check_model("model", model)
        self.logprobs_mode = check_logprobs_mode(logprobs_mode)
        if draft is not None and not isinstance(draft, PromptLookup | Medusa | Eagle | Transformer):
            raise TypeError(
                "draft must be None, a decoding.PromptLookup, a decoding.Medusa, a decoding.Eagle "
                f"or a draft models.Transformer, got {type(draft).__name__}"
            )
        k = check_optional_int("num_draft_tokens", num_draft_tokens, 1, MAX_K + 1)
        if k is not None and draft is None:
            raise ValueError(f"num_draft_tokens={k} needs a draft (draft=None)")
        if isinstance(draft, Medusa):
            if draft.tree is not None:
                raise ValueError(
                    "the engine verifies chains: draft=Medusa(heads) or Medusa(heads, "
                    "lookup_ngram=n), not a token tree"
                )
        if isinstance(draft, Medusa | Eagle | Transformer) and mesh_of(model) is not None:
            name = "model" if isinstance(draft, Transformer) else type(draft).__name__
            raise ValueError(f"a {name} draft needs an unsharded model (models.shard) here")
        if isinstance(draft, Transformer) and mesh_of(draft) is not None:
            raise ValueError("the draft model must not be sharded (models.shard) here")
        self.config = model.config
        self.max_batch = check_int("max_batch", max_batch, 1)
        self.page_size = page_size = check_int("page_size", page_size, 1)
        self.max_prefill_tokens = check_int("max_prefill_tokens", max_prefill_tokens, 1)
        self.sampling = _check_sampling("sampling", sampling) or SamplingConfig()
        self.prefix_caching = check_bool("prefix_caching", prefix_caching)
        num_pages = check_int("num_pages", num_pages, 1)
        limit = self.config.max_position
        max_seq_len = check_optional_int("max_seq_len", max_seq_len, 2, limit + 1)
        self.max_seq_len = limit if max_seq_len is None else max_seq_len
        if isinstance(draft, Transformer) and draft.config.max_position < self.max_seq_len:
            raise ValueError(
                f"the draft model's max_position={draft.config.max_position} is shorter than "
                f"max_seq_len={self.max_seq_len}: pass a smaller max_seq_len"
            )
        self.max_pages = min(num_pages, pages_for(self.max_seq_len - 1, page_size))
        self._model, self.draft = model, draft
        self._fixed_k, self.num_draft_tokens = k, k
        self._counts = collections.Counter()
        self.runner = Runner(
            model,
            max_batch=self.max_batch,
            num_pages=num_pages,
            page_size=page_size,
            max_pages=self.max_pages,
            max_seq_len=self.max_seq_len,
            max_prefill_tokens=self.max_prefill_tokens,
            draft=draft,
            logprobs_mode=self.logprobs_mode,
            counts=self._counts,
        )
        self.scheduler = Scheduler(
            max_batch=self.max_batch,
            num_pages=num_pages,
            page_size=page_size,
            max_pages=self.max_pages,
            prefix_caching=self.prefix_caching,
            max_prefill_tokens=self.max_prefill_tokens,
            counts=self._counts,
            replay_tokens=self.runner.replay_tokens,
            # An EAGLE head's pair at a page's last position reads the token after the page:
            # a page is shared only where that token agrees too.
            hash_lookahead=1 if isinstance(draft, Eagle) else 0,
        )
        # Medusa with lookup_ngram: a step where no row's n-gram matched verifies the heads'
        # drafts alone, at their own k (heads_draft_tokens) from their own acceptance.
        self.heads_draft_tokens = k
        self._heads_acceptance = None
        if isinstance(draft, Medusa) and k is not None:
            self.heads_draft_tokens = min(k, draft.heads.num_heads)
        if draft is not None:
            kind, params = self.runner.draft, self.runner.draft_params
            kind.check(model, k or 1)  # Medusa: the heads' shapes, k <= num_heads (or MAX_K)
            prior = kind.costs(model, params).prior
            self.acceptance = AcceptanceEstimate(prior)
            if isinstance(draft, Medusa) and draft.lookup_ngram is not None:
                self._heads_acceptance = AcceptanceEstimate(prior)
            # The steps' own costs and, for prompt lookup, the share of rows with a match:
            # what the k rule weighs (_choose_k). The measured costs are looked up once, when
            # the rule first weighs them (``speculative.draft_step_costs``: the lookup alone
            # cost 40 ms, 7% of a batch-8 pass when it ran every ``RECHOOSE_STEPS``).
            self._observed = ObservedCosts()
            self._drafting = AcceptanceEstimate(1.0)
            self._step_costs = functools.cache(
                functools.partial(draft_step_costs, model, kind, params, batch=self.max_batch)
            )
            self._choose_k()
        # Ragged prompt lookup with k chosen: each row's draft length from its own acceptance
        # (_row_caps): a drafted token pays where the chance it is kept exceeds what a row of
        # the step costs against a plain step's token: measured, (Tq = 2 - Tq = 1) / (Tq = 1),
        # until this engine has timed its own steps at the decode batch (_row_costs).
        self._row_rates: dict[int, AcceptanceEstimate] = {}
        self._row_threshold = None
        self._plain_s: dict[int, ObservedCosts] = {}  # decode batch -> plain step seconds
        self._row_s: dict[int, ObservedCosts] = {}  # decode batch -> seconds per draft row
        if self.runner.ragged and k is None and mesh_of(model) is None:
            t = measured_costs(model, batch=self.max_batch, max_k=MAX_K).target
            self._row_threshold = max(t[1] - t[0], 0.0) / t[0]
        self._events: dict[int, list[int]] = {}  # tokens not yet returned by step()
        self._num_logprobs: dict[int, int] = {}  # live requests that asked: rid -> n
        self._step_logprobs: dict[int, list[TokenLogprob]] = {}  # of self._events' tokens
        self._logprobs: dict[int, list[TokenLogprob]] = {}  # of returned tokens, not popped
        self._returned_logprobs: tuple[dict[int, list[TokenLogprob]], ...] = ()  # to merge
        self._broken: str | None = None
        self._next_rid = 0
        self._busy_s = 0.0
        self._warmup_compile_s = 0.0  # compile_s spent by warmup(), outside step()

    @property
    def allocator(self):
        """The ``paging.PageAllocator`` of the pool (and prefix cache)."""
        return self.scheduler.allocator

    @property
    def tables(self):
        """The ``paging.BlockTables`` of the batch rows."""
        return self.scheduler.tables

    @property
    def ring_pages(self) -> int | None:
        """R, the pages per batch slot of each sliding-window layer's ring, or None when every
        layer is on the pool (module doc)."""
        return self.runner.ring_pages

    @property
    def pool_layers(self) -> tuple[int, ...]:
        """The layers whose keys and values the pool's pages hold (module doc)."""
        return self.runner.pool_layers

    # ----------------------------------------------------------------------------- requests

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
        """Queues a request; returns its id. ``seed`` defaults to the id.

        ``logprobs``: None (default) or n in [0, ``MAX_LOGPROBS``]: record each generated
        token's log-probability and its n most likely alternatives (``pop_logprobs``).

        Raises ``ValueError`` (``TypeError`` for ``sampling``) before queueing anything when the
        request is malformed or can never fit: an empty prompt, a token outside the vocabulary,
        or prompt + max_new_tokens beyond the pool or ``max_seq_len``.
        """
        self._check_usable()
        prompt = self._check_prompt(prompt_tokens)
        max_new = check_int("max_new_tokens", max_new_tokens, 1)
        sampling = _check_sampling("sampling", sampling) or self.sampling
        V = self.config.vocab_size
        eos = check_optional_int("eos_id", eos_id, 0, V)
        seed = check_optional_int("seed", seed, 0, 2**32)
        num_logprobs = check_optional_int("logprobs", logprobs, 0, MAX_LOGPROBS + 1)
        if num_logprobs is not None and num_logprobs > V:
            raise ValueError(f"logprobs={num_logprobs} exceeds the vocabulary's size {V}")
        total = len(prompt) + max_new
        need = pages_for(total - 1, self.page_size)  # the last new token is never cached
        if need > self.allocator.num_pages:
            raise ValueError(
                f"prompt length {len(prompt)} + max_new_tokens {max_new} needs {need} pages of "
                f"{self.page_size}, more than the pool holds (num_pages={self.allocator.num_pages})"
            )
        if total > self.max_seq_len:
            raise ValueError(
                f"prompt length {len(prompt)} + max_new_tokens {max_new} exceeds max_seq_len "
                f"{self.max_seq_len} (default: the model's max_position)"
            )
        with deferred_interrupts():
            rid = self._next_rid
            self._next_rid += 1
            seed = rid if seed is None else seed
            if num_logprobs is not None:
                self._num_logprobs[rid] = num_logprobs
            self.scheduler.add(Request(rid, len(prompt), max_new, sampling, eos, seed, prompt))
        return rid

    def abort(self, rid) -> list[int]:
        """Cancels request ``rid`` -> the tokens it generated so far.

        A waiting request leaves the queue; a running one leaves its batch row and its pages are
        released at once (full pages it registered stay in the prefix cache, reusable and
        evictable); a finished one's result is dropped. Other requests are unaffected. Its
        tokens not yet returned by ``step()`` are dropped too. Raises ``KeyError`` naming
        ``rid`` when no such request is live or waiting to be handed out.
        """
        self._check_usable()
        with deferred_interrupts():
            if not is_int(rid):  # True == 1 would find request 1
                raise KeyError(f"no request with id {rid!r}: request ids are ints")
            out = self.scheduler.abort(int(rid))
            self._events.pop(rid, None)
            self._merge_returned_logprobs()
            for d in (self._num_logprobs, self._step_logprobs, self._logprobs):
                d.pop(rid, None)
        return out

    def _check_prompt(self, prompt_tokens) -> list[int]:
        if isinstance(prompt_tokens, np.ndarray | jax.Array):
            arr = np.asarray(prompt_tokens)
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(
                    f"prompt_tokens must be a 1-D int array, got {arr.shape} {arr.dtype}"
                )
            prompt_tokens = arr.tolist()
        if not isinstance(prompt_tokens, list | tuple):
            raise ValueError(
                f"prompt_tokens must be a list of ints, got {type(prompt_tokens).__name__}"
            )
        if not prompt_tokens:
            raise ValueError("prompt_tokens must not be empty")
        bad = [
            t for t in prompt_tokens if isinstance(t, bool) or not isinstance(t, int | np.integer)
        ]
        if bad:
            raise ValueError(f"prompt_tokens must hold ints, got {bad[:3]!r}")
        V = self.config.vocab_size
        out = [t for t in prompt_tokens if not 0 <= t < V]
        if out:
            raise ValueError(f"prompt_tokens has ids outside the vocabulary [0, {V}): {out[:5]}")
        return [int(t) for t in prompt_tokens]

    # ----------------------------------------------------------------------------- stepping

    def step(self) -> dict[int, list[int]]:
        """One scheduler step -> ``{request id: [new tokens]}``, each token returned once (none
        when there is no work or every admitted request is still prefilling; more than one
        after an interrupted step, whose tokens come with the next).

        On an exception the engine rebuilds itself first (module doc), then re-raises.
        """
        self._check_usable()
        with deferred_interrupts():
            t0 = time.perf_counter()
            # What was pending before this step; the lists are replaced, never extended, so
            # handing a row's tokens out can be redone after an exception (see below).
            events, logprobs, lengths = dict(self._events), dict(self._step_logprobs), None
            try:
                caps, ks = self._row_caps(), self._source_ks()
                ahead = self.num_draft_tokens + 1 if self.draft is not None else 1
                if ks is not None:
                    ahead = 1 + max(ks)
                elif self._probe():
                    ahead = 2
                if caps:
                    ahead = 1 + max(caps.values(), default=0) if self.num_draft_tokens else 1
                plan = self.scheduler.schedule(ahead)
                out = self.runner.run(
                    plan, set(self._num_logprobs), plain=self._explore(plan), caps=caps, ks=ks
                )
                lengths = [len(row.req.tokens) for row in plan.decode]
                self.scheduler.postprocess(plan, out.tokens)
                self._emit(plan, out, lengths, events, logprobs)
                self._count_drafts(plan, out, lengths)
            except BaseException:
                try:  # the tokens some rows appended before the exception are theirs: handed
                    if lengths is not None:  # out like any step's, or a stream would skip them
                        self._emit(plan, out, lengths, events, logprobs)
                finally:
                    self._rebuild()
                raise
            finally:
                self._busy_s += time.perf_counter() - t0
        # Handing the tokens out: from the block's end to the return there is no call and no
        # backward jump, the only points where CPython runs a signal handler, so a Ctrl-C is
        # raised either above (the tokens stay in self._events and come with the next step) or
        # in the caller after the return, never with the tokens out of self._events and not
        # returned.
        events, self._events = self._events, {}
        if self._step_logprobs:
            self._returned_logprobs = self._returned_logprobs + (self._step_logprobs,)
            self._step_logprobs = {}
        return events

    def pop_logprobs(self) -> dict[int, list[TokenLogprob]]:
        """``{request id: [TokenLogprob per token]}`` of the tokens ``step()`` returned since
        the last call, for the requests submitted with ``logprobs``; each handed out once, in
        token order (after ``run_until_done()``: every token of those requests)."""
        with deferred_interrupts():
            self._merge_returned_logprobs()
            out, self._logprobs = self._logprobs, {}
        return out

    def _merge_returned_logprobs(self) -> None:
        """Folds the per-step records ``step()`` handed out (kept as a tuple there, to add
        without a call) into ``self._logprobs``."""
        for part in self._returned_logprobs:
            for rid, records in part.items():
                self._logprobs.setdefault(rid, []).extend(records)
        self._returned_logprobs = ()

    def warmup(self) -> float:
        """Compiles every device step this engine can run -> the seconds it took.

        Each shape (a prefill chunk bucket with its chunks per call, a decode batch, a
        verification's k, the page copies) otherwise compiles inside the first ``step`` that
        needs it, about a second each on SmolLM2 and a few dozen of them, so early requests
        and any new mix of lengths stall behind compilations. A server warms up before it
        listens (``python -m decoding.serve`` unless ``--no-warmup``). The steps run on padding
        rows, reading and writing the scratch page only; the counters of ``stats()`` are left as
        they were except ``compile_s``. ``RuntimeError`` unless the engine is idle.
        """
        self._check_usable()
        if self.busy:
            raise RuntimeError(
                "warmup() needs an idle engine: a request is waiting or running, or tokens "
                "are yet to be returned by step()"
            )
        lengths: tuple[int, ...] = ()
        if self.draft is not None:  # every k the rule may choose, or the fixed one
            kind, params = self.runner.draft, self.runner.draft_params
            costs = kind.costs(self._model, params)
            fixed = self._fixed_k or costs.fixed_k
            lengths = (fixed,) if fixed else tuple(range(1, costs.max_k + 1))
        t0, compiled = time.perf_counter(), self.runner.compile_s
        try:
            self.runner.warmup(lengths)
        except BaseException:  # a step's donated pool may be gone: as after a failed step
            self._rebuild()
            raise
        finally:  # not inside step(): kept out of tokens_per_s's time
            self._warmup_compile_s += self.runner.compile_s - compiled
        return time.perf_counter() - t0

    @property
    def busy(self) -> bool:
        """Some request is waiting or running, or some tokens are yet to be returned by
        ``step()`` (those of a step that raised), so ``while eng.busy: eng.step()`` streams
        every token even when the last step was interrupted."""
        return bool(self.scheduler.waiting or self.scheduler.running or self._events)

    def pop_finished(self) -> dict[int, list[int]]:
        """``{request id: generated tokens}`` of the requests finished since the last call, each
        handed out once (the engine keeps no result after this)."""
        out, self.scheduler.finished = self.scheduler.finished, {}
        return out

    def run_until_done(self) -> dict[int, list[int]]:
        """Steps while ``busy`` -> ``pop_finished()``: the requests that
        finished during this call (and any finished earlier that were not yet handed out)."""
        while self.busy:
            self.step()
        return self.pop_finished()

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise RuntimeError(self._broken)

    def _rebuild(self) -> None:
        """After an exception inside ``step``: a fresh allocator, block tables and (when the pool's
        buffers were donated and lost, or failed) pool; every unfinished request back to the
        queue, running ones first in admission order, to be recomputed from its tokens."""
        try:
            self.runner.recover()
            self.scheduler.reset()
            self._counts["rebuilds"] += 1
        except BaseException as e:
            self._broken = (
                f"this Engine cannot continue: rebuilding it after an exception in step() failed "
                f"({type(e).__name__}: {e}); create a new Engine and resubmit the requests"
            )
            raise

    def _emit(self, plan: StepPlan, out: RunOutput, lengths: list[int], events, logprobs) -> None:
        """Keeps for ``step()``'s caller the tokens each decode row appended this step (its
        request's tokens past ``lengths[i]``) and, when the request asked, their logprobs,
        after ``events`` / ``logprobs`` (what was pending before the step). Idempotent: run
        again after an exception it sets the same lists."""
        for i, row in enumerate(plan.decode):
            req = row.req
            tokens = req.tokens[lengths[i] :]
            if not tokens:
                continue
            self._events[req.rid] = events.get(req.rid, []) + tokens
            n = self._num_logprobs.get(req.rid)
            if n is not None and out.logprobs is not None:
                m = len(tokens)
                part = jax.tree.map(lambda x, m=m: x[:m], out.logprobs[i])
                records = logprob_records(tokens, part, n)
                self._step_logprobs[req.rid] = logprobs.get(req.rid, []) + records
                if req.done:
                    del self._num_logprobs[req.rid]

    def _count_drafts(self, plan: StepPlan, out: RunOutput, lengths: list[int]) -> None:
        """With a draft: counts what each row accepted and every ``RECHOOSE_STEPS``
        verifications chooses k again."""
        if not plan.decode or self.draft is None:
            return
        k = plan.ahead - 1  # the k in use (prompt lookup); out.k, the step's verified drafts
        # A step's cost where it computed the rows a verification does (max_batch of them): a
        # plain step (k = 0 chosen, or nothing to propose) or a verification of k. Not a ragged
        # one: its rows drafted what they had (and their own lengths), fewer than k each, so
        # its time would price k below what k drafts cost (at batch 8 on SmolLM2 the rule
        # then drafted and ran at 0.8x); the rule keeps the measured whole-row costs, scaled.
        ragged = out.proposed is not None
        full = not ragged and (
            out.verified or self.runner.decode_batch(len(plan.decode)) == self.max_batch
        )
        if out.seconds is not None and full:
            self._observed.observe(out.k, out.seconds)
        if out.seconds is not None and self._row_threshold is not None:
            self._row_costs(plan, out)
        if isinstance(self.draft, PromptLookup):
            found = out.found  # the runner's, from the rows' known tokens (lengths)
            self._drafting.add(sum(found), len(found))
            # Not drafting: would the draft's first token have been this step's token? Only
            # where some row had a match: a step where none has is never verified.
            # A row with a match that drafted nothing (cap 0): its own rate follows the same.
            drafted = out.proposed or [out.k] * len(plan.decode)
            for row, n, f, m, first in zip(
                plan.decode, lengths, found, drafted, out.nexts, strict=True
            ):
                if f and not m and len(row.req.tokens) > n:
                    hit = int(first == row.req.tokens[n])
                    if k == 0:
                        self.acceptance.update(hit, 1)
                    if self._row_threshold is not None:
                        self._row_rate(row.req.rid).update(hit, 1)
        proposed = out.proposed or [out.k] * len(out.accepted)
        pairs = zip(plan.decode, out.accepted, proposed, strict=True) if out.verified else ()
        estimate = self.acceptance
        if self._heads_acceptance is not None and not any(out.found):
            estimate = self._heads_acceptance  # the heads' drafts alone
        for row, n, m in pairs:
            if m:  # a ragged verification's rows without a draft proposed nothing
                self._counts["draft_accepted"] += n
                self._counts["draft_proposed"] += m
                estimate.update(n, m)
                if self._row_threshold is not None:
                    self._row_rate(row.req.rid).update(n, m)
        if self._counts["decode_steps"] % RECHOOSE_STEPS == 0:
            self._choose_k()

    def _row_rate(self, rid: int) -> AcceptanceEstimate:
        """Request ``rid``'s own acceptance rate: from the engine's running rate (worth
        ``ROW_PRIOR_WEIGHT`` tested tokens), then what its verifications kept."""
        if rid not in self._row_rates:
            self._row_rates[rid] = AcceptanceEstimate(self.acceptance.rate, ROW_PRIOR_WEIGHT)
        return self._row_rates[rid]

    def _row_costs(self, plan: StepPlan, out: RunOutput) -> None:
        """Times a step for the rows' draft lengths: a plain one's seconds at its decode batch
        (not one with prompt rows folded in), a ragged verification's seconds beyond that per
        draft row (its rows padded: ``runner.draft_bucket``)."""
        B = self.runner.decode_batch(len(plan.decode))
        if not out.verified:
            if not self.runner.fold(plan)[0]:
                self._plain_s.setdefault(B, ObservedCosts()).observe(0, out.seconds)
        elif out.proposed and B in self._plain_s:
            rows = draft_bucket(sum(out.proposed), B)
            extra = (out.seconds - self._plain_s[B].seconds[0]) / rows
            self._row_s.setdefault(B, ObservedCosts()).observe(0, max(extra, 0.0))

    def _threshold(self, n: int) -> float:
        """The chance of being kept a draft token needs at n decoding rows: a draft row's
        seconds over a plain step's per row, as this engine timed them at that decode batch
        (``_row_costs``), else as measured at ``max_batch``."""
        B = self.runner.decode_batch(max(n, 1))
        if B in self._row_s and self._row_s[B].count(0) >= 4:
            return self._row_s[B].seconds[0] * n / self._plain_s[B].seconds[0]
        return self._row_threshold

    def _row_caps(self) -> dict[int, int] | None:
        """Ragged prompt lookup with k chosen (``num_draft_tokens=None``; None otherwise): each
        running request's most draft tokens, ``{rid: cap}``: the longest j <= k (the rule's,
        so that a verification's time is what k's drafts cost at most) whose
        chance of being kept, a^j with a the request's own rate (``_row_rate``), is at least
        the threshold, the cost of a row against a plain step's (a draft token's marginal
        row pays only then). 0 for every row while the k rule chooses not to draft. A copying
        answer's rows draft long, an open chat's one or two tokens, in the same step."""
        if self._row_threshold is None:
            return None
        live = set(self.scheduler.live)
        for rid in [r for r in self._row_rates if r not in live]:
            del self._row_rates[rid]  # finished or aborted
        caps = {}
        theta = self._threshold(sum(r.decoding for r in self.scheduler.running))
        for req in self.scheduler.running:
            a, j = self._row_rate(req.rid).rate, 0
            while j < self.num_draft_tokens and a ** (j + 1) >= theta:
                j += 1
            caps[req.rid] = j
        return caps

    def _explore(self, plan: StepPlan) -> bool:
        """Whether this step runs plain although prompt lookup drafts (k >= 1): the k rule
        weighs a verification's cost against a plain step's as this engine runs them (real
        contexts, the lookup and acceptance around the forward), so while k >= 1 a plain step
        is timed now and then: every ``EXPLORE_STEPS`` until a few are, then every
        ``EXPLORE_EVERY``. Its tokens are a plain step's, exact as a verification's. (Medusa
        could too, its plain steps keeping the rows' states, but on SmolLM2 timing them made
        the engine slower at batch 1 and 8: 0.86x and 0.83x against 0.94x and 0.93x.)"""
        if not isinstance(self.draft, PromptLookup) or self._fixed_k is not None:
            return False  # only the k rule reads the times
        if plan.ahead == 1 or not plan.decode:
            return False
        if self.runner.decode_batch(len(plan.decode)) != self.max_batch:
            return False  # not a verification's rows: its time would not compare
        every = EXPLORE_STEPS if self._observed.count(0) < 4 else EXPLORE_EVERY
        return self._counts["decode_steps"] % every == every // 2

    def _probe(self) -> bool:
        """Whether this step verifies one Medusa or EAGLE draft token per row although k is 0
        (with ``lookup_ngram``, either source's): every ``PROBE_EVERY`` decode steps, so that
        the acceptance estimate follows the heads (rows keep their hidden states, and an EAGLE
        head's pool its pairs, through plain steps: ``Runner.decode``) and k can come back."""
        if not isinstance(self.draft, Medusa | Eagle) or self._fixed_k:
            return False
        if self.num_draft_tokens and (self._heads_acceptance is None or self.heads_draft_tokens):
            return False
        return self._counts["decode_steps"] % PROBE_EVERY == PROBE_EVERY // 2

    def _source_ks(self) -> tuple[int, int] | None:
        """Medusa with ``lookup_ngram``: (k of a step where some row's n-gram matched, k of
        one where none did, whose rows all draft with the heads), each at least 1 in a probe
        step (``_probe``); None for other drafts. Copying rows keep most of a long lookup
        draft, the heads' open-chat guesses one token in four, so one k for both would pay a
        long verification for the heads' guesses or cut the lookup's (on SmolLM2 at batch 1
        one k chose 4 and ran at 1.25x, lookup alone at 1.38x)."""
        if self._heads_acceptance is None:
            return None
        ks = (self.num_draft_tokens, self.heads_draft_tokens)
        return tuple(max(k, 1) for k in ks) if self._probe() else ks

    def _choose_k(self) -> None:
        """k for the next verification steps (fixed, or the rule on the running estimate; with
        ``Medusa(heads, lookup_ngram=n)`` one k per source, each on its own estimate: the
        steps cost the same, what they keep differs)."""
        if self._fixed_k is not None:
            return
        lookup = isinstance(self.draft, PromptLookup)

        def chosen(estimate: AcceptanceEstimate, keep: int | None, most=None) -> int:
            return chosen_num_draft_tokens(
                self._model,
                self.runner.draft,
                self.runner.draft_params,
                batch=self.max_batch,
                acceptance=estimate.rate,
                # A head's guesses are judged by verifying them: while k is 0, by probes.
                allow_zero=isinstance(self.draft, PromptLookup | Medusa | Eagle),
                keep=keep,
                observed=self._observed,
                drafting=self._drafting.rate if lookup else 1.0,
                step_costs=self._step_costs,
                max_k=most,
            )

        self.num_draft_tokens = chosen(self.acceptance, self.num_draft_tokens)
        if self._heads_acceptance is not None:  # the heads draft num_heads tokens at most
            self.heads_draft_tokens = chosen(
                self._heads_acceptance, self.heads_draft_tokens, self.runner.draft.num_heads
            )

    # ----------------------------------------------------------------------------- stats

    def stats(self) -> dict:
        """Pool and scheduler counters.

        ``utilization`` is used token slots over allocated token slots: positions holding a
        cached token of a running request, over ``P`` times the pages running requests hold
        (0.0 when they hold none). ``prefix_cache_hits`` counts pages reused from the cache;
        ``tokens_per_s`` is generated tokens over the time spent in ``step`` less its compilation
        (steps that traced a device step); ``compile_s`` counts ``warmup()``'s too; ``finished``
        and ``aborted`` count requests; ``rebuilds`` the times an exception in ``step`` made the
        engine rebuild.

        Memory: the ``pages_*`` counts are pool pages; a pool page holds P positions of the
        ``pool_layers`` layers, ``page_bytes`` of keys and values (with a draft model's page at
        the same id). With rings (``ring_pages`` R
        > 0) those are the global layers only: the sliding layers' rings, ``ring_bytes`` in all
        (``max_batch * R + 1`` pages of each sliding layer), are allocated once and never taken
        from the pool; ``replay_tokens`` counts the positions replayed to rebuild rings after
        prefix hits.
        """
        alloc, P, L = self.allocator, self.page_size, self.config.num_layers
        k = self.runner.k
        used = {}
        for req in self.scheduler.running:
            for i, page in enumerate(self.tables.rows[req.row]):
                used[page] = max(used.get(page, 0), min(P, max(req.computed - i * P, 0)))
        pages_used = alloc.num_pages - alloc.num_available
        c = self._counts
        run_s = self._busy_s - (self.runner.compile_s - self._warmup_compile_s)
        return dict(
            pages_total=alloc.num_pages,
            pages_free=alloc.num_free,
            pages_cached=alloc.num_cached,
            pages_used=pages_used,
            utilization=sum(used.values()) / (pages_used * P) if pages_used else 0.0,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            finished=c["finished"],
            aborted=c["aborted"],
            rebuilds=c["rebuilds"],
            prefix_cache_hits=c["prefix_cache_hits"],
            preemptions=c["preemptions"],
            decode_steps=c["decode_steps"],
            prefill_tokens=c["prefill_tokens"],
            generated_tokens=c["generated_tokens"],
            page_copies=c["page_copies"],
            evictions=alloc.evictions,
            compile_s=self.runner.compile_s,
            tokens_per_s=c["generated_tokens"] / run_s if run_s > 0 else 0.0,
            num_draft_tokens=self.num_draft_tokens,
            heads_draft_tokens=(
                self.heads_draft_tokens if self._heads_acceptance is not None else None
            ),
            draft_accepted=c["draft_accepted"],
            draft_proposed=c["draft_proposed"],
            pool_layers=len(self.pool_layers),
            ring_pages=self.ring_pages or 0,
            page_bytes=sum(k[i].nbytes // k[i].shape[0] * 2 for i in self.pool_layers)
            + sum(x.nbytes // x.shape[0] * 2 for x in self.runner.draft_k),
            ring_bytes=sum(
                x.nbytes for i, x in enumerate(k + self.runner.v) if i % L not in self.pool_layers
            ),
            replay_tokens=c["replay_tokens"],
        )

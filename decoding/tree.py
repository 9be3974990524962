"""Token trees for speculative decoding (Medusa / EAGLE): candidates from the top-s of each
draft head, verified in one target call with tree attention, the accepted path compacted.

A :class:`TreeSpec` is the node list as Medusa builds it ("medusa choices"): node ``(c_1, .., c_d)``
at depth d is the c_d-th best candidate of head d - 1, child of node ``(c_1, .., c_{d-1})``. The
verification input is ``[last, node_1, .., node_N]`` (Tq = N + 1, node 0 = the root = the last,
not yet fed token), at positions ``lengths + depth``, written in cache slots
``lengths .. lengths + N``; ``tree_mask`` lets each node see the cache, the root and its
ancestors only. After acceptance the accepted path's K/V move from their slots to
``lengths + 1 .. lengths + n`` and everything past is rolled back by the length.

Acceptance (:func:`accept_tree`) is recursive rejection sampling over each node's children, so
sampling stays exactly the target's distribution; greedy keeps the path of argmax tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq

import jax
import jax.numpy as jnp
import numpy as np

from decoding.checks import check_int, is_int
from models import KVCache
from pallas_attn.cache import set_rows


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """Nodes as choice paths, e.g. ``((0,), (1,), (0, 0))``: the root's children are head 0's
    top-1 and top-2 candidates, and the top-1 of head 1 follows the first of them.

    Every node's parent (its path minus the last choice) must be a node too; choices are ints
    >= 0; no duplicates. Nodes are kept sorted by (depth, path), so parents precede children.
    """

    paths: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        paths = self.paths
        if not isinstance(paths, tuple | list) or not paths:
            raise ValueError(f"TreeSpec paths must be a non-empty tuple of paths, got {paths!r}")
        clean = []
        for p in paths:
            ok = isinstance(p, tuple | list) and len(p) > 0
            if not ok or any(not is_int(c) or c < 0 for c in p):
                raise ValueError(f"TreeSpec path must be a non-empty tuple of ints >= 0, got {p!r}")
            clean.append(tuple(int(c) for c in p))
        if len(set(clean)) != len(clean):
            raise ValueError("TreeSpec paths contain duplicates")
        for p in clean:
            if len(p) > 1 and p[:-1] not in set(clean):
                raise ValueError(f"TreeSpec path {p} has no parent {p[:-1]} in the tree")
        object.__setattr__(self, "paths", tuple(sorted(clean, key=lambda p: (len(p), p))))

    @classmethod
    def default(cls, num_heads: int) -> TreeSpec:
        """Every path of length d <= num_heads whose choices sum to at most (2, 2, 1, 1, ..)[d-1]:
        for 4 heads 18 nodes (3 + 6 + 4 + 5), Tq = 19 per verification."""
        num_heads = check_int("num_heads", num_heads, 1)
        paths, frontier = [], [()]
        for d in range(1, num_heads + 1):
            budget = 2 if d <= 2 else 1
            frontier = [
                p + (c,) for p in frontier for c in range(budget + 1) if sum(p) + c <= budget
            ]
            paths += frontier
        return cls(tuple(paths))

    @classmethod
    def from_accuracies(cls, rank_accuracy, num_nodes: int) -> TreeSpec:
        """The ``num_nodes`` paths most likely to be accepted (Medusa's tree construction):
        ``rank_accuracy[d][c]`` is the probability that head d's c-th best candidate is the
        right token (e.g. :func:`decoding.medusa.rank_accuracy`); a path's probability is the
        product over its choices (heads taken as independent), and the expected tokens per
        verification is 1 + the sum over the tree's paths. Best-first, so parents always come
        with their children."""
        acc = [[float(a) for a in row] for row in rank_accuracy]
        if not acc or any(not row or any(not 0.0 <= a <= 1.0 for a in row) for row in acc):
            raise ValueError("rank_accuracy must be a non-empty [heads][ranks] table in [0, 1]")
        num_nodes = check_int("num_nodes", num_nodes, 1)
        frontier = [(-acc[0][c], (c,)) for c in range(len(acc[0]))]
        heapq.heapify(frontier)
        paths = []
        while frontier and len(paths) < num_nodes:
            neg, path = heapq.heappop(frontier)
            paths.append(path)
            if len(path) < len(acc):  # its children: the next head's candidates
                for c, a in enumerate(acc[len(path)]):
                    heapq.heappush(frontier, (neg * a, path + (c,)))
        return cls(tuple(paths))

    def expected_tokens(self, rank_accuracy) -> float:
        """1 + the summed acceptance probability of every path (see :meth:`from_accuracies`)."""
        return 1.0 + sum(
            float(np.prod([rank_accuracy[d][c] for d, c in enumerate(p)])) for p in self.paths
        )

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    @property
    def top(self) -> int:
        """Candidates needed per head: 1 + the largest choice."""
        return 1 + max(max(p) for p in self.paths)

    @functools.cached_property
    def tables(self) -> dict[str, np.ndarray]:
        """Static index tables over the N + 1 nodes (0 = root): ``parent`` [N+1] (-1 for the
        root), ``depth`` [N+1], ``head``/``choice`` [N+1] (node i>0 is ``choice``-th best of
        ``head``), ``mask`` [N+1, N+1] bool (j is i or an ancestor), ``path`` [N+1, depth]
        (the ancestor of i at depth d + 1, or i past its own depth), ``children`` [N+1, M]
        (in choice order, -1 padded)."""
        index = {p: i + 1 for i, p in enumerate(self.paths)}
        n = len(self.paths) + 1
        parent, depth = np.full(n, -1, np.int32), np.zeros(n, np.int32)
        head, choice = np.zeros(n, np.int32), np.zeros(n, np.int32)
        kids: list[list[int]] = [[] for _ in range(n)]
        mask = np.eye(n, dtype=bool)
        mask[:, 0] = True
        path = np.zeros((n, self.depth), np.int32)
        for p, i in index.items():
            parent[i] = index.get(p[:-1], 0)
            kids[parent[i]].append(i)
            depth[i], head[i], choice[i] = len(p), len(p) - 1, p[-1]
            for d in range(1, len(p) + 1):
                mask[i, index[p[:d]]] = True
            path[i] = [index[p[: d + 1]] if d < len(p) else i for d in range(self.depth)]
        children = np.full((n, max(map(len, kids))), -1, np.int32)
        for i, k in enumerate(kids):
            children[i, : len(k)] = k
        return dict(
            parent=parent,
            depth=depth,
            head=head,
            choice=choice,
            mask=mask,
            path=path,
            children=children,
        )


def node_tokens(spec: TreeSpec, head_logits, last):
    """The verification input [B, N+1]: ``last`` [B] then each node's candidate from
    ``head_logits`` [B, H, V] (H >= depth)."""
    t = spec.tables
    _, top = jax.lax.top_k(head_logits[:, : spec.depth], spec.top)  # [B, depth, top]
    nodes = top[:, t["head"][1:], t["choice"][1:]]  # [B, N]
    return jnp.concatenate([last[:, None], nodes.astype(jnp.int32)], axis=1)


def accept_tree(spec: TreeSpec, tokens, p, key):
    """Recursive rejection sampling down the tree (SpecInfer's rule for deterministic drafts).

    tokens [B, N+1] (root first), p [B, N+1, V] the target's distributions after each node ->
    (best [B], the last accepted node; n [B] its depth; path [B, depth] its path's tokens;
    nxt [B], one more token). At node u with r = p_u, its children c_1, c_2, .. (distinct
    tokens, q one-hot) are tried in order: accept c_j with probability r(c_j), else
    r <- normalize(r without c_j) and try the next; an accepted child continues from its own p;
    when every child is rejected (or u is a leaf) next ~ r. Each emitted token is distributed
    exactly as the target's; greedy (one-hot p) keeps the child equal to the argmax.
    """
    t = spec.tables
    B = tokens.shape[0]
    rows = jnp.arange(B)
    children = jnp.asarray(t["children"])  # [N+1, M], -1 padded
    M = children.shape[1]
    keys = jax.random.split(key, spec.depth * M + 1)

    def try_child(i, carry):  # i = d * M + j: the j-th child of the current node, at depth d
        r, cur, alive, moved, nxt_node = carry
        child = children[cur, i % M]
        tok = tokens[rows, jnp.maximum(child, 0)]
        r_tok = r[rows, tok] / jnp.maximum(jnp.sum(r, -1), 1e-30)
        tried = alive & ~moved & (child >= 0)
        ok = tried & (jax.random.uniform(keys[i], (B,)) < r_tok)
        removed = r.at[rows, tok].set(0.0)
        r = jnp.where((tried & ~ok)[:, None], removed, r)  # rejected: drop the token
        return r, cur, alive, moved | ok, jnp.where(ok, child, nxt_node)

    def descend(d, carry):
        r, cur, alive = carry
        init = (r, cur, alive, jnp.zeros((B,), bool), cur)
        # A loop, not unrolled: a wide tree (M children) would give M copies of [B, V] work.
        r, _, _, moved, nxt_node = jax.lax.fori_loop(d * M, (d + 1) * M, try_child, init)
        cur = jnp.where(moved, nxt_node, cur)
        return jnp.where(moved[:, None], p[rows, cur], r), cur, moved

    init = (p[:, 0], jnp.zeros((B,), jnp.int32), jnp.ones((B,), bool))
    r, cur, _ = jax.lax.fori_loop(0, spec.depth, descend, init)
    r = jnp.where(jnp.sum(r, -1, keepdims=True) > 0, r, p[rows, cur])
    nxt = jax.random.categorical(keys[-1], jnp.log(r), axis=-1).astype(jnp.int32)
    return _outcome(spec, tokens, cur, nxt)


def _outcome(spec: TreeSpec, tokens, best, nxt):
    """What both acceptance rules return: (best, its depth n, its path's tokens, nxt)."""
    t = spec.tables
    path = jnp.take_along_axis(tokens, jnp.asarray(t["path"])[best], axis=1)
    return best, jnp.asarray(t["depth"])[best], path, nxt


def accept_tree_greedy(spec: TreeSpec, tokens, best_tok):
    """:func:`accept_tree`'s greedy limit, without randomness: best_tok [B, N+1] the target's
    argmax after each node. From the root, move to the child whose token is the current node's
    argmax (children hold distinct tokens) while there is one; next = the argmax there."""
    t = spec.tables
    rows = jnp.arange(tokens.shape[0])
    children = jnp.asarray(t["children"])  # [N+1, M], -1 padded
    cur = jnp.zeros(rows.shape, jnp.int32)
    for _ in range(spec.depth):
        kids = children[cur]  # [B, M]
        kid_tok = jnp.take_along_axis(tokens, jnp.maximum(kids, 0), axis=1)
        hit = (kids >= 0) & (kid_tok == best_tok[rows, cur][:, None])
        cur = jnp.where(jnp.any(hit, 1), kids[rows, jnp.argmax(hit, 1)], cur)
    return _outcome(spec, tokens, cur, best_tok[rows, cur])


def compact_path(spec: TreeSpec, cache: KVCache, start, best):
    """Moves the K/V of ``best``'s path (slots ``start + path node``) to ``start + 1 .. start +
    depth`` in every layer; start [B] = the root's slot. Lengths are not changed."""
    src = start[:, None] + jnp.asarray(spec.tables["path"])[best]  # [B, depth]
    dst = start[:, None] + 1 + jnp.arange(spec.depth, dtype=jnp.int32)
    s0, s1 = cache_slots(cache, src)
    d0, d1 = cache_slots(cache, dst)

    def move(x):
        return set_rows(x, d0, d1, x[s0, s1])

    return cache.replace(k=tuple(map(move, cache.k)), v=tuple(map(move, cache.v)))


def cache_slots(cache: KVCache, pos):
    """(idx0, idx1) [B, T] into a layer's cache array for logical positions pos [B, T]."""
    if cache.block_table is None:
        return jnp.broadcast_to(jnp.arange(pos.shape[0])[:, None], pos.shape), pos
    P = cache.k[0].shape[1]
    page = jnp.take_along_axis(cache.block_table, pos // P, axis=1, mode="clip")
    return page, pos % P

"""Medusa heads (Cai et al., 2024): light heads on a frozen target's last hidden state, each
predicting a token further ahead, so that one model drafts for itself.

Offset convention. With the target's last hidden state h_t (after its final norm, what its LM
head reads) the target predicts x_{t+1}; head i (0-based) predicts x_{t+2+i}. So after the target
has produced x_{t+1}, heads 0 .. k-1 draft x_{t+2} .. x_{t+1+k}.

Head i: a residual SiLU layer ``r_i = h + silu(W_i h + b_i)`` (``W_i``, ``b_i`` initialised to
zero, so an untrained head predicts what the target predicts one step earlier), then an LM head.

Root token (``root_token=True``): each head also reads the embedding of x_{t+1}, the token the
target has just produced from h_t (the draft's root, known before any head runs):
``r_i = h + silu(W_i h + U_i e(x_{t+1}) + b_i)``, ``e`` the target's own embedding (so calls need
``target=`` and ``tokens=``). Plain Medusa heads guess x_{t+2} without knowing x_{t+1}; Hydra
(Ankner et al., 2024) conditions each head on the tokens before it. Conditioning every head on
the root only keeps the heads independent of each other's guesses, so chains and token trees
draft as before (every node of a tree shares the root), and it is the first head's largest
missing input.

* shared (``shared_head=True``, the default for a target with a tied embedding): the frozen
  target's own LM head, ``target.logits(r_i)``. A head is then only ``dim * dim + dim``
  parameters, and a drafting step computes every head's logits in one few-row product with the
  target's (packed, ``models.transformer.pack_decode_weights``) head weights: k rows of [dim, V].
  Calls then need the target: ``heads(h, target=target)``.
* own (``shared_head=False``): a ``[dim, V]`` Linear per head; :meth:`MedusaHeads.init_from`
  copies the target's LM head (its tied embedding when ``tie_embeddings``) into each.

Draft vocabulary (``vocab=``, shared heads only): the heads' logits cover only these token ids
(FR-Spec's observation, Zhao et al., 2025: a small model's drafts come from a few thousand
frequent tokens, and the LM head over the whole vocabulary is most of a drafting step's cost).
The heads then carry ``vocab_head``, a frozen copy of the target LM head's rows for those ids
(:meth:`MedusaHeads.init_from` fills it; a few-row product over V' rows instead of V), and every
other token's logit is -inf: such a token is never drafted. Verification keeps the output exact
whatever the draft proposes, so this only trades acceptance for cost; the trainer
(``models.medusa_train``) uses the tokens of its data, which its softmax was restricted to.

Checkpoints (heads only): ``config.json`` (``{"medusa_num_heads": n, "shared_head": bool,
"target": {...}}``, the target's :class:`TransformerConfig` fields, plus what the trainer adds,
e.g. ``base_model``) and ``model.safetensors`` (``heads.<i>.<name>``; with a draft vocabulary also
``vocab`` and ``vocab_head.kernel``). :func:`load_medusa` checks the target's shapes and every
tensor's name and shape.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx

from models.config import TransformerConfig
from models.quant import QuantLinear
from models.transformer import Linear

# Target config fields that fix the shapes the heads read and write, or the hidden states they
# were trained on: heads saved for one target refuse a target that differs in any of them.
TARGET_FIELDS = ("dim", "vocab_size", "num_layers", "num_heads", "num_kv_heads", "mlp_dim")


class DraftVocab(nnx.Variable):
    """The token ids a draft vocabulary covers (int32 [V']): state, not a trained parameter."""


def check_vocab_ids(vocab, vocab_size: int) -> np.ndarray:
    """``vocab`` as sorted int32 ids -> np.ndarray; ValueError/TypeError naming ``vocab`` unless
    it is a non-empty 1-D collection of distinct integers in [0, vocab_size)."""
    if isinstance(vocab, (str, bytes)) or not hasattr(vocab, "__len__"):
        raise TypeError(f"vocab must be a 1-D sequence of token ids, got {type(vocab).__name__}")
    ids = np.asarray(vocab)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"vocab must be a non-empty 1-D sequence of token ids, got {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer) or ids.dtype == np.bool_:
        raise TypeError(f"vocab must hold integer token ids, got dtype {ids.dtype}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(
            f"vocab ids must be in [0, {vocab_size}), got {int(ids.min())} .. {int(ids.max())}"
        )
    out = np.unique(ids).astype(np.int32)
    if out.size != ids.size:
        raise ValueError(f"vocab has {ids.size - out.size} repeated token ids")
    return out


def vocab_head(config: TransformerConfig, vocab, rngs: nnx.Rngs) -> tuple[DraftVocab, Linear]:
    """A draft vocabulary's state and projection: (the checked ids, :func:`check_vocab_ids`, as
    a ``DraftVocab``; a zero [dim, V'] ``Linear`` that :func:`copy_vocab_rows` fills)."""
    ids = check_vocab_ids(vocab, config.vocab_size)
    dt = config.jnp_dtype
    proj = Linear(
        config.dim,
        int(ids.size),
        use_bias=False,
        kernel_init=nnx.initializers.zeros,
        dtype=dt,
        param_dtype=dt,
        rngs=rngs,
    )
    return DraftVocab(jnp.asarray(ids)), proj


def copy_vocab_rows(target, vocab: DraftVocab, proj: Linear) -> None:
    """Sets ``proj`` (:func:`vocab_head`) to ``target``'s LM-head rows for the ids ``vocab``."""
    rows = head_rows(target)[vocab[...]]  # [V', dim]
    proj.kernel.set_value(jnp.array(rows.T, proj.kernel.dtype))


def head_rows(target) -> jax.Array:
    """``target``'s LM head as [V, dim] in its dtype: the tied embedding, or the LM head's
    kernel transposed (dequantized for a quantized head)."""
    head = target.lm_head
    if head is None:
        return target.embed.embedding[...]
    if isinstance(head, QuantLinear):
        return head.weight(target.config.jnp_dtype).T
    return head.kernel[...].T


class MedusaHead(nnx.Module):
    """One head. ``residual(h)``: h [B, T, dim] -> r [B, T, dim]; ``head(h)`` (own LM head only):
    logits [B, T, V] float32."""

    def __init__(
        self,
        config: TransformerConfig,
        *,
        shared_head: bool = False,
        root_token: bool = False,
        rngs: nnx.Rngs,
    ):
        dt = config.jnp_dtype
        zeros = nnx.initializers.zeros
        square = functools.partial(
            Linear, config.dim, config.dim, kernel_init=zeros, dtype=dt, param_dtype=dt, rngs=rngs
        )
        self.res = square()
        self.root = square(use_bias=False) if root_token else None
        self.lm_head = (
            None
            if shared_head
            else Linear(
                config.dim,
                config.vocab_size,
                use_bias=False,
                dtype=dt,
                param_dtype=dt,
                kernel_init=nnx.initializers.normal(stddev=0.02),
                rngs=rngs,
            )
        )

    def residual(self, h, e=None):
        """h [..., dim] (and with a root token, its embedding e [..., dim]) -> [..., dim]."""
        z = self.res(h)
        if self.root is not None:
            z = z + self.root(e)
        return h + jax.nn.silu(z)

    def __call__(self, h, e=None):
        if self.lm_head is None:
            raise ValueError(
                "a shared-head MedusaHead has no LM head: call MedusaHeads(h, target=)"
            )
        return self.lm_head(self.residual(h, e)).astype(jnp.float32)


class MedusaHeads(nnx.Module):
    """``num_heads`` :class:`MedusaHead`s for a target with ``config``.

    ``heads(h, num=None, target=None, tokens=None)``: the target's last hidden state h [B, T, dim]
    -> logits [B, T, num, V] float32 (``num`` defaults to ``num_heads``); ``[..., i, :]`` predicts
    the token i + 2 positions after h's own position. ``target`` (the frozen
    ``models.Transformer``) is required when ``shared_head``: its LM head gives the logits.

    ``root_token`` (module doc): the heads also read the embedding of ``tokens`` [B, T] int, the
    token after each of h's positions (x_{t+1}); calls then need ``tokens=`` and ``target=``
    (whose embedding table gives e).

    ``shared_head``: None (default) shares the target's LM head when ``config.tie_embeddings``
    (a head is then its residual layer only), else each head owns a ``[dim, V]`` LM head.

    ``vocab``: None, or the token ids the heads draft from (shared heads only; module doc):
    ``vocab_head`` then holds the target's head rows for them, zero until :meth:`init_from`
    (or a checkpoint) fills it, and ``target=`` is optional in calls.
    """

    def __init__(
        self,
        config: TransformerConfig,
        num_heads: int = 4,
        *,
        shared_head: bool | None = None,
        vocab=None,
        root_token: bool = False,
        rngs: nnx.Rngs,
    ):
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads must be an int >= 1, got {num_heads!r}")
        if shared_head is None:
            shared_head = bool(config.tie_embeddings)
        if not isinstance(shared_head, bool):
            raise TypeError(f"shared_head must be a bool or None, got {shared_head!r}")
        if not isinstance(root_token, bool):
            raise TypeError(f"root_token must be a bool, got {root_token!r}")
        self.config = config
        self.num_heads = num_heads
        self.shared_head = shared_head
        self.root_token = root_token
        self.heads = nnx.List(
            [
                MedusaHead(config, shared_head=shared_head, root_token=root_token, rngs=rngs)
                for _ in range(num_heads)
            ]
        )
        if vocab is None:
            self.vocab = self.vocab_head = None
            return
        if not shared_head:
            raise ValueError(
                "vocab needs shared_head=True: a draft vocabulary restricts the target's shared "
                "LM head (own LM heads are [dim, V] each)"
            )
        self.vocab, self.vocab_head = vocab_head(config, vocab, rngs)

    def residuals(self, h, num: int | None = None, e=None):
        """h [B, T, dim] (and the root tokens' embeddings e [B, T, dim] with ``root_token``) ->
        the first ``num`` heads' residual outputs [B, T, num, dim]."""
        return jnp.stack([head.residual(h, e) for head in list(self.heads)[:num]], axis=-2)

    def root_embeddings(self, tokens, target):
        """The embeddings e [B, T, dim] the heads read for root ``tokens`` [B, T] (None without
        ``root_token``); ValueError naming what is missing."""
        if not self.root_token:
            return None
        if tokens is None or target is None:
            raise ValueError(
                "these Medusa heads read the root token (root_token=True): pass tokens= (the "
                "token after each hidden state) and target= (whose embedding they read)"
            )
        self.check_target(target.config)
        return target.embed(jnp.asarray(tokens, jnp.int32))

    def __call__(self, h, num: int | None = None, *, target=None, tokens=None):
        """Logits [B, T, num, V] float32 of every head, or of the first ``num`` (a drafting step
        that needs only k)."""
        e = self.root_embeddings(tokens, target)
        if not self.shared_head:
            return jnp.stack([head(h, e) for head in list(self.heads)[:num]], axis=-2)
        if self.vocab is not None:
            if target is not None:
                self.check_target(target.config)
            r = self.residuals(h, num, e)  # [B, T, n, dim]
            sub = self.vocab_head(r).astype(jnp.float32)  # few rows: the packed product
            c = self.config.final_softcap
            sub = c * jnp.tanh(sub / c) if c > 0 else sub
            full = jnp.full((*sub.shape[:-1], self.config.vocab_size), -jnp.inf, jnp.float32)
            return full.at[..., self.vocab[...]].set(sub)
        if target is None:
            raise ValueError(
                "these Medusa heads share the target's LM head: pass target= (the frozen "
                "models.Transformer they were trained on)"
            )
        self.check_target(target.config)
        r = self.residuals(h, num, e)  # [B, T, n, dim]
        B, T, n, D = r.shape
        # One [B * T * n]-row product with the target's head (packed in decode steps).
        return target.logits(r.reshape(B, T * n, D)).reshape(B, T, n, -1)

    def check_target(self, config: TransformerConfig) -> None:
        """ValueError naming the first shape field where ``config`` differs from the heads'."""
        check_saved_target(dataclasses.asdict(self.config), config, "the Medusa heads")

    def init_from(self, target) -> MedusaHeads:
        """Copies ``target``'s LM head ([dim, V]) into every own head, or its rows for the draft
        vocabulary into ``vocab_head`` (nothing to copy for other shared heads: they read the
        target's); returns ``self``."""
        if target.config.vocab_size != self.config.vocab_size or (
            target.config.dim != self.config.dim
        ):
            raise ValueError(
                f"target (dim {target.config.dim}, vocab {target.config.vocab_size}) does not "
                f"match the heads' (dim {self.config.dim}, vocab {self.config.vocab_size})"
            )
        if self.vocab is not None:
            copy_vocab_rows(target, self.vocab, self.vocab_head)
            return self
        if self.shared_head:
            return self
        kernel = head_rows(target).T
        for head in self.heads:
            head.lm_head.kernel.set_value(jnp.array(kernel, head.lm_head.kernel.dtype))  # a copy
        return self


def save_medusa(
    heads: MedusaHeads, path: str, *, extra: dict | None = None, dtype: str = "float32"
) -> None:
    """Writes ``config.json`` and ``model.safetensors`` (the heads' own parameters only, in
    ``dtype``: "float32" or "float16", half the size for shipping) under ``path``; ``extra``
    adds fields to the config (e.g. ``base_model``)."""
    tensors = param_tensors(heads, dtype)
    os.makedirs(path, exist_ok=True)
    if heads.vocab is not None:
        tensors["vocab"] = np.asarray(heads.vocab[...], np.int32)
    safetensors.numpy.save_file(tensors, os.path.join(path, "model.safetensors"))
    cfg = {k: v for k, v in dataclasses.asdict(heads.config).items() if k != "rope_scaling"}
    meta = dict(
        medusa_num_heads=heads.num_heads,
        shared_head=heads.shared_head,
        root_token=heads.root_token,
        target=cfg,
        **(extra or {}),
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(meta, f, indent=2, default=str)
        f.write("\n")


def listing(names) -> str:
    """Up to five sorted names, comma-separated, then how many more (for error messages)."""
    names = sorted(names)
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    return ", ".join(names[:5]) + more


def check_saved_target(saved: dict, config: TransformerConfig, what: str) -> None:
    """ValueError naming the first :data:`TARGET_FIELDS` field where the target something was
    made for (``saved``, its config fields as a dict) differs from ``config``."""
    for name in TARGET_FIELDS:
        if name in saved and saved[name] != getattr(config, name):
            raise ValueError(
                f"{what}: saved for a target with {name}={saved[name]}; the target has "
                f"{name}={getattr(config, name)}"
            )


def fill_params(module: nnx.Module, tensors: dict, what: str) -> nnx.Module:
    """Sets ``module``'s parameters from ``tensors`` (names: their dotted paths, cast to each
    parameter's dtype); ValueError naming ``what`` and the tensors that are missing,
    unexpected or misshapen. Returns ``module``."""
    flat = nnx.to_flat_state(nnx.state(module, nnx.Param))
    names = {".".join(str(p) for p in key) for key, _ in flat}
    missing, unexpected = names - set(tensors), set(tensors) - names
    if missing or unexpected:
        raise ValueError(
            f"{what}: missing tensors [{listing(missing)}], unexpected [{listing(unexpected)}]"
        )
    for key, v in flat:
        name = ".".join(str(p) for p in key)
        if tensors[name].shape != v[...].shape:
            raise ValueError(
                f"{what}: tensor {name} has shape {tensors[name].shape}, expected {v[...].shape}"
            )
        v.set_value(jnp.asarray(tensors[name], dtype=v.dtype))
    nnx.update(module, nnx.from_flat_state(flat))
    return module


def param_tensors(module: nnx.Module, dtype: str) -> dict:
    """``module``'s parameters by dotted path as numpy arrays in ``dtype`` ("float32" or
    "float16"), what :func:`fill_params` reads back."""
    if dtype not in ("float32", "float16"):
        raise ValueError(f"dtype must be 'float32' or 'float16', got {dtype!r}")
    flat = nnx.to_flat_state(nnx.state(module, nnx.Param))
    return {".".join(str(p) for p in key): np.asarray(v[...], dtype) for key, v in flat}


def load_medusa(path: str, config: TransformerConfig) -> MedusaHeads:
    """Heads saved by :func:`save_medusa` for a target with ``config`` (its dtype is used).

    ValueError naming the mismatch when the saved target differs from ``config`` in a
    :data:`TARGET_FIELDS` field, or when a tensor is missing, unexpected or of the wrong shape.
    Checkpoints written before ``shared_head`` existed have own LM heads."""
    with open(os.path.join(path, "config.json")) as f:
        meta = json.load(f)
    check_saved_target(meta["target"], config, f"heads at {path}")
    shared = bool(meta.get("shared_head", False))
    tensors = safetensors.numpy.load_file(os.path.join(path, "model.safetensors"))
    vocab = tensors.pop("vocab", None)
    try:
        heads = MedusaHeads(
            config,
            meta["medusa_num_heads"],
            shared_head=shared,
            vocab=vocab,
            root_token=meta.get("root_token", False),
            rngs=nnx.Rngs(0),
        )
    except (TypeError, ValueError) as e:  # a vocab tensor that lies
        raise ValueError(f"heads at {path}: {e}") from None
    return fill_params(heads, tensors, f"heads at {path}")

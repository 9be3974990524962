"""The training objective and step, shared by the trainers (``models.train``, ``models.medusa_train``)
and the sharded step (``models.shard``): the run's settings (:class:`TrainConfig`), the optimizer
(AdamW on a warmup + cosine schedule, global-norm clipping), next-token and distillation losses,
and the jitted step. It imports no model module, so each of those can import it."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

if TYPE_CHECKING:  # annotations only
    from models.transformer import Transformer


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 1000
    batch: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    warmup: int = 50
    end_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    eval_every: int = 100
    eval_batches: int = 4
    seed: int = 0
    distill_temperature: float = 1.0  # softens teacher and student when distilling

    def __post_init__(self):
        """Raises ``ValueError`` naming the field for a value no run can use (bools, NaN,
        ``steps=0``, a non-positive learning rate, ...), before any work."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            low, high, low_open = _LIMITS[field.name]
            kinds = (int, np.integer) if field.type in (int, "int") else (int, float, np.number)
            if isinstance(value, bool | np.bool_) or not isinstance(value, kinds):
                raise ValueError(f"{field.name} must be {field.type}, got {value!r}")
            v = float(value)
            if not math.isfinite(v) or not (low < v if low_open else low <= v) or v > high:
                bound = f"{'>' if low_open else '>='} {low}"
                bound += f" and <= {high}" if high < math.inf else ""
                raise ValueError(f"{field.name} must be finite and {bound}, got {value!r}")


# field -> (lower bound, upper bound, lower bound excluded): what a run can use. steps >= 1 so
# that something is trained and evaluated; a zero or negative learning rate trains nothing.
_LIMITS = dict(
    steps=(1, math.inf, False),
    batch=(1, math.inf, False),
    seq_len=(1, math.inf, False),
    lr=(0.0, math.inf, True),
    warmup=(0, math.inf, False),
    end_lr_fraction=(0.0, 1.0, False),
    weight_decay=(0.0, math.inf, False),
    clip_norm=(0.0, math.inf, True),
    eval_every=(1, math.inf, False),
    eval_batches=(1, math.inf, False),
    seed=(0, 2**32 - 1, False),
    distill_temperature=(0.0, math.inf, True),
)


def schedule(tc: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 to ``lr`` over ``warmup`` steps, then cosine decay to
    ``lr * end_lr_fraction`` at ``steps``."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=tc.lr,
        warmup_steps=min(tc.warmup, max(tc.steps - 1, 0)),
        decay_steps=max(tc.steps, 1),
        end_value=tc.lr * tc.end_lr_fraction,
    )


def optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW on :func:`schedule`."""
    return optax.chain(
        optax.clip_by_global_norm(tc.clip_norm),
        optax.adamw(schedule(tc), b1=0.9, b2=0.95, weight_decay=tc.weight_decay),
    )


def token_losses(model: Transformer, inputs, targets, segment_ids):
    """Per-token cross entropy [B, T] float32 of next-token prediction."""
    logits = model(inputs, segment_ids=segment_ids)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def loss_fn(model: Transformer, batch):
    """Mean cross entropy over the weighted (same-document) targets."""
    inputs, targets, segment_ids, weights = batch
    losses = token_losses(model, inputs, targets, segment_ids)
    return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def distill_loss_fn(model: Transformer, teacher_logits, batch, temperature: float = 1.0):
    """Mean KL(teacher || student) over the weighted tokens, both softened by ``temperature``.

    ``teacher_logits`` [B, T, V] for the same inputs; scaled by ``temperature**2`` so that the
    gradient size does not depend on it (Hinton et al., 2015).
    """
    inputs, _, segment_ids, weights = batch
    log_q = jax.nn.log_softmax(model(inputs, segment_ids=segment_ids) / temperature, axis=-1)
    log_p = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
    kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)  # [B, T]
    return temperature**2 * jnp.sum(kl * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def make_train_step(graphdef, tx: optax.GradientTransformation, *, teacher_graphdef=None):
    """``step(params, rest, opt_state, batch, teacher=None) -> (params, opt_state, loss)``,
    jitted, donating params and optimizer state.

    With ``teacher_graphdef`` the loss is :func:`distill_loss_fn` against the logits of
    ``nnx.merge(teacher_graphdef, teacher)`` (``teacher`` = its state, not trained); the softening
    temperature is the static ``temperature`` argument of ``step``.
    """

    def step(params, rest, opt_state, batch, teacher=None, temperature=1.0):
        if teacher_graphdef is None:
            target = None
        else:
            inputs, _, segment_ids, _ = batch
            t_model = nnx.merge(teacher_graphdef, teacher)
            target = jax.lax.stop_gradient(t_model(inputs, segment_ids=segment_ids))

        def f(p):
            model = nnx.merge(graphdef, p, rest)
            if target is None:
                return loss_fn(model, batch)
            return distill_loss_fn(model, target, batch, temperature)

        loss, grads = jax.value_and_grad(f)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 2), static_argnames=("temperature",))

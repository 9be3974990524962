"""Tensor and data parallelism on ``jax.sharding``: Megatron-style layouts for the transformer,
its KV cache and its optax train step.

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    model = models.shard(model, mesh)  # places the parameters, returns the same Transformer
    logits = model(tokens)  # batch over "data", heads / hidden / vocabulary over "model"

What is sharded how (``tp`` = size of the "model" axis, ``dp`` = size of the "data" axis):

* fused q/k/v projection, fused MLP gate/up: column-parallel, the output features (heads, hidden
  units) split over "model" in contiguous blocks. The fused layouts group features per KV head
  (``[Hkv, G + 2, D]``) and per hidden unit (``[mlp_dim, 2]``), so device ``j`` holds KV heads
  ``[j Hkv/tp, (j+1) Hkv/tp)`` with the query heads that read them (every GQA group whole) and
  the gate and up columns of the same hidden units.
* o and down projections: row-parallel, input features over "model" (XLA adds the all-reduce).
* embedding [V, dim] and untied LM head [dim, V]: over the vocabulary; logits come out
  [B, T, V] with V over "model".
* RMSNorm weights: replicated. Every parameter is replicated over "data" (plain data
  parallelism; the optimizer state follows its parameter).
* attention: ``pallas_attn`` runs per device on its local heads inside ``jax.shard_map``
  (batch over "data" when B divides), so the kernels never see a sharded array.
* KV cache: heads over "model"; a contiguous cache also splits its rows over "data". A paged pool
  is shared by all rows through the block table, so it keeps every page on every "data" shard,
  and paged attention runs all rows on each data shard (correct for any block table; the
  memory and attention work are divided by ``tp`` only).

``num_kv_heads`` must be a multiple of ``tp`` (a ``ValueError`` otherwise). Replicating KV heads
(as MaxText and vLLM do when ``tp > Hkv``) would multiply the KV cache, which bounds the decode
batch, by ``tp / Hkv`` on every device; with ``tp > Hkv`` use fewer model shards and more data
shards instead. ``mlp_dim`` and ``vocab_size`` must be multiples of ``tp`` too.

Meshes: axis names from ("data", "model"); an absent axis counts as size 1. ``shard`` keeps the
mesh's devices and names but uses ``AxisType.Auto`` axes, so that XLA propagates the shardings
through the unchanged model code (``jax.make_mesh`` creates ``Explicit`` axes by default).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models import train_step
from models.config import TransformerConfig

AXES = ("data", "model")
_COL, _ROW = P(None, "model"), P("model", None)
# (module name, parameter name) -> spec; anything else is replicated.
PARAM_RULES = {
    ("embed", "embedding"): _ROW,
    ("lm_head", "kernel"): _COL,
    ("qkv_proj", "kernel"): _COL,  # features [Hkv, G + 2, D]: whole GQA groups per device
    ("qkv_proj", "bias"): P("model"),
    ("gate_up_proj", "kernel"): _COL,  # features [mlp_dim, 2]: gate and up of the same units
    ("o_proj", "kernel"): _ROW,
    ("down_proj", "kernel"): _ROW,
}


def axis_size(mesh: Mesh, name: str) -> int:
    """Size of mesh axis ``name`` (1 when the mesh has no such axis)."""
    return dict(zip(mesh.axis_names, mesh.devices.shape, strict=True)).get(name, 1)


def check_mesh(config: TransformerConfig, mesh) -> Mesh:
    """Validates ``mesh`` for ``config`` -> a mesh with both axes ("data", "model"), an absent
    one added with size 1 (after the mesh's own axes, so the device order is kept), and
    ``Auto`` axis types. Bad meshes are ``ValueError``s naming ``mesh``, before anything moves."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    names = tuple(mesh.axis_names)
    if any(a not in AXES for a in names) or len(set(names)) != len(names):
        raise ValueError(f"mesh axis names must be distinct names from {AXES}, got {names}")
    devices = mesh.devices
    if len(set(devices.flat)) != devices.size:
        raise ValueError(f"mesh must hold each device once, got {devices.size} entries")
    missing = tuple(a for a in AXES if a not in names)
    devices = devices.reshape(devices.shape + (1,) * len(missing))
    names += missing
    tp = dict(zip(names, devices.shape, strict=True))["model"]
    for field in ("num_kv_heads", "mlp_dim", "vocab_size"):
        if getattr(config, field) % tp:
            raise ValueError(
                f"{field} ({getattr(config, field)}) must be divisible by the 'model' axis size "
                f"({tp}) of mesh; use a smaller 'model' axis (and a larger 'data' axis)"
            )
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def mesh_of(model) -> Mesh | None:
    """The mesh ``model`` was sharded over by :func:`shard`, or None."""
    return getattr(model, "mesh", None)


def _param_spec(path) -> P:
    names = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
    return PARAM_RULES.get(names[-2:], P())


def param_shardings(model, mesh: Mesh | None = None):
    """The ``NamedSharding`` of every parameter of ``model``, as a state of the same structure
    as ``nnx.state(model)`` (see ``PARAM_RULES``). Default mesh: the model's own."""
    mesh = mesh_of(model) if mesh is None else check_mesh(model.config, mesh)
    if mesh is None:
        raise ValueError("model is not sharded: pass a mesh or call models.shard(model, mesh)")
    return jax.tree_util.tree_map_with_path(
        lambda path, _: NamedSharding(mesh, _param_spec(path)), nnx.state(model)
    )


def put_global(tree, shardings):
    """``jax.device_put(tree, shardings)`` that also works when a sharding spans devices of other
    processes: each process passes the same whole value and keeps the slices of its own devices
    (``jax.make_array_from_callback``), so no device of another process is addressed."""

    def put(x, sharding):
        if sharding.is_fully_addressable or (
            isinstance(x, jax.Array) and not x.is_fully_addressable
        ):
            return jax.device_put(x, sharding)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree, shardings)


@functools.cache
def _replicate(sharding: NamedSharding):
    return jax.jit(lambda x: x, out_shardings=NamedSharding(sharding.mesh, P()))


def to_host(tree):
    """``jax.device_get(tree)`` on every process, also for arrays sharded over devices of other
    processes: those are first replicated over their mesh (one all-gather, a collective every
    process must call, as it calls the computation that produced them), so every process gets
    the whole value. Explicit transfers only: allowed under ``jax.transfer_guard("disallow")``."""

    def fetch(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return x
        if not x.is_fully_replicated:
            if not isinstance(x.sharding, NamedSharding):
                raise TypeError(f"to_host: cannot gather an array with {x.sharding!r}")
            x = _replicate(x.sharding)(x)
        return x.addressable_data(0)

    return jax.device_get(jax.tree.map(fetch, tree))


def shard(model, mesh: Mesh):
    """Places ``model``'s parameters on ``mesh`` (Megatron tensor parallel over "model",
    replicated over "data") and makes its attention run per device on local heads.

    Returns the same ``models.Transformer``, changed in place. Raises ``ValueError`` when
    ``num_kv_heads``, ``mlp_dim`` or ``vocab_size`` is not a multiple of the "model" axis, and
    ``TypeError`` for anything but a Transformer, before any parameter moves.

    The mesh may span processes (``jax.distributed``): every process calls ``shard`` with the
    same parameters (the same checkpoint files, or the same seed) and keeps only the shards of
    its own devices.
    """
    config = getattr(model, "config", None)
    # Checked before anything moves: a wrong object (Medusa heads have a config too) or a bad
    # mesh leaves the model as it was.
    attns = [getattr(layer, "attn", None) for layer in getattr(model, "layers", ())]
    if (
        not isinstance(config, TransformerConfig)
        or len(attns) != config.num_layers
        or (None in attns)
    ):
        hint = (
            "; shard the target only: speculative_generate places Medusa heads on its mesh"
            if type(model).__name__ == "MedusaHeads"
            else ""
        )
        raise TypeError(f"model must be a models.Transformer, got {type(model).__name__}{hint}")
    mesh = check_mesh(config, mesh)
    nnx.update(model, put_global(nnx.state(model), param_shardings(model, mesh)))
    model.mesh = mesh
    for layer in model.layers:
        layer.attn.mesh = mesh
    return model


def batch_axis(mesh: Mesh, batch: int) -> str | None:
    """The "data" axis when the mesh has one that divides ``batch``, else None (replicated)."""
    return "data" if "data" in mesh.axis_names and batch % axis_size(mesh, "data") == 0 else None


def cache_specs(mesh: Mesh, batch: int, paged: bool) -> tuple[P, P]:
    """``(layer array spec, row spec)`` of a KV cache: heads over "model"; rows over "data"
    for a contiguous cache (when ``batch`` divides), never for a paged pool (shared by rows)."""
    rows = None if paged else batch_axis(mesh, batch)
    return P(rows, None, "model", None), P(rows)


def cache_shardings(mesh: Mesh | None, batch: int, paged: bool):
    """``(layer arrays, lengths, block table)`` shardings of a KV cache on ``mesh`` (all None
    without a mesh): where ``KVCache.contiguous`` / ``KVCache.paged`` create the arrays."""
    if mesh is None:
        return None, None, None
    layer, rows = cache_specs(mesh, batch, paged)
    return (
        NamedSharding(mesh, layer),
        NamedSharding(mesh, rows),
        NamedSharding(mesh, P(*rows, None)),
    )


def replicated(model) -> NamedSharding | None:
    """A replicated sharding on the model's mesh (None for an unsharded model): where host
    inputs of a jitted call go, so that no implicit transfer happens inside it."""
    mesh = mesh_of(model)
    return None if mesh is None else NamedSharding(mesh, P())


def constrain_batch(x, mesh: Mesh | None):
    """Activations [B, ...]: rows over "data" (when B divides), the rest replicated."""
    if mesh is None:
        return x
    spec = P(batch_axis(mesh, x.shape[0]), *([None] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def local_heads(fn, mesh: Mesh, *, batch: int, cached: bool, paged: bool):
    """``fn`` run per device inside ``jax.shard_map`` on its local heads.

    ``fn(q, k, v, segment_ids, kv)`` takes q [B, T, Hq, D], k/v [B, T, Hkv, D], segment_ids
    [B, T] or None and ``kv = (k_cache, v_cache, lengths [B], block_table)`` or None; it returns
    ``out`` [B, T, Hq, D], or ``(out, (k_cache, v_cache))`` when ``cached``. Inside, each device
    sees Hq/tp query heads and their Hkv/tp KV heads (and B/dp rows when sharded over "data").
    """
    layer, rows = cache_specs(mesh, batch, paged)
    b = rows[0]
    heads, tokens = P(b, None, "model", None), P(b, None)
    kv_specs = (layer, layer, rows, tokens) if cached else None
    out_specs = (heads, (layer, layer)) if cached else heads
    # check_vma=False: the attention loops start their carries from unvarying zeros, which the
    # varying-axes type check rejects; every output here is per-device data by construction.
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(heads, heads, heads, tokens, kv_specs),
        out_specs=out_specs,
        check_vma=False,
    )


@dataclasses.dataclass(frozen=True)
class TrainShardings:
    """Shardings of a data + tensor parallel train step: ``params`` (``PARAM_RULES``),
    ``rest`` (non-parameter state, replicated), ``opt_state`` (each optimizer leaf that mirrors a
    parameter, e.g. Adam's mu and nu, takes that parameter's sharding; counts and other scalars
    are replicated), ``batch`` (every [B, T] array: rows over "data")."""

    params: object
    rest: object
    opt_state: object
    batch: NamedSharding


def train_shardings(model, tx: optax.GradientTransformation) -> TrainShardings:
    """The :class:`TrainShardings` of ``model`` (sharded by :func:`shard`) under ``tx``."""
    mesh = mesh_of(model)
    if mesh is None:
        raise ValueError("model is not sharded: call models.shard(model, mesh) first")
    _, params, rest = nnx.split(model, nnx.Param, ...)
    param_sh = jax.tree.map(lambda x: x.sharding, params)
    rep = NamedSharding(mesh, P())
    opt_shapes = jax.eval_shape(tx.init, params)
    opt_sh = optax.tree_map_params(
        tx, lambda _, s: s, opt_shapes, param_sh, transform_non_params=lambda _: rep
    )
    data = "data" if "data" in mesh.axis_names else None
    return TrainShardings(
        params=param_sh,
        rest=jax.tree.map(lambda _: rep, rest),
        opt_state=opt_sh,
        batch=NamedSharding(mesh, P(data, None)),
    )


def make_train_step(model, tx: optax.GradientTransformation):
    """``(step, shardings)``: ``models.train``'s step, jitted with the :class:`TrainShardings`
    as input and output shardings (params and optimizer state donated).

    ``step(params, rest, opt_state, batch) -> (params, opt_state, loss)`` with
    ``_, params, rest = nnx.split(model, nnx.Param, ...)``,
    ``opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(params)`` and ``batch``
    the 4 [B, T] arrays of ``models.train_step.loss_fn``; B must be a multiple of the "data" axis.
    On a mesh that spans processes, every process passes the same global batch as NumPy arrays
    (placed with :func:`put_global`) or global ``jax.Array``s (e.g. from
    ``jax.make_array_from_process_local_data(shardings.batch, local_rows)``); the loss comes
    back replicated, readable on every process.
    """
    sh = train_shardings(model, tx)
    graphdef, _, _ = nnx.split(model, nnx.Param, ...)
    inner = train_step.make_train_step(graphdef, tx)
    jitted = jax.jit(
        inner,
        in_shardings=(sh.params, sh.rest, sh.opt_state, sh.batch),
        out_shardings=(sh.params, sh.opt_state, NamedSharding(sh.batch.mesh, P())),
        donate_argnums=(0, 2),
    )
    dp = axis_size(sh.batch.mesh, "data")

    def step(params, rest, opt_state, batch):
        if batch[0].shape[0] % dp:
            raise ValueError(
                f"batch size {batch[0].shape[0]} must be a multiple of the 'data' axis ({dp})"
            )
        batch = tuple(put_global(x, sh.batch) for x in batch)
        return jitted(params, rest, opt_state, batch)

    return step, sh


def memory_plan(
    config: TransformerConfig,
    *,
    devices: int,
    model_axis: int,
    hbm_bytes: float,
    context: int,
    reserve_fraction: float = 0.1,
    processes: int = 1,
) -> dict:
    """Memory arithmetic of serving ``config`` on ``devices`` accelerators of ``hbm_bytes`` each,
    sharded ``(devices // model_axis, model_axis)`` over ("data", "model").

    Weights in ``config.dtype``, the KV cache in ``config.kv_dtype``; ``reserve_fraction`` of each device is kept for
    activations, logits and the compiler's workspace. Returns weight bytes (total and per
    device), KV bytes per token (total and per device: 2 x layers x Hkv x D x itemsize, over tp),
    and the largest total batch whose rows each hold ``context`` tokens.

    With ``processes`` hosts (``jax.distributed``, ``devices // processes`` devices each) it
    also gives what one process holds: ``weight_bytes_per_process`` and
    ``kv_bytes_per_token_per_process`` on its devices (per-device figures times its devices),
    and ``host_bytes_per_process_at_load``: every process reads the whole checkpoint into host
    memory before keeping its own shards (``models.shard``).
    """
    if not 0 <= reserve_fraction < 1:
        raise ValueError(f"reserve_fraction must be in [0, 1), got {reserve_fraction!r}")
    if model_axis < 1 or devices % model_axis or config.num_kv_heads % model_axis:
        raise ValueError(
            f"model_axis ({model_axis}) must divide devices ({devices}) and num_kv_heads "
            f"({config.num_kv_heads})"
        )
    if processes < 1 or devices % processes:
        raise ValueError(f"processes ({processes}) must divide devices ({devices})")
    local = devices // processes
    itemsize = config.jnp_dtype.itemsize
    weights = config.num_params() * itemsize
    kv_item = config.kv_jnp_dtype.itemsize
    kv_token = 2 * config.num_layers * config.num_kv_heads * config.resolved_head_dim * kv_item
    free = hbm_bytes * (1 - reserve_fraction) - weights / model_axis
    per_replica = math.floor(free / (context * kv_token / model_axis)) if free > 0 else 0
    return dict(
        weight_bytes=weights,
        weight_bytes_per_device=weights / model_axis,
        kv_bytes_per_token=kv_token,
        kv_bytes_per_token_per_device=kv_token / model_axis,
        max_batch=per_replica * (devices // model_axis),
        weight_bytes_per_process=weights / model_axis * local,
        kv_bytes_per_token_per_process=kv_token / model_axis * local,
        host_bytes_per_process_at_load=weights,
    )


def mesh_shape(text: str) -> tuple[int, int]:
    """An ``argparse`` type for the command lines' ``--mesh DATA,MODEL`` -> two ints >= 1."""
    parts = text.split(",")
    if len(parts) != 2 or not all(x.strip().isdigit() and int(x) >= 1 for x in parts):
        raise argparse.ArgumentTypeError(f"expected DATA,MODEL (two ints >= 1), got {text!r}")
    return int(parts[0]), int(parts[1])

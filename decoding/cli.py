"""What the command lines (``python -m decoding``, ``python -m decoding.serve``) share: argument
types that turn bad values into usage errors, loading the model, a check that a server can listen
where it was told to, and the on-disk compilation cache."""

from __future__ import annotations

import argparse
import errno
import math
import os
import socket

import jax
import numpy as np

import models
from decoding.sampling import check_seed
from models.config import TransformerConfig
from models.kv_cache import KVCache
from pallas_attn import native


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


def seed(text: str) -> int:
    try:
        return check_seed(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int in [0, 2**32), got {text!r}") from None


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def nonnegative_number(text: str) -> float:
    """A finite number >= 0 (seconds, say): NaN and inf are refused."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def load_model(parser: argparse.ArgumentParser, args: argparse.Namespace, **kwargs):
    """``models.pretrained(args.model, **kwargs)``, block-quantized to ``args.quantize`` when it
    is set, its KV caches in ``args.kv_dtype`` when that is set -> ``(model, tokenizer)``; a
    checkpoint that does not load (or lies), a layer the format cannot hold and a cache dtype
    the model cannot take are usage errors naming the flag."""
    try:
        model, tokenizer = models.pretrained(args.model, **kwargs)
    except (OSError, ValueError) as e:  # a checkpoint that lies (models.hf, models.gguf)
        parser.error(f"--model {args.model}: {e}")
    if args.quantize is not None:
        try:
            model = models.quantize(model, args.quantize)
        except ValueError as e:  # a layer whose input width is not a multiple of the block
            parser.error(f"--quantize {args.quantize}: {e}")
    if getattr(args, "kv_dtype", None) is not None:
        try:
            model = models.configure(model, kv_dtype=args.kv_dtype)
        except ValueError as e:  # a 16-bit model asked for another 16-bit cache
            parser.error(f"--kv-dtype {args.kv_dtype}: {e}")
    return model, tokenizer


KV_DTYPES = ("bfloat16", "float16")
KV_DTYPE_HELP = (
    "the KV cache's dtype (default: the model's); a 16-bit cache halves what a float32 or "
    "quantized model's decode steps read per cached token"
)


def port(text: str) -> int:
    """A TCP port in [0, 65535] (0: the OS picks one). Larger numbers are refused here because
    ``getaddrinfo`` takes them modulo 65536 (70000 would quietly serve on 4464)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected an int in [0, 65535], got {text!r}")
    return value


def check_bindable(host: str, port: int) -> str | None:
    """``None`` when a listening TCP socket could be bound at (``host``, ``port``) now, else
    what is wrong, naming the flag (``--host`` / ``--port``). Binds every address ``host``
    resolves to, as ``asyncio``'s ``create_server`` (uvicorn) does, with its socket options,
    and closes each at once: a server can run the check before the minutes of loading a model
    instead of failing after them. Another process may still take the port in between."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (socket.gaierror, UnicodeError) as e:
        return f"--host {host}: cannot be resolved ({getattr(e, 'strerror', None) or e})"
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"--port {port}: address already in use"
            if e.errno == errno.EACCES:
                return f"--port {port}: permission denied"
            return f"--host {host}: cannot listen on {address[0]} ({e.strerror or e})"
    return None


def available_memory(device: jax.Device) -> int | None:
    """Bytes ``device`` can still allocate: its allocator's limit less what is in use, or for a
    CPU the host's available memory (``MemAvailable``); ``None`` when unknown."""
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def kv_pool_problem(config: TransformerConfig, num_pages: int, page_size: int) -> str | None:
    """``None`` when a KV pool of ``num_pages`` pages of ``page_size`` tokens (and the scratch
    page) for ``config`` fits in the default device's available memory, else a message naming
    the flags. Sized with ``jax.eval_shape``: nothing is allocated. A pool that does not fit
    fails at once on a device, but on a CPU the zeroed pool is overcommitted and the process
    killed later by the kernel's OOM killer, which is why servers check first."""
    rows = np.zeros((1, 1), np.int32)
    shapes = jax.eval_shape(lambda: KVCache.paged(config, num_pages + 1, page_size, rows))
    need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    have = available_memory(jax.devices()[0])
    if have is None or need <= have:
        return None
    return (
        f"--num-pages {num_pages} x --page-size {page_size}: the KV pool needs "
        f"{need / 2**30:.1f} GiB, the device has {have / 2**30:.1f} GiB available"
    )


def persistent_compilation_cache() -> None:
    """Keeps compiled programs on disk between runs (the engine's two steps take seconds to
    compile on a CPU), unless the user configured JAX's cache already."""
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", str(native.cache_dir() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

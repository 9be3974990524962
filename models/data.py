"""The training corpus: the Python standard library's own ``.py`` files, read at run time.

Real code, present on every machine, nothing downloaded. Files are taken in sorted order of their
path relative to ``sysconfig.get_paths()["stdlib"]`` (skipping ``site-packages`` and test
directories); a file is held out when ``crc32(relative path) % 20 == 0`` (about 5%), so the split
does not depend on which other files a Python version ships. Each file becomes one document
``BOS + bytes + EOS`` (ids of :class:`~models.tokenizer.ByteTokenizer`), documents are concatenated
into one stream per split, and training windows are packed: a window may span documents, and
segment ids keep attention inside each document.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sysconfig
import zlib

import numpy as np

from models.tokenizer import ByteTokenizer

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
HELDOUT_MODULUS = 20


def stdlib_files(root: str | None = None) -> list[pathlib.Path]:
    """Sorted ``.py`` files of the standard library (``root`` overrides its location)."""
    base = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    files = [p for p in base.rglob("*.py") if not _SKIP_DIRS & set(p.relative_to(base).parts)]
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def is_heldout(relative_path: str) -> bool:
    return zlib.crc32(relative_path.encode("utf-8")) % HELDOUT_MODULUS == 0


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Token streams (uint16 ids) of the training and held-out documents."""

    train: np.ndarray
    heldout: np.ndarray

    @classmethod
    def from_stdlib(cls, root: str | None = None, max_bytes: int | None = None) -> Corpus:
        """Reads the corpus; ``max_bytes`` caps each split (for tests)."""
        tok = ByteTokenizer()
        base = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
        parts: dict[bool, list[np.ndarray]] = {True: [], False: []}
        sizes = {True: 0, False: 0}
        for path in stdlib_files(str(base)):
            held = is_heldout(path.relative_to(base).as_posix())
            if max_bytes is not None and sizes[held] >= max_bytes:
                continue
            data = np.frombuffer(path.read_bytes(), np.uint8).astype(np.uint16)
            doc = np.concatenate([[tok.bos_id], data, [tok.eos_id]]).astype(np.uint16)
            parts[held].append(doc)
            sizes[held] += doc.size
        if not parts[False] or not parts[True]:
            raise ValueError(f"no Python files for one of the splits under {base}")
        return cls(train=np.concatenate(parts[False]), heldout=np.concatenate(parts[True]))


def windows(stream: np.ndarray, starts: np.ndarray, length: int):
    """Packed batch from windows of ``length + 1`` tokens at ``starts`` [B].

    Returns ``(inputs, targets, segment_ids, weights)``, each [B, length]: next-token targets,
    segment ids counting the BOS tokens seen so far, and weight 1 where the target is in the same
    document as its input (0 across a document boundary).
    """
    tok = ByteTokenizer()
    idx = starts[:, None] + np.arange(length + 1)
    chunk = stream[idx].astype(np.int32)
    seg = np.cumsum(chunk == tok.bos_id, axis=1, dtype=np.int32)
    inputs, targets = chunk[:, :-1], chunk[:, 1:]
    weights = (seg[:, 1:] == seg[:, :-1]).astype(np.float32)
    return inputs, targets, seg[:, :-1], weights


def random_batch(stream: np.ndarray, rng: np.random.Generator, batch: int, length: int):
    """:func:`windows` at uniformly random start offsets."""
    starts = rng.integers(0, stream.size - length - 1, size=batch)
    return windows(stream, starts, length)


def heldout_batches(stream: np.ndarray, batch: int, length: int, num_batches: int):
    """Deterministic evaluation batches: evenly spaced windows over the held-out stream."""
    count = batch * num_batches
    starts = np.linspace(0, stream.size - length - 2, count).astype(np.int64)
    return [windows(stream, s, length) for s in starts.reshape(num_batches, batch)]

"""Sampling defaults from a checkpoint: what a request that leaves a field out gets.

Sources, first found wins per field:

* a Hugging Face checkpoint directory's ``generation_config.json``: ``temperature``, ``top_p``,
  ``top_k``, ``min_p``; ``do_sample: false`` means greedy (temperature 0), as transformers'
  ``generate`` reads it;
* a GGUF file's ``general.sampling.temp`` / ``.top_p`` / ``.top_k`` / ``.min_p`` keys (llama.cpp's
  names for a model's recommended sampling);
* OpenAI's defaults otherwise: temperature 1, top_p 1, no top-k or min-p.

The shipped SmolLM2 GGUF carries none, so its server uses OpenAI's defaults.
"""

from __future__ import annotations

import json
import pathlib

OPENAI = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
_GGUF_KEYS = {
    "temperature": "general.sampling.temp",
    "top_p": "general.sampling.top_p",
    "top_k": "general.sampling.top_k",
    "min_p": "general.sampling.min_p",
}


def _checked(values: dict, source: str) -> dict:
    out = {}
    for name, value in values.items():
        if name not in OPENAI or value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{source}: {name} must be a number, got {value!r}")
        out[name] = int(value) if name == "top_k" else float(value)
    return out


def from_generation_config(path) -> dict:
    """The sampling fields of a ``generation_config.json`` (a file or the directory holding
    it; {} when there is none)."""
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    values = _checked(config, str(path))
    if config.get("do_sample") is False:
        values["temperature"] = 0.0
    return values


def from_gguf(path) -> dict:
    """The ``general.sampling.*`` fields of a GGUF file ({} when it has none)."""
    import gguf  # only for .gguf checkpoints  # noqa: PLC0415

    reader = gguf.GGUFReader(str(path))
    values = {}
    for name, key in _GGUF_KEYS.items():
        field = reader.fields.get(key)
        if field is not None:
            values[name] = field.parts[field.data[0]].tolist()[0]
    return _checked(values, str(path))


def generation_defaults(checkpoint) -> dict:
    """``{temperature, top_p, top_k, min_p}`` for requests that leave them out: the
    checkpoint's (a directory or a ``.gguf`` file; a shipped name has none of its own beyond
    its file) over OpenAI's defaults."""
    path = pathlib.Path(str(checkpoint))
    found = {}
    if path.suffix == ".gguf" and path.is_file():
        found = from_gguf(path)
    elif path.exists():
        found = from_generation_config(path)
    return {**OPENAI, **found}

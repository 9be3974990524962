"""Argument checks shared by the decoding API: one rule for what counts as a number.

NumPy scalars are accepted wherever Python numbers are (``np.int64(3)`` as an int, ``np.float32``
as a float); bools never count as numbers (``True`` is not a page size). A value of the wrong
type raises :class:`ArgumentTypeError`, a ``TypeError`` that is also a ``ValueError`` (callers
that caught ``ValueError`` for bad arguments keep catching it); a value out of range raises
``ValueError``. Messages name the argument and the value.
"""

from __future__ import annotations

import numbers

import numpy as np

from models import Transformer


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (e.g. a float or a bool where an int is expected)."""


def is_int(value) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A Python or NumPy int or float, not a bool."""
    return isinstance(value, numbers.Real | np.integer | np.floating) and not isinstance(
        value, bool | np.bool_
    )


def check_int(name: str, value, low: int | None = None, high: int | None = None) -> int:
    """``value`` as a Python int in ``[low, high)`` (either bound optional)."""
    if not is_int(value):
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value >= high):
        if high is None:
            bounds = f">= {low}"
        elif low is None:
            bounds = f"< {high}"
        else:
            bounds = f"in [{low}, {high})"
        raise ValueError(f"{name} must be {bounds}, got {value!r}")
    return value


def check_optional_int(name: str, value, low: int | None = None, high: int | None = None):
    """None, or :func:`check_int`."""
    if value is None:
        return None
    if not is_int(value):
        raise ArgumentTypeError(
            f"{name} must be an int or None, got {type(value).__name__} {value!r}"
        )
    return check_int(name, value, low, high)


def check_real(name: str, value) -> float:
    """``value`` as a Python float (range checks are the caller's)."""
    if not is_real(value):
        raise ArgumentTypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise ArgumentTypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def check_model(name: str, model) -> None:
    """TypeError naming the argument unless ``model`` is a ``models.Transformer``."""
    if not isinstance(model, Transformer):
        raise TypeError(f"{name} must be a models.Transformer, got {type(model).__name__}")

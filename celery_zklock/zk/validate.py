"""One rule per kind of setting value: seconds, whole numbers >= 1, znode paths.

Every place that checks such a value (the app's ``zklock_*`` settings, the lock options, the
fleet's ``ZKLOCK_*`` variables, command-line options, the local stack's options) calls these, so
a value means the same everywhere. A bad value raises
:class:`~celery_zklock.errors.ConfigurationError` (a ``ValueError``) naming the setting, the value
and what to give instead. ``text=True`` also accepts the value as text (an environment variable,
a command-line argument) and parses it first.
"""

from __future__ import annotations

import argparse
import math
import reprlib
from collections.abc import Callable
from typing import Any, TypeVar

from celery_zklock.errors import ConfigurationError

__all__ = ["argument", "forbidden_in_znode", "positive_int", "seconds", "short_repr", "znode_path"]

_T = TypeVar("_T")
_N = TypeVar("_N", int, float)

_repr = reprlib.Repr()
_repr.maxstring = 80
_repr.maxother = 80


def short_repr(value: object) -> str:
    """``repr(value)``, cut to about 80 characters (a message must stay readable)."""
    return _repr.repr(value)


def seconds(
    name: str, value: object, *, zero: bool = False, text: bool = False, advice: str = ""
) -> float:
    """``value`` as a finite number of seconds, ``> 0`` (``>= 0`` with ``zero``).

    ``bool`` is not a number here. ``advice`` is appended to the message (``", or None to ..."``).
    """
    number = _float(value, text)
    finite = number is not None and math.isfinite(number)
    if number is not None and finite and (number >= 0 if zero else number > 0):
        return number
    shown = short_repr(number if number is not None and isinstance(value, str) else value)
    raise ConfigurationError(
        f"{name} must be a number of seconds {'>= 0' if zero else '> 0'}, got {shown}"
        f"{'' if finite or number is None else ' (not finite)'}{advice}"
    )


def positive_int(name: str, value: object, *, text: bool = False) -> int:
    """``value`` as a whole number ``>= 1`` (``bool`` and ``2.0`` are not whole numbers here)."""
    number = _int(value, text)
    if number is not None and number >= 1:
        return number
    shown = short_repr(number if number is not None and isinstance(value, str) else value)
    raise ConfigurationError(f"{name} must be a whole number >= 1, got {shown}")


def znode_path(name: str, value: object) -> str:
    """``value`` as an absolute znode path other than ``/``; one trailing ``/`` is dropped.

    No empty, ``.`` or ``..`` segment, and none of the characters ZooKeeper rejects in paths.
    """
    problem = "not a string"
    if isinstance(value, str):
        path = value[:-1] if value.endswith("/") and value != "/" else value
        segments = path.split("/")[1:]
        bad = next((char for char in path if forbidden_in_znode(char)), None)
        if not path.startswith("/"):
            problem = "not absolute"
        elif path == "/":
            problem = "the root itself"
        elif any(segment in ("", ".", "..") for segment in segments):
            problem = "an empty, '.' or '..' segment"
        elif bad is not None:
            problem = f"the character U+{ord(bad):04X}"
        else:
            return path
    raise ConfigurationError(
        f"{name} must be an absolute znode path like '/zklock', got {short_repr(value)} ({problem})"
    )


def forbidden_in_znode(char: str) -> bool:
    """True for the characters ZooKeeper's ``PathUtils.validatePath`` rejects."""
    code = ord(char)
    return (
        code <= 0x1F or 0x7F <= code <= 0x9F or 0xD800 <= code <= 0xF8FF or 0xFFF0 <= code <= 0xFFFF
    )


def argument(check: Callable[..., _T], **options: Any) -> Callable[[str], _T]:
    """An argparse ``type=`` that parses its text with ``check`` (one of the above)."""

    def parse(text: str) -> _T:
        try:
            return check("the value", text, text=True, **options)
        except ConfigurationError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = check.__name__  # argparse names the type in some messages
    return parse


def _float(value: object, text: bool) -> float | None:
    """``value`` as a float, or None if it is not a number (or, with ``text``, a numeral)."""
    if text and isinstance(value, str):
        return _numeral(float, value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:  # an int too large for a float
        return math.inf


def _int(value: object, text: bool) -> int | None:
    """``value`` as an int, or None if it is not a whole number (or, with ``text``, a numeral)."""
    if text and isinstance(value, str):
        return _numeral(int, value)
    return None if isinstance(value, bool) or not isinstance(value, int) else value


def _numeral(kind: Callable[[str], _N], text: str) -> _N | None:
    """``text`` (stripped) read by ``kind`` (``int`` or ``float``), or None if it is not one."""
    try:
        return kind(text.strip())
    except ValueError:
        return None

"""The one check of an integer config value (sizes, counts, intervals).

Every module that takes an int from a config calls :func:`check_int`, so
the wording of the error (key, value, what is allowed) is the same
everywhere and ``True`` is never taken for ``1``.
"""
from typing import Any, Optional, Type


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is no size)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(key: str,
              value: Any,
              minimum: int = 1,
              *,
              also: Optional[tuple] = None,
              error: Type[Exception] = ValueError) -> int:
    """Return ``value`` if it is an int ``>= minimum`` (or one of ``also``).

    Args:
        key: the config key, as the user wrote it (e.g. ``'parallel.tp'``).
        value: the value to check.
        minimum: the smallest int allowed.
        also: other values allowed, each with its meaning, e.g.
            ``((-1, 'the rest of the world'),)``.
        error: the exception class to raise.

    Raises:
        error: naming ``key``, the value and what is allowed.
    """
    also = also or ()
    if is_int(value) and (value >= minimum or value in [v for v, _ in also]):
        return value
    allowed = f'an int >= {minimum}' + ''.join(
        f', or {v} for {meaning}' for v, meaning in also)
    raise error(f'{key}={value!r} is not allowed; allowed: {allowed}')

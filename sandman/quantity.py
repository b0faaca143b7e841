"""Kubernetes resource quantities ("500m", "1.5", "512Mi"), spelled once: their syntax, the parser
and the spelling the API server stores. The SDK checks a size's syntax with it before sending
(sandman/api.py), the webhook sizes and compares containers with it, the controller checks sizes
and counts cores and memory with it, the benches read a node's allocatable with it. Stdlib
only, Python 3.9: it ships in the client wheel."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SUFFIXES = {
    "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40, "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
    "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"),
    "P": Decimal("1e15"), "E": Decimal("1e18"),
}


def parse_quantity(value: str | int | float) -> Decimal:
    """A Kubernetes resource quantity as a Decimal ("500m" -> 0.5, "1Gi" -> 1073741824)."""
    text = str(value).strip()
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if suffix and text.endswith(suffix):
            number, factor = text[: -len(suffix)], _SUFFIXES[suffix]
            break
    else:
        number, factor = text, Decimal(1)
    try:
        return Decimal(number) * factor
    except InvalidOperation:
        raise ValueError(f"not a resource quantity: {value!r}") from None


_BINARY = ("Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
_DECIMAL_UP = ("k", "M", "G", "T", "P", "E")
_DECIMAL_DOWN = ("n", "u", "m")
# k8s.io/apimachinery resource.Quantity's syntax without a minus (a size is never negative).
_SYNTAX = re.compile(r"\+?([0-9]+(\.[0-9]*)?|\.[0-9]+)"
                     rf"([eE][+-]?[0-9]+|{'|'.join(_BINARY)}|[{''.join(_DECIMAL_DOWN + _DECIMAL_UP)}])?")
# The plain spelling of a byte count: digits, an optional fraction, a binary or upward
# decimal suffix (no sign, exponent or sub-unit suffix).
_PLAIN = re.compile(rf"[0-9]+(\.[0-9]+)?({'|'.join(_BINARY + _DECIMAL_UP)})?")


def is_quantity(text: object) -> bool:
    """`text` is a string in a Kubernetes quantity's syntax, without a minus."""
    return isinstance(text, str) and _SYNTAX.fullmatch(text) is not None


def is_positive_plain(text: str) -> bool:
    """`text` is a positive quantity in the plain spelling (_PLAIN): "10Gi", "512Mi", "1.5"."""
    return _PLAIN.fullmatch(text) is not None and parse_quantity(text) > 0


def format_quantity(value: Decimal, binary: bool) -> str:
    """A quantity in the spelling the API server stores ("1500m", "2", "1536Mi", "1G")."""
    if value == value.to_integral_value():
        n = int(value)
        suffixes = _BINARY[::-1] + _DECIMAL_UP[::-1] if binary else ()
        for suffix in suffixes:
            factor = int(_SUFFIXES[suffix])
            if n and n % factor == 0:
                return f"{n // factor}{suffix}"
        return str(n)
    for suffix in reversed(_DECIMAL_DOWN):
        scaled = value / _SUFFIXES[suffix]
        if scaled == scaled.to_integral_value():
            return f"{int(scaled)}{suffix}"
    return f"{int((value / _SUFFIXES['n']).to_integral_value(rounding='ROUND_CEILING'))}n"

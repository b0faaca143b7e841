"""JSON text of netguard's status file and log lines, byte for byte what
`json.dumps(obj, indent=indent, sort_keys=True)` writes, without importing `json`.

`json` imports `re` (and with it enum) for its decoder: ~5 ms of CPU on every guarded pod's
start, paid under the pod's own quota, to write one small object; even its C string encoder
(`_json`) is a shared library to load. Strings are escaped here as `json` does with
ensure_ascii: `"`, `\\`, control characters and DEL escaped, anything past ASCII as \\uXXXX
(a surrogate pair past the BMP). Readers use the real `json`.
"""

from __future__ import annotations

_ESCAPES = {i: f"\\u{i:04x}" for i in (*range(0x20), 0x7F)}
_ESCAPES.update({ord('"'): '\\"', ord("\\"): "\\\\", ord("\b"): "\\b", ord("\f"): "\\f",
                 ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})


def _char(c: str) -> str:
    n = ord(c)
    if n < 0x80:
        return _ESCAPES.get(n, c)
    if n < 0x10000:
        return f"\\u{n:04x}"
    n -= 0x10000
    return f"\\u{0xD800 | (n >> 10):04x}\\u{0xDC00 | (n & 0x3FF):04x}"


def _string(s: str) -> str:
    if s.isascii():
        return '"' + s.translate(_ESCAPES) + '"'
    return '"' + "".join(map(_char, s)) + '"'


_FLOAT_SPECIAL = {float("inf"): "Infinity", float("-inf"): "-Infinity"}


def dumps(obj: object, indent: int | None = None) -> str:
    return "".join(_parts(obj, indent, 0))


def _parts(obj: object, indent: int | None, level: int):
    if isinstance(obj, str):
        yield _string(obj)
    elif obj is None:
        yield "null"
    elif obj is True:
        yield "true"
    elif obj is False:
        yield "false"
    elif isinstance(obj, int):
        yield int.__repr__(obj)
    elif isinstance(obj, float):
        yield ("NaN" if obj != obj else _FLOAT_SPECIAL.get(obj) or float.__repr__(obj))
    elif isinstance(obj, (list, tuple, dict)):
        items = sorted(obj.items()) if isinstance(obj, dict) else obj
        if not items:
            yield "{}" if isinstance(obj, dict) else "[]"
            return
        if indent is None:
            inner, sep, end = "", ", ", ""
        else:
            inner = "\n" + " " * (indent * (level + 1))
            sep, end = "," + inner, "\n" + " " * (indent * level)
        yield ("{" if isinstance(obj, dict) else "[") + inner
        for i, item in enumerate(items):
            if i:
                yield sep
            if isinstance(obj, dict):
                key, item = item
                if not isinstance(key, str):
                    raise TypeError(f"keys must be str, not {type(key).__name__}")
                yield _string(key) + ": "
            yield from _parts(item, indent, level + 1)
        yield end + ("}" if isinstance(obj, dict) else "]")
    else:
        raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")

"""netguard's value classes, without `dataclasses`.

Importing `dataclasses` (it imports inspect, ast, dis, tokenize and copy) was most of the CPU
this module and rules.py's built-in sha256 saved: netguard's own process went from 96 to 74 ms
(`make bench-netguard`), paid on every guarded pod's start under the pod's own CPU quota. A class names its FIELDS in order, with DEFAULTS and FACTORIES
(a fresh value per instance, like `field(default_factory=...)`) for the optional ones;
`Record` gives `__init__` (positional or keyword), `==` and `repr`, as `@dataclass` did;
`Frozen` also hashes and refuses assignment, as `@dataclass(frozen=True)` did. UNCOMPARED
fields are left out of `==` and the hash (`field(compare=False)`).
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing's import is CPU on the guard's hot path
if TYPE_CHECKING:
    from typing import TypeVar

    _F = TypeVar("_F", bound="Frozen")


class Record:
    __slots__ = ()
    FIELDS: tuple[str, ...] = ()
    DEFAULTS: dict = {}
    FACTORIES: dict = {}
    UNCOMPARED: tuple[str, ...] = ()

    def __init__(self, *args, **kwargs) -> None:
        name = type(self).__name__
        if len(args) > len(self.FIELDS):
            raise TypeError(f"{name}() takes at most {len(self.FIELDS)} positional arguments")
        values = dict(zip(self.FIELDS[:len(args)], args, strict=True))
        for k, v in kwargs.items():
            if k not in self.FIELDS:
                raise TypeError(f"{name}() got an unexpected keyword argument {k!r}")
            if k in values:
                raise TypeError(f"{name}() got multiple values for argument {k!r}")
            values[k] = v
        for f in self.FIELDS:
            if f not in values:
                if f in self.FACTORIES:
                    values[f] = self.FACTORIES[f]()
                elif f in self.DEFAULTS:
                    values[f] = self.DEFAULTS[f]
                else:
                    raise TypeError(f"{name}() missing required argument {f!r}")
            object.__setattr__(self, f, values[f])
        self.__post_init__()

    def __post_init__(self) -> None:
        pass

    def _key(self) -> tuple:
        return tuple(getattr(self, f) for f in self.FIELDS if f not in self.UNCOMPARED)

    def __eq__(self, other) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]  # mutable: unhashable, as @dataclass leaves an eq class

    def __repr__(self) -> str:
        inner = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.FIELDS)
        return f"{type(self).__name__}({inner})"


class Frozen(Record):
    __slots__ = ()

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot assign to {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot delete {name!r}")

    def __hash__(self) -> int:  # type: ignore[override]  # frozen: hashable again (Record's is None)
        return hash(self._key())

    def replace(self: _F, **changes) -> _F:
        """A copy with `changes` (dataclasses.replace): validated again by __post_init__."""
        return type(self)(**{**{f: getattr(self, f) for f in self.FIELDS}, **changes})

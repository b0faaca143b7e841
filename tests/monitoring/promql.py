"""The metric names a PromQL expression selects, without a PromQL parser (no maintained one is
pinned here): a tokenizer that drops what cannot be a metric name (strings, label matchers,
ranges and subqueries, Grafana variables, numbers and durations, comments), the label lists of
`by`/`without`/`on`/`ignoring`/`group_left`/`group_right`, keywords, and every identifier
followed by `(` (functions; aggregations also take `by (...)` first). What is left are vector
selectors. `{__name__="x"}` names x; a `__name__` regex cannot be checked and is an error."""

from __future__ import annotations

import re

AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count",
                "count_values", "bottomk", "topk", "quantile", "limitk", "limit_ratio"}
KEYWORDS = AGGREGATIONS | {"and", "or", "unless", "by", "without", "on", "ignoring",
                           "group_left", "group_right", "offset", "bool", "atan2", "inf", "nan",
                           "start", "end"}
LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}

TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<var>\$\{[^}]*\}|\$\w+)
  | (?P<number>(?:0x[0-9a-fA-F]+|\d[\w.]*)(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<punct>==|!=|=~|!~|>=|<=|[-+*/%^<>=(){}\[\],:@.])
""", re.X)


class PromQLError(ValueError):
    pass


def tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        if not m:
            raise PromQLError(f"cannot read {expr[pos:pos + 20]!r} in {expr!r}")
        if m.lastgroup not in ("ws", "comment"):
            out.append((m.lastgroup, m.group()))
        pos = m.end()
    return out


def _skip_group(toks: list[tuple[str, str]], i: int, open_: str, close: str) -> int:
    """Index after the group that starts at toks[i] == open_."""
    depth = 0
    for j in range(i, len(toks)):
        if toks[j] == ("punct", open_):
            depth += 1
        elif toks[j] == ("punct", close):
            depth -= 1
            if depth == 0:
                return j + 1
    raise PromQLError(f"unbalanced {open_}")


def _check_balanced(toks: list[tuple[str, str]]) -> None:
    stack: list[str] = []
    pairs = {")": "(", "]": "[", "}": "{"}
    for kind, text in toks:
        if kind != "punct":
            continue
        if text in "([{":
            stack.append(text)
        elif text in pairs and (not stack or stack.pop() != pairs[text]):
            raise PromQLError(f"unbalanced {text}")
    if stack:
        raise PromQLError(f"unbalanced {stack[-1]}")


def metric_names(expr: str) -> set[str]:
    toks = tokens(expr)
    _check_balanced(toks)
    names: set[str] = set()
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1] if i + 1 < len(toks) else ("", "")
        if (kind, text) == ("punct", "{"):
            end = _skip_group(toks, i, "{", "}")
            names |= _name_matchers(toks[i + 1:end - 1], expr)
            i = end
        elif (kind, text) == ("punct", "["):
            i = _skip_group(toks, i, "[", "]")
        elif kind == "ident" and text in LABEL_LISTS and nxt == ("punct", "("):
            i = _skip_group(toks, i + 1, "(", ")")
        elif kind == "ident" and (text in KEYWORDS or nxt == ("punct", "(")):
            i += 1
        elif kind == "ident":
            names.add(text)
            i += 1
        else:
            i += 1
    return names


def _name_matchers(inner: list[tuple[str, str]], expr: str) -> set[str]:
    out = set()
    for k in range(len(inner) - 2):
        if inner[k] == ("ident", "__name__"):
            op, (vkind, value) = inner[k + 1][1], inner[k + 2]
            if op != "=" or vkind != "string":
                raise PromQLError(f"__name__{op} cannot be checked: {expr!r}")
            out.add(value[1:-1])
    return out

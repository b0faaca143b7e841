"""A new leader learns a sandbox's execd token back from its holder (Controller.prove) only
when the token hashes to the pod's annotation; the wire bounds what a caller may send."""

import hashlib
from types import SimpleNamespace

import pytest

from controller.books import State
from controller.core import Controller
from sandman import api

TOKEN = "t0k3n-of-the-holder-" + "x" * 23


def _entry(**kw):
    base = dict(id="sbx-a", token=None, _stage=State.LEASED,
                token_sha256=hashlib.sha256(TOKEN.encode()).hexdigest())
    base.update(kw)
    e = SimpleNamespace(**base)
    e.stage = e._stage
    return e


def _prove(e, tokens) -> None:
    Controller.prove(SimpleNamespace(books=SimpleNamespace(fields=lambda e: {})), e, tokens)


def test_the_holders_token_is_learned_back():
    e = _entry()
    _prove(e, {"sbx-a": TOKEN})
    assert e.token == TOKEN


@pytest.mark.parametrize("tokens, entry", [
    ({"sbx-a": TOKEN + "x"}, {}),  # a wrong token
    ({"sbx-b": TOKEN}, {}),  # the right token under another id
    ({"sbx-a": TOKEN}, {"token": "known"}),  # a known token is never replaced
    ({"sbx-a": TOKEN}, {"token_sha256": None}),  # no annotation: nothing to check against
    ({"sbx-a": TOKEN}, {"_stage": State.WARM}),  # only a handed-out sandbox
    (None, {}), ({}, {}),
])
def test_anything_else_changes_nothing(tokens, entry):
    e = _entry(**entry)
    before = e.token
    _prove(e, tokens)
    assert e.token == before


@pytest.mark.parametrize("tokens", [
    {"sbx-a": ""}, {"sbx-a": "x" * (api.MAX_TOKEN_LEN + 1)}, {"": "t"}, {"sbx-a": 5},
    {f"sbx-{i}": "t" for i in range(api.MAX_CHECKPOINT + 1)}, ["sbx-a"], "sbx-a=t",
])
def test_the_wire_refuses_tokens_out_of_bounds_in_one_line(tokens):
    for make in (lambda: api.ForkRequest(n=1, tokens=tokens),
                 lambda: api.CheckpointRequest(ids=["sbx-a"], tokens=tokens),
                 lambda: api.RestoreRequest(tokens=tokens),
                 lambda: api.RenewRequest(tokens=tokens)):
        with pytest.raises(ValueError) as ei:
            make()
        assert "tokens:" in str(ei.value) and "\n" not in str(ei.value)

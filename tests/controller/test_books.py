"""The books' one transition table: every legal change is allowed, every other one is refused
loudly (and not applied), and the table has the shape the ownership rules need."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from controller import metrics
from controller.books import (
    BORN,
    ENTRY_STATES,
    PRE_CREATE,
    TERMINAL,
    TRANSITIONS,
    Books,
    Entry,
    IllegalTransition,
    State,
)
from controller.pacer import Limits, Pacer
from controller.pods import SandboxSpec

# The table written out here, not read from the product: a change to controller/books.py's
# TRANSITIONS fails `test_the_table_is_the_reviewed_one` and the legal/illegal cases below until
# this copy is changed with it (a reviewed, deliberate change to the ownership rules).
EXPECTED = {
    "QUEUED": {"CREATING", "WITHDRAWN"},
    "WITHDRAWN": {"GONE"},
    "CREATING": {"STARTING", "FAILED", "CREATING_ORPHANED", "CREATING_DRAINED", "DELETING",
                 "GONE"},
    "CREATING_ORPHANED": {"STARTING_ORPHANED", "FAILED", "CREATING_DRAINED", "DELETING", "GONE"},
    "CREATING_DRAINED": {"STARTING_DRAINED", "FAILED", "DELETING", "GONE"},
    "STARTING": {"LEASED", "WARM", "STARTING_ORPHANED", "STARTING_DRAINED", "DELETING", "GONE"},
    "STARTING_ORPHANED": {"PARKED", "STARTING_DRAINED", "DELETING", "GONE"},
    "STARTING_DRAINED": {"DELETING", "GONE"},
    "WARM": {"CHECKING", "DELETING", "GONE"},
    "PARKED": {"CHECKING", "DELETING", "GONE"},
    "CHECKING": {"LEASED", "PARKED", "DELETING", "GONE"},
    "LEASED": {"DELETING", "CHECKING", "GONE"},
    "DELETING": {"GONE"},
    "GONE": set(),
    "FAILED": set(),
}
LEGAL = [(State[a], State[b]) for a, targets in EXPECTED.items() for b in sorted(targets)]
ILLEGAL = [(a, b) for a, b in itertools.product(State, State) if b.name not in EXPECTED[a.name]]
# States in which a pod may exist (or its create may have been stored).
MAY_HAVE_A_POD = set(State) - PRE_CREATE - TERMINAL - {State.DELETING}


def entry(stage: State, name: str = "sbx-a-1") -> Entry:
    return Entry(name, SandboxSpec("img"), "a", "nonce", "tok", _stage=stage)


def test_the_table_is_the_reviewed_one():
    assert {a.name: {b.name for b in t} for a, t in TRANSITIONS.items()} == EXPECTED


def test_the_table_names_every_state():
    assert set(TRANSITIONS) == set(State) and set(EXPECTED) == {s.name for s in State}
    assert len(LEGAL) + len(ILLEGAL) == len(State) ** 2


@pytest.mark.parametrize(("frm", "to"), LEGAL, ids=lambda s: s.name)
def test_every_legal_transition_is_applied(frm, to):
    seen = []
    books = Books(on_move=lambda e, old, new: seen.append((old, new)))
    e = entry(frm)
    books.entries[e.name] = e
    books.move(e, to, "test")
    assert e.stage is to and e.state == to.public
    assert seen == [(frm, to)]
    assert (e.name in books.entries) == (to not in TERMINAL)
    assert books.illegal == 0


@pytest.mark.parametrize(("frm", "to"), ILLEGAL, ids=lambda s: s.name)
def test_every_illegal_transition_is_refused_and_not_applied(frm, to, caplog):
    seen = []
    books = Books(on_move=lambda e, old, new: seen.append((old, new)))
    e = entry(frm)
    books.entries[e.name] = e
    before = REGISTRY.get_sample_value("sandman_controller_illegal_transitions_total",
                                       {"from_state": frm.name, "to_state": to.name}) or 0
    with pytest.raises(IllegalTransition):
        books.move(e, to, "test")
    assert e.stage is frm and seen == [] and books.entries[e.name] is e
    assert books.illegal == 1
    assert any(r.levelname == "ERROR" and "illegal transition" in r.message
               for r in caplog.records)
    assert REGISTRY.get_sample_value("sandman_controller_illegal_transitions_total",
                                     {"from_state": frm.name, "to_state": to.name}) == before + 1


def test_terminal_states_have_no_way_out_and_every_other_state_ends():
    for s in TERMINAL:
        assert TRANSITIONS[s] == frozenset()

    def reaches_terminal(s: State, seen: frozenset = frozenset()) -> bool:
        return s in TERMINAL or any(reaches_terminal(t, seen | {s})
                                    for t in TRANSITIONS[s] if t not in seen)

    assert all(reaches_terminal(s) for s in State)


def test_every_state_is_reachable_from_birth():
    reached, todo = set(BORN), list(BORN)
    while todo:
        for t in TRANSITIONS[todo.pop()]:
            if t not in reached:
                reached.add(t)
                todo.append(t)
    assert reached == set(State)


def test_fail_closed_is_always_legal():
    """Deleting is legal from every state that may have a pod, and the informer's GONE from
    every state whose create was sent: an actor's error path can always take them."""
    for s in MAY_HAVE_A_POD:
        assert State.DELETING in TRANSITIONS[s], s
    for s in set(State) - PRE_CREATE - TERMINAL:
        assert State.GONE in TRANSITIONS[s], s
    # A create never sent cannot be deleted, only withdrawn.
    assert State.DELETING not in TRANSITIONS[State.QUEUED]
    assert TRANSITIONS[State.WITHDRAWN] == {State.GONE}


def test_public_words_are_the_api_vocabulary():
    assert {s.public for s in State} <= set(ENTRY_STATES)
    assert set(metrics.STATES) == {s.name for s in State}


def test_births():
    books = Books()
    for s in BORN:
        books.add(entry(s, f"sbx-{s.name.lower()}"))
    for s in set(State) - BORN:
        with pytest.raises(IllegalTransition):
            books.add(entry(s, "sbx-x"))
    assert "sbx-x" not in books.entries


def test_a_terminal_entry_leaves_the_books_and_the_caps():
    pacer = Pacer(Limits())
    books = Books()
    e = entry(State.LEASED)
    e.slot = pacer.adopt("a")
    books.add(e)
    assert pacer.live == 1
    books.gone(e)
    assert e.stage is State.GONE and e.name not in books.entries and pacer.live == 0
    books.gone(e)  # idempotent
    assert pacer.live == 0


def test_only_the_books_write_an_entry_state():
    """The table is checked at every change because nothing else assigns the state."""
    root = Path(__file__).resolve().parents[2] / "controller"
    writers = [f"{p.name}:{i}" for p in root.glob("*.py") if p.name != "books.py"
               for i, line in enumerate(p.read_text().splitlines(), 1)
               if re.search(r"\b_stage\b|\.state\s*=[^=]|\.stage\s*=[^=]", line)]
    assert writers == []


def test_metric_labels_are_bounded():
    assert metrics.bounded("ok", metrics.ACQUIRE_RESULTS) == "ok"
    assert metrics.bounded("job-4711", metrics.ACQUIRE_RESULTS) == "other"
    before = REGISTRY.get_sample_value("sandman_controller_creates_total",
                                       {"result": "other"}) or 0
    metrics.created("sbx-some-pod-name")
    assert REGISTRY.get_sample_value("sandman_controller_creates_total",
                                     {"result": "other"}) == before + 1
    assert REGISTRY.get_sample_value("sandman_controller_creates_total",
                                     {"result": "sbx-some-pod-name"}) is None
    metrics.acquired("ok", "yes")  # not a bool: counted as warm=false, never a new label value
    assert REGISTRY.get_sample_value("sandman_controller_acquires_total",
                                     {"result": "ok", "warm": "yes"}) is None

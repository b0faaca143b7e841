"""Checkpoints' pure parts: the id's form, the index's proof, the request's checks. The
registry, the pods and the restores are tested on the bed (test_checkpoint_on_testbed.py)."""

from __future__ import annotations

import pytest

from controller import checkpoint as C
from controller import oci
from controller.errors import CheckpointGone
from sandman import api

HEX = "ab" * 32


def test_an_id_names_its_tenant_and_the_sets_digest():
    assert C.checkpoint_id("team-a", "sha256:" + HEX) == f"team-a.{HEX}"
    assert C.parse_id(f"team-a.{HEX}") == ("team-a", "sha256:" + HEX)


@pytest.mark.parametrize("bad", [HEX, f"team-a.{HEX[:-1]}", f"Team.{HEX}",
                                 f"team-a.{HEX.upper()}", f"../x.{HEX}", f"a.b.{HEX}", ""])
def test_anything_else_is_no_checkpoint(bad):
    with pytest.raises(CheckpointGone):
        C.parse_id(bad)


def test_the_proof_binds_the_tenant_the_sandboxes_and_the_times():
    key, d = b"k" * 32, ["sha256:" + HEX]
    p = C.proof(key, "sbx", "team-a", d, "2026-01-01T00:00:00Z", "2026-01-08T00:00:00Z")
    for other in (C.proof(key, "sbx", "team-b", d, "2026-01-01T00:00:00Z",
                          "2026-01-08T00:00:00Z"),
                  C.proof(key, "sbx", "team-a", ["sha256:" + "cd" * 32],
                          "2026-01-01T00:00:00Z", "2026-01-08T00:00:00Z"),
                  C.proof(key, "sbx", "team-a", d, "2026-01-01T00:00:00Z",
                          "2027-01-08T00:00:00Z"),
                  C.proof(b"j" * 32, "sbx", "team-a", d, "2026-01-01T00:00:00Z",
                          "2026-01-08T00:00:00Z")):
        assert other != p


def test_a_request_names_a_job_or_ids_never_both():
    api.CheckpointRequest(job="j")
    api.CheckpointRequest(ids=["a", "b"])
    for kw in ({}, {"job": "j", "ids": ["a"]}, {"ids": []}, {"ids": ["a", "a"]},
               {"ids": ["x"] * (api.MAX_CHECKPOINT + 1)}, {"job": ""},
               {"job": "j", "timeout_s": 0}):
        with pytest.raises(ValueError):
            api.CheckpointRequest(**kw)


def test_what_is_pushed_has_one_serialization():
    assert oci.dumps({"b": 1, "a": [1, 2]}) == b'{"a":[1,2],"b":1}'
    with pytest.raises(oci.Tampered):
        oci.check_digest("sha256:" + HEX.upper())

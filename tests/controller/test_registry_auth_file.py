"""The checkpoint registry's credentials follow a rotated Secret (controller/oci.py AuthFile):
an ECR password lives 12 hours, a CronJob writes the new one into the Secret, and the kubelet
swaps the mounted files in place. Read once at start (the old behaviour), the controller's
checkpoints fail from the 13th hour on."""

import base64
import json
import os
from pathlib import Path

import pytest

from controller import oci
from controller.__main__ import _registry_creds

HOST = "123456789012.dkr.ecr.us-east-1.amazonaws.com"


def _config(password: str, host: str = HOST) -> str:
    auth = base64.b64encode(f"AWS:{password}".encode()).decode()
    return json.dumps({"auths": {host: {"auth": auth}}})


def _secret_volume(root: Path, content: str, n: int) -> Path:
    """What the kubelet does: files in a timestamped dir, `..data` moved to it atomically,
    the visible name a link through `..data`."""
    d = root / f"..2026_12_07_{n:02d}"
    d.mkdir()
    (d / "config.json").write_text(content)
    tmp = root / "..data_tmp"
    tmp.symlink_to(d.name)
    os.replace(tmp, root / "..data")
    if not (root / "config.json").is_symlink():
        (root / "config.json").symlink_to("..data/config.json")
    return root / "config.json"


def test_a_rotated_secret_is_used_at_the_next_registry_call(tmp_path):
    path = _secret_volume(tmp_path, _config("token-1"), 1)
    creds = _registry_creds(str(path), f"{HOST}/sandman-checkpoints")
    store = oci.Store(HOST, "sandman-checkpoints", creds=creds)
    assert creds() == ("AWS", "token-1")
    _secret_volume(tmp_path, _config("token-2"), 2)
    assert creds() == ("AWS", "token-2")
    # The oras client each call makes carries the new password.
    reg = store._client()
    assert base64.b64decode(reg.auth._basic_auth).decode() == "AWS:token-2"


@pytest.mark.parametrize("broken", ["{not json", _config("x", host="other.example"), ""])
def test_a_broken_rewrite_keeps_the_last_good_credentials(tmp_path, broken):
    path = _secret_volume(tmp_path, _config("token-1"), 1)
    creds = oci.AuthFile(str(path), HOST)
    _secret_volume(tmp_path, broken, 2)
    assert creds() == ("AWS", "token-1")
    _secret_volume(tmp_path, _config("token-3"), 3)
    assert creds() == ("AWS", "token-3")


@pytest.mark.parametrize("content", ["{not json", _config("x", host="other.example")])
def test_a_file_without_credentials_stops_the_start_in_one_line(tmp_path, content):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ValueError) as ei:
        _registry_creds(str(path), f"{HOST}/p")
    assert str(path) in str(ei.value) and "\n" not in str(ei.value)

"""testbed/versions.py's minor table and the cache folder it keys (make test-compat K8S=1.xx)."""

from __future__ import annotations

import re

import pytest

from testbed import build, versions


def test_no_minor_asked_is_ci_version(monkeypatch):
    monkeypatch.delenv("SANDMAN_K8S", raising=False)
    assert versions.kubernetes() == versions.KUBERNETES
    assert versions.KUBERNETES_MINORS["1.36"] == versions.KUBERNETES


def test_a_minor_resolves_to_its_pinned_patch_and_own_cache_folder(monkeypatch):
    for minor, pinned in versions.KUBERNETES_MINORS.items():
        assert re.fullmatch(rf"v{re.escape(minor)}\.\d+", pinned), (minor, pinned)
        monkeypatch.setenv("SANDMAN_K8S", minor)
        assert versions.kubernetes() == pinned
        assert build.bin_dir().parent.name.startswith(f"k8s-{pinned}_")
    monkeypatch.setenv("SANDMAN_K8S", "v1.33")
    assert versions.kubernetes() == versions.KUBERNETES_MINORS["1.33"]


@pytest.mark.parametrize("asked", ["1.29", "1.33.1", "latest", "1.3"])
def test_an_unpinned_minor_is_one_line_error_not_ci_version(monkeypatch, asked):
    monkeypatch.setenv("SANDMAN_K8S", asked)
    with pytest.raises(build.BuildError) as e:
        build.bin_dir()
    assert "not a pinned minor" in str(e.value) and "1.33" in str(e.value)
    assert "\n" not in str(e.value)

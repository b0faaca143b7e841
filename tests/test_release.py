"""tools/release.py's checks before anything is built or pushed: each refusal is one line and
exits 1 (the pushes themselves: tests/charts/test_release_on_testbed.py, on the bed)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from testbed.procs import refused_port
from tools import release

DIGEST = "sha256:" + "ab" * 32


def _one_line_refusal(capsys, argv: list[str], needle: str) -> None:
    assert release.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("release: ") and needle in err, err


def test_no_registry_is_one_line(capsys):
    _one_line_refusal(capsys, [], "no registry: make release REGISTRY=host/prefix")
    _one_line_refusal(capsys, ["--registry", "  "], "no registry")


@pytest.mark.parametrize("bad", ["https://ghcr.io/org", "ghcr.io/Org", "ghcr.io/org:1.0",
                                 "ghcr.io/org@sha256:00", "ghcr.io/org/../x"])
def test_a_malformed_registry_is_one_line(capsys, bad):
    _one_line_refusal(capsys, ["--registry", bad], "is not host[:port]/prefix")


def test_an_unreachable_registry_is_refused_before_any_build(capsys, monkeypatch):
    def no_build(*a, **k):
        raise AssertionError("built or pushed for an unreachable registry")

    monkeypatch.setattr(release, "Tools", no_build)
    monkeypatch.setattr(release, "uncommitted", lambda root, paths: [])  # whatever the tree's
    with refused_port() as port:
        _one_line_refusal(capsys, ["--registry", f"127.0.0.1:{port}/org", "--plain-http"],
                          f"registry 127.0.0.1:{port} unreachable")


@pytest.mark.parametrize("field", ["version", "appVersion"])
def test_a_chart_version_other_than_the_package_version_is_refused(capsys, monkeypatch,
                                                                   tmp_path, field):
    chart = tmp_path / "sandman"
    shutil.copytree(release.CHART, chart)
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    meta[field] = "9.9.9"
    (chart / "Chart.yaml").write_text(yaml.safe_dump(meta))
    monkeypatch.setattr(release, "CHART", chart)
    monkeypatch.setattr(release, "check_reachable", lambda *a: pytest.fail("went on"))
    _one_line_refusal(capsys, ["--registry", "ghcr.io/org"], "version mismatch: "
                      f"sandman/_version.py is {release.images.sandman_version()}")


def test_the_shipped_chart_carries_the_package_version():
    assert release.versions() == release.images.sandman_version()


def test_pinning_changes_only_the_image_repository_and_digest():
    text = (release.CHART / "values.yaml").read_text()
    out = release.pinned_values(text, "registry.example:5000/org/sandman", DIGEST)
    before, after = yaml.safe_load(text), yaml.safe_load(out)
    assert after["image"] == dict(before["image"], repository="registry.example:5000/org/sandman",
                                  digest=DIGEST)
    assert {k: v for k, v in after.items() if k != "image"} == \
        {k: v for k, v in before.items() if k != "image"}
    # Components' own `image` blocks (indented deeper) are left as they were: empty, so every
    # pod runs the pinned one.
    assert len(text.splitlines()) == len(out.splitlines())
    changed = [(a, b) for a, b in zip(text.splitlines(), out.splitlines(), strict=True) if a != b]
    assert len(changed) == 2, changed


def test_pinning_a_values_file_without_the_image_block_is_refused():
    with pytest.raises(release.ReleaseError, match="no top-level `image:` block"):
        release.pinned_values("replicas: 1\n", "r/sandman", DIGEST)
    with pytest.raises(release.ReleaseError, match="no `repository:` or `digest:` line"):
        release.pinned_values("image:\n  repository: x\n  tag: y\n", "r/sandman", DIGEST)


def test_uncommitted_changes_of_what_ships_are_refused(capsys, monkeypatch):
    monkeypatch.setattr(release, "uncommitted", lambda root, paths: [f"p{i}" for i in range(5)])
    monkeypatch.setattr(release, "check_reachable", lambda *a: pytest.fail("went on"))
    _one_line_refusal(capsys, ["--registry", "ghcr.io/org"],
                      "uncommitted changes would ship: p0, p1, p2 and 2 more")


def test_uncommitted_lists_edits_and_new_files_under_the_shipped_paths_only(tmp_path):
    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c",
                        "user.email=t@t", *args], check=True, capture_output=True)

    (tmp_path / "shipped").mkdir()
    (tmp_path / "shipped" / "a.py").write_text("a\n")
    (tmp_path / "docs.md").write_text("d\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "x")
    assert release.uncommitted(tmp_path, ["shipped"]) == []
    (tmp_path / "docs.md").write_text("edited\n")  # not shipped
    assert release.uncommitted(tmp_path, ["shipped"]) == []
    (tmp_path / "shipped" / "a.py").write_text("edited\n")
    (tmp_path / "shipped" / "new.py").write_text("n\n")
    assert release.uncommitted(tmp_path, ["shipped"]) == ["shipped/a.py", "shipped/new.py"]


def test_no_git_checkout_is_refused(tmp_path):
    with pytest.raises(release.ReleaseError, match="a release is built from a git checkout"):
        release.uncommitted(tmp_path / "nowhere", ["x"])

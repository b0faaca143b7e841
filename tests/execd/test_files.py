"""Byte-exact files (paper table A24): reads, raw GET, atomic writes, refusals, big files."""

from __future__ import annotations

import base64
import hashlib
import os
import stat

import pytest

LINE_ENDINGS = {
    "lf": b"def f():\n    return 1\n",
    "crlf": b"line one\r\nline two\r\n",
    "bom": b"\xef\xbb\xbfprint('bom')\n",
    "non_utf8": b"caf\xe9 latin-1\n\xff\xfe\x00binary",
    "mixed": b"a\r\nb\nc\r\nd",
    "bare_cr": b"progress 10%\rprogress 100%\n",
    "no_final_newline": b"last line without newline",
    "empty": b"",
}


@pytest.mark.parametrize("name", sorted(LINE_ENDINGS))
def test_read_is_byte_exact(execd, tmp_path, name):
    data = LINE_ENDINGS[name]
    f = tmp_path / f"{name}.txt"
    f.write_bytes(data)
    r = execd.post("/files/read", {"path": str(f)})
    assert r.status_code == 200, r.text
    j = r.json()
    assert base64.b64decode(j["data_b64"]) == data
    assert j["size"] == len(data) and j["sha256"] == hashlib.sha256(data).hexdigest()
    g = execd.get("/files", params={"path": str(f)})
    assert g.status_code == 200 and g.content == data
    assert g.headers["x-content-sha256"] == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("name", sorted(LINE_ENDINGS))
def test_write_then_read_round_trip(execd, tmp_path, name):
    data = LINE_ENDINGS[name]
    f = tmp_path / "out.bin"
    r = execd.post("/files/write", {"path": str(f), "data_b64": base64.b64encode(data).decode()})
    assert r.status_code == 200, r.text
    assert r.json()["size"] == len(data)
    assert r.json()["sha256"] == hashlib.sha256(data).hexdigest()
    assert f.read_bytes() == data


def test_relative_path_is_the_shells_cwd(execd, tmp_path):
    execd.exec(f"cd {tmp_path} && printf rel > rel.txt")
    j = execd.post("/files/read", {"path": "rel.txt"}).json()
    assert base64.b64decode(j["data_b64"]) == b"rel"


def test_write_is_atomic_and_keeps_mode_and_owner(execd, tmp_path):
    f = tmp_path / "script.sh"
    f.write_bytes(b"old\n")
    os.chmod(f, 0o751)
    os.chown(f, 1234, 2345)
    ino = f.stat().st_ino
    r = execd.post("/files/write", {"path": str(f), "data_b64": base64.b64encode(b"new\n").decode()})
    assert r.status_code == 200, r.text
    st = f.stat()
    assert f.read_bytes() == b"new\n"
    assert stat.S_IMODE(st.st_mode) == 0o751 and (st.st_uid, st.st_gid) == (1234, 2345)
    assert st.st_ino != ino, "not replaced by rename"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".execd-")] == []


def test_write_mode_for_new_file_and_symlink_target(execd, tmp_path):
    f = tmp_path / "new.sh"
    r = execd.post("/files/write", {"path": str(f), "data_b64": "", "mode": "0755"})
    assert r.status_code == 200 and stat.S_IMODE(f.stat().st_mode) == 0o755
    target = tmp_path / "target.txt"
    target.write_bytes(b"t")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    r = execd.post("/files/write", {"path": str(link), "data_b64": base64.b64encode(b"via").decode()})
    assert r.status_code == 200
    assert link.is_symlink() and target.read_bytes() == b"via"


def test_write_if_sha256_conflict_409(execd, tmp_path):
    f = tmp_path / "f.txt"
    f.write_bytes(b"v1")
    good = hashlib.sha256(b"v1").hexdigest()
    r = execd.post("/files/write", {"path": str(f), "data_b64": base64.b64encode(b"v2").decode(),
                                    "if_sha256": good})
    assert r.status_code == 200 and f.read_bytes() == b"v2"
    r = execd.post("/files/write", {"path": str(f), "data_b64": base64.b64encode(b"v3").decode(),
                                    "if_sha256": good})
    assert r.status_code == 409 and r.json()["sha256"] == hashlib.sha256(b"v2").hexdigest()
    assert f.read_bytes() == b"v2"
    r = execd.post("/files/write", {"path": str(tmp_path / "missing"), "data_b64": "",
                                    "if_sha256": good})
    assert r.status_code == 409 and not (tmp_path / "missing").exists()


def test_non_regular_files_refused(execd, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for p in (str(tmp_path), str(fifo), "/dev/zero", "/dev/null"):
        r = execd.post("/files/read", {"path": p})
        assert r.status_code == 400 and "not a regular file" in r.json()["error"], (p, r.text)
        g = execd.get("/files", params={"path": p})
        assert g.status_code == 400
    r = execd.post("/files/write", {"path": str(tmp_path), "data_b64": ""})
    assert r.status_code == 400
    r = execd.post("/files/read", {"path": str(tmp_path / "nope")})
    assert r.status_code == 404
    r = execd.post("/files/write", {"path": str(tmp_path / "no" / "dir"), "data_b64": ""})
    assert r.status_code == 404


def test_paths_outside_root_refused(execd_factory, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "in.txt").write_bytes(b"in")
    (tmp_path / "out.txt").write_bytes(b"out")
    (root / "escape").symlink_to(tmp_path / "out.txt")
    d = execd_factory("--root", str(root))
    assert d.post("/files/read", {"path": str(root / "in.txt")}).status_code == 200
    for p in (str(tmp_path / "out.txt"), str(root / ".." / "out.txt"), str(root / "escape"),
              "/etc/passwd"):
        r = d.post("/files/read", {"path": p})
        assert r.status_code == 403 and "outside" in r.json()["error"], p
        assert d.get("/files", params={"path": p}).status_code == 403
        w = d.post("/files/write", {"path": p, "data_b64": "eA=="})
        assert w.status_code == 403
    assert (tmp_path / "out.txt").read_bytes() == b"out"


@pytest.mark.slow
def test_large_file_streams_without_loading_twice(execd, tmp_path):
    rest = execd.reset_hwm()
    size = 64 << 20
    f = tmp_path / "big.bin"
    with open(f, "wb") as fh:
        block = os.urandom(1 << 20)
        for _ in range(size >> 20):
            fh.write(block)
    want = hashlib.sha256(f.read_bytes()).hexdigest()
    g = execd.get("/files", params={"path": str(f)})
    assert g.status_code == 200 and len(g.content) == size
    assert hashlib.sha256(g.content).hexdigest() == want == g.headers["x-content-sha256"]
    r = execd.post("/files/read", {"path": str(f)})
    j = r.json()
    assert j["size"] == size and j["sha256"] == want
    assert hashlib.sha256(base64.b64decode(j["data_b64"])).hexdigest() == want
    # A whole-file buffer (let alone two, or a base64 copy) would add more than 64 MiB.
    assert execd.rss_hwm_kib() - rest < 24 * 1024, (execd.rss_hwm_kib(), rest)

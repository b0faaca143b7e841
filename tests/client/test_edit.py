"""The byte-safe editor, `sandbox.edit(path, old, new)`, against a real execd: every refusal
(not UTF-8, mixed endings, bare CR, 0 or 2 matches, empty old), byte-exactness outside the
edit (CRLF, BOM, no final newline, non-ASCII), the file's mode kept, and a file changed
between read and write refused with nothing written. Both twins."""

from __future__ import annotations

import hashlib
import os
import stat

import pytest

from sandman.client import (
    EditAmbiguous,
    EditConflict,
    EditNoMatch,
    EditRefused,
    FileNotFound,
    WriteConflict,
)
from sandman.client.editing import plan_edit

from .conftest import Execd, Flavor


def _edit_case(flavor: Flavor, execd: Execd, path, data: bytes, old: str, new: str):
    path.write_bytes(data)

    async def body():
        async with flavor.connect(execd) as sb:
            return await sb.edit(str(path), old, new)

    return flavor.run(body)


@pytest.mark.parametrize("data,old,new,expected", [
    (b"a = 1\nb = 2\n", "b = 2", "b = 3", b"a = 1\nb = 3\n"),
    # CRLF file: edited in its own convention, whatever the agent wrote.
    (b"x\r\ny = 1\r\nz\r\n", "y = 1\nz", "y = 2\nw\nz", b"x\r\ny = 2\r\nw\r\nz\r\n"),
    (b"x\r\ny = 1\r\n", "y = 1\r\n", "y = 2\r\n", b"x\r\ny = 2\r\n"),
    # BOM kept, no final newline kept, non-ASCII text.
    (b"\xef\xbb\xbfcaf\xc3\xa9 = 1", "caf\u00e9 = 1", "caf\u00e9 = 2", b"\xef\xbb\xbfcaf\xc3\xa9 = 2"),
    (b"tab\there\n\n\n  trailing  \n", "here", "there", b"tab\tthere\n\n\n  trailing  \n"),
])
def test_edit_changes_only_the_edit(flavor, execd, tmp_path, data, old, new, expected) -> None:
    path = tmp_path / "f.txt"
    res = _edit_case(flavor, execd, path, data, old, new)
    assert path.read_bytes() == expected
    assert res.sha256_before == hashlib.sha256(data).hexdigest()
    assert res.sha256 == hashlib.sha256(expected).hexdigest() and res.size == len(expected)


def test_edit_reports_line_and_keeps_mode(flavor, execd, tmp_path) -> None:
    path = tmp_path / "run.sh"
    path.write_bytes(b"#!/bin/sh\necho one\necho two\n")
    os.chmod(path, 0o751)

    async def body():
        async with flavor.connect(execd) as sb:
            return await sb.edit(str(path), "echo two", "echo 2")

    res = flavor.run(body)
    assert res.line == 3
    assert path.read_bytes() == b"#!/bin/sh\necho one\necho 2\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o751


@pytest.mark.parametrize("data,old,error,words", [
    (b"caf\xe9 = 1\n", "= 1", EditRefused, "not valid UTF-8"),
    (b"a\r\nb\nc\r\n", "b", EditRefused, "mixes line endings"),
    (b"a\rb\n", "b", EditRefused, "bare carriage return"),
    (b"a\nb\n", "zzz", EditNoMatch, "not found"),
    (b"x = 1\nx = 1\n", "x = 1", EditAmbiguous, "occurs 2 times"),
    (b"aaa\n", "aa", EditAmbiguous, "occurs 2 times"),  # overlapping matches count
    (b"a\n", "", EditRefused, "empty"),
])
def test_edit_refusals_write_nothing(flavor, execd, tmp_path, data, old, error, words) -> None:
    path = tmp_path / "f.txt"
    with pytest.raises(error) as e:
        _edit_case(flavor, execd, path, data, old, "NEW")
    assert words in str(e.value)
    if error is EditRefused and old:
        assert "use the shell" in str(e.value)
    assert path.read_bytes() == data  # nothing written


def test_edit_refuses_bare_cr_in_new_text(flavor, execd, tmp_path) -> None:
    path = tmp_path / "f.txt"
    with pytest.raises(EditRefused, match="bare carriage return"):
        _edit_case(flavor, execd, path, b"a\nb\n", "b", "c\rd")
    assert path.read_bytes() == b"a\nb\n"


def test_edit_of_a_missing_file(flavor, execd, tmp_path) -> None:
    async def body():
        async with flavor.connect(execd) as sb:
            await sb.edit(str(tmp_path / "nope.py"), "a", "b")

    with pytest.raises(FileNotFound):
        flavor.run(body)


def test_edit_conflict_when_the_file_changes_in_between(flavor, execd, tmp_path,
                                                        monkeypatch) -> None:
    """Another writer changes the file after the editor's read: execd's if_sha256 check
    refuses the write (409), EditConflict says so, the other writer's bytes stay."""
    path = tmp_path / "f.txt"
    path.write_bytes(b"value = 1\n")
    import sandman.client.editing as editing

    real = editing.plan_edit

    def racing(data, old, new, p):
        path.write_bytes(b"value = 1\n# someone else\n")  # lands between read and write
        return real(data, old, new, p)

    monkeypatch.setattr(editing, "plan_edit", racing)

    async def body():
        async with flavor.connect(execd) as sb:
            await sb.edit(str(path), "value = 1", "value = 2")

    with pytest.raises(EditConflict) as e:
        flavor.run(body)
    assert isinstance(e.value, WriteConflict) and "changed since it was read" in str(e.value)
    assert e.value.current_sha256 == hashlib.sha256(b"value = 1\n# someone else\n").hexdigest()
    assert path.read_bytes() == b"value = 1\n# someone else\n"


def test_plan_edit_keeps_every_other_byte() -> None:
    """Pure: over many positions, the bytes before and after the edit are the input's."""
    text = "".join(f"line {i} \u00e9\u4e2d\n" for i in range(200)).encode()
    for i in (0, 57, 199):
        old = f"line {i} "
        out, line = plan_edit(text, old, f"LINE {i} ", "p")
        k = text.index(old.encode())
        assert line == i + 1
        assert out[:k] == text[:k] and out[k + len(old):] == text[k + len(old):]

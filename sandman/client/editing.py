"""The byte-safe editor's I/O-free half: `sandbox.edit(path, old, new)` (docs/grading.md).

An edit must start from the exact bytes and change nothing but the edit (paper §3: trimmed
reads written back lost 655,315 lines; text-mode reads changed bytes outside the edit in all
892 sampled files). `plan_edit` takes the file's exact bytes and returns the new bytes, or
refuses a file it cannot write back unchanged outside the edit:

- not valid UTF-8 (the edit is given as text; a re-encoding could change other bytes);
- mixed line endings (both CRLF and a bare LF) or a bare CR (not followed by LF): which
  ending would the new text get?
- `old` found 0 times, or more than once (the agent must quote more context).

Decided and documented: a UTF-8 byte-order mark is kept as it is (the edit works on the text
after it; `old`/`new` may not contain U+FEFF). A CRLF-only file is edited in its own
convention: `old` and `new` are matched and written with CRLF whether the agent wrote "\\n"
or "\\r\\n". A file without any line ending takes `new` as given. Every refusal says to use
the shell instead.
"""

from __future__ import annotations

from typing import NamedTuple

from sandman.client.errors import SandmanError, WriteConflict

BOM = b"\xef\xbb\xbf"
USE_SHELL = "use the shell (e.g. python3 or sed) to change this file"


class EditError(SandmanError):
    """An edit was refused; nothing was written. `path` is the file."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


class EditRefused(EditError):
    """The file cannot be written back unchanged outside the edit (encoding, line endings)
    or `old`/`new` are not usable; use the shell."""


class EditNoMatch(EditError):
    """`old` does not occur in the file."""


class EditAmbiguous(EditError):
    """`old` occurs more than once; `count` times (overlaps counted)."""

    def __init__(self, message: str, *, path: str, count: int) -> None:
        super().__init__(message, path=path)
        self.count = count


class EditConflict(EditError, WriteConflict):
    """The file changed between the editor's read and its write (execd's 409 on
    `if_sha256`); nothing was written. Read it again and redo the edit."""

    def __init__(self, message: str, *, path: str, current_sha256: str | None) -> None:
        WriteConflict.__init__(self, message, current_sha256=current_sha256)
        self.path = path


class EditResult(NamedTuple):
    path: str
    line: int  # 1-based line where `old` started
    sha256_before: str
    sha256: str
    size: int


def _count(hay: bytes, needle: bytes) -> tuple[int, int]:
    """(0, 1 or 2 for "more than one", counting overlaps; index of the first)."""
    first = hay.find(needle)
    if first == -1:
        return 0, -1
    return (1 if hay.find(needle, first + 1) == -1 else 2), first


def _ending(body: bytes, path: str) -> bytes | None:
    """The file's one line ending (b"\\n", b"\\r\\n") or None for a file without any; refuses
    mixed endings and bare CR."""
    crlf = body.count(b"\r\n")
    cr = body.count(b"\r") - crlf
    lf = body.count(b"\n") - crlf
    if cr:
        raise EditRefused(f"edit {path}: refused, the file has a bare carriage return (CR "
                          f"not followed by LF); {USE_SHELL}", path=path)
    if crlf and lf:
        raise EditRefused(f"edit {path}: refused, the file mixes line endings ({crlf} CRLF, "
                          f"{lf} LF); {USE_SHELL}", path=path)
    return b"\r\n" if crlf else (b"\n" if lf else None)


def _as_file_text(text: str, what: str, ending: bytes | None, path: str) -> bytes:
    if "\ufeff" in text:
        raise EditRefused(f"edit {path}: refused, `{what}` contains a byte-order mark "
                          f"(U+FEFF); {USE_SHELL}", path=path)
    norm = text.replace("\r\n", "\n")
    if "\r" in norm:
        raise EditRefused(f"edit {path}: refused, `{what}` has a bare carriage return; "
                          f"{USE_SHELL}", path=path)
    raw = norm.encode("utf-8", "surrogatepass")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raise EditRefused(f"edit {path}: refused, `{what}` is not valid Unicode text "
                          f"(lone surrogate); {USE_SHELL}", path=path) from None
    if ending == b"\r\n":
        raw = raw.replace(b"\n", b"\r\n")
    return raw


def plan_edit(data: bytes, old: str, new: str, path: str) -> tuple[bytes, int]:
    """(new file bytes, 1-based line of the edit). Bytes outside the edit are kept exactly."""
    if not isinstance(old, str) or not isinstance(new, str):
        raise EditRefused(f"edit {path}: `old` and `new` must be str", path=path)
    if not old:
        raise EditRefused(f"edit {path}: `old` is empty; quote the text to replace", path=path)
    bom = BOM if data.startswith(BOM) else b""
    body = data[len(bom):]
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EditRefused(f"edit {path}: refused, the file is not valid UTF-8 (byte "
                          f"0x{body[e.start]:02x} at offset {e.start + len(bom)}); "
                          f"{USE_SHELL}", path=path) from None
    ending = _ending(body, path)
    if ending is None:  # no line ending yet: take the agent's, if it is one kind
        ending = b"\r\n" if "\r\n" in old + new else None
    raw_old = _as_file_text(old, "old", ending, path)
    raw_new = _as_file_text(new, "new", ending, path)
    n, i = _count(body, raw_old)
    if n == 0:
        raise EditNoMatch(f"edit {path}: `old` not found in the file (it must match the "
                          f"file's text exactly, whitespace included)", path=path)
    if n > 1:
        total, k = 0, i
        while k != -1:
            total, k = total + 1, body.find(raw_old, k + 1)
        raise EditAmbiguous(f"edit {path}: `old` occurs {total} times; include more "
                            f"surrounding lines so that it occurs exactly once", path=path,
                            count=total)
    line = body.count(b"\n", 0, i) + 1
    return bom + body[:i] + raw_new + body[i + len(raw_old):], line

"""The text editor tool: view, create, str_replace, insert, undo_edit.

It runs inside the sandbox as the sandbox's uid, so a path can reach only what
the sandbox itself can see: there is nothing to escape to. Relative paths are
taken from the workspace. Every command answers with a structured result that
each HTTP dialect renders its own way (Anthropic's typed result blocks, or the
protocol's plain stdout), plus the plain text rendering.
"""

from __future__ import annotations

import base64
import errno
import os
import secrets
import stat

WORKSPACE = "/home/agent/workspace"
# A view answers in one channel frame (4 MiB), with its text twice (numbered, and
# as content): larger files are viewed a range at a time.
MAX_VIEW_BYTES = 1024 * 1024
_IMAGE_SUFFIXES = {".png": "image", ".jpg": "image", ".jpeg": "image", ".gif": "image",
                   ".webp": "image", ".pdf": "pdf"}


class EditorError(Exception):
    def __init__(self, message: str, code: str = "invalid_tool_input") -> None:
        super().__init__(message)
        self.code = code


class TextEditor:
    def __init__(self) -> None:
        # Previous contents per path, newest last; None means "did not exist".
        self._history: dict[str, list[str | None]] = {}

    def run(self, request: dict) -> dict:
        command = request.get("command")
        handler = {
            "view": self._view,
            "create": self._create,
            "str_replace": self._str_replace,
            "insert": self._insert,
            "undo_edit": self._undo_edit,
        }.get(command)
        try:
            if handler is None:
                raise EditorError(f"Unknown command {command!r}: expected one of "
                                  "view, create, str_replace, insert, undo_edit.")
            path = _resolve(request.get("path"))
            return handler(path, request)
        except EditorError as exc:
            return _failure(str(exc), exc.code)
        except PermissionError:
            return _failure(f"Permission denied: {request.get('path')}", "invalid_tool_input")
        except IsADirectoryError:
            return _failure(f"{request.get('path')} is a directory.", "invalid_tool_input")
        except OSError as exc:
            return _failure(f"{request.get('path')}: {exc.strerror or exc}", "unavailable")

    # -- commands ------------------------------------------------------------
    def _view(self, path: str, request: dict) -> dict:
        if os.path.isdir(path):
            return self._view_directory(path)
        view_range = request.get("view_range")
        kind = _IMAGE_SUFFIXES.get(os.path.splitext(path)[1].lower())
        if kind is not None:
            if view_range is not None:
                raise EditorError("view_range is only supported for text files.")
            data = _read_bytes(path)
            return _success(f"[{kind} file {os.path.basename(path)}, {len(data)} bytes]",
                            {"kind": "view", "file_type": kind,
                             "content": base64.b64encode(data).decode(),
                             "num_lines": None, "start_line": None, "total_lines": None})
        lines = _read_text(path).split("\n")
        total = len(lines)
        start, end = 1, total
        if view_range is not None:
            start, end = _check_range(view_range, total)
        shown = lines[start - 1:end]
        numbered = "\n".join(f"{number:6}\t{line}" for number, line in enumerate(shown, start))
        return _success(numbered, {"kind": "view", "file_type": "text",
                                   "content": "\n".join(shown), "num_lines": len(shown),
                                   "start_line": start, "total_lines": total})

    @staticmethod
    def _view_directory(path: str) -> dict:
        entries = []
        for root, dirs, files in os.walk(path):
            depth = root[len(path):].count(os.sep)
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(files):
                if not name.startswith("."):
                    entries.append(os.path.join(root, name))
            entries.extend(os.path.join(root, d) + "/" for d in dirs)
            if depth >= 1:
                dirs[:] = []
        listing = "\n".join(sorted(entries))
        text = (f"Here are the files and directories up to 2 levels deep in {path}, "
                f"excluding hidden items:\n{listing}")
        return _success(text, {"kind": "view", "file_type": "directory", "content": listing,
                               "num_lines": len(entries), "start_line": 1,
                               "total_lines": len(entries)})

    def _create(self, path: str, request: dict) -> dict:
        text = _required_str(request, "file_text")
        existed = os.path.isfile(path)
        previous = _read_text(path) if existed else None
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        _write_text(path, text)
        self._history.setdefault(path, []).append(previous)
        verb = "overwritten" if existed else "created"
        return _success(f"File {verb} successfully at: {path}",
                        {"kind": "create", "is_file_update": existed})

    def _str_replace(self, path: str, request: dict) -> dict:
        old = _required_str(request, "old_str")
        new = request.get("new_str")
        if new is None:
            new = ""
        if not isinstance(new, str):
            raise EditorError("new_str must be a string.")
        content = _read_existing_text(path)
        count = content.count(old) if old else 0
        if not old:
            raise EditorError("old_str must not be empty.")
        if count == 0:
            raise EditorError(f"No replacement was performed, old_str `{old}` did not appear "
                              f"verbatim in {path}.")
        if count > 1:
            starts = [i for i in range(len(content)) if content.startswith(old, i)]
            line_numbers = sorted({content.count("\n", 0, s) + 1 for s in starts})
            raise EditorError(f"No replacement was performed. Multiple occurrences of old_str "
                              f"`{old}` in lines {line_numbers}. Please ensure it is unique.")
        at = content.index(old)
        updated = content[:at] + new + content[at + len(old):]
        _write_text(path, updated)
        self._history.setdefault(path, []).append(content)
        start_line = content.count("\n", 0, at) + 1
        # The diff shows whole lines, as the change leaves them: from the start of
        # the line the old string starts on to the end of the line it ends on.
        line_start = content.rfind("\n", 0, at) + 1
        old_end = content.find("\n", at + len(old))
        old_lines = content[line_start:len(content) if old_end < 0 else old_end].split("\n")
        new_end = updated.find("\n", at + len(new))
        new_lines = updated[line_start:len(updated) if new_end < 0 else new_end].split("\n")
        diff = [f"-{line}" for line in old_lines] + [f"+{line}" for line in new_lines]
        return _success(
            f"The file {path} has been edited.\n{_snippet(updated, start_line, len(new_lines))}",
            {"kind": "str_replace", "old_start": start_line, "old_lines": len(old_lines),
             "new_start": start_line, "new_lines": len(new_lines), "lines": diff})

    def _insert(self, path: str, request: dict) -> dict:
        text = request.get("new_str")
        if text is None:
            text = request.get("insert_text")
        if not isinstance(text, str):
            raise EditorError("insert needs `new_str` (or `insert_text`) as a string.")
        line = request.get("insert_line")
        if not isinstance(line, int) or isinstance(line, bool):
            raise EditorError("insert needs `insert_line` as an integer.")
        content = _read_existing_text(path)
        lines = content.split("\n")
        if not 0 <= line <= len(lines):
            raise EditorError(f"Invalid `insert_line` parameter: {line}. It should be within "
                              f"the range of lines of the file: [0, {len(lines)}].")
        inserted = text.split("\n")
        updated = "\n".join(lines[:line] + inserted + lines[line:])
        _write_text(path, updated)
        self._history.setdefault(path, []).append(content)
        diff = [f"+{entry}" for entry in inserted]
        return _success(
            f"The file {path} has been edited.\n{_snippet(updated, line + 1, len(inserted))}",
            {"kind": "insert", "old_start": line + 1, "old_lines": 0, "new_start": line + 1,
             "new_lines": len(inserted), "lines": diff})

    def _undo_edit(self, path: str, request: dict) -> dict:
        history = self._history.get(path)
        if not history:
            raise EditorError(f"No edit history found for {path}.")
        previous = history.pop()
        if previous is None:
            os.unlink(path)
            return _success(f"Undid the creation of {path}; the file is removed.",
                            {"kind": "undo_edit", "removed": True})
        _write_text(path, previous)
        return _success(f"Last edit to {path} undone successfully.\n"
                        f"{_snippet(previous, 1, previous.count(chr(10)) + 1)}",
                        {"kind": "undo_edit", "removed": False})


# -- helpers -----------------------------------------------------------------
def _resolve(path: object) -> str:
    if not isinstance(path, str) or not path:
        raise EditorError("`path` is required and must be a non-empty string.")
    if "\x00" in path:
        raise EditorError("`path` must not contain NUL bytes.")
    return os.path.normpath(os.path.join(WORKSPACE, path))


def _required_str(request: dict, field: str) -> str:
    value = request.get(field)
    if not isinstance(value, str):
        raise EditorError(f"`{field}` is required and must be a string.")
    return value


def _read_bytes(path: str) -> bytes:
    # Links are followed: the editor sees only what the sandbox may see, and a
    # link inside the workspace is a file the code means. What is opened must
    # be a regular file, though: a FIFO or a device would block the open or
    # never end the read, and the agent would hang with the interpreter in it.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise EditorError(f"The path {path} does not exist.", "file_not_found") from None
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a socket, or a device with no driver
            raise _not_regular(path) from None
        raise
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        if not stat.S_ISREG(info.st_mode):
            raise _not_regular(path)
        if info.st_size > MAX_VIEW_BYTES:
            raise EditorError(f"{path} is larger than {MAX_VIEW_BYTES} bytes; view it with bash "
                              "(head, sed -n, grep) instead.", "invalid_tool_input")
        os.set_blocking(fd, True)
        return handle.read()


def _not_regular(path: str) -> EditorError:
    return EditorError(f"{path} is not a regular file (a FIFO, socket or device); "
                       "the editor only reads and writes regular files.")


def _read_text(path: str) -> str:
    data = _read_bytes(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise EditorError(f"{path} is not a UTF-8 text file.") from None


def _read_existing_text(path: str) -> str:
    if os.path.isdir(path):
        raise EditorError(f"{path} is a directory, not a file.")
    return _read_text(path)


def _write_text(path: str, text: str) -> None:
    """Replace the file's content all at once, or not at all.

    The new text goes to a temporary file beside the target, which is renamed
    over it only once every byte is written: a full disk (or anything else that
    stops the write) leaves the original as it was, where truncating first lost
    it. A link is followed to the file it names, which is what is replaced, so
    the link stays a link. The rename gives the path a new inode: other hard
    links to the old one keep the old text, and the file becomes the sandbox
    user's own. We accept both: rewriting the inode in place is what loses the
    file on a full disk, and in the sandbox every file the code can write is
    its own already (the host's files are read-only to it).
    """
    target = os.path.realpath(path)
    try:
        info = os.stat(target)
    except FileNotFoundError:
        info = None
    if info is not None:
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        if not stat.S_ISREG(info.st_mode):
            raise _not_regular(path)
    # A hidden name, so a directory view never lists one left by a killed agent.
    temporary = os.path.join(os.path.dirname(target), f".shoal-edit-{secrets.token_hex(8)}")
    # 0o666 lets the umask decide a new file's mode, as open(path, "w") did.
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            if info is not None:
                os.fchmod(fd, stat.S_IMODE(info.st_mode))
            handle.write(text)
            handle.flush()
            # A filesystem may report a full disk only when the data is flushed;
            # it must be reported before the rename, while the original is whole.
            os.fsync(fd)
        os.rename(temporary, target)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


def _check_range(view_range: object, total: int) -> tuple[int, int]:
    if (not isinstance(view_range, list) or len(view_range) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in view_range)):
        raise EditorError("`view_range` must be a list of two integers.")
    start, end = view_range
    if not 1 <= start <= total:
        raise EditorError(f"Invalid `view_range` {view_range}: the first element {start} "
                          f"should be within the range of lines of the file: [1, {total}].")
    if end == -1:
        return start, total
    if end < start:
        raise EditorError(f"Invalid `view_range` {view_range}: the second element {end} "
                          f"should be larger or equal than the first element {start}.")
    if end > total:
        raise EditorError(f"Invalid `view_range` {view_range}: the second element {end} "
                          f"should be smaller than the number of lines in the file: {total}.")
    return start, end


def _snippet(content: str, first_line: int, count: int, context: int = 4) -> str:
    lines = content.split("\n")
    start = max(1, first_line - context)
    end = min(len(lines), first_line + count - 1 + context)
    return "\n".join(f"{n:6}\t{lines[n - 1]}" for n in range(start, end + 1))


def _success(text: str, structured: dict) -> dict:
    return {"return_code": 0, "stdout": text, "stderr": "", "editor": structured}


def _failure(message: str, code: str) -> dict:
    return {"return_code": 1, "stdout": "", "stderr": message,
            "editor": {"kind": "error", "error_code": code, "error_message": message}}

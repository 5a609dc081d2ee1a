"""The text editor tool of a real sandbox: five commands and every way to misuse them.

Requests use Anthropic's field names. A failed edit answers ``return_code`` 1, the
message in stderr and a structured ``editor`` dict of kind ``error``.
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import pytest

WORKSPACE = "/home/agent/workspace"
OUTPUTS = "/mnt/user-data/outputs"


async def edit(sandbox, **request):
    return await sandbox.edit(request)


async def edit_ok(sandbox, **request):
    result = await sandbox.edit(request)
    assert result.return_code == 0, result.stderr
    assert result.editor is not None and result.editor["kind"] != "error", result.editor
    return result


async def read(sandbox, path: str) -> str:
    result = await sandbox.run_python(f"print(open({path!r}).read(), end='')")
    assert result.return_code == 0, result.stderr
    return result.stdout


async def exists(sandbox, path: str) -> bool:
    result = await sandbox.run_python(f"import os; print(os.path.exists({path!r}))")
    return result.stdout == "True\n"


def assert_error(result, *fragments: str, code: str | None = None) -> None:
    assert result.return_code == 1, result
    assert result.editor is not None and result.editor["kind"] == "error", result.editor
    assert result.stderr, "an error must say what went wrong"
    assert result.editor["error_message"] == result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, (fragment, result.stderr)
    if code is not None:
        assert result.editor["error_code"] == code


FOUR_LINES = "one\ntwo\nthree\nfour"


@pytest.fixture
async def four(sandbox):
    """A four-line file (no trailing newline) in the workspace."""
    await edit_ok(sandbox, command="create", path="four.txt", file_text=FOUR_LINES)
    return sandbox


# -- view ----------------------------------------------------------------------------------
async def test_view_file(four):
    result = await edit_ok(four, command="view", path="four.txt")
    assert result.stdout == "     1\tone\n     2\ttwo\n     3\tthree\n     4\tfour"
    assert result.stderr == ""
    assert result.editor == {"kind": "view", "file_type": "text", "content": FOUR_LINES,
                             "num_lines": 4, "start_line": 1, "total_lines": 4}


async def test_view_absolute_path(four):
    result = await edit_ok(four, command="view", path=f"{WORKSPACE}/four.txt")
    assert result.editor["content"] == FOUR_LINES


async def test_view_range(four):
    result = await edit_ok(four, command="view", path="four.txt", view_range=[2, 3])
    assert result.stdout == "     2\ttwo\n     3\tthree"
    assert result.editor["content"] == "two\nthree"
    assert result.editor["num_lines"] == 2
    assert result.editor["start_line"] == 2
    assert result.editor["total_lines"] == 4


async def test_view_range_to_the_end(four):
    result = await edit_ok(four, command="view", path="four.txt", view_range=[2, -1])
    assert result.stdout == "     2\ttwo\n     3\tthree\n     4\tfour"
    assert result.editor["num_lines"] == 3
    assert result.editor["start_line"] == 2
    assert result.editor["total_lines"] == 4


async def test_view_range_single_line(four):
    result = await edit_ok(four, command="view", path="four.txt", view_range=[4, 4])
    assert result.stdout == "     4\tfour"


@pytest.mark.parametrize("view_range, fragment", [
    ([0, 2], "first element 0"),
    ([5, 5], "first element 5"),
    ([3, 2], "second element 2"),
    ([1, 99], "second element 99"),
    ([1], "list of two integers"),
    ([1, 2, 3], "list of two integers"),
    ("1,2", "list of two integers"),
    ([1.0, 2], "list of two integers"),
    (["1", "2"], "list of two integers"),
    ([True, 2], "list of two integers"),
])
async def test_invalid_view_range(four, view_range, fragment):
    result = await edit(four, command="view", path="four.txt", view_range=view_range)
    assert_error(result, "view_range", fragment)


async def test_view_directory_two_levels_without_hidden(sandbox):
    await sandbox.run_bash("mkdir -p proj/sub/deeper proj/.hiddendir && touch proj/a.txt "
                           "proj/.hidden proj/sub/b.txt proj/sub/.secret proj/sub/deeper/c.txt "
                           "proj/.hiddendir/x.txt")
    result = await edit_ok(sandbox, command="view", path="proj")
    assert result.editor["file_type"] == "directory"
    listed = result.editor["content"].splitlines()
    root = f"{WORKSPACE}/proj"
    assert set(listed) == {f"{root}/a.txt", f"{root}/sub/", f"{root}/sub/b.txt",
                           f"{root}/sub/deeper/"}
    assert ".hidden" not in result.stdout and ".secret" not in result.stdout
    assert "c.txt" not in result.stdout
    assert f"{root}/sub/b.txt" in result.stdout


async def test_view_workspace_root(sandbox):
    await sandbox.run_bash("touch top.txt")
    result = await edit_ok(sandbox, command="view", path=WORKSPACE)
    assert f"{WORKSPACE}/top.txt" in result.stdout


async def test_view_missing_file(sandbox):
    result = await edit(sandbox, command="view", path="nope.txt")
    assert_error(result, "nope.txt", code="file_not_found")


async def test_view_binary_file_is_an_error(sandbox):
    await sandbox.run_bash("printf '\\xff\\xfe\\x00' > blob.bin")
    result = await edit(sandbox, command="view", path="blob.bin")
    assert_error(result, "UTF-8")


async def test_view_image(sandbox):
    await sandbox.run_python("import matplotlib.pyplot as plt\nplt.plot([1, 2])\n"
                             "plt.savefig('plot.png')\nplt.close('all')")
    result = await edit_ok(sandbox, command="view", path="plot.png")
    assert result.editor["file_type"] == "image"
    assert base64.b64decode(result.editor["content"]).startswith(b"\x89PNG\r\n\x1a\n")


# -- create --------------------------------------------------------------------------------
async def test_create_new_file(sandbox):
    result = await edit_ok(sandbox, command="create", path="new.py", file_text="print('hi')\n")
    assert result.editor == {"kind": "create", "is_file_update": False}
    assert "new.py" in result.stdout
    assert await read(sandbox, "new.py") == "print('hi')\n"
    run = await sandbox.run_python("exec(open('new.py').read())")
    assert run.stdout == "hi\n"


async def test_create_overwrites(sandbox):
    await edit_ok(sandbox, command="create", path="f.txt", file_text="old")
    result = await edit_ok(sandbox, command="create", path="f.txt", file_text="new")
    assert result.editor == {"kind": "create", "is_file_update": True}
    assert await read(sandbox, "f.txt") == "new"


async def test_create_makes_parent_directories(sandbox):
    await edit_ok(sandbox, command="create", path="a/b/c/deep.txt", file_text="deep")
    assert await read(sandbox, f"{WORKSPACE}/a/b/c/deep.txt") == "deep"


async def test_create_empty_file(sandbox):
    await edit_ok(sandbox, command="create", path="empty.txt", file_text="")
    assert await exists(sandbox, "empty.txt")
    assert await read(sandbox, "empty.txt") == ""


async def test_create_keeps_content_verbatim(sandbox):
    text = "tabs\tand \r\n crlf and unicode é ✓\n\n"
    await edit_ok(sandbox, command="create", path="verbatim.txt", file_text=text)
    result = await sandbox.run_python("print(repr(open('verbatim.txt', newline='').read()))")
    assert result.stdout == repr(text) + "\n"


async def test_create_without_file_text(sandbox):
    result = await edit(sandbox, command="create", path="x.txt")
    assert_error(result, "file_text")
    assert not await exists(sandbox, "x.txt")


async def test_create_over_a_directory(sandbox):
    await sandbox.run_bash("mkdir -p somedir")
    result = await edit(sandbox, command="create", path="somedir", file_text="x")
    assert_error(result, "directory")


async def test_create_in_outputs_is_a_produced_file(sandbox):
    result = await edit_ok(sandbox, command="create", path=f"{OUTPUTS}/x.txt", file_text="12345")
    assert [(f.path, f.size) for f in result.files] == [(f"{OUTPUTS}/x.txt", 5)]
    assert await read(sandbox, f"{OUTPUTS}/x.txt") == "12345"
    viewed = await edit_ok(sandbox, command="view", path=f"{OUTPUTS}/x.txt")
    assert viewed.editor["content"] == "12345"


async def test_uploads_are_read_only(sandbox):
    result = await edit(sandbox, command="create", path="/mnt/user-data/uploads/x.txt",
                        file_text="nope")
    assert_error(result, "Read-only file system")
    assert not await exists(sandbox, "/mnt/user-data/uploads/x.txt")
    assert not (sandbox.home.uploads / "x.txt").exists()


# -- str_replace ---------------------------------------------------------------------------
async def test_str_replace_one_match(sandbox):
    await edit_ok(sandbox, command="create", path="s.txt", file_text="alpha\nbeta\ngamma\ndelta")
    result = await edit_ok(sandbox, command="str_replace", path="s.txt",
                           old_str="beta", new_str="BETA\nBETA2")
    assert await read(sandbox, "s.txt") == "alpha\nBETA\nBETA2\ngamma\ndelta"
    assert result.editor == {"kind": "str_replace", "old_start": 2, "old_lines": 1,
                             "new_start": 2, "new_lines": 2,
                             "lines": ["-beta", "+BETA", "+BETA2"]}
    assert "has been edited" in result.stdout
    assert "     2\tBETA" in result.stdout


async def test_str_replace_multiline_old_str(sandbox):
    await edit_ok(sandbox, command="create", path="m.txt", file_text="a\nb\nc\nd\ne")
    result = await edit_ok(sandbox, command="str_replace", path="m.txt",
                           old_str="c\nd", new_str="X")
    assert await read(sandbox, "m.txt") == "a\nb\nX\ne"
    assert result.editor["old_start"] == 3
    assert result.editor["old_lines"] == 2
    assert result.editor["new_lines"] == 1
    assert result.editor["lines"] == ["-c", "-d", "+X"]


async def test_str_replace_no_match(sandbox):
    await edit_ok(sandbox, command="create", path="s.txt", file_text="alpha\nbeta")
    result = await edit(sandbox, command="str_replace", path="s.txt",
                        old_str="zeta", new_str="x")
    assert_error(result, "zeta", "did not appear")
    assert await read(sandbox, "s.txt") == "alpha\nbeta"


async def test_str_replace_multiple_matches(sandbox):
    await edit_ok(sandbox, command="create", path="s.txt", file_text="x = 1\ny = 2\nx = 1\n")
    result = await edit(sandbox, command="str_replace", path="s.txt",
                        old_str="x = 1", new_str="x = 3")
    assert_error(result, "Multiple occurrences", "[1, 3]")
    assert await read(sandbox, "s.txt") == "x = 1\ny = 2\nx = 1\n"


async def test_str_replace_missing_old_str(sandbox):
    await edit_ok(sandbox, command="create", path="s.txt", file_text="alpha")
    result = await edit(sandbox, command="str_replace", path="s.txt", new_str="x")
    assert_error(result, "old_str")


async def test_str_replace_empty_old_str(sandbox):
    await edit_ok(sandbox, command="create", path="s.txt", file_text="alpha")
    result = await edit(sandbox, command="str_replace", path="s.txt", old_str="", new_str="x")
    assert_error(result, "old_str")
    assert await read(sandbox, "s.txt") == "alpha"


async def test_str_replace_without_new_str_deletes(sandbox):
    await edit_ok(sandbox, command="create", path="s.txt", file_text="keep DELETE ME keep")
    result = await edit_ok(sandbox, command="str_replace", path="s.txt", old_str=" DELETE ME")
    assert await read(sandbox, "s.txt") == "keep keep"
    # Whole lines, as Anthropic's diff shows them.
    assert result.editor["lines"] == ["-keep DELETE ME keep", "+keep keep"]


async def test_str_replace_non_string_new_str(sandbox):
    await edit_ok(sandbox, command="create", path="s.txt", file_text="alpha")
    result = await edit(sandbox, command="str_replace", path="s.txt", old_str="alpha", new_str=5)
    assert_error(result, "new_str")
    assert await read(sandbox, "s.txt") == "alpha"


async def test_str_replace_missing_file(sandbox):
    result = await edit(sandbox, command="str_replace", path="ghost.txt", old_str="a", new_str="b")
    assert_error(result, "ghost.txt", code="file_not_found")


async def test_str_replace_on_a_directory(sandbox):
    await sandbox.run_bash("mkdir -p adir")
    result = await edit(sandbox, command="str_replace", path="adir", old_str="a", new_str="b")
    assert_error(result, "directory")


# -- insert --------------------------------------------------------------------------------
@pytest.mark.parametrize("line, expected", [
    (0, "NEW\none\ntwo\nthree\nfour"),
    (2, "one\ntwo\nNEW\nthree\nfour"),
    (4, "one\ntwo\nthree\nfour\nNEW"),
])
async def test_insert(four, line, expected):
    result = await edit_ok(four, command="insert", path="four.txt", insert_line=line, new_str="NEW")
    assert await read(four, "four.txt") == expected
    assert result.editor == {"kind": "insert", "old_start": line + 1, "old_lines": 0,
                             "new_start": line + 1, "new_lines": 1, "lines": ["+NEW"]}
    assert "     " + str(line + 1) + "\tNEW" in result.stdout


async def test_insert_several_lines_with_insert_text(four):
    result = await edit_ok(four, command="insert", path="four.txt", insert_line=1,
                           insert_text="A\nB")
    assert await read(four, "four.txt") == "one\nA\nB\ntwo\nthree\nfour"
    assert result.editor["new_lines"] == 2
    assert result.editor["lines"] == ["+A", "+B"]


async def test_insert_at_the_end_of_a_file_with_trailing_newline(sandbox):
    await edit_ok(sandbox, command="create", path="t.txt", file_text="a\nb\n")
    await edit_ok(sandbox, command="insert", path="t.txt", insert_line=2, new_str="c")
    assert await read(sandbox, "t.txt") == "a\nb\nc\n"


@pytest.mark.parametrize("line", [5, -1, 100])
async def test_insert_out_of_range(four, line):
    result = await edit(four, command="insert", path="four.txt", insert_line=line, new_str="X")
    assert_error(result, "insert_line", str(line), "[0, 4]")
    assert await read(four, "four.txt") == FOUR_LINES


@pytest.mark.parametrize("request_fields, fragment", [
    ({"new_str": "X"}, "insert_line"),
    ({"new_str": "X", "insert_line": "2"}, "insert_line"),
    ({"new_str": "X", "insert_line": 1.5}, "insert_line"),
    ({"new_str": "X", "insert_line": True}, "insert_line"),
    ({"insert_line": 1}, "new_str"),
    ({"insert_line": 1, "new_str": 7}, "new_str"),
])
async def test_insert_bad_input(four, request_fields, fragment):
    result = await four.edit({"command": "insert", "path": "four.txt", **request_fields})
    assert_error(result, fragment)
    assert await read(four, "four.txt") == FOUR_LINES


async def test_insert_missing_file(sandbox):
    result = await edit(sandbox, command="insert", path="ghost.txt", insert_line=0, new_str="x")
    assert_error(result, code="file_not_found")


# -- undo_edit -----------------------------------------------------------------------------
async def test_undo_after_str_replace(four):
    await edit_ok(four, command="str_replace", path="four.txt", old_str="two", new_str="2")
    result = await edit_ok(four, command="undo_edit", path="four.txt")
    assert result.editor == {"kind": "undo_edit", "removed": False}
    assert await read(four, "four.txt") == FOUR_LINES


async def test_undo_after_insert(four):
    await edit_ok(four, command="insert", path="four.txt", insert_line=0, new_str="top")
    await edit_ok(four, command="undo_edit", path="four.txt")
    assert await read(four, "four.txt") == FOUR_LINES


async def test_undo_after_creating_a_new_file_removes_it(sandbox):
    await edit_ok(sandbox, command="create", path="fresh.txt", file_text="x")
    result = await edit_ok(sandbox, command="undo_edit", path="fresh.txt")
    assert result.editor == {"kind": "undo_edit", "removed": True}
    assert not await exists(sandbox, "fresh.txt")


async def test_undo_after_overwriting_create(sandbox):
    await edit_ok(sandbox, command="create", path="o.txt", file_text="original")
    await edit_ok(sandbox, command="create", path="o.txt", file_text="replacement")
    await edit_ok(sandbox, command="undo_edit", path="o.txt")
    assert await read(sandbox, "o.txt") == "original"


async def test_undo_steps_back_through_history(four):
    await edit_ok(four, command="str_replace", path="four.txt", old_str="one", new_str="1")
    await edit_ok(four, command="str_replace", path="four.txt", old_str="two", new_str="2")
    await edit_ok(four, command="undo_edit", path="four.txt")
    assert await read(four, "four.txt") == "1\ntwo\nthree\nfour"
    await edit_ok(four, command="undo_edit", path="four.txt")
    assert await read(four, "four.txt") == FOUR_LINES
    # The create of the fixture is the last step: undoing it removes the file.
    await edit_ok(four, command="undo_edit", path="four.txt")
    assert not await exists(four, "four.txt")
    assert_error(await edit(four, command="undo_edit", path="four.txt"), "No edit history")


async def test_undo_with_no_history(sandbox):
    await sandbox.run_bash("echo untouched > u.txt")
    result = await edit(sandbox, command="undo_edit", path="u.txt")
    assert_error(result, "No edit history")
    assert await read(sandbox, "u.txt") == "untouched\n"


async def test_undo_history_is_per_path(four):
    await edit_ok(four, command="create", path="other.txt", file_text="other")
    await edit_ok(four, command="str_replace", path="four.txt", old_str="one", new_str="1")
    await edit_ok(four, command="undo_edit", path="other.txt")
    assert not await exists(four, "other.txt")
    assert await read(four, "four.txt") == "1\ntwo\nthree\nfour"


async def test_undo_relative_and_absolute_paths_are_the_same_file(four):
    await edit_ok(four, command="str_replace", path="four.txt", old_str="one", new_str="1")
    await edit_ok(four, command="undo_edit", path=f"{WORKSPACE}/four.txt")
    assert await read(four, "four.txt") == FOUR_LINES


# -- malformed requests ----------------------------------------------------------------------
@pytest.mark.parametrize("command", ["delete", "", None, "VIEW", "undo"])
async def test_unknown_command(sandbox, command):
    result = await sandbox.edit({"command": command, "path": "x.txt"})
    assert_error(result, "command")


async def test_missing_command(sandbox):
    result = await sandbox.edit({"path": "x.txt"})
    assert_error(result, "command")


@pytest.mark.parametrize("path", [None, "", 5, ["x.txt"]])
async def test_missing_or_invalid_path(sandbox, path):
    request = {"command": "create", "file_text": "x"}
    if path is not None:
        request["path"] = path
    result = await sandbox.edit(request)
    assert_error(result, "path")


async def test_path_with_nul_byte(sandbox):
    result = await edit(sandbox, command="create", path="a\x00b.txt", file_text="x")
    assert_error(result, "path")


# -- files that are not regular files -------------------------------------------------------------
# Each request would block the agent in open() (a FIFO with no writer, or no
# reader) or never end its read (/dev/zero): the call timed out and the restart
# that followed took the interpreter's variables with it.
NOT_REGULAR_REQUESTS = {
    "view": {"command": "view"},
    "view_range": {"command": "view", "view_range": [1, 2]},
    "create": {"command": "create", "file_text": "x"},
    "str_replace": {"command": "str_replace", "old_str": "a", "new_str": "b"},
    "insert": {"command": "insert", "insert_line": 0, "new_str": "x"},
}


@pytest.mark.parametrize("path", ["fifo", "/dev/zero", "link-to-fifo"])
@pytest.mark.parametrize("request_name", NOT_REGULAR_REQUESTS)
async def test_a_fifo_or_device_is_refused_at_once(sandbox, path, request_name):
    await sandbox.run_python("secret_state = 42")
    await sandbox.run_bash("mkfifo fifo && ln -s fifo link-to-fifo")
    result = await sandbox.edit({**NOT_REGULAR_REQUESTS[request_name], "path": path}, timeout=3)
    assert not result.timed_out and not result.restarted, result
    assert_error(result, "not a regular file", code="invalid_tool_input")
    assert (await sandbox.run_python("print(secret_state)")).stdout == "42\n"
    # The FIFO is still a FIFO: nothing was written in its place.
    assert (await sandbox.run_bash("test -p fifo && echo fifo")).stdout == "fifo\n"


async def test_undo_never_writes_into_a_fifo_left_at_the_path(sandbox):
    await edit_ok(sandbox, command="create", path="f.txt", file_text="one")
    await edit_ok(sandbox, command="create", path="f.txt", file_text="two")
    await sandbox.run_bash("rm f.txt && mkfifo f.txt")
    result = await sandbox.edit({"command": "undo_edit", "path": "f.txt"}, timeout=3)
    assert not result.timed_out and not result.restarted, result
    assert_error(result, "not a regular file")


# -- nothing outside the sandbox is reachable ---------------------------------------------------
def _files_holding(root: Path, needle: bytes) -> list[str]:
    """Files under ``root`` (a sandbox's host directories) whose content holds ``needle``."""
    return [str(path) for path in root.rglob("*")
            if path.is_file() and not path.is_symlink() and needle in path.read_bytes()]


# Each path leaves the workspace for a place that is read-only inside the sandbox
# (the synthetic /etc, /usr, the read-only root); where it resolves to there.
@pytest.mark.parametrize("path, resolved", [
    ("../../etc/passwd", "/home/etc/passwd"), ("../../../etc/passwd", "/etc/passwd"),
    ("../../../../../../etc/passwd", "/etc/passwd"), ("/etc/passwd", "/etc/passwd"),
    ("/usr/bin/python3-owned.txt", "/usr/bin/python3-owned.txt"),
    ("../../../root/owned.txt", "/root/owned.txt"),
])
async def test_escaping_paths_cannot_touch_the_host(sandbox, path, resolved):
    host_passwd = Path("/etc/passwd")
    before = hashlib.sha256(host_passwd.read_bytes()).hexdigest()
    inside_before = await read(sandbox, "/etc/passwd")
    create = await edit(sandbox, command="create", path=path, file_text="owned::0:0::/:/bin/sh\n")
    replace = await edit(sandbox, command="str_replace", path=path, old_str="agent:x:",
                         new_str="owned::0:0")
    insert = await edit(sandbox, command="insert", path=path, insert_line=0, new_str="owned::0:0")
    assert hashlib.sha256(host_passwd.read_bytes()).hexdigest() == before
    assert not Path("/root/owned.txt").exists()
    assert not Path("/usr/bin/python3-owned.txt").exists()
    # Every edit was refused (the targets are read-only inside the sandbox too) ...
    for result in (create, replace, insert):
        assert_error(result)
    assert "Read-only file system" in create.stderr, create.stderr
    # ... and the write landed nowhere: not at the path it named inside the sandbox,
    # not anywhere in the sandbox's own writable space on the host.
    if resolved == "/etc/passwd":
        assert await read(sandbox, resolved) == inside_before
    else:
        assert not await exists(sandbox, resolved)
    assert _files_holding(sandbox.home.root, b"owned::0:0") == []


async def test_view_of_etc_passwd_is_the_synthetic_one(sandbox):
    result = await edit_ok(sandbox, command="view", path="../../../etc/passwd")
    assert "agent:x:" in result.editor["content"]
    host = Path("/etc/passwd").read_text()
    assert result.editor["content"] != host


async def test_symlink_out_of_the_workspace_cannot_write_the_host(sandbox):
    before = hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest()
    await sandbox.run_bash("ln -s /etc/passwd link-to-passwd")
    result = await edit(sandbox, command="create", path="link-to-passwd", file_text="owned\n")
    assert_error(result)
    assert hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest() == before

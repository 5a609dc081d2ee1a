"""The bash tool of a real sandbox: a new shell per call, in the workspace."""

from __future__ import annotations


import pytest

from shoal.sandbox.result import Limit

WORKSPACE = "/home/agent/workspace"
OUTPUTS = "/mnt/user-data/outputs"


async def ok(sandbox, command: str, timeout: float | None = None):
    result = await sandbox.run_bash(command, timeout=timeout)
    assert result.return_code == 0, (result.stdout, result.stderr)
    return result


# -- one new shell per call --------------------------------------------------------------
async def test_cwd_is_the_workspace(sandbox):
    result = await ok(sandbox, "pwd")
    assert result.stdout == f"{WORKSPACE}\n"


async def test_files_persist_between_calls(sandbox):
    await ok(sandbox, "echo persisted > note.txt && mkdir -p dir && echo deep > dir/f")
    result = await ok(sandbox, "cat note.txt dir/f")
    assert result.stdout == "persisted\ndeep\n"


async def test_cd_does_not_persist(sandbox):
    await ok(sandbox, "mkdir -p elsewhere && cd elsewhere && pwd")
    result = await ok(sandbox, "pwd")
    assert result.stdout == f"{WORKSPACE}\n"


async def test_export_does_not_persist(sandbox):
    first = await ok(sandbox, "export SHOAL_TEST_VAR=set; echo \"[$SHOAL_TEST_VAR]\"")
    assert first.stdout == "[set]\n"
    result = await ok(sandbox, "echo \"[${SHOAL_TEST_VAR:-unset}]\"")
    assert result.stdout == "[unset]\n"


async def test_shell_functions_and_aliases_do_not_persist(sandbox):
    await ok(sandbox, "greet() { echo hi; }; greet")
    result = await sandbox.run_bash("greet")
    assert result.return_code == 127
    assert "not found" in result.stderr


async def test_bash_and_python_share_files(sandbox):
    await ok(sandbox, "printf 'from bash' > shared.txt")
    result = await sandbox.run_python("print(open('shared.txt').read())")
    assert result.stdout == "from bash\n"


# -- return codes and streams --------------------------------------------------------------
@pytest.mark.parametrize("command, code", [
    ("exit 7", 7), ("true", 0), ("false", 1), ("exit 255", 255),
    ("command-that-does-not-exist", 127), ("kill -TERM $$", 128 + 15),
])
async def test_return_codes(sandbox, command, code):
    result = await sandbox.run_bash(command)
    assert result.return_code == code


async def test_stderr_is_captured_separately(sandbox):
    result = await sandbox.run_bash("echo to-out; echo to-err >&2; ls /no/such/path")
    assert result.return_code != 0
    assert result.stdout == "to-out\n"
    assert result.stderr.startswith("to-err\n")
    assert "No such file or directory" in result.stderr


async def test_pipelines(sandbox):
    result = await ok(sandbox, "printf 'b\\na\\nc\\na\\n' | sort | uniq -c | sort -rn | head -1")
    assert result.stdout.split() == ["2", "a"]
    result = await ok(sandbox, "seq 1 10 | awk '{s += $1} END {print s}'")
    assert result.stdout == "55\n"


async def test_pipefail_is_not_set_by_default(sandbox):
    result = await sandbox.run_bash("false | true")
    assert result.return_code == 0


async def test_stdin_is_empty(sandbox):
    result = await ok(sandbox, "cat; read -r line || echo eof")
    assert result.stdout == "eof\n"


async def test_produced_files_are_reported(sandbox):
    result = await ok(sandbox, f"echo -n 12345 > {OUTPUTS}/b.txt; echo -n ab > top.txt; "
                               "mkdir -p sub && echo no > sub/not-reported.txt")
    assert {f.path: f.size for f in result.files} == {
        f"{OUTPUTS}/b.txt": 5, f"{WORKSPACE}/top.txt": 2}


# -- the command-line tools of the runtime ---------------------------------------------------
async def test_rg(sandbox):
    await ok(sandbox, "mkdir -p src && echo 'needle here' > src/a.txt && echo hay > src/b.txt")
    result = await ok(sandbox, "rg --no-heading -n needle src")
    assert result.stdout == "src/a.txt:1:needle here\n"


async def test_fd(sandbox):
    await ok(sandbox, "mkdir -p tree/x && touch tree/x/target.md tree/other.txt")
    result = await ok(sandbox, "if command -v fd >/dev/null; then fd -e md . tree; "
                               "else fdfind -e md . tree; fi")
    assert result.stdout == "tree/x/target.md\n"


async def test_sqlite3(sandbox):
    result = await ok(sandbox, "sqlite3 db.sqlite 'create table t(x); insert into t values (20), (22);"
                               " select sum(x) from t;'")
    assert result.stdout == "42\n"


async def test_jq(sandbox):
    result = await ok(sandbox, "echo '{\"a\": {\"b\": [1, 2, 3]}}' | jq -c '.a.b | map(. * 2)'")
    assert result.stdout == "[2,4,6]\n"


async def test_7z_and_unzip(sandbox):
    await ok(sandbox, "mkdir -p pack && echo zipped > pack/f.txt && 7z a -tzip archive.zip pack >/dev/null")
    result = await ok(sandbox, "mkdir -p un && unzip -q archive.zip -d un && cat un/pack/f.txt")
    assert result.stdout == "zipped\n"
    result = await ok(sandbox, "7z l archive.zip | grep -c 'pack/f.txt'")
    assert result.stdout == "1\n"


async def test_bc(sandbox):
    result = await ok(sandbox, "echo 'scale=3; 10/4' | bc")
    assert result.stdout == "2.500\n"


async def test_node(sandbox):
    result = await ok(sandbox, "node -e 'console.log([1,2,3].map(x => x * x).join(\",\"))'")
    assert result.stdout == "1,4,9\n"


async def test_python3_is_the_runtime_python(sandbox):
    result = await ok(sandbox, "python3 -c 'import pandas, numpy; print(pandas.DataFrame({\"a\": [1, 2]}).a.sum())'")
    assert result.stdout == "3\n"


async def test_awk(sandbox):
    result = await ok(sandbox, "printf 'a 1\\nb 2\\n' | awk '{print $2 $1}'")
    assert result.stdout == "1a\n2b\n"


async def test_coreutils(sandbox):
    result = await ok(sandbox, "echo hello | tr a-z A-Z | wc -c; basename /x/y.txt .txt; date +%Y >/dev/null")
    assert result.stdout == "6\ny\n"


# -- background jobs, big and odd output -------------------------------------------------------
async def test_background_job_does_not_hold_the_call(sandbox):
    # A call that waited for the 100 s job would hit its 20 s timeout instead.
    result = await sandbox.run_bash("sleep 100 & echo started", timeout=20)
    assert result.return_code == 0
    assert not result.timed_out and result.limits == []
    assert result.stdout == "started\n"
    # The sandbox keeps answering.
    assert (await ok(sandbox, "echo next")).stdout == "next\n"


async def test_background_job_with_redirected_output(sandbox):
    result = await sandbox.run_bash("nohup sleep 100 >/dev/null 2>&1 & echo bg", timeout=20)
    assert result.return_code == 0 and result.stdout == "bg\n"


async def test_large_output_arrives_complete_and_in_order(sandbox):
    # 938,901 bytes: under the 1 MiB cap of the test settings.
    result = await ok(sandbox, "seq 1 150000")
    assert Limit.OUTPUT not in result.limits
    assert result.stdout == "".join(f"{i}\n" for i in range(1, 150001))


async def test_output_over_the_cap_is_truncated(sandbox, settings):
    result = await sandbox.run_bash("seq 1 200000")  # 1,288,895 bytes
    assert result.return_code == 0
    assert Limit.OUTPUT in result.limits
    assert result.stdout.endswith("...[truncated]")
    body = result.stdout[: -len("\n...[truncated]")]
    assert len(body.encode()) <= settings.output_cap_bytes
    expected = "".join(f"{i}\n" for i in range(1, 200001))
    assert expected.startswith(body)


async def test_large_interleaved_output(sandbox):
    result = await ok(sandbox, "for i in $(seq 1 2000); do echo out$i; echo err$i >&2; done")
    assert result.stdout == "".join(f"out{i}\n" for i in range(1, 2001))
    assert result.stderr == "".join(f"err{i}\n" for i in range(1, 2001))


async def test_non_utf8_output_does_not_break_the_call(sandbox):
    result = await ok(sandbox, "printf '\\xff\\xfe'; echo; echo after; printf '\\xc3' >&2")
    assert isinstance(result.stdout, str)
    assert result.stdout.endswith("\nafter\n")
    assert "\ufffd" in result.stdout
    assert isinstance(result.stderr, str)
    # Split UTF-8 sequences across writes still decode.
    result = await ok(sandbox, "printf '\\xc3'; sleep 0.05; printf '\\xa9\\n'")
    assert result.stdout == "\u00e9\n"
    assert (await ok(sandbox, "echo fine")).stdout == "fine\n"

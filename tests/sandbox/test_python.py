"""The persistent Python interpreter of a real sandbox (DESIGN.md, "Execution semantics").

Every test leases a fresh warm sandbox from the session pool and talks to it
only through the public ``Sandbox`` calls; nothing is mocked.
"""

from __future__ import annotations

import pytest

from shoal.sandbox.result import Limit

OUTPUTS = "/mnt/user-data/outputs"
WORKSPACE = "/home/agent/workspace"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def by_path(result) -> dict[str, int]:
    return {produced.path: produced.size for produced in result.files}


async def ok(sandbox, code: str):
    """Run code that must succeed; return its result."""
    result = await sandbox.run_python(code)
    assert result.return_code == 0, result.stderr
    return result


# -- state -------------------------------------------------------------------------------
async def test_state_persists(sandbox):
    first = await sandbox.run_python("value = 6 * 7")
    assert first.return_code == 0
    second = await sandbox.run_python("print(value)")
    assert second.stdout == "42\n"


async def test_a_leased_sandbox_starts_fresh_though_the_pool_warmed_it(pool):
    # The pool runs one Python call in every sandbox before leasing it (the
    # agent's warm op): the client must find no trace of it.
    await pool.wait_warm()  # a lease that misses gets an unwarmed sandbox
    sandbox = await pool.lease()
    try:
        result = await sandbox.run_python(
            "print(sorted(k for k in globals() if not k.startswith('__')))\n"
            "import sys; print(sys.last_value if hasattr(sys, 'last_value') else None)\n"
            "raise KeyError('first')")
        assert result.stdout == "['ToolError']\nNone\n"
        assert '"<cell-1>", line 3' in result.stderr, result.stderr
        assert result.files == [] and result.limits == []
    finally:
        await sandbox.close()


async def test_imports_functions_and_classes_persist(sandbox):
    await ok(sandbox, "import json as j\n"
                      "def double(x):\n    return 2 * x\n"
                      "class Counter:\n    count = 0\n"
                      "    def bump(self):\n        Counter.count += 1\n        return Counter.count\n")
    result = await ok(sandbox, "c = Counter(); c.bump(); c.bump()\n"
                               "print(j.dumps({'d': double(21), 'n': Counter.count}))")
    assert result.stdout == '{"d": 42, "n": 2}\n'
    result = await ok(sandbox, "print(Counter().bump())")
    assert result.stdout == "3\n"


# -- capture at the file-descriptor level ----------------------------------------------
async def test_os_system_output_is_captured(sandbox):
    result = await ok(sandbox, "import os\nrc = os.system('echo hi')\nprint('rc', rc)")
    assert result.stdout == "hi\nrc 0\n"


async def test_subprocess_output_is_captured(sandbox):
    result = await ok(sandbox, "import subprocess\n"
                               "subprocess.run(['echo', 'from', 'child'], check=True)\n"
                               "_ = subprocess.run(['sh', '-c', 'echo err-from-child >&2'])")
    assert result.stdout == "from child\n"
    assert result.stderr == "err-from-child\n"


async def test_c_level_printf_is_captured(sandbox):
    result = await ok(sandbox, "import ctypes\n"
                               "libc = ctypes.CDLL(None)\n"
                               "libc.printf(b'from C %d\\n', 42)\n"
                               "_ = libc.fflush(None)")
    assert result.stdout == "from C 42\n"


async def test_stderr_writes_are_captured(sandbox):
    result = await ok(sandbox, "import os, sys\n"
                               "sys.stderr.write('via sys.stderr\\n')\n"
                               "sys.stderr.flush()\n"
                               "_ = os.write(2, b'via fd 2\\n')")
    assert result.stdout == ""
    assert result.stderr == "via sys.stderr\nvia fd 2\n"


async def test_stdout_and_stderr_are_separated_and_ordered(sandbox):
    result = await ok(sandbox, "import os, sys\n"
                               "for i in range(5):\n"
                               "    print('out', i)\n"
                               "    print('err', i, file=sys.stderr)\n"
                               "os.write(1, b'out fd\\n')\n"
                               "os.write(2, b'err fd\\n')\n"
                               "os.system('echo out shell; echo err shell >&2')\n"
                               "print('out last')")
    assert result.stdout == "".join(f"out {i}\n" for i in range(5)) + \
        "out fd\nout shell\nout last\n"
    assert result.stderr == "".join(f"err {i}\n" for i in range(5)) + "err fd\nerr shell\n"


async def test_output_does_not_leak_into_the_next_call(sandbox):
    await ok(sandbox, "print('first')")
    result = await ok(sandbox, "x = 1")
    assert result.stdout == "" and result.stderr == ""


# -- exceptions and exits ----------------------------------------------------------------
async def test_exception_prints_traceback_and_keeps_state(sandbox):
    await ok(sandbox, "kept = 'still here'")
    result = await sandbox.run_python("def inner():\n    raise ValueError('bad value')\n"
                                      "print('before')\ninner()")
    assert result.return_code == 1
    assert result.stdout == "before\n"
    assert "Traceback (most recent call last)" in result.stderr
    assert "ValueError: bad value" in result.stderr
    assert "in inner" in result.stderr
    assert "shoal_agent" not in result.stderr
    assert "python_repl" not in result.stderr
    again = await ok(sandbox, "print(kept)")
    assert again.stdout == "still here\n"


async def test_exception_in_final_expression(sandbox):
    result = await sandbox.run_python("x = 1\n1 / 0")
    assert result.return_code == 1
    assert "ZeroDivisionError" in result.stderr
    assert "shoal_agent" not in result.stderr
    assert (await ok(sandbox, "print(x)")).stdout == "1\n"


# -- top-level await, as in a notebook ------------------------------------------------------
async def test_a_cell_may_await_at_its_top_level(sandbox):
    # A Jupyter-backed interpreter accepts it, so models write it; it was a
    # SyntaxError ('await' outside function).
    result = await ok(sandbox, "import asyncio\n"
                               "async def double(x):\n    await asyncio.sleep(0.01)\n    return 2 * x\n"
                               "pair = await asyncio.gather(double(1), double(20))\n"
                               "async def count():\n    for i in range(3):\n        yield i\n"
                               "seen = [i async for i in count()]\n"
                               "print(pair, seen)\n"
                               "await double(21)")
    assert result.stdout == "[2, 40] [0, 1, 2]\n42\n"
    # Its names live on in the namespace, as any cell's.
    assert (await ok(sandbox, "print(pair[1] + seen[2])")).stdout == "42\n"


async def test_an_error_in_awaited_code_shows_the_cells_frames_only(sandbox):
    result = await sandbox.run_python("import asyncio\n"
                                      "async def fail():\n    raise ValueError('awaited')\n"
                                      "await fail()")
    assert result.return_code == 1
    assert "ValueError: awaited" in result.stderr
    assert '"<cell-1>", line 4' in result.stderr and '"<cell-1>", line 3' in result.stderr
    assert "asyncio" not in result.stderr.replace("import asyncio", ""), result.stderr
    assert "python_repl" not in result.stderr


async def test_an_awaiting_cell_times_out_and_the_next_one_awaits_again(sandbox):
    await ok(sandbox, "kept = 'still here'")
    result = await sandbox.run_python(
        "import asyncio\n"
        "async def background():\n"
        "    try:\n        await asyncio.sleep(60)\n"
        "    finally:\n        print('background cleaned up')\n"
        "task = asyncio.create_task(background())\n"
        "await asyncio.sleep(60)", timeout=1)
    assert result.timed_out and result.return_code == 124
    # The cell's other tasks were cancelled, and ran their cleanup.
    assert result.stdout == "background cleaned up\n"
    again = await ok(sandbox, "await asyncio.sleep(0)\nprint(kept, task.cancelled())")
    assert again.stdout == "still here True\n"


async def test_a_cell_without_await_runs_on_no_event_loop(sandbox):
    # asyncio.run in a plain cell, as before: no loop is running around it.
    result = await ok(sandbox, "import asyncio\n"
                               "async def seven():\n    return 7\n"
                               "print(asyncio.run(seven()))")
    assert result.stdout == "7\n"


async def test_syntax_error(sandbox):
    result = await sandbox.run_python("x = (")
    assert result.return_code == 1
    assert "SyntaxError" in result.stderr
    assert "shoal_agent" not in result.stderr
    assert result.stdout == ""


async def test_syntax_error_runs_nothing(sandbox):
    await ok(sandbox, "counter = 0")
    result = await sandbox.run_python("counter = 1\nprint('no')\ndef broken(:\n    pass")
    assert result.return_code == 1
    assert "SyntaxError" in result.stderr
    assert result.stdout == ""
    assert (await ok(sandbox, "print(counter)")).stdout == "0\n"


async def test_a_broken_pipe_is_an_exception_not_the_end_of_the_interpreter(sandbox):
    # As in any Python, SIGPIPE is ignored: a write to a pipe or socket nobody
    # reads raises BrokenPipeError. (A zygote's fork once inherited the default
    # action, and such a write killed the interpreter and its state with it.)
    await sandbox.run_python("kept = 42")
    result = await sandbox.run_python(
        "import os, socket\n"
        "r, w = os.pipe(); os.close(r)\n"
        "try:\n    os.write(w, b'x')\nexcept BrokenPipeError:\n    print('pipe: BrokenPipeError')\n"
        "a, b = socket.socketpair(); b.close()\n"
        "try:\n    a.send(b'x')\nexcept BrokenPipeError:\n    print('socket: BrokenPipeError')\n"
        "print(kept)")
    assert result.stdout.splitlines() == ["pipe: BrokenPipeError", "socket: BrokenPipeError",
                                          "42"], result.stderr
    assert not result.restarted
    # Child processes get the default action back, as subprocess gives them anywhere.
    shell = await sandbox.run_bash("yes | head -c 1 >/dev/null; echo ${PIPESTATUS[0]}")
    assert shell.stdout == "141\n", shell.stderr  # 128 + SIGPIPE: killed by it, as usual


async def test_sys_exit_with_code_keeps_state(sandbox):
    await ok(sandbox, "survivor = 123")
    result = await sandbox.run_python("import sys\nprint('bye')\nsys.exit(3)\nprint('never')")
    assert result.return_code == 3
    assert result.stdout == "bye\n"
    assert "Traceback" not in result.stderr
    assert (await ok(sandbox, "print(survivor)")).stdout == "123\n"


async def test_sys_exit_without_argument_is_success(sandbox):
    result = await sandbox.run_python("import sys\nsys.exit()")
    assert result.return_code == 0
    assert result.stderr == ""


async def test_sys_exit_zero_is_success(sandbox):
    result = await sandbox.run_python("import sys\nsys.exit(0)")
    assert result.return_code == 0


async def test_sys_exit_with_message(sandbox):
    result = await sandbox.run_python("import sys\nsys.exit('fatal: went wrong')")
    assert result.return_code == 1
    assert "fatal: went wrong" in result.stderr
    # The interpreter lives on.
    assert (await ok(sandbox, "print('alive')")).stdout == "alive\n"


# -- the REPL's final expression ---------------------------------------------------------
@pytest.mark.parametrize("code, expected", [
    ("1+1", "2\n"),
    ("'a'", "'a'\n"),
    ("[1, 'b', None]", "[1, 'b', None]\n"),
    ("None", ""),
    ("x = 5\ny = 6\nx * y", "30\n"),
    ("print('p')\n'v'", "p\n'v'\n"),
    ("x = 5", ""),
])
async def test_final_expression(sandbox, code, expected):
    result = await ok(sandbox, code)
    assert result.stdout == expected


async def test_final_expression_that_returns_none_prints_nothing(sandbox):
    result = await ok(sandbox, "def nothing():\n    pass\nnothing()")
    assert result.stdout == ""


# -- stdin -------------------------------------------------------------------------------
async def test_input_raises_eof(sandbox):
    result = await sandbox.run_python("input('prompt? ')")
    assert result.return_code == 1
    assert "EOFError" in result.stderr
    result = await ok(sandbox, "try:\n    input()\nexcept EOFError:\n    print('eof')")
    assert result.stdout == "eof\n"


async def test_stdin_reads_empty(sandbox):
    result = await ok(sandbox, "import sys\nprint(repr(sys.stdin.read()))")
    assert result.stdout == "''\n"


# -- matplotlib figures ------------------------------------------------------------------
async def _assert_one_valid_png(sandbox, result) -> str:
    pngs = [f for f in result.files if f.path.endswith(".png")]
    assert len(pngs) == 1, result.files
    figure = pngs[0]
    assert figure.path.startswith(OUTPUTS + "/")
    assert figure.size > 100
    check = await ok(sandbox, f"data = open({figure.path!r}, 'rb').read()\n"
                              "print(data[:8] == b'\\x89PNG\\r\\n\\x1a\\n', len(data))")
    assert check.stdout == f"True {figure.size}\n"
    return figure.path


async def test_open_figure_is_saved_as_png(sandbox):
    result = await ok(sandbox, "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\n"
                               "plt.title('left open')")
    await _assert_one_valid_png(sandbox, result)
    following = await ok(sandbox, "print('next')")
    assert following.files == []
    # The figure was closed after it was saved.
    assert (await ok(sandbox, "print(plt.get_fignums())")).stdout == "[]\n"


async def test_a_figure_the_code_saved_itself_is_not_saved_twice(sandbox):
    result = await ok(sandbox, "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\n"
                               "plt.savefig('/mnt/user-data/outputs/mine.png')")
    assert [f.path.rsplit("/", 1)[-1] for f in result.files] == ["mine.png"], result.files
    # Changed after it was saved: what the code left open is saved, as before.
    changed = await ok(sandbox, "plt.plot([0, 1])\nplt.savefig('/mnt/user-data/outputs/v1.png')\n"
                                "plt.title('changed after saving')")
    assert sorted(f.path.rsplit("/", 1)[-1] for f in changed.files) == ["figure_1.png", "v1.png"]
    assert (await ok(sandbox, "print(plt.get_fignums())")).stdout == "[]\n"


async def test_shown_figure_is_saved_as_png(sandbox):
    result = await ok(sandbox, "import matplotlib.pyplot as plt\n"
                               "plt.figure()\nplt.bar(['a', 'b'], [3, 4])\nplt.show()")
    path = await _assert_one_valid_png(sandbox, result)
    assert "non-interactive" not in result.stderr
    following = await ok(sandbox, "x = 1")
    assert following.files == []
    # A second figure does not overwrite the first.
    second = await ok(sandbox, "plt.plot([0, 1])")
    second_path = await _assert_one_valid_png(sandbox, second)
    assert second_path != path


async def test_a_saved_chart_is_drawn_once(sandbox):
    """plt.savefig draws into the file; the redraw "when idle" it asks for after
    the save waits until something reads the canvas (Agg has no screen to refresh)."""
    result = await ok(sandbox, "import matplotlib.pyplot as plt\n"
                               "from matplotlib.figure import Figure\n"
                               "drawn = []\n"
                               "original = Figure.draw\n"
                               "Figure.draw = lambda self, renderer: (drawn.append(1), "
                               "original(self, renderer))[1]\n"
                               "plt.plot([1, 3, 2])\nplt.savefig('/tmp/once.png')\n"
                               "plt.close('all')\nFigure.draw = original\nprint(len(drawn))")
    assert result.stdout == "1\n", result.stderr


async def test_a_redraw_asked_for_is_there_when_the_pixels_are_read(sandbox):
    """What the deferral must not change: after plt.draw() the canvas holds the
    chart, and after a transparent save it holds the figure's own colours again
    (the redraw pyplot asks for), the moment anything reads it."""
    result = await ok(sandbox, "import matplotlib.pyplot as plt, numpy as np\n"
                               "figure = plt.figure()\nplt.plot([1, 3, 2], linewidth=8)\n"
                               "plt.draw()\n"
                               "pixels = np.asarray(figure.canvas.buffer_rgba())\n"
                               "print(pixels[..., :3].min() < 128)\n"
                               "plt.savefig('/tmp/clear.png', transparent=True)\n"
                               "print(np.asarray(figure.canvas.buffer_rgba())[..., 3].min())\n"
                               "region = figure.canvas.copy_from_bbox(figure.bbox)\n"
                               "print(type(region).__name__)\nplt.close('all')")
    assert result.stdout.split() == ["True", "255", "BufferRegion"], result.stderr


async def test_two_open_figures_are_both_saved(sandbox):
    result = await ok(sandbox, "import matplotlib.pyplot as plt\n"
                               "plt.figure(); plt.plot([1, 2])\n"
                               "plt.figure(); plt.plot([2, 1])")
    pngs = [f.path for f in result.files if f.path.endswith(".png")]
    assert len(pngs) == 2 and len(set(pngs)) == 2


# -- produced files --------------------------------------------------------------------
async def test_produced_files_are_reported(sandbox):
    result = await ok(sandbox, f"""
import os
open({OUTPUTS!r} + '/report.txt', 'w').write('hello')
os.makedirs({OUTPUTS!r} + '/sub/deeper', exist_ok=True)
open({OUTPUTS!r} + '/sub/deeper/data.csv', 'w').write('a,b\\n1,2\\n')
open('top.txt', 'w').write('x' * 1000)
os.makedirs('nested', exist_ok=True)
open('nested/hidden.txt', 'w').write('not reported')
""")
    assert by_path(result) == {
        f"{OUTPUTS}/report.txt": 5,
        f"{OUTPUTS}/sub/deeper/data.csv": 8,
        f"{WORKSPACE}/top.txt": 1000,
    }


async def test_unchanged_file_is_not_reported_again_and_modified_is(sandbox):
    first = await ok(sandbox, f"open({OUTPUTS!r} + '/a.txt', 'w').write('one')\n"
                              f"open({OUTPUTS!r} + '/b.txt', 'w').write('two')")
    assert set(by_path(first)) == {f"{OUTPUTS}/a.txt", f"{OUTPUTS}/b.txt"}
    unchanged = await ok(sandbox, "print('nothing written')")
    assert unchanged.files == []
    modified = await ok(sandbox, f"open({OUTPUTS!r} + '/a.txt', 'a').write(' more')")
    assert by_path(modified) == {f"{OUTPUTS}/a.txt": 8}
    # Same size, new content: still a change.
    rewritten = await ok(sandbox, "import time; time.sleep(0.01)\n"
                                  f"open({OUTPUTS!r} + '/b.txt', 'w').write('TWO')")
    assert by_path(rewritten) == {f"{OUTPUTS}/b.txt": 3}


async def test_at_most_50_files_are_reported(sandbox):
    result = await ok(sandbox, "for i in range(60):\n"
                               f"    open(f'{OUTPUTS}/many_{{i:02}}.txt', 'w').write(str(i))")
    assert len(result.files) == 50
    assert len({f.path for f in result.files}) == 50
    assert all(f.path.startswith(f"{OUTPUTS}/many_") for f in result.files)
    listing = await ok(sandbox, f"import os; print(len(os.listdir({OUTPUTS!r})))")
    assert listing.stdout == "60\n"


async def test_deleted_file_is_not_reported(sandbox):
    await ok(sandbox, f"open({OUTPUTS!r} + '/gone.txt', 'w').write('x')")
    result = await ok(sandbox, f"import os; os.remove({OUTPUTS!r} + '/gone.txt')")
    assert result.files == []


# -- the preloaded runtime -----------------------------------------------------------------
async def test_pandas_is_preloaded(sandbox):
    result = await ok(sandbox, "import sys\nprint('pandas' in sys.modules, 'numpy' in sys.modules)")
    assert result.stdout == "True True\n"
    result = await ok(sandbox, "import pandas as pd\n"
                               "df = pd.DataFrame({'a': [1, 2, 3], 'b': [4.0, 5.0, 6.0]})\n"
                               "print(df['a'].sum(), df['b'].mean(), df.shape)")
    assert result.stdout == "6 5.0 (3, 2)\n"


async def test_preloaded_modules_stay_out_of_the_namespace(sandbox):
    result = await sandbox.run_python("pandas")
    assert result.return_code == 1
    assert "NameError" in result.stderr


@pytest.mark.parametrize("module", [
    "numpy", "scipy", "sklearn", "matplotlib", "statsmodels.api", "openpyxl", "PIL.Image",
    "pyarrow", "sympy", "networkx", "lxml.etree", "bs4", "yaml", "docx", "pptx", "pypdf",
    "reportlab", "seaborn", "xlsxwriter", "tabulate",
])
async def test_runtime_library_imports(sandbox, module):
    result = await sandbox.run_python(f"import {module}\nprint('ok')")
    assert result.return_code == 0, result.stderr
    assert result.stdout == "ok\n"


async def test_libraries_do_real_work(sandbox):
    result = await ok(sandbox, """
import numpy as np, scipy.stats, sympy, networkx as nx, yaml
from bs4 import BeautifulSoup
print(int(np.arange(10).sum()))
print(round(float(scipy.stats.norm.cdf(0)), 3))
print(sympy.factor(sympy.Symbol('x')**2 - 1))
print(nx.shortest_path_length(nx.path_graph(5), 0, 4))
print(yaml.safe_load('a: [1, 2]'))
print(BeautifulSoup('<p>hi</p>', 'lxml').p.text)
""")
    assert result.stdout == "45\n0.5\n(x - 1)*(x + 1)\n4\n{'a': [1, 2]}\nhi\n"


# -- JavaScript ------------------------------------------------------------------------------
async def test_javascript_runs_node(sandbox):
    result = await sandbox.run_javascript("console.log(1+1)")
    assert result.return_code == 0, result.stderr
    assert result.stdout == "2\n"


async def test_javascript_stderr_and_files(sandbox):
    result = await sandbox.run_javascript(
        "const fs = require('fs');\n"
        f"fs.writeFileSync('{OUTPUTS}/from_js.txt', 'js!');\n"
        "console.error('to stderr');")
    assert result.return_code == 0, result.stderr
    assert result.stderr == "to stderr\n"
    assert by_path(result) == {f"{OUTPUTS}/from_js.txt": 3}


async def test_javascript_error_gives_nonzero_return_code(sandbox):
    result = await sandbox.run_javascript("throw new Error('boom')")
    assert result.return_code != 0
    assert "boom" in result.stderr


async def test_javascript_process_exit_code(sandbox):
    result = await sandbox.run_javascript("process.exit(5)")
    assert result.return_code == 5


async def test_javascript_output_written_just_before_exit_is_not_dropped(sandbox, monkeypatch):
    # Bun queues what a full pipe refuses and drops that queue at process.exit():
    # without the synchronous stdio preload only about a pipe's worth (1 MiB)
    # arrives. A cap above the pipe's size makes the loss visible.
    size = 3 * 1024 * 1024
    monkeypatch.setattr(sandbox._pool.settings, "output_cap_bytes", 2 * size)
    result = await sandbox.run_javascript(
        f"process.stdout.write('y'.repeat({size})); process.stderr.write('e'.repeat({size}));"
        " process.exit(4)")
    assert result.return_code == 4 and not result.limits
    assert (len(result.stdout), len(result.stderr)) == (size, size)


# -- restart -----------------------------------------------------------------------------------
async def test_restart_keeps_files_and_drops_variables(sandbox):
    await ok(sandbox, f"lost = 1\nopen('kept.txt', 'w').write('file survives')\n"
                      f"open({OUTPUTS!r} + '/out.txt', 'w').write('also')")
    await sandbox.restart()
    result = await sandbox.run_python("lost")
    assert result.return_code == 1
    assert "NameError" in result.stderr
    result = await ok(sandbox, f"print(open('kept.txt').read(), open({OUTPUTS!r} + '/out.txt').read())")
    assert result.stdout == "file survives also\n"


async def test_restart_comes_back_warm(sandbox):
    await sandbox.restart()
    result = await ok(sandbox, "import sys\nprint('pandas' in sys.modules)")
    assert result.stdout == "True\n"

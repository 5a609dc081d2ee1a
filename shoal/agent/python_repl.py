"""The session's persistent Python interpreter.

Runs each call's source in one long-lived namespace, so variables, imports and
functions survive between calls, and behaves like a REPL cell: the value of a
final expression is printed, an exception prints its traceback (without the
agent's own frames) and gives return code 1, and ``sys.exit(n)`` gives ``n``
while the interpreter and its state live on. As in a notebook, a cell may
``await`` at its top level (``rows = await query_async(...)``,
``await asyncio.gather(...)``): such a cell runs as a task on the interpreter's
own event loop, which persists from cell to cell.

Timeouts arrive as SIGALRM and are raised as ``KeyboardInterrupt`` inside user
code only, so an expiry never lands in the agent's own bookkeeping and the
namespace survives the interruption. A cancellation from the host takes the
same road. While the code waits for an inner tool call the timer is stopped and
later re-armed with what was left, so waiting for the client costs no budget.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import importlib.util
import inspect
import linecache
import os
import signal
import sys
import traceback
import warnings

OUTPUTS_DIR = "/mnt/user-data/outputs"


class CallTimedOut(KeyboardInterrupt):
    """Raised into user code when the call's time is up."""


class CallCancelled(CallTimedOut):
    """Raised into user code when the host cancels the call."""


CANCELLED_RETURN_CODE = 130
# A cell may await at its top level, as in a notebook: models write it so (a
# Jupyter-backed interpreter accepts it), and it is how awaitable tool stubs
# are meant to be gathered. Code that never awaits compiles exactly as before.
_TOP_LEVEL_AWAIT = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
# Where an awaiting cell leaves its final expression's value, for a moment.
_CELL_VALUE = "__shoal_cell_value__"
_VALUE_KEPT = object()
# How long the tasks of an interrupted cell get to run their cleanup.
_CLEANUP_SECONDS = 1.0


class PythonInterpreter:
    def __init__(self) -> None:
        self.namespace: dict = {"__name__": "__main__", "__builtins__": builtins}
        self._cells = 0
        self._in_user_code = False
        self._timed_out = False
        self._cancelled = False
        self._paused_remaining: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        signal.signal(signal.SIGALRM, self._on_alarm)
        signal.signal(signal.SIGINT, self._on_interrupt)
        # Figures are collected after every call; Agg's show() has nothing to show.
        warnings.filterwarnings("ignore", message=".*non-interactive.*")

    # -- signals -----------------------------------------------------------
    def _on_alarm(self, signum, frame) -> None:
        if not self._cancelled:
            self._timed_out = True
        if self._in_user_code:
            # Re-arm: code that swallows the first interrupt gets another.
            signal.setitimer(signal.ITIMER_REAL, 1.0)
            raise CallCancelled() if self._cancelled else CallTimedOut()

    # -- from other threads ----------------------------------------------------
    def cancel(self) -> None:
        """Stop the running cell soon (the host cancelled the call)."""
        self._cancelled = True
        self._paused_remaining = None
        signal.setitimer(signal.ITIMER_REAL, 0.001)

    def pause_clock(self) -> None:
        """Code waits for a tool result: stop its timer, keep what is left."""
        if self._cancelled or self._paused_remaining is not None:
            return
        remaining, _ = signal.setitimer(signal.ITIMER_REAL, 0)
        self._paused_remaining = remaining if remaining > 0 else 0.001

    def resume_clock(self) -> None:
        remaining, self._paused_remaining = self._paused_remaining, None
        if remaining is not None and self._in_user_code and not self._cancelled:
            signal.setitimer(signal.ITIMER_REAL, remaining)

    def _on_interrupt(self, signum, frame) -> None:
        if self._in_user_code:
            raise KeyboardInterrupt()

    # -- running -------------------------------------------------------------
    def preload(self, modules: list[str]) -> list[str]:
        """Import heavy modules ahead of time; they stay out of the namespace."""
        failed = []
        for name in modules:
            try:
                __import__(name)
            except Exception:
                failed.append(name)
        return failed

    def run(self, source: str, timeout: float) -> tuple[int, bool]:
        """Run one cell; returns (return_code, timed_out)."""
        _note_saved_figures()
        self._cells += 1
        filename = f"<cell-{self._cells}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        self._timed_out = False
        self._cancelled = False
        self._paused_remaining = None
        try:
            body, last = self._compile(source, filename)
        except SyntaxError as exc:
            # The parser's own frames say nothing useful to the user.
            traceback.print_exception(type(exc), exc, None, file=sys.stderr)
            _flush_std_streams()
            return 1, False
        return_code = 0
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            self._in_user_code = True
            try:
                self._evaluate(body)
                if last is _VALUE_KEPT:
                    value = self.namespace.pop(_CELL_VALUE, None)
                elif last is not None:
                    value = eval(last, self.namespace)
                if last is not None:
                    if value is not None:
                        self.namespace["_"] = value
                        print(repr(value))
            finally:
                self._in_user_code = False
                signal.setitimer(signal.ITIMER_REAL, 0)
                self.namespace.pop(_CELL_VALUE, None)
        except CallCancelled:
            return CANCELLED_RETURN_CODE, False
        except CallTimedOut:
            if self._cancelled:
                return CANCELLED_RETURN_CODE, False
            return 124, True
        except SystemExit as exc:
            return_code = _exit_code(exc)
        except BaseException:
            self._print_exception()
            return_code = 1
        finally:
            _flush_std_streams()
        if self._cancelled:
            return CANCELLED_RETURN_CODE, False
        if self._timed_out:
            return 124, True
        return return_code, False

    def save_open_figures(self) -> None:
        """Write every open matplotlib figure into outputs as a PNG, then close it."""
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is None:
            return
        try:
            numbers = pyplot.get_fignums()
        except Exception:
            return
        for number in numbers:
            try:
                figure = pyplot.figure(number)
                if getattr(figure, _SAVED, False) and not figure.stale:
                    continue  # the code saved it itself, as it is now: no second copy
                figure.savefig(_next_figure_path(), format="png")
            except Exception as exc:
                print(f"could not save figure {number}: {exc}", file=sys.stderr)
        _note_saved_figures()
        if numbers:
            pyplot.close("all")
        _flush_std_streams()

    def _evaluate(self, code) -> None:
        """Run the cell's statements; a cell that awaits runs on the loop."""
        running = eval(code, self.namespace)
        if code.co_flags & inspect.CO_COROUTINE:
            self._run_coroutine(running)

    def _run_coroutine(self, coroutine):
        loop = self._loop
        if loop is None or loop.is_closed():
            loop = self._loop = asyncio.new_event_loop()
        task = loop.create_task(coroutine)
        try:
            return loop.run_until_complete(task)
        except BaseException:
            if task.done() and not task.cancelled() and not isinstance(
                    task.exception(), KeyboardInterrupt):
                raise  # the cell's own error (or exit); the loop is as it was
            # A timeout or a cancellation lands wherever the loop was (often in
            # its selector, the cell's task still pending): every task of the
            # loop is cancelled and given a moment for its cleanup, and the loop,
            # perhaps interrupted inside its own bookkeeping, is replaced. The
            # alarm, re-armed, ends a cleanup that does not finish.
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for waiting in pending:
                waiting.cancel()
            try:
                if pending:
                    loop.run_until_complete(asyncio.wait(pending, timeout=_CLEANUP_SECONDS))
                loop.close()
            except BaseException:
                pass
            self._loop = None
            raise

    @staticmethod
    def _compile(source: str, filename: str):
        """The cell's statements and its final expression, compiled apart (the
        expression's value is printed)."""
        tree = ast.parse(source, filename, "exec")
        try:
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                expression = ast.Expression(tree.body.pop().value)
                last = compile(expression, filename, "eval")
            return compile(tree, filename, "exec"), last
        except SyntaxError as error:
            awaiting = _compile_awaiting(source, filename)
            if awaiting is None:
                raise error from None
            return awaiting, _VALUE_KEPT

    @staticmethod
    def _print_exception() -> None:
        """The traceback from the cell's own first frame: the agent's and asyncio's
        frames above it say nothing useful to the user."""
        kind, value, tb = sys.exc_info()
        first = tb
        while first is not None and not first.tb_frame.f_code.co_filename.startswith("<cell-"):
            first = first.tb_next
        if first is None and tb is not None:
            first = tb.tb_next
        traceback.print_exception(kind, value, first, file=sys.stderr)


def _compile_awaiting(source: str, filename: str):
    """A cell that awaits at its top level, compiled whole as one coroutine, as
    in a notebook: a task it creates runs while a later line awaits. Its final
    expression's value is kept in a name of the agent's. None when the cell does
    not await (its SyntaxError is another)."""
    tree = ast.parse(source, filename, "exec")
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = tree.body[-1]
        tree.body[-1] = ast.copy_location(ast.Assign(
            targets=[ast.Name(_CELL_VALUE, ast.Store())], value=last.value), last)
        ast.fix_missing_locations(tree)
    try:
        code = compile(tree, filename, "exec", flags=_TOP_LEVEL_AWAIT)
    except SyntaxError:
        return None
    return code if code.co_flags & inspect.CO_COROUTINE else None


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF if code >= 0 else 1
    print(code, file=sys.stderr)
    return 1


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


_SAVED = "_shoal_saved"
_DRAW_DUE = "_shoal_draw_due"
# The modules whose classes Shoal adjusts, each as soon as it is loaded.
_FIGURE, _AGG = "matplotlib.figure", "matplotlib.backends.backend_agg"


def _note_saved_figures() -> None:
    """Adjust matplotlib for a sandbox, now where it is loaded, else as a cell
    imports it:

    - every figure the code saves is marked, so the figures left open at the end
      of a cell are saved for it only if it did not save them itself (or changed
      them since: the figure is stale again);
    - Agg draws "when idle" only once something reads its pixels (see
      :func:`_draw_agg_when_read`)."""
    figure, agg = sys.modules.get(_FIGURE), sys.modules.get(_AGG)
    hooks = [finder for finder in sys.meta_path if isinstance(finder, _MatplotlibImportHook)]
    if figure is None or agg is None:
        if not hooks:
            sys.meta_path.insert(0, _MatplotlibImportHook())
    else:
        for hook in hooks:
            sys.meta_path.remove(hook)
    if figure is not None and not getattr(figure.Figure.savefig, _SAVED, False):
        _mark_saved_figures(figure)
    if agg is not None and not getattr(agg.FigureCanvasAgg.draw_idle, _DRAW_DUE, False):
        _draw_agg_when_read(agg)


def _mark_saved_figures(module) -> None:
    original = module.Figure.savefig

    def savefig(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        setattr(self, _SAVED, True)
        # Saving drew the figure as it is: it is not stale. (matplotlib marks it
        # so as it puts the save's dpi and colours back; pyplot's redraw after a
        # save cleared that, and Agg now makes that redraw only when read.)
        self.stale = False
        return result

    setattr(savefig, _SAVED, True)
    module.Figure.savefig = savefig


def _draw_agg_when_read(module) -> None:
    """A request to redraw "once control returns to the GUI event loop" (that is
    matplotlib's ``draw_idle``) draws at once on Agg, which has no event loop: so
    ``plt.savefig`` drew every saved figure twice, once into the file and once
    more after it (~40 ms each for a small chart), for a screen a sandbox does
    not have. Here the request is noted and honoured when the canvas's pixels
    are next read; a save draws for itself."""
    canvas = module.FigureCanvasAgg
    draw = canvas.draw

    def draw_idle(self, *args, **kwargs):
        setattr(self, _DRAW_DUE, True)

    def drawn(self, *args, **kwargs):
        setattr(self, _DRAW_DUE, False)
        return draw(self, *args, **kwargs)

    def reading(method):
        def read(self, *args, **kwargs):
            if getattr(self, _DRAW_DUE, False):
                self.draw()
            return method(self, *args, **kwargs)
        read.__name__, read.__doc__ = method.__name__, method.__doc__
        return read

    for name in ("buffer_rgba", "tostring_argb", "tostring_rgb", "copy_from_bbox"):
        if hasattr(canvas, name):
            setattr(canvas, name, reading(getattr(canvas, name)))
    drawn.__doc__ = draw.__doc__
    setattr(draw_idle, _DRAW_DUE, True)
    canvas.draw, canvas.draw_idle = drawn, draw_idle


class _MatplotlibImportHook:
    """Adjusts matplotlib's modules as they finish loading (see _note_saved_figures);
    it finds nothing itself, it only wraps what the real finders find."""

    def __init__(self) -> None:
        self._finding = False

    def find_spec(self, name, path=None, target=None):
        if name not in (_FIGURE, _AGG) or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding = False
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):
            original(module)
            _note_saved_figures()

        loader.exec_module = exec_module
        return spec


def _next_figure_path() -> str:
    number = 1
    while os.path.exists(os.path.join(OUTPUTS_DIR, f"figure_{number}.png")):
        number += 1
    return os.path.join(OUTPUTS_DIR, f"figure_{number}.png")

"""The session's persistent Python interpreter.

Runs each call's source in one long-lived namespace, so variables, imports and
functions survive between calls, and behaves like a REPL cell: the value of a
final expression is printed, an exception prints its traceback (without the
agent's own frames) and gives return code 1, and ``sys.exit(n)`` gives ``n``
while the interpreter and its state live on.

Timeouts arrive as SIGALRM and are raised as ``KeyboardInterrupt`` inside user
code only, so an expiry never lands in the agent's own bookkeeping and the
namespace survives the interruption. A cancellation from the host takes the
same road. While the code waits for an inner tool call the timer is stopped and
later re-armed with what was left, so waiting for the client costs no budget.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
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


class PythonInterpreter:
    def __init__(self) -> None:
        self.namespace: dict = {"__name__": "__main__", "__builtins__": builtins}
        self._cells = 0
        self._in_user_code = False
        self._timed_out = False
        self._cancelled = False
        self._paused_remaining: float | None = None
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
                exec(body, self.namespace)
                if last is not None:
                    value = eval(last, self.namespace)
                    if value is not None:
                        self.namespace["_"] = value
                        print(repr(value))
            finally:
                self._in_user_code = False
                signal.setitimer(signal.ITIMER_REAL, 0)
        except CallCancelled:
            return CANCELLED_RETURN_CODE, False
        except CallTimedOut:
            if self._cancelled:
                return CANCELLED_RETURN_CODE, False
            return 124, True
        except SystemExit as exc:
            return_code = _exit_code(exc)
        except BaseException:
            self._print_exception(skip_frames=1)
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

    @staticmethod
    def _compile(source: str, filename: str):
        tree = ast.parse(source, filename, "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            expression = ast.Expression(tree.body.pop().value)
            last = compile(expression, filename, "eval")
        return compile(tree, filename, "exec"), last

    @staticmethod
    def _print_exception(skip_frames: int) -> None:
        kind, value, tb = sys.exc_info()
        for _ in range(skip_frames):
            if tb is not None:
                tb = tb.tb_next
        traceback.print_exception(kind, value, tb, file=sys.stderr)


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


def _note_saved_figures() -> None:
    """Every figure the code saves is marked, so the figures left open at the end
    of a cell are saved for it only if it did not save them itself (or changed
    them since: the figure is stale again). Matplotlib is marked when it is
    loaded: now if it is, else as a cell imports it."""
    module = sys.modules.get("matplotlib.figure")
    if module is None:
        if not any(isinstance(finder, _FigureImportHook) for finder in sys.meta_path):
            sys.meta_path.insert(0, _FigureImportHook())
        return
    if getattr(module.Figure.savefig, _SAVED, False):
        return
    original = module.Figure.savefig

    def savefig(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        setattr(self, _SAVED, True)
        return result

    setattr(savefig, _SAVED, True)
    module.Figure.savefig = savefig


class _FigureImportHook:
    """Marks matplotlib's figures as ``matplotlib.figure`` finishes loading."""

    def find_spec(self, name, path=None, target=None):
        if name != "matplotlib.figure":
            return None
        sys.meta_path.remove(self)  # the real finders find it; this only waits
        spec = importlib.util.find_spec(name)
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

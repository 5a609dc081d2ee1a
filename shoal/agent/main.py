"""The agent's entry point: serve calls from the host until the channel closes.

The agent is the sandbox's only long-lived process besides bubblewrap's init.
It reads one call at a time from the channel (the host serializes calls to a
session), runs it, streams its output and answers with one ``done`` frame.
Timeouts are enforced here, next to the code, so that a Python call can be
interrupted without losing the interpreter; the host keeps a backstop that
destroys the whole sandbox if the agent itself stops answering.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from . import produced
from .capture import OutputCapture
from .editor import TextEditor
from .protocol import CHANNEL_FD, FrameError, encode, recv_frame
from .python_repl import PythonInterpreter

WORKSPACE = "/home/agent/workspace"
MAX_PRODUCED_FILES = 50
DEFAULT_CAP = 1024 * 1024


class Agent:
    def __init__(self, channel: socket.socket) -> None:
        self._channel = channel
        self._send_lock = threading.Lock()
        self._capture = OutputCapture(self.send)
        self._python = PythonInterpreter()
        self._editor = TextEditor()
        self._scripts = 0

    def send(self, message: dict) -> None:
        frame = encode(message)
        with self._send_lock:
            self._channel.sendall(frame)

    def serve(self) -> None:
        global _AGENT_PID
        _AGENT_PID = os.getpid()  # a zygote's fork is the agent: its pid, not the zygote's
        self.send({"type": "ready", "pid": os.getpid()})
        while True:
            try:
                message = recv_frame(self._channel)
            except FrameError:
                return
            if message is None:
                return
            call_id = message.get("id")
            try:
                result = self._dispatch(message)
            except Exception as exc:  # the agent must outlive any one call
                result = {"return_code": 1, "error": f"agent error: {exc!r}"}
            result.update(id=call_id, type="done")
            self.send(result)
            if message.get("op") == "exit":
                return

    def _dispatch(self, message: dict) -> dict:
        op = message.get("op")
        cap = _positive_int(message.get("cap"), DEFAULT_CAP)
        timeout = max(0.001, float(message.get("timeout") or 60))
        if op == "ping" or op == "exit":
            return {"return_code": 0}
        if op == "preload":
            return {"return_code": 0, "failed": self._python.preload(list(message["modules"]))}
        if op == "python":
            return self._captured(message, cap, lambda: self._run_python(message["code"], timeout))
        if op == "bash":
            argv = ["/bin/bash", "-c", message["command"]]
            return self._captured(message, cap, lambda: self._run_process(argv, timeout))
        if op == "javascript":
            argv = ["node", self._write_script(message["code"])]
            return self._captured(message, cap, lambda: self._run_process(argv, timeout))
        if op == "edit":
            before = produced.snapshot()
            result = self._editor.run(message.get("request") or {})
            result["stdout"] = result["stdout"][:cap]
            result["files"] = produced.produced_since(before, MAX_PRODUCED_FILES)
            return result
        return {"return_code": 1, "error": f"unknown op {op!r}"}

    def _captured(self, message: dict, cap: int, run) -> dict:
        before = produced.snapshot()
        self._capture.begin(message.get("id"), cap)
        try:
            return_code, timed_out = run()
        finally:
            _exit_if_forked_copy()
            truncated = self._capture.finish()
        return {
            "return_code": return_code,
            "timed_out": timed_out,
            "truncated": truncated,
            "files": produced.produced_since(before, MAX_PRODUCED_FILES),
        }

    def _run_python(self, code: str, timeout: float) -> tuple[int, bool]:
        forks_before = _forks_made
        return_code, timed_out = self._python.run(code, timeout)
        self._python.save_open_figures()
        if timed_out:
            _kill_everything_else()
        elif _forks_made != forks_before:
            # The code forked copies of this interpreter (os.fork, multiprocessing
            # with fork): they must not outlive the call, nor fork on (a bomb).
            _kill_forked_copies()
        return return_code, timed_out

    @staticmethod
    def _run_process(argv: list[str], timeout: float) -> tuple[int, bool]:
        try:
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, cwd=WORKSPACE,
                                       start_new_session=True)
        except OSError as exc:
            os.write(2, f"could not start {argv[0]}: {exc}\n".encode())
            return 127, False
        try:
            return_code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process.pid)
            process.wait()
            _wait_group_gone(process.pid)
            return 124, True
        if return_code < 0:
            return_code = 128 - return_code
        return return_code, False

    def _write_script(self, code: str) -> str:
        self._scripts += 1
        path = f"/tmp/.shoal-script-{self._scripts}.js"
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(code)
        return path


_AGENT_PID = os.getpid()
_forks_made = 0


def _count_fork() -> None:
    global _forks_made
    _forks_made += 1


os.register_at_fork(after_in_parent=_count_fork)


def _kill_forked_copies(patience: float = 2.0) -> None:
    """Kill every other process running this interpreter's own command line:
    forks of the agent, not programs the code started (those exec'd another)."""
    with open("/proc/self/cmdline", "rb") as handle:
        mine = handle.read()
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        found = 0
        for pid in _other_processes():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    if handle.read() != mine:
                        continue
                os.kill(pid, signal.SIGKILL)
                found += 1
            except OSError:
                continue
        if not found:
            return
        time.sleep(0.005)


def _exit_if_forked_copy() -> None:
    """A child that user code forked (``os.fork()``) returns into the agent's loop
    when its code ends: it must never read or answer a call, so it ends here."""
    if os.getpid() != _AGENT_PID:
        os._exit(0)


def _positive_int(value: object, default: int) -> int:
    return value if isinstance(value, int) and value > 0 else default


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def _wait_group_gone(pgid: int, patience: float = 1.0) -> None:
    """Let bubblewrap's init reap the killed group before the call answers."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except OSError:
            return
        time.sleep(0.002)


def _other_processes() -> list[int]:
    """Every process of the sandbox but its init (pid 1) and the agent itself."""
    keep = {1, os.getpid()}
    return [int(name) for name in os.listdir("/proc") if name.isdigit() and int(name) not in keep]


def _kill_everything_else() -> None:
    """Stop every process in the sandbox but its init and the agent."""
    for pid in _other_processes():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def main() -> None:
    serve_channel(int(sys.argv[1]) if len(sys.argv) > 1 else CHANNEL_FD)


def serve_channel(fd: int) -> None:
    channel = socket.socket(fileno=fd)
    os.set_inheritable(fd, False)
    devnull = os.open(os.devnull, os.O_RDWR)
    for std in (0, 1, 2):
        os.dup2(devnull, std)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.reconfigure(line_buffering=True)
    Agent(channel).serve()


if __name__ == "__main__":
    main()

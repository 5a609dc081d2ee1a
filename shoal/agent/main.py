"""The agent's entry point: serve calls from the host until the channel closes.

The agent is the sandbox's only long-lived process besides bubblewrap's init.
It runs one call at a time (the host serializes calls to a session), streams
its output and answers with one ``done`` frame. A reader thread keeps listening
while a call runs, for what the host sends in the middle of one: the results of
inner tool calls, and cancellation. Timeouts are enforced here, next to the
code, so that a Python call can be interrupted without losing the interpreter;
the host keeps a backstop that destroys the whole sandbox if the agent itself
stops answering.
"""

from __future__ import annotations

import builtins
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from . import produced, tools
from .relay import start_if_granted as start_egress_relay
from .capture import OutputCapture
from .editor import TextEditor
from .protocol import CHANNEL_FD, FrameError, encode, recv_frame
from .python_repl import CANCELLED_RETURN_CODE, PythonInterpreter

WORKSPACE = "/home/agent/workspace"
MAX_PRODUCED_FILES = 50
DEFAULT_CAP = 1024 * 1024
BUN = "/opt/shoal/runtime/bin/bun"
_HERE = os.path.dirname(os.path.abspath(__file__))
BUNFIG = os.path.join(_HERE, "bunfig.toml")
SYNC_STDIO = os.path.join(_HERE, "syncstdio.js")
# No package is ever installed, no .env file of the workspace is read, nothing
# is cached under $HOME, nothing is reported.
_BUN_ENV = {"DO_NOT_TRACK": "1", "BUN_RUNTIME_TRANSPILER_CACHE_PATH": "0",
            "BUN_OPTIONS": "--no-install --no-env-file"}
EXTERNAL_FILES = "/home/agent/.external-files"
_BUN_MISSING = ("JavaScript is not available: this server's runtime has no Bun "
                "(rebuild it with `shoal runtime build`, which installs the pinned Bun)\n")


class Agent:
    def __init__(self, channel: socket.socket) -> None:
        self._channel = channel
        self._send_lock = threading.Lock()
        self._capture = OutputCapture(self.send)
        # The call's last output frames, sent with its answer (OutputCapture.finish).
        self._last_output: list[dict] = []
        self._python = PythonInterpreter()
        self._editor = TextEditor()
        self._relay = tools.ToolRelay(self.send)
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._scripts = 0
        self._stubs: list[str] = []
        # The call in progress, and what stops it when the host cancels it.
        self._current: object = None
        self._cancelled: set = set()
        self._stop_current = lambda: None
        self._state_lock = threading.Lock()

    def send(self, message: dict) -> None:
        frame = encode(message)
        with self._send_lock:
            self._channel.sendall(frame)

    def serve(self) -> None:
        global _AGENT_PID
        _AGENT_PID = os.getpid()  # a zygote's fork is the agent: its pid, not the zygote's
        # Egress, where granted: the relay listens before anything runs.
        start_egress_relay()
        self.send({"type": "ready", "pid": os.getpid()})
        threading.Thread(target=self._read, name="shoal-channel-reader", daemon=True).start()
        while True:
            message = self._work.get()
            if message is None:
                return
            call_id = message.get("id")
            with self._state_lock:
                self._current = call_id
                cancelled = call_id in self._cancelled
            try:
                if cancelled:
                    result = {"return_code": CANCELLED_RETURN_CODE, "cancelled": True}
                else:
                    result = self._dispatch(message)
            except Exception as exc:  # the agent must outlive any one call
                result = {"return_code": 1, "error": f"agent error: {exc!r}"}
            with self._state_lock:
                self._current = None
                if call_id in self._cancelled:
                    result["cancelled"] = True
                self._cancelled.clear()
                self._stop_current = lambda: None
            result.update(id=call_id, type="done")
            frames = []
            for frame in (*self._last_output, result):
                try:
                    frames.append(encode(frame))
                except (FrameError, UnicodeError) as exc:
                    # An answer that cannot travel (too large, or text that is not
                    # UTF-8) must cost the call, never the agent and its state.
                    if frame is result:
                        frames.append(encode({
                            "id": call_id, "type": "done", "return_code": 1,
                            "error": f"agent error: the call's answer could not be sent: {exc}"}))
            self._last_output.clear()
            with self._send_lock:
                self._channel.sendall(b"".join(frames))
            if message.get("op") == "exit":
                return

    def _read(self) -> None:
        """Frames from the host: calls are queued for the main thread; tool results
        and cancellations are acted on at once, while a call runs."""
        while True:
            try:
                message = recv_frame(self._channel)
            except (FrameError, OSError):
                message = None
            if message is None:
                self._relay.abort("the host closed the channel")
                self._work.put(None)
                return
            op = message.get("op")
            if op == "tool_result":
                self._relay.deliver(message)
            elif op == "cancel":
                self._cancel(message.get("id"))
            else:
                self._work.put(message)

    def _cancel(self, call_id: object) -> None:
        with self._state_lock:
            self._cancelled.add(call_id)
            running = self._current == call_id
            stop = self._stop_current
        if running:
            stop()
            self._relay.abort("the call was cancelled")

    def _dispatch(self, message: dict) -> dict:
        op = message.get("op")
        cap = _positive_int(message.get("cap"), DEFAULT_CAP)
        if op == "ping" or op == "exit":
            return {"return_code": 0}
        if op == "preload":
            return {"return_code": 0, "failed": self._python.preload(list(message["modules"]))}
        if op == "warm":
            return self._warm(message, cap)
        _apply_env(message.get("env"))
        if op == "python":
            return self._captured(message, cap, lambda clock: self._run_python(message, clock))
        if op == "bash":
            argv = ["/bin/bash", "-c", message["command"]]
            return self._captured(message, cap, lambda clock: self._run_process(argv, clock))
        if op == "javascript":
            return self._captured(message, cap, lambda clock: self._run_javascript(message, clock))
        if op == "edit":
            before = produced.snapshot()
            result = self._editor.run(message.get("request") or {})
            result["stdout"] = result["stdout"][:cap]
            result["files"] = produced.produced_since(before, MAX_PRODUCED_FILES)
            return result
        return {"return_code": 1, "error": f"unknown op {op!r}"}

    def _captured(self, message: dict, cap: int, run) -> dict:
        timeout = max(0.001, float(message.get("timeout") or 60))
        clock = _Clock(timeout)
        wait_limit = _positive_number(message.get("tool_wait"), 300.0)
        if message.get("external_files"):
            _link_external_files()
        before = produced.snapshot()
        self._capture.begin(message.get("id"), cap)
        self._relay.begin(message.get("id"), wait_limit, clock.pause, clock.resume)
        try:
            return_code, timed_out = run(clock)
            _exit_if_forked_copy()
            # The files before the output's last drain: its frames and the answer
            # then leave back to back, and the host reads them in one wake-up
            # instead of two a file scan apart.
            files = produced.produced_since(before, MAX_PRODUCED_FILES)
        finally:
            _exit_if_forked_copy()
            self._relay.finish()
            truncated = self._capture.finish(self._last_output)
        return {
            "return_code": return_code,
            "timed_out": timed_out,
            "truncated": truncated,
            "files": files,
            "tool_calls": self._relay.calls_made,
        }

    def _warm(self, message: dict, cap: int) -> dict:
        """Walk a Python call's whole path once, before the sandbox is leased.

        A fork of the zygote pays on its first call for what it touches first:
        copy-on-write faults on the interpreter's pages, the workspace's cold
        directory entries, state built on first use. The pool pays that here,
        off the client's clock, in a throwaway namespace: the first client call
        finds the interpreter exactly as fresh (no variable, cell 1). The cell
        prints, because the output path (the capture's pipe, its reader, the
        chunks on the channel) is most of what a first call touches first: a
        silent cell left about 2 ms of it on the first client call."""
        python = self._python
        namespace, cells = python.namespace, python._cells
        python.namespace = {"__name__": "__main__", "__builtins__": builtins}
        try:
            result = self._captured({"id": message.get("id"), "timeout": 5}, cap,
                                    lambda clock: self._run_python({"code": "print(1)"}, clock))
        finally:
            python.namespace, python._cells = namespace, cells
            self._stubs = []
        return {"return_code": result["return_code"]}

    def _on_stop(self, stop) -> None:
        with self._state_lock:
            self._stop_current = stop
            cancelled = self._current in self._cancelled
        if cancelled:
            stop()

    def _run_python(self, message: dict, clock: "_Clock") -> tuple[int, bool]:
        stubs = message.get("tools")
        self._stubs = tools.install_python(
            self._python.namespace, self._relay, stubs if isinstance(stubs, list) else [],
            message.get("tool_module") if isinstance(message.get("tool_module"), str) else None,
            self._stubs)
        clock.on_pause, clock.on_resume = self._python.pause_clock, self._python.resume_clock
        self._on_stop(self._python.cancel)
        forks_before = _forks_made
        return_code, timed_out = self._python.run(message["code"], clock.seconds)
        self._python.save_open_figures()
        if timed_out or return_code == CANCELLED_RETURN_CODE:
            _kill_everything_else()
        elif _forks_made != forks_before:
            # The code forked copies of this interpreter (os.fork, multiprocessing
            # with fork): they must not outlive the call, nor fork on (a bomb).
            _kill_forked_copies()
        return return_code, timed_out

    def _run_javascript(self, message: dict, clock: "_Clock") -> tuple[int, bool]:
        if not os.access(BUN, os.X_OK):
            os.write(2, _BUN_MISSING.encode())
            return 127, False
        self._scripts += 1
        script = self._write_file(f"/tmp/.shoal-script-{self._scripts}.js", message["code"])
        argv = [BUN, f"--config={BUNFIG}", "--preload", SYNC_STDIO]
        env = {**os.environ, **_BUN_ENV}
        bridge = None
        stubs = message.get("tools")
        if isinstance(stubs, list) and stubs:
            prelude = self._write_file(f"/tmp/.shoal-tools-{self._scripts}.js",
                                       tools.javascript_stubs(stubs))
            bridge = tools.JavaScriptBridge(self._relay, f"/tmp/.shoal-tools-{self._scripts}.sock")
            env["SHOAL_TOOLS_SOCKET"] = bridge.path
            argv += ["--preload", prelude]
        try:
            return self._run_process([*argv, script], clock, env)
        finally:
            if bridge is not None:
                bridge.close()

    @staticmethod
    def _write_file(path: str, text: str) -> str:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
        return path

    def _run_process(self, argv: list[str], clock: "_Clock",
                     env: dict | None = None) -> tuple[int, bool]:
        try:
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, cwd=WORKSPACE,
                                       start_new_session=True, env=env)
        except OSError as exc:
            os.write(2, f"could not start {argv[0]}: {exc}\n".encode())
            return 127, False
        stopped = threading.Event()

        def stop() -> None:
            stopped.set()
            _kill_group(process.pid)

        self._on_stop(stop)
        while not _exited(process, 0.5 if clock.paused else min(clock.remaining(), 0.5)):
            if clock.remaining() <= 0 and not clock.paused:
                _kill_group(process.pid)
                process.wait()
                _wait_group_gone(process.pid)
                return 124, True
        return_code = process.wait()
        if stopped.is_set():
            _wait_group_gone(process.pid)
            return CANCELLED_RETURN_CODE, False
        if return_code < 0:
            return_code = 128 - return_code
        return return_code, False


class _Clock:
    """A call's time budget, stopped while its code waits for tool results."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._deadline = time.monotonic() + seconds
        self._paused_at: float | None = None
        self.on_pause = lambda: None
        self.on_resume = lambda: None

    @property
    def paused(self) -> bool:
        return self._paused_at is not None

    def remaining(self) -> float:
        now = self._paused_at if self._paused_at is not None else time.monotonic()
        return self._deadline - now

    def pause(self) -> None:
        if self._paused_at is None:
            self._paused_at = time.monotonic()
            self.on_pause()

    def resume(self) -> None:
        if self._paused_at is not None:
            self._deadline += time.monotonic() - self._paused_at
            self._paused_at = None
            self.on_resume()


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


def _apply_env(env: object) -> None:
    """Variables the host sets for this call and the ones after it (the model API's
    base URL and token of the request that runs the code): in the interpreter's
    environment, so Python, bash and Bun all see them."""
    if not isinstance(env, dict):
        return
    for name, value in env.items():
        if (isinstance(name, str) and isinstance(value, str) and name and len(name) < 128
                and name.replace("_", "a").isalnum() and not name[0].isdigit()
                and "\x00" not in value and len(value) < 8192):
            os.environ[name] = value


def _positive_int(value: object, default: int) -> int:
    return value if isinstance(value, int) and value > 0 else default


def _exited(process: subprocess.Popen, timeout: float) -> bool:
    """Wait up to ``timeout`` for a child to exit, woken the moment it does
    (a pidfd), not at the next tick of a polling loop."""
    try:
        fd = os.pidfd_open(process.pid)
    except OSError:  # already reaped, or no pidfds here
        try:
            process.wait(max(timeout, 0))
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(max(0, int(timeout * 1000))))
    finally:
        os.close(fd)


def _positive_number(value: object, default: float) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return default


def _link_external_files() -> None:
    """``./external-files`` in the workspace: the container's files, read-only.

    The host lays them out in a read-only mount; the link is made here, as the
    sandbox's own uid, and only replaces a link (never a file the code made).
    """
    link = os.path.join(WORKSPACE, "external-files")
    try:
        if os.readlink(link) == EXTERNAL_FILES:
            return
        os.unlink(link)
    except FileNotFoundError:
        pass
    except OSError:
        return  # a real file or directory of the code's own: leave it
    try:
        os.symlink(EXTERNAL_FILES, link)
    except OSError:
        pass


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

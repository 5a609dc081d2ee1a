"""Inner tool calls: stubs inside the sandbox for tools the client owns.

The sandbox has no network, so a stub never reaches a tool itself: it asks the
host over the agent's channel and waits. The host decides everything that
matters (whether the tool is allowed, whether the arguments fit its schema,
which client answers); the stubs here are a convenience for the code, never the
control. Code can forge any request it likes on the channel, and the host
refuses what the run did not grant.

Calls made at the same time travel as one batch, so the client sees them in one
``tool_call.required``: awaitable stubs started in one turn of an event loop
(``asyncio.gather``), JavaScript calls made in one tick (``Promise.all``), and
blocking stubs called from several threads within a couple of milliseconds of
each other. A lone blocking call goes out at once.

While any call waits for its result, the call's clock stops (time spent waiting
for the client does not count against its timeout); the host bounds the wait
with a ceiling of its own and answers with an error when it passes.
"""

from __future__ import annotations

import itertools
import json
import keyword
import os
import socket
import sys
import threading
import time
import types
from typing import Callable

from .protocol import MAX_FRAME_BYTES, FrameError

# How long a blocking call waits for other threads' calls to join its batch;
# only when the code runs more than one thread.
BATCH_WINDOW_SECONDS = 0.002
# Past the host's own ceiling: the host's error answer normally comes first.
_WAIT_GRACE_SECONDS = 5.0
_MAX_LINE_BYTES = 4 * 1024 * 1024
# What a JavaScript stub puts in one line: a batch that fits goes on in one
# frame to the host (the frame's envelope beside it), and within the line the
# bridge reads.
_MAX_SENT_LINE = min(_MAX_LINE_BYTES, MAX_FRAME_BYTES) - 64 * 1024
# The host's cap (shoal.sandbox.toolcalls.MAX_CALLS_PER_CALL): calls past it are
# refused here, since the host answers only so many refusals per call and drops
# the rest (a flood of forged entries must not cost it a frame each).
MAX_CALLS_PER_CALL = 1000


class ToolError(Exception):
    """A tool call failed: refused by the host, failed by the client, or timed out."""


class _Pending:
    __slots__ = ("ref", "name", "arguments", "complete")

    def __init__(self, ref: str, name: str, arguments: object,
                 complete: Callable[[dict], None]) -> None:
        self.ref = ref
        self.name = name
        self.arguments = arguments
        self.complete = complete


class ToolRelay:
    """Carries the calls of the running call's stubs to the host and back."""

    def __init__(self, send: Callable[[dict], None]) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._refs = itertools.count(1)
        self._batch: list[_Pending] = []
        self._waiting: dict[str, _Pending] = {}
        self._call_id: object = None
        self._wait_limit = 300.0
        self._on_pause: Callable[[], None] = lambda: None
        self._on_resume: Callable[[], None] = lambda: None
        self.calls_made = 0

    # -- the call's lifetime ------------------------------------------------------------
    def begin(self, call_id: object, wait_limit: float, on_pause: Callable[[], None],
              on_resume: Callable[[], None]) -> None:
        with self._lock:
            self._call_id = call_id
            self._wait_limit = wait_limit
            self._on_pause, self._on_resume = on_pause, on_resume
            self.calls_made = 0

    def finish(self) -> None:
        """The call is over: whatever still waits fails, and nothing more is sent."""
        self.abort("the call ended before the tool answered")
        with self._lock:
            self._call_id = None
            self._on_pause = self._on_resume = lambda: None

    def abort(self, reason: str) -> None:
        with self._lock:
            waiting = list(self._waiting.values()) + self._batch
            self._waiting.clear()
            self._batch = []
            was_waiting = bool(waiting)
        for pending in waiting:
            pending.complete({"error": reason})
        if was_waiting:
            self._on_resume()

    @property
    def active(self) -> bool:
        return self._call_id is not None

    # -- from the stubs ---------------------------------------------------------------------
    def call(self, name: str, arguments: object) -> object:
        """Blocking: send one call (batched with concurrent ones) and wait for its result."""
        done = threading.Event()
        box: dict = {}

        def complete(result: dict) -> None:
            box.update(result)
            done.set()

        first = self._enqueue(name, arguments, complete)
        if first:
            if _user_threads() > 1:
                time.sleep(BATCH_WINDOW_SECONDS)
            self._flush()
        if not done.wait(self._wait_limit + _WAIT_GRACE_SECONDS):
            raise ToolError(f"tool {name!r} did not answer within {self._wait_limit:g}s")
        return _outcome(name, box)

    async def call_async(self, name: str, arguments: object) -> object:
        """Awaitable: calls started in one turn of the event loop go out as one batch."""
        import asyncio

        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def complete(result: dict) -> None:
            def settle() -> None:
                if not future.done():
                    future.set_result(result)
            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:
                pass  # the loop is closed: nobody waits any more

        if self._enqueue(name, arguments, complete):
            loop.call_soon(self._flush)
        result = await asyncio.wait_for(future, self._wait_limit + _WAIT_GRACE_SECONDS)
        return _outcome(name, result)

    def submit(self, calls: list[tuple[str, object]], complete: Callable[[int, dict], None]) -> None:
        """A whole batch at once (the JavaScript bridge); ``complete(index, result)``."""
        entries = []
        with self._lock:
            for index, (name, arguments) in enumerate(calls):
                entries.append(self._pending(name, arguments,
                                             lambda result, i=index: complete(i, result)))
        if entries:
            self._send_batch(entries)

    # -- from the host -------------------------------------------------------------------------
    def deliver(self, message: dict) -> None:
        ref = message.get("ref")
        with self._lock:
            pending = self._waiting.pop(ref, None) if isinstance(ref, str) else None
            resumed = pending is not None and not self._waiting
        if pending is None:
            return  # stale, forged, or already failed
        if "error" in message:
            pending.complete({"error": str(message["error"])})
        else:
            pending.complete({"output": message.get("output")})
        if resumed:
            self._on_resume()

    # -- internals -----------------------------------------------------------------------------
    def _pending(self, name: str, arguments: object, complete) -> _Pending:
        return _Pending(f"t{next(self._refs)}", name, arguments, complete)

    def _enqueue(self, name: str, arguments: object, complete) -> bool:
        if not self.active:
            raise ToolError(f"tool {name!r} can only be called while the code runs")
        with self._lock:
            self._batch.append(self._pending(name, arguments, complete))
            return len(self._batch) == 1

    def _flush(self) -> None:
        with self._lock:
            batch, self._batch = self._batch, []
        if batch:
            self._send_batch(batch)

    def _send_batch(self, batch: list[_Pending]) -> None:
        with self._lock:
            call_id = self._call_id
            if call_id is None:
                failed = batch
            else:
                room = max(MAX_CALLS_PER_CALL - self.calls_made, 0)
                batch, failed = batch[:room], batch[room:]
                paused = not self._waiting
                for pending in batch:
                    self._waiting[pending.ref] = pending
                self.calls_made += len(batch)
        if failed:
            reason = ("the call ended before the tool was called" if call_id is None else
                      f"at most {MAX_CALLS_PER_CALL} tool calls are allowed per call")
            for pending in failed:
                pending.complete({"error": reason})
        if not batch or call_id is None:
            return
        if paused:
            self._on_pause()
        try:
            self._send({"id": call_id, "type": "tool_calls",
                        "calls": [{"ref": p.ref, "name": p.name, "arguments": p.arguments}
                                  for p in batch]})
        except (TypeError, ValueError, FrameError) as exc:
            # The calls never left: they fail here, as ToolErrors, and the clock
            # they stopped runs again. Left waiting, they kept it stopped for the
            # rest of the call, so its timeout went unenforced until the host's
            # backstop destroyed the interpreter and everything the code had.
            self._unsend(batch, _unsendable(exc))

    def _unsend(self, batch: list[_Pending], reason: str) -> None:
        with self._lock:
            for pending in batch:
                self._waiting.pop(pending.ref, None)
            self.calls_made -= len(batch)
            idle = not self._waiting
        for pending in batch:
            pending.complete({"error": reason})
        if idle:
            self._on_resume()


def _unsendable(exc: Exception) -> str:
    if isinstance(exc, FrameError):
        return (f"the tool call is too large to send: its arguments may be at most "
                f"{MAX_FRAME_BYTES // (1024 * 1024)} MiB as JSON (pass large data through "
                "files instead)")
    return f"the tool call's arguments must be JSON: {exc}"


def _outcome(name: str, result: dict) -> object:
    if "error" in result:
        raise ToolError(str(result["error"]))
    output = result.get("output")
    if isinstance(output, str):
        try:
            return json.loads(output)
        except ValueError:
            return output
    return output


def _user_threads() -> int:
    """Threads of the code itself (the agent's own are named ``shoal-*``)."""
    return sum(1 for thread in threading.enumerate() if not thread.name.startswith("shoal-"))


# -- Python stubs ------------------------------------------------------------------------------
def python_name(tool_name: str) -> str | None:
    """The identifier a tool is called by in Python, or None if it cannot be one."""
    name = tool_name.replace("-", "_")
    if not name.isidentifier() or keyword.iskeyword(name):
        return None
    return name


def _arguments(spec: dict, args: tuple, kwargs: dict) -> object:
    if len(args) == 1 and not kwargs and isinstance(args[0], dict):
        return args[0]
    names = list((spec.get("parameters") or {}).get("properties") or {})
    if len(args) > len(names):
        raise TypeError(f"{spec['name']}() takes at most {len(names)} positional arguments "
                        f"({len(args)} given); pass keyword arguments")
    merged = dict(zip(names, args))
    for key, value in kwargs.items():
        if key in merged:
            raise TypeError(f"{spec['name']}() got multiple values for argument {key!r}")
        merged[key] = value
    return merged


def make_stubs(relay: ToolRelay, specs: list[dict]) -> dict[str, Callable]:
    """``name`` (blocking) and ``name_async`` (awaitable) for each tool spec."""
    stubs: dict[str, Callable] = {}
    for spec in specs:
        name = spec.get("name")
        identifier = python_name(name) if isinstance(name, str) else None
        if identifier is None:
            continue
        doc = spec.get("description") or spec.get("doc") or f"Calls the client's tool {name!r}."

        def stub(*args, _spec=spec, **kwargs):
            return relay.call(_spec["name"], _arguments(_spec, args, kwargs))

        async def stub_async(*args, _spec=spec, **kwargs):
            return await relay.call_async(_spec["name"], _arguments(_spec, args, kwargs))

        for function, suffix in ((stub, ""), (stub_async, "_async")):
            function.__name__ = function.__qualname__ = identifier + suffix
            function.__doc__ = str(doc)
            stubs[identifier + suffix] = function
    return stubs


def stub_module(name: str, stubs: dict[str, Callable]) -> types.ModuleType:
    module = types.ModuleType(name, "Stubs of the client's tools; each call asks the host.")
    module.ToolError = ToolError
    module.__all__ = sorted(stubs)
    for key, function in stubs.items():
        setattr(module, key, function)
    return module


# -- the JavaScript bridge ------------------------------------------------------------------------
class JavaScriptBridge:
    """A UNIX socket the JavaScript stubs connect to; one JSON line per batch.

    Bun runs in a process of its own, so its stubs reach the relay through a
    socket in the sandbox's /tmp, named for the one call it serves and gone
    with it. Requests are ``{"calls": [{"id", "name", "arguments"}]}``; each
    answer is ``{"id", "output"}`` or ``{"id", "error"}``.
    """

    def __init__(self, relay: ToolRelay, path: str) -> None:
        self._relay = relay
        self.path = path
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self._server.bind(path)
        os.chmod(path, 0o600)
        self._server.listen(4)
        self._closed = False
        threading.Thread(target=self._accept, name="shoal-js-bridge", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        try:
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._server.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                connection, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(connection,), name="shoal-js-conn",
                             daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        write_lock = threading.Lock()

        def answer(message: dict) -> None:
            line = json.dumps(message, ensure_ascii=False).encode() + b"\n"
            with write_lock:
                try:
                    connection.sendall(line)
                except OSError:
                    pass

        buffer = b""
        with connection:
            while True:
                try:
                    chunk = connection.recv(65536)
                except OSError:
                    return
                if not chunk:
                    return
                buffer += chunk
                if len(buffer) > _MAX_LINE_BYTES and b"\n" not in buffer:
                    return
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    self._batch(line, answer)

    def _batch(self, line: bytes, answer: Callable[[dict], None]) -> None:
        try:
            request = json.loads(line)
            calls = request["calls"]
            ids = [call["id"] for call in calls]
            batch = [(str(call["name"]), call.get("arguments")) for call in calls]
        except (ValueError, KeyError, TypeError):
            return
        try:
            self._relay.submit(batch, lambda index, result: answer({"id": ids[index], **result}))
        except ToolError as exc:
            for call_id in ids:
                answer({"id": call_id, "error": str(exc)})


JAVASCRIPT_PRELUDE = r"""
// Stubs of the client's tools (Shoal). Each call asks the host, which owns the tools.
const __shoalTools = (() => {
  const net = require("node:net");
  let socket = null, buffer = "", nextId = 1, queue = [];
  const MAX_LINE = __MAX_LINE__, MAX_LINE_MIB = __MAX_LINE_MIB__;
  const waiting = new Map();
  class ToolError extends Error { constructor(message) { super(message); this.name = "ToolError"; } }
  function connect() {
    if (socket) return socket;
    socket = net.createConnection(process.env.SHOAL_TOOLS_SOCKET);
    socket.setEncoding("utf8");
    socket.on("data", (chunk) => {
      buffer += chunk;
      let end;
      while ((end = buffer.indexOf("\n")) >= 0) {
        const answer = JSON.parse(buffer.slice(0, end));
        buffer = buffer.slice(end + 1);
        const entry = waiting.get(answer.id);
        if (!entry) continue;
        waiting.delete(answer.id);
        if (waiting.size === 0) socket.unref();
        if ("error" in answer) entry.reject(new ToolError(String(answer.error)));
        else {
          let value = answer.output;
          if (typeof value === "string") { try { value = JSON.parse(value); } catch (_) {} }
          entry.resolve(value);
        }
      }
    });
    socket.on("error", (error) => {
      for (const entry of waiting.values()) entry.reject(new ToolError(`${entry.name}: ${error.message}`));
      waiting.clear();
    });
    return socket;
  }
  // Arguments are written when the call is made, so that what cannot travel
  // (a BigInt, a cycle, more than a line holds) rejects that call's promise;
  // thrown later, in the microtask that sends the batch, it was uncaught, and
  // the script hung until its timeout. A batch is sent in lines the bridge
  // takes (a longer one was cut off, failing every call on the socket).
  function line(calls) {
    return '{"calls":[' + calls.map(({ id, name, encoded }) =>
      `{"id":${id},"name":${JSON.stringify(name)},"arguments":${encoded}}`).join(",") + "]}\n";
  }
  function flush() {
    const calls = queue; queue = [];
    const s = connect(); s.ref();
    let start = 0, size = 0;
    calls.forEach((entry, index) => {
      if (index > start && size + entry.size > MAX_LINE) {
        s.write(line(calls.slice(start, index)));
        start = index; size = 0;
      }
      size += entry.size;
    });
    s.write(line(calls.slice(start)));
  }
  function call(name, args) {
    return new Promise((resolve, reject) => {
      let encoded;
      try { encoded = JSON.stringify(args === undefined ? {} : args); }
      catch (error) { encoded = error; }
      if (typeof encoded !== "string") {
        const why = encoded instanceof Error ? `: ${encoded.message}` : "";
        reject(new ToolError(`the tool call's arguments must be JSON${why}`));
        return;
      }
      const size = Buffer.byteLength(encoded) + name.length + 32;
      if (size > MAX_LINE) {
        reject(new ToolError(`the tool call is too large to send: its arguments may be at most ${MAX_LINE_MIB} MiB as JSON (pass large data through files instead)`));
        return;
      }
      const id = nextId++;
      waiting.set(id, { name, resolve, reject });
      if (queue.length === 0) queueMicrotask(flush);
      queue.push({ id, name, encoded, size });
    });
  }
  globalThis.ToolError = ToolError;
  return { call };
})();
"""


def javascript_stubs(specs: list[dict]) -> str:
    """A prelude defining one async function per tool (``await name({...})``)."""
    lines = [JAVASCRIPT_PRELUDE.replace("__MAX_LINE__", str(_MAX_SENT_LINE)).replace(
        "__MAX_LINE_MIB__", str(MAX_FRAME_BYTES // (1024 * 1024)))]
    for spec in specs:
        name = spec.get("name")
        if not isinstance(name, str) or python_name(name) is None:
            continue
        identifier = python_name(name)
        lines.append(f"globalThis[{json.dumps(identifier)}] = (args) => "
                     f"__shoalTools.call({json.dumps(name)}, args);")
    return "\n".join(lines) + "\n"


def install_python(namespace: dict, relay: ToolRelay, specs: list[dict],
                   module_name: str | None, previous: list[str]) -> list[str]:
    """Put stubs where code finds them; returns the names now installed.

    Stubs from an earlier call are removed first (unless code rebound the name),
    so a tool granted once is not callable later even by its stub (the host
    would refuse it anyway).
    """
    for name in previous:
        value = namespace.get(name)
        if getattr(value, "__shoal_stub__", False):
            del namespace[name]
    stubs = make_stubs(relay, specs)
    for function in stubs.values():
        function.__shoal_stub__ = True
    if module_name:
        sys.modules[module_name] = stub_module(module_name, stubs)
        return []
    namespace.update(stubs)
    namespace.setdefault("ToolError", ToolError)
    return list(stubs)

"""File-descriptor level capture of every call's stdout and stderr.

Output written by child processes and C extensions bypasses Python's
``sys.stdout``, so fds 1 and 2 of the agent (and of every process it starts)
are the write ends of two long-lived pipes. A pump thread forwards whatever
arrives to the host as ``out`` frames while a call runs, so output streams and
a chatty program never blocks on a full pipe.

A call is over when its own code returns, not when every writer closed the
pipe: a background job (``sleep 100 &``) may hold it open forever. So at the
end of a call the agent itself drains what is already in the pipes, under the
same lock the pump uses, which keeps the order of the bytes and costs no thread
wake-up. What background jobs print between calls is dropped.

Output is coalesced: bytes wait until 4 KiB have gathered or 50 ms have passed
since the first of them, so a chatty program costs the channel a frame per
chunk, not per ``print``, and the host still sees output while the call runs.

The pump enforces the per-stream cap, so a program that prints forever costs
the host nothing beyond it.
"""

from __future__ import annotations

import codecs
import fcntl
import os
import select
import threading
import time
from typing import Callable

TRUNCATION_MARKER = "\n...[truncated]"
_READ_SIZE = 65536
_F_SETPIPE_SZ = 1031
_PIPE_SIZE = 1024 * 1024
COALESCE_BYTES = 4096
COALESCE_SECONDS = 0.05


class _CallState:
    def __init__(self, call_id: int, cap: int) -> None:
        self.call_id = call_id
        self.cap = cap
        self.sent = {"stdout": 0, "stderr": 0}
        self.truncated = {"stdout": False, "stderr": False}
        self.decoders = {name: codecs.getincrementaldecoder("utf-8")("replace")
                         for name in self.sent}
        # Text decoded but not yet sent, and when its first byte arrived.
        self.held: dict[str, list[str]] = {name: [] for name in self.sent}
        self.held_bytes = {name: 0 for name in self.sent}
        self.held_since: float | None = None


class OutputCapture:
    """Owns fds 1 and 2 of the agent; forwards their bytes to the current call."""

    def __init__(self, send: Callable[[dict], None]) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._call: _CallState | None = None
        self._readers: dict[int, str] = {}
        self._writers: dict[str, int] = {}
        for name in ("stdout", "stderr"):
            read_end, write_end = os.pipe()
            try:
                fcntl.fcntl(write_end, _F_SETPIPE_SZ, _PIPE_SIZE)
            except OSError:
                pass  # a smaller pipe only means more wake-ups
            os.set_blocking(read_end, False)
            self._readers[read_end] = name
            self._writers[name] = write_end
        self.attach()
        threading.Thread(target=self._pump, name="shoal-output-pump", daemon=True).start()

    def attach(self) -> None:
        """Point fds 1 and 2 at the pipes again, in case user code moved them."""
        os.dup2(self._writers["stdout"], 1)
        os.dup2(self._writers["stderr"], 2)

    def begin(self, call_id: int, cap: int) -> None:
        self.attach()
        with self._lock:
            self._drain_locked()  # leftovers of background jobs belong to no call
            self._call = _CallState(call_id, cap)

    def finish(self, last: list[dict]) -> dict[str, bool]:
        """Take what the call left in the pipes: its last frames go into ``last``,
        for the agent to send with the call's answer (one write, one wake-up of
        the host, which then ends the call's output and the call together).
        Returns which streams were cut."""
        with self._lock:
            self._drain_locked()
            call, self._call = self._call, None
        if call is None:
            return {"stdout": False, "stderr": False}
        for name, decoder in call.decoders.items():
            call.held[name].append(decoder.decode(b"", final=True))
            if call.truncated[name]:
                call.held[name].append(TRUNCATION_MARKER)
        self._release(call, last.append)
        return call.truncated

    def _pump(self) -> None:
        poller = select.poll()
        for fd in self._readers:
            poller.register(fd, select.POLLIN)
        while True:
            call = self._call
            wait = None
            if call is not None and call.held_since is not None:
                wait = max(0, int((call.held_since + COALESCE_SECONDS - time.monotonic()) * 1000))
            poller.poll(wait)
            with self._lock:
                # A bounded helping per turn, so a writer faster than us can
                # never keep the lock from the end of a call.
                self._drain_locked(budget=4 * _READ_SIZE)
                call = self._call
                if (call is not None and call.held_since is not None
                        and time.monotonic() - call.held_since >= COALESCE_SECONDS):
                    self._release(call)

    def _release(self, call: _CallState, send: Callable[[dict], None] | None = None) -> None:
        """Send what the call holds back, one frame per stream."""
        send = send or self._send
        for name, parts in call.held.items():
            text = "".join(parts)
            parts.clear()
            call.held_bytes[name] = 0
            if text:
                send({"id": call.call_id, "type": "out", "stream": name, "data": text})
        call.held_since = None

    def _drain_locked(self, budget: int = 2 * _PIPE_SIZE) -> None:
        """Read what the pipes hold now, at most ``budget`` bytes per stream.

        The budget also ends a drain that a background writer keeps feeding.
        """
        for fd, name in self._readers.items():
            taken = 0
            while taken < budget:
                try:
                    data = os.read(fd, _READ_SIZE)
                except BlockingIOError:
                    break
                if not data:
                    break
                taken += len(data)
                if self._call is not None:
                    self._forward(self._call, name, data)

    def _forward(self, call: _CallState, stream: str, data: bytes) -> None:
        room = call.cap - call.sent[stream]
        if room <= 0:
            call.truncated[stream] = True
            return
        if len(data) > room:
            data = data[:room]
            call.truncated[stream] = True
        call.sent[stream] += len(data)
        text = call.decoders[stream].decode(data)
        if text:
            call.held[stream].append(text)
            call.held_bytes[stream] += len(data)
            if call.held_since is None:
                call.held_since = time.monotonic()
            if call.held_bytes[stream] >= COALESCE_BYTES:
                self._release(call)  # one read at most per frame: frames stay small

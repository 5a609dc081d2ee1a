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

The pump enforces the per-stream cap, so a program that prints forever costs
the host nothing beyond it.
"""

from __future__ import annotations

import codecs
import fcntl
import os
import select
import threading
from typing import Callable

TRUNCATION_MARKER = "\n...[truncated]"
_READ_SIZE = 65536
_F_SETPIPE_SZ = 1031
_PIPE_SIZE = 1024 * 1024


class _CallState:
    def __init__(self, call_id: int, cap: int) -> None:
        self.call_id = call_id
        self.cap = cap
        self.sent = {"stdout": 0, "stderr": 0}
        self.truncated = {"stdout": False, "stderr": False}
        self.decoders = {name: codecs.getincrementaldecoder("utf-8")("replace")
                         for name in self.sent}


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
        threading.Thread(target=self._pump, name="output-pump", daemon=True).start()

    def attach(self) -> None:
        """Point fds 1 and 2 at the pipes again, in case user code moved them."""
        os.dup2(self._writers["stdout"], 1)
        os.dup2(self._writers["stderr"], 2)

    def begin(self, call_id: int, cap: int) -> None:
        self.attach()
        with self._lock:
            self._drain_locked()  # leftovers of background jobs belong to no call
            self._call = _CallState(call_id, cap)

    def finish(self) -> dict[str, bool]:
        """Forward what the call left in the pipes; returns which streams were cut."""
        with self._lock:
            self._drain_locked()
            call, self._call = self._call, None
        if call is None:
            return {"stdout": False, "stderr": False}
        for name, decoder in call.decoders.items():
            tail = decoder.decode(b"", final=True)
            if call.truncated[name]:
                tail += TRUNCATION_MARKER
            if tail:
                self._send({"id": call.call_id, "type": "out", "stream": name, "data": tail})
        return call.truncated

    def _pump(self) -> None:
        poller = select.poll()
        for fd in self._readers:
            poller.register(fd, select.POLLIN)
        while True:
            poller.poll()
            with self._lock:
                # A bounded helping per turn, so a writer faster than us can
                # never keep the lock from the end of a call.
                self._drain_locked(budget=4 * _READ_SIZE)

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
            self._send({"id": call.call_id, "type": "out", "stream": stream, "data": text})

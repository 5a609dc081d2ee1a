"""The sandbox's end of egress: a proxy port on loopback, relayed to the host.

The sandbox's network namespace has only its loopback. Where the host grants
egress, it binds its broker's socket into the sandbox at
``/run/shoal-egress/proxy.sock``, and this relay listens on
``127.0.0.1:3128``. ``HTTP(S)_PROXY`` points there. Each TCP connection is
copied byte for byte to a new connection to the broker. The broker reads the
proxy request, knows the sandbox by the uid the kernel reports for the
socket, and decides. The relay decides nothing: code that skips it and talks
to the socket itself gets the same answers.

It is one thread and one ``selectors`` loop for every connection, because
threads count against the sandbox's pids limit. The agent starts it before it
reports ready, so no user code runs before the port answers.
"""

from __future__ import annotations

import os
import selectors
import socket
import threading

SOCKET_PATH = "/run/shoal-egress/proxy.sock"
PORT = 3128
MAX_CONNECTIONS = 64
_CHUNK = 64 * 1024


class _Pipe:
    """One direction of a connection: what was read from ``source`` and not yet
    written to ``sink`` (at most one chunk, so a slow reader is never buffered
    without bound)."""

    __slots__ = ("source", "sink", "pending", "eof")

    def __init__(self, source: socket.socket, sink: socket.socket) -> None:
        self.source = source
        self.sink = sink
        self.pending = b""
        self.eof = False


class _Connection:
    __slots__ = ("pipes", "registered")

    def __init__(self, client: socket.socket, host: socket.socket) -> None:
        self.pipes = (_Pipe(client, host), _Pipe(host, client))
        self.registered: dict[socket.socket, bool] = {client: False, host: False}

    def events(self, sock: socket.socket) -> int:
        wanted = 0
        for pipe in self.pipes:
            if pipe.source is sock and not pipe.pending and not pipe.eof:
                wanted |= selectors.EVENT_READ
            if pipe.sink is sock and pipe.pending:
                wanted |= selectors.EVENT_WRITE
        return wanted

    @property
    def done(self) -> bool:
        return all(pipe.eof and not pipe.pending for pipe in self.pipes)


class Relay(threading.Thread):
    def __init__(self, socket_path: str = SOCKET_PATH, port: int = PORT) -> None:
        super().__init__(name="shoal-egress-relay", daemon=True)
        self._socket_path = socket_path
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", port))  # IPv4 loopback, explicitly
        self._listener.listen(128)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._connections = 0

    def run(self) -> None:
        while True:
            for key, _ in self._selector.select():
                if key.data is None:
                    self._accept()
                else:
                    self._step(key.fileobj, key.data)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except OSError:
            return
        if self._connections >= MAX_CONNECTIONS:
            client.close()
            return
        host = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            host.connect(self._socket_path)
        except OSError:
            host.close()
            client.close()
            return
        client.setblocking(False)
        host.setblocking(False)
        self._connections += 1
        connection = _Connection(client, host)
        self._update(connection)

    def _step(self, sock: socket.socket, connection: _Connection) -> None:
        for pipe in connection.pipes:
            if pipe.source is sock and not pipe.pending and not pipe.eof:
                try:
                    data = sock.recv(_CHUNK)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if data:
                    pipe.pending = data
                else:
                    pipe.eof = True
                    _shutdown_write(pipe.sink)
            if pipe.pending:
                self._flush(pipe)
        if connection.done:
            self._close(connection)
        else:
            self._update(connection)

    def _flush(self, pipe: _Pipe) -> None:
        while pipe.pending:
            try:
                sent = pipe.sink.send(pipe.pending)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # the other side is gone: so is this direction
                pipe.pending = b""
                pipe.eof = True
                return
            pipe.pending = pipe.pending[sent:]

    def _update(self, connection: _Connection) -> None:
        for sock, registered in list(connection.registered.items()):
            wanted = connection.events(sock)
            if wanted and registered:
                self._selector.modify(sock, wanted, connection)
            elif wanted:
                self._selector.register(sock, wanted, connection)
            elif registered:
                self._selector.unregister(sock)
            connection.registered[sock] = bool(wanted)

    def _close(self, connection: _Connection) -> None:
        for sock, registered in connection.registered.items():
            if registered:
                self._selector.unregister(sock)
            sock.close()
        self._connections -= 1


def _shutdown_write(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def start_if_granted() -> Relay | None:
    """The relay, listening, where the host bound its broker in; else None."""
    if not os.path.exists(SOCKET_PATH):
        return None
    relay = Relay()
    relay.start()
    return relay

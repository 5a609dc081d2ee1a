"""Runs the app under uvicorn, after checking that isolation is possible.

The checks run before the server binds, so a host that cannot isolate code
answers with a message naming what is missing instead of a traceback, and
never with a server that runs code unsandboxed.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket
import sys

import uvicorn

from . import logs
from .api.auth import TokenConfigError, TokenTable
from .config import Settings
from .connections import header_deadline_protocol
from .runs import CALLBACKS_AT_ONCE


class StartupError(RuntimeError):
    """Something outside the host's isolation stops the server: named in one line."""


def startup_problems(settings: Settings) -> list[str]:
    """Everything that stops this host from serving safely, named, all at once."""
    from .sandbox import preflight
    from .sandbox.cgroups import CgroupManager, CgroupUnavailable
    from .sandbox.runtime import RuntimeMissing, find_runtime

    found = preflight.problems()
    try:
        CgroupManager()
    except CgroupUnavailable as exc:
        found.append(str(exc))
    try:
        find_runtime(settings.runtime_dir)
    except RuntimeMissing as exc:
        found.append(str(exc))
    try:
        TokenTable.parse(settings.tokens, settings.operator_tokens)
    except TokenConfigError as exc:
        found.append(str(exc))
    from .config import read_secret
    from .storage import files_problem, metadata_problem

    try:
        problem = metadata_problem(settings.data_dir, read_secret(settings.database_url))
    except ValueError as exc:  # an '@file' that cannot be read
        problem = f"database_url: {exc}"
    if problem:
        found.append(problem)
    for name in ("upstream_anthropic_key", "upstream_openai_key"):
        setting = getattr(settings, name).strip()
        try:
            key = read_secret(setting)
        except ValueError as exc:
            found.append(f"{name}: {exc}")
            continue
        # Sent as a header, which httpx encodes as ASCII: a key pasted with its
        # typographic quotes made every gateway call a 500.
        if not key.isascii():
            where = setting[1:] if setting.startswith("@") else "the value"
            found.append(f"{name}: {where} holds a character past ASCII, which a header "
                         "cannot carry (typographic quotes around the key?)")
    try:
        problem = files_problem(settings.object_store_config())
    except ValueError as exc:
        problem = f"object store: {exc}"
    if problem:
        found.append(problem)
    return found


def _raise_fd_limit() -> int:
    """Every live sandbox costs the server a few fds (its channel, its pipes):
    take the soft limit up to the hard one, as servers do (systemd's default soft
    limit, 1024, would cap a busy server at a few hundred sandboxes). Returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


# What the server holds besides its clients' connections, in fds: its own
# (listener, database, logs) and, per sandbox, its channel and pipes (about 5,
# measured) with room for its egress; the gateway's upstream connections, and
# each session's tool callbacks.
_OWN_FDS = 64
_FDS_PER_SANDBOX = 8


def open_files_shortfall(settings: Settings, limit: int) -> str | None:
    """Why ``limit`` open files cannot hold max_connections beside what the
    sandboxes need, or None: past the limit the server can neither accept nor
    start a sandbox, for anyone."""
    if settings.cluster:
        # A front end runs no sandbox and calls no model: beside each client's
        # connection it holds one to the host relaying that client's call.
        others = _OWN_FDS + settings.max_connections
        held = "connections to the sandbox hosts"
        fitting = (limit - _OWN_FDS) // 2
    else:
        sandboxes = settings.max_sessions + settings.pool_size
        others = (_OWN_FDS + _FDS_PER_SANDBOX * sandboxes + settings.upstream_max_connections
                  + CALLBACKS_AT_ONCE * settings.max_sessions)
        held = "sandboxes, tool callbacks, upstream connections"
        fitting = limit - others
    if settings.max_connections + others <= limit:
        return None
    need = (f"the open-file limit {limit} cannot hold max_connections "
            f"({settings.max_connections}) beside the server's other {others} ({held}): "
            f"raise it (LimitNOFILE=, ulimit -Hn)")
    if fitting > 1:
        need += f" or lower max_connections to {fitting}"
    return need


def _check_data_dir(settings: Settings) -> None:
    """Say now, in one line, that another server holds the data directory (the
    metadata store takes the lock for real when the app starts)."""
    from .storage import data_dir_holder

    try:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        holder = data_dir_holder(settings.data_dir)
    except OSError as exc:
        raise StartupError(f"cannot use the data directory {settings.data_dir}: "
                           f"{exc.strerror}") from None
    if holder is not None:
        raise StartupError(f"another Shoal server (pid {holder}) is using the data directory "
                           f"{settings.data_dir}; give each server its own --data-dir")


def _url_of(listener: socket.socket) -> str:
    """Where the listener serves, as a URL: an IPv6 address goes in brackets
    (RFC 3986), or the port would read as part of it."""
    host, port = listener.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _listen(settings: Settings) -> socket.socket:
    """Bind before anything starts, so a taken port is one clear line, not a
    server that warmed its pool and then fails."""
    try:
        family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((settings.host, settings.port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        reason = ("it is in use" if exc.errno == errno.EADDRINUSE else
                  exc.strerror or str(exc))
        raise StartupError(f"cannot listen on {settings.host}:{settings.port}: {reason}") from None
    except (socket.gaierror, UnicodeError) as exc:
        raise StartupError(f"cannot listen on {settings.host!r}: {exc}") from None
    sock.set_inheritable(False)
    return sock


def front_end_problems(settings: Settings) -> list[str]:
    """What stops this process from serving as a cluster front end."""
    found = []
    try:
        import ray  # noqa: F401
    except ImportError:
        found.append("cluster needs Ray: install Shoal with its 'cluster' extra "
                     "(pip install 'shoal[cluster]')")
    if not settings.database_url:
        found.append("cluster needs database_url: the front ends and hosts share one "
                     "PostgreSQL database")
    if not settings.object_store:
        found.append("cluster needs object_store: containers move between hosts through "
                     "its snapshots")
    try:
        TokenTable.parse(settings.tokens, settings.operator_tokens)
    except TokenConfigError as exc:
        found.append(str(exc))
    return found


def _refuse(found: list[str]) -> int:
    if len(found) == 1:
        print(f"shoal: refusing to start: {found[0]}", file=sys.stderr)
    else:
        print("shoal: refusing to start:\n  - " + "\n  - ".join(found), file=sys.stderr)
    return 2


def serve_front_end(settings: Settings) -> int:
    """A cluster front end: routes to the sandbox hosts, runs no code itself (so
    it needs none of the isolation checks a host makes)."""
    found = front_end_problems(settings)
    if found:
        return _refuse(found)
    try:
        listener = _listen(settings)
    except StartupError as exc:
        return _refuse([str(exc)])
    from .cluster.frontend import create_front_end

    from .draining import DrainingServer

    app = create_front_end(settings)
    line = f"shoal: serving on {_url_of(listener)} (cluster front end)"
    # It drains as a host does: a balancer sees /readyz fail while it still
    # serves, and the requests it relays finish before it goes.
    server = DrainingServer(_uvicorn_config(app, settings), app,
                            on_started=lambda: print(line, file=sys.stderr, flush=True))
    return _run(server, listener, "the cluster front end could not start")


def _run(server: uvicorn.Server, listener: socket.socket, failure: str) -> int:
    """Serve until stopped. A start-up that failed after the checks passed fails
    closed at once: what the failed start had opened (a store's worker thread)
    would otherwise keep this process alive, never serving and never exiting."""
    try:
        server.run(sockets=[listener])
    except SystemExit:
        if server.started:
            raise
        # uvicorn's way out when the app's start-up failed; handled below
    if not server.started:
        print(f"shoal: refusing to serve: {failure} (the error is above)",
              file=sys.stderr, flush=True)
        os._exit(1)
    return 0


def _uvicorn_config(app, settings: Settings) -> uvicorn.Config:
    # limit_concurrency: uvicorn answers 503 to a request made with this many
    # connections open or requests in progress; shoal.connections closes a
    # connection past it at once.
    return uvicorn.Config(
        app, loop="uvloop", http=header_deadline_protocol(settings.request_header_seconds),
        lifespan="on", access_log=False, log_config=None, log_level=settings.log_level,
        timeout_graceful_shutdown=2,  # after the drain (shoal.draining)
        timeout_keep_alive=settings.keep_alive_seconds,
        limit_concurrency=settings.max_connections)


def serve(settings: Settings) -> int:
    logs.configure(settings.log_level)
    shortfall = open_files_shortfall(settings, _raise_fd_limit())
    if shortfall:
        logging.getLogger("shoal.server").warning("%s", shortfall)
    if settings.cluster:
        return serve_front_end(settings)
    found = startup_problems(settings)
    if found:
        return _refuse(found)
    try:
        _check_data_dir(settings)
        listener = _listen(settings)
    except StartupError as exc:
        return _refuse([str(exc)])
    from .app import create_app
    from .draining import DrainingServer

    url = _url_of(listener)
    app = create_app(settings)
    app.state.url = url
    server = DrainingServer(_uvicorn_config(app, settings), app, on_started=lambda: print(
        f"shoal: serving on {url}", file=sys.stderr, flush=True))
    # A failed start here means the first sandbox could not be launched: isolation
    # the checks above cannot see is unavailable.
    return _run(server, listener, "start-up failed")

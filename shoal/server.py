"""Runs the app under uvicorn, after checking that isolation is possible.

The checks run before the server binds, so a host that cannot isolate code
answers with a message naming what is missing instead of a traceback, and
never with a server that runs code unsandboxed.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys

import uvicorn

from .api.auth import TokenConfigError, TokenTable
from .config import Settings


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": round(record.created, 3), "level": record.levelname.lower(),
                 "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


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
    return found


def _raise_fd_limit() -> None:
    """Every live sandbox costs the server a few fds (its channel, its pipes):
    take the soft limit up to the hard one, as servers do (systemd's default soft
    limit, 1024, would cap a busy server at a few hundred sandboxes)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def serve(settings: Settings) -> int:
    configure_logging(settings.log_level)
    _raise_fd_limit()
    found = startup_problems(settings)
    if found:
        print("shoal: refusing to start:\n  - "
              + "\n  - ".join(found), file=sys.stderr)
        return 2
    from .app import create_app

    config = uvicorn.Config(
        create_app(settings), host=settings.host, port=settings.port,
        loop="uvloop", http="httptools", lifespan="on", access_log=False,
        log_config=None, log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=settings.shutdown_grace_seconds,
        timeout_keep_alive=settings.keep_alive_seconds)
    server = uvicorn.Server(config)
    print(f"shoal: serving on http://{settings.host}:{settings.port}", file=sys.stderr, flush=True)
    try:
        server.run()
    except SystemExit:
        if server.started:
            raise
        # uvicorn's way out when the app's start-up failed; handled below
    if not server.started:
        # Start-up failed after the checks above passed (the first sandbox could not be
        # launched: isolation they cannot see is unavailable). Fail closed at once: what
        # the failed start had opened (the metadata store's worker thread) would
        # otherwise keep this process alive, never serving and never exiting.
        print("shoal: refusing to serve: start-up failed (the error is above)",
              file=sys.stderr, flush=True)
        os._exit(1)
    return 0

"""Logs an operator can feed to a log pipeline: one JSON object per line.

Every line is one flat object: time, level, logger, message, then the fields of
the event (``extra=``), never a JSON document nested in a string. A line logged
while a request is served also carries that request's id and tenant. It gets
them from a context variable set once per request, so the layers below the API
log the id without knowing about HTTP.

The default level is WARNING, and the server logs at WARNING whatever an
operator must know: a sandbox that crashed or was killed for memory, a launch
that failed, an exhausted resource, a rejected token.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys

# The request being served: {"request_id": ..., "tenant": ...}, or None.
request_context: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "shoal_request", default=None)

LEVELS = ("debug", "info", "warning", "error", "critical")
# The attributes every LogRecord has; whatever else it holds came from ``extra=``.
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName",
                                                             "color_message"}  # uvicorn's


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": round(record.created, 3), "level": record.levelname.lower(),
                 "logger": record.name, "message": record.getMessage()}
        context = request_context.get()
        if context:
            for key, value in context.items():
                if value is not None:
                    entry.setdefault(key, value)
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    # Debug is Shoal's own: the libraries' DEBUG lines carry the data they handle
    # (aiosqlite logs every statement with its parameters: containers' domain
    # secrets, stored conversations, runs' output), so they stay at INFO.
    root.setLevel(max(logging.getLevelName(level.upper()), logging.INFO))
    logging.getLogger("shoal").setLevel(level.upper())
    # uvicorn's own loggers propagate to ours: one format for every line.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True

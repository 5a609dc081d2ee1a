"""Runs: code executed to completion with an event log, and the tool-call broker.

The dialects start runs and read their events; the gateway loops pause and
resume them across requests; every inner tool call of every face passes through
the broker.
"""

from .broker import (CALLBACKS_AT_ONCE, CallbackNotAllowed, CallbackTools, ClientTools, Grant,
                     HostAllowlist, InvalidTools, PendingCall, ToolSpec, check_callback_url,
                     normalise_tool)
from .events import Event, EventLog
from .manager import (DEFAULT_TIMEOUT_MS, LANGUAGES, MAX_TIMEOUT_MS, Run, RunConflict, RunManager,
                      RunRequest, UnknownRun, UnknownToolCall, public_file_id, render_generated)

__all__ = [
    "CALLBACKS_AT_ONCE", "CallbackNotAllowed", "CallbackTools", "ClientTools", "Grant",
    "HostAllowlist", "InvalidTools", "PendingCall", "ToolSpec", "check_callback_url", "normalise_tool",
    "Event", "EventLog",
    "DEFAULT_TIMEOUT_MS", "LANGUAGES", "MAX_TIMEOUT_MS", "Run", "RunConflict", "RunManager",
    "RunRequest", "UnknownRun", "UnknownToolCall", "public_file_id", "render_generated",
]

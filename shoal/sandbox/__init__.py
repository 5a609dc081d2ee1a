"""The sandbox runtime: isolated, warm, stateful sandboxes and their results.

The layer above leases a :class:`Sandbox` from a :class:`SandboxPool` and gets
an :class:`ExecResult` back from every call; nothing else here is public.
"""

from .channel import CallTooLarge
from .files import (FileAccessError, FileEntry, FileMissing, FileTooLarge, IsDirectory,
                    PathOutside, SandboxFiles, SandboxPath, guess_mime_type, parse_path)
from .pool import PoolBusy, SandboxPool
from .preflight import IsolationUnavailable
from .result import ExecResult, Limit, ProducedFile, decode_file_id, encode_file_id
from .runtime import RuntimeMissing
from .sandbox import OutputCallback, Sandbox, SandboxClosed
from .toolcalls import StubSpec, ToolCall, ToolHandler, ToolOutcome
from .uids import UidsExhausted
from .volumes import DiskFull

__all__ = [
    "CallTooLarge", "DiskFull",
    "FileAccessError", "FileEntry", "FileMissing", "FileTooLarge", "IsDirectory",
    "PathOutside", "SandboxFiles", "SandboxPath", "guess_mime_type", "parse_path",
    "ExecResult", "IsolationUnavailable", "Limit", "ProducedFile", "RuntimeMissing",
    "OutputCallback", "PoolBusy", "Sandbox", "SandboxClosed", "SandboxPool", "StubSpec", "ToolCall",
    "ToolHandler", "ToolOutcome", "UidsExhausted", "decode_file_id", "encode_file_id",
]

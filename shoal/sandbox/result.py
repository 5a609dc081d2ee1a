"""The one internal result type every call produces.

The sandbox layer fills it; each HTTP dialect renders it into its own wire
shape. Keeping it free of any dialect's vocabulary is what lets one sandbox
serve them all.
"""

from __future__ import annotations

import base64
import enum
from dataclasses import dataclass, field


class Limit(str, enum.Enum):
    """Which resource limit ended or constrained a call."""

    TIMEOUT = "timeout"
    MEMORY = "memory"
    PIDS = "pids"
    OUTPUT = "output"
    DISK = "disk"


@dataclass(frozen=True)
class ProducedFile:
    """A file the call created or changed, by its absolute path in the sandbox."""

    path: str
    size: int

    @property
    def file_id(self) -> str:
        return encode_file_id(self.path)

    @property
    def filename(self) -> str:
        return self.path.rsplit("/", 1)[-1]


@dataclass
class ExecResult:
    stdout: str = ""
    stderr: str = ""
    return_code: int = 0
    files: list[ProducedFile] = field(default_factory=list)
    execution_time_ms: int = 0
    limits: list[Limit] = field(default_factory=list)
    # The text editor's structured answer, for dialects with typed editor results.
    editor: dict | None = None
    # The sandbox had to be restarted: interpreter state from before is gone.
    restarted: bool = False
    # The call was cancelled by its client before it finished.
    cancelled: bool = False
    # How many inner tool calls the code made.
    tool_calls: int = 0

    @property
    def timed_out(self) -> bool:
        return Limit.TIMEOUT in self.limits


def encode_file_id(sandbox_path: str) -> str:
    return base64.urlsafe_b64encode(sandbox_path.encode()).rstrip(b"=").decode()


def decode_file_id(file_id: str) -> str | None:
    """The sandbox path a file id names, or ``None`` if it is not one."""
    try:
        padded = file_id + "=" * (-len(file_id) % 4)
        path = base64.urlsafe_b64decode(padded.encode("ascii")).decode("utf-8")
    except (ValueError, UnicodeError):
        return None
    return path if path.startswith("/") else None

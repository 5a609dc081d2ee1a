"""Sessions: who holds which sandbox, for how long, and within which limits.

The HTTP layer talks to a :class:`SessionManager`; it never touches a sandbox
or the pool directly.
"""

from shoal.sandbox import (CallTooLarge, ExecResult, FileAccessError, Limit, ProducedFile, SandboxClosed,
                           guess_mime_type)
from shoal.storage import StoreUnavailable

from .container_files import (ContainerFile, ContainerFiles, InvalidKey, parse_scoped_file_id,
                              path_for_key, scoped_file_id)
from .containers import (ContainerElsewhere, ContainerExists, ContainerManager, InvalidContainer, TenantQuotaExceeded, UnknownContainer,
                         UnknownSkill)
from .uploads import Uploads
from .manager import AtCapacity, SessionManager, Slot, UnknownSession
from .session import Session

__all__ = [
    "CallTooLarge",
    "ContainerFile", "ContainerFiles", "InvalidKey", "Uploads", "parse_scoped_file_id",
    "path_for_key", "scoped_file_id",
    "ContainerElsewhere", "ContainerExists", "ContainerManager", "InvalidContainer", "TenantQuotaExceeded", "UnknownContainer", "UnknownSkill",
    "AtCapacity", "ExecResult", "FileAccessError", "Limit", "ProducedFile", "SandboxClosed",
    "Session", "SessionManager", "Slot", "StoreUnavailable", "UnknownSession", "guess_mime_type",
]

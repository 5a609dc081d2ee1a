"""Gateway mode: Shoal in front of a model provider, serving its hosted code tools.

The routers in ``shoal.api`` parse and render; everything between the request
and the upstream model (the tool loop, tool rewriting, history mapping, the
upstream clients) lives here, and every execution goes through the runs layer.
"""

from .engine import ToolLoop, ToolUse, Turn
from .service import Gateway
from .upstream import Upstream, UpstreamError, UpstreamNotConfigured

__all__ = ["Gateway", "ToolLoop", "ToolUse", "Turn", "Upstream", "UpstreamError",
           "UpstreamNotConfigured"]

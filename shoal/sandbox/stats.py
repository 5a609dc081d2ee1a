"""What the sandbox layer counts, for the operator's metrics and readiness.

Plain counters, kept where the events happen (a launch, a crash, an OOM kill,
the seconds a tenant's code ran), and read by the API layer when /metrics is
scraped. The sandbox layer knows nothing of Prometheus. Tenants are whatever
the layer above named as a sandbox's owner; they come from the token table,
so the set of labels is bounded by configuration, not by requests.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class SandboxStats:
    launches: int = 0
    launch_failures: int = 0
    crashes: int = 0
    oom_kills: int = 0
    restarts: int = 0
    zygote_restarts: int = 0
    exec_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def ran(self, tenant: str | None, seconds: float) -> None:
        tenant = tenant or "unknown"
        self.exec_seconds[tenant] += seconds
        self.calls[tenant] += 1

"""Whether this test run gives sandboxes egress (``SHOAL_TEST_EGRESS=1``, a pass of
the Makefile): the relay on their loopback, AF_INET sockets, a broker on the host.

The suites that assert "no socket but AF_UNIX" then assert what egress changes
instead: inet sockets exist, but lead nowhere but the sandbox's own loopback.
"""

import errno
import os

EGRESS = os.environ.get("SHOAL_TEST_EGRESS") == "1"

# With egress, the inet families make sockets; anything that is not the sandbox's
# loopback is then unreachable (no route) or refused (nothing listens).
UNREACHABLE = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ECONNREFUSED}
INET_FAMILIES = {2, 10}  # AF_INET, AF_INET6

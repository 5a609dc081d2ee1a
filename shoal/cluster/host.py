"""A sandbox host: the Ray actor that runs one node's sandboxes.

Every node that offers the ``shoal_host`` resource (``ray start --resources
'{"shoal_host": 1}'``) gets one detached actor of this class, pinned to the node
and holding that one unit, so there is never a second. The actor runs the
node's own Shoal server (``shoal serve`` with the node's ``SHOAL_*`` settings
and a node key): its launcher, warm pool, cgroups, uids and volumes, on the
cluster's database and object store. That server dies with the actor
(``PR_SET_PDEATHSIG``), and the actor with its node, so a node Ray reports dead
runs nothing the cluster would still route to.

To take a node out, stop its server with SIGTERM (it drains: it finishes its
calls and snapshots every container it holds) and then ``ray stop`` the node;
in between the actor reports the host drained, so no front end starts another
one there and the containers it held move on their next use.

The server listens on ``SHOAL_HOST`` if the node sets it, else on the node's
address in the Ray cluster: where the front ends can reach it, and nowhere a
sandbox can (sandboxes have no network).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import ray

HOST_RESOURCE = "shoal_host"
NAMESPACE = "shoal"
_KEY_LENGTH = 10
_START_SECONDS = 180
# How a server that was stopped (drained), not one that died, exits.
_DRAINED = (0, -signal.SIGTERM, -signal.SIGINT)


def node_key(node_id: str) -> str:
    """The short name a node's host goes by: the prefix of its sessions' and runs' ids."""
    return "n" + node_id[:_KEY_LENGTH - 1]


def key_length() -> int:
    return _KEY_LENGTH


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _shoal() -> str:
    beside = Path(sys.executable).with_name("shoal")
    return str(beside) if beside.exists() else (shutil.which("shoal") or "shoal")


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


@ray.remote(num_cpus=0, max_restarts=0)
class SandboxHost:
    def __init__(self, key: str) -> None:
        listen = os.environ.get("SHOAL_HOST") or ray.util.get_node_ip_address()
        port = _free_port(listen)
        env = {name: value for name, value in os.environ.items() if name != "SHOAL_CLUSTER"}
        env["SHOAL_NODE_KEY"] = key
        # Where the server reserves its node's slots (shoal.cluster.slots).
        context = ray.get_runtime_context()
        env["SHOAL_NODE_ID"] = context.get_node_id()
        env["SHOAL_RAY_ADDRESS"] = context.gcs_address
        self._process = subprocess.Popen(
            [_shoal(), "serve", "--host", listen, "--port", str(port)], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=_die_with_parent)
        self.key = key
        self._url = ""
        ready = threading.Event()
        threading.Thread(target=self._relay, args=(ready,), daemon=True).start()
        if not ready.wait(_START_SECONDS) or not self._url:
            self._process.kill()
            raise RuntimeError(f"the sandbox host's server did not start on {listen}:{port} "
                               "(its log is in this actor's stderr)")

    def _relay(self, ready: threading.Event) -> None:
        """The server's log into this actor's (Ray keeps it per worker), noting
        the line that says where it serves."""
        assert self._process.stderr is not None
        for raw in self._process.stderr:
            line = raw.decode("utf-8", "replace")
            sys.stderr.write(line)
            if not self._url and line.startswith("shoal: serving on "):
                self._url = line.split("serving on ", 1)[1].strip()
                ready.set()
        ready.set()  # the server exited
        if self._process.wait() in _DRAINED:
            self._close_node()

    def _close_node(self) -> None:
        """A drained node takes nothing new until it leaves the cluster: its
        slots, which its server reserved while it drained and gave back as it
        stopped, are held from here, by this actor (Ray drops them with it)."""
        from .slots import SLOT_RESOURCE, close_node

        node_id = ray.get_runtime_context().get_node_id()
        mine = next((n for n in ray.nodes() if n["NodeID"] == node_id), {})
        total = int(mine.get("Resources", {}).get(SLOT_RESOURCE, 0))
        if total:
            self._closed = close_node(node_id, total)

    def url(self) -> str:
        self.state()
        return self._url

    def state(self) -> str:
        """``serving``; or ``drained``: its server was stopped (SIGTERM: it finished
        its calls and snapshotted its containers) and the node should get no new
        host until it leaves the cluster. A server that died otherwise takes this
        actor with it, and the front ends start a new host on the node."""
        code = self._process.poll()
        if code is None:
            return "serving"
        if code in _DRAINED:
            return "drained"
        ray.actor.exit_actor()
        return "gone"

    def stop(self, timeout: float = 60) -> int:
        """Drain and stop the node's server (its sandboxes' containers are snapshotted)."""
        self._process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self._process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._process.poll() is None:
            self._process.kill()
        return self._process.wait()

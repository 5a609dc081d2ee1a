"""Which sandbox hosts exist, as the Ray cluster reports them.

Ray is the source of truth for nodes: a node it reports alive with the
``shoal_host`` resource has (or gets, here) its sandbox host actor, and a node
it reports dead, or that left, has none: nothing is routed to it, its sessions
are gone, and the containers placed on it move on their next use. Every front
end keeps this view, refreshed every second; two front ends starting the same
node's host get the same actor (it is named by the node, and there is one
``shoal_host`` unit per node to hold).

Where something new goes is Ray's choice (``place``): its scheduler reserves
a ``shoal_slot`` on a node whose host left one unreserved (shoal.cluster.slots).
Each host's ``/health``, polled on the same cadence, says whether it serves
and takes new work; a host that stops answering is asked, through Ray, what
became of it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass

import httpx
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .driver import connect
from .host import HOST_RESOURCE, NAMESPACE, SandboxHost, node_key
from .slots import SLOT_RESOURCE, Probe, Probes

log = logging.getLogger("shoal.cluster")
REFRESH_SECONDS = 1.0
# A host whose /health has not answered this many refreshes in a row is asked
# (through Ray) what became of it.
_SILENT_POLLS = 3
_HOST_START_SECONDS = 180
# How long a new sandbox waits for Ray to find a slot before its 503, and how
# many nodes it tries whose host turns out not to take it.
PLACE_SECONDS = 1.0
_PLACE_ATTEMPTS = 3


class NoHost(RuntimeError):
    """No sandbox host is up (or every one is full): a 503 to come back later."""


@dataclass
class Host:
    key: str
    node_id: str
    url: str
    actor: object = None
    healthy: bool = True  # takes new sessions and containers (its /health says ok)
    silent: int = 0  # polls in a row its /health did not answer


class Membership:
    def __init__(self, address: str, operator_token: str | None = None) -> None:
        self._address = address
        self._headers = {"Authorization": f"Bearer {operator_token}"} if operator_token else {}
        self.hosts: dict[str, Host] = {}
        self._drained: set[str] = set()  # nodes whose host was drained: none started again
        self._nodes: set[str] = set()  # host keys of the nodes Ray last reported alive
        self._starting: dict[str, asyncio.Task] = {}
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(5.0), trust_env=False)
        self._probes = Probes()
        self._slotless: set[str] = set()  # nodes warned about: a host, but no slots
        self.free_slots = 0  # unreserved shoal_slot units, by Ray, at the last refresh
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await connect(self._address or "auto", NAMESPACE)
        await self.refresh(wait=True)
        self._task = asyncio.create_task(self._forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for task in self._starting.values():
            task.cancel()
        await self._client.aclose()
        await asyncio.to_thread(self._probes.close)
        await asyncio.to_thread(ray.shutdown)

    def alive(self, key: str) -> Host | None:
        return self.hosts.get(key)

    @staticmethod
    def unresponsive(host: Host) -> bool:
        """Whether the host's /health went unanswered for the last few polls: it
        holds connections and answers nothing (stopped, wedged), or it died and
        Ray has not said so yet."""
        return host.silent >= _SILENT_POLLS

    def gone(self, key: str) -> bool:
        """Whether what the host ``key`` held may move: its node left the cluster
        (Ray says so), or its server was drained. A host this front end does not
        know yet on a node Ray reports alive (another front end just started it)
        is not gone."""
        return key not in self._nodes or key in self._drained

    def any(self) -> Host:
        """A host for what any host answers (a stored record, a file): no room taken."""
        candidates = [h for h in self.hosts.values() if h.healthy] or list(self.hosts.values())
        if not candidates:
            raise NoHost("no sandbox host is up; retry later")
        return random.choice(candidates)

    async def place(self) -> tuple[Host, Probe]:
        """The host Ray's scheduler chose for one new sandbox: the node it reserved
        a ``shoal_slot`` on, among those whose hosts left slots unreserved
        (shoal.cluster.slots), with the probe holding that slot. The caller hands
        the probe to the host with the request (``handed_over``) or gives it back."""
        missed: list[Probe] = []
        try:
            for _ in range(_PLACE_ATTEMPTS):
                try:
                    probe = await self._probes.probe(PLACE_SECONDS)
                except Exception as exc:  # noqa: BLE001 - Ray's own errors, or no answer
                    log.warning("Ray's scheduler did not place a sandbox: %r", exc)
                    raise NoHost("the cluster's scheduler did not answer; retry later") from exc
                if probe is None:
                    raise NoHost("every sandbox host is full (its sessions, its memory, or "
                                 "it takes nothing new); retry later")
                host = self.hosts.get(node_key(probe.node_id))
                # Whether it has room is Ray's to know (the host's reservations
                # say); passed over is only a host that does not serve or answer,
                # its slot held meanwhile so that Ray looks elsewhere.
                if host is not None and not host.silent:
                    return host, probe
                missed.append(probe)
            raise NoHost("the sandbox hosts with room are not ready; retry later")
        finally:
            for probe in missed:
                self._probes.give_back(probe)

    def handed_over(self, probe: Probe, adopted: bool) -> None:
        """The request the probe placed was answered: adopted by its host, or not
        (refused, or it failed), and given back."""
        if adopted:
            self._probes.handed_over(probe)
        else:
            self._probes.give_back(probe)

    async def _forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_SECONDS)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("could not refresh the cluster's membership")

    async def refresh(self, wait: bool = False) -> None:
        nodes = await asyncio.to_thread(ray.nodes)
        available = await asyncio.to_thread(ray.available_resources)
        self.free_slots = int(available.get(SLOT_RESOURCE, 0))
        alive = {node_key(n["NodeID"]): n["NodeID"] for n in nodes
                 if n.get("Alive") and n.get("Resources", {}).get(HOST_RESOURCE, 0) >= 1}
        self._nodes = set(alive)
        slots = {node_key(n["NodeID"]): int(n["Resources"].get(SLOT_RESOURCE, 0)) for n in nodes
                 if node_key(n["NodeID"]) in alive}
        for key in alive:
            if not slots[key] and key not in self._slotless:
                self._slotless.add(key)
                log.warning("node %s offers %s but no %s: Ray places nothing new on it (give "
                            "it --resources '{\"%s\": 1, \"%s\": N}')", alive[key],
                            HOST_RESOURCE, SLOT_RESOURCE, HOST_RESOURCE, SLOT_RESOURCE)
        gone = set(self.hosts) - set(alive)
        for key in gone:
            log.warning("sandbox host %s is gone (its node left the cluster)", key)
            del self.hosts[key]
        self._drained &= set(alive)
        for key, node_id in alive.items():
            if key not in self.hosts and key not in self._starting and key not in self._drained:
                self._starting[key] = asyncio.create_task(self._start_host(key, node_id))
        if wait and self._starting:
            await asyncio.gather(*self._starting.values(), return_exceptions=True)
        await asyncio.gather(*(self._poll(host) for host in list(self.hosts.values())))
        for host in [h for h in self.hosts.values() if h.silent >= _SILENT_POLLS]:
            await self._ask(host)
        # A node whose host does not serve reserves nothing itself: closed here.
        # So is one whose host stopped answering (its server crashed: its own
        # reservations went with it, and Ray, seeing the node all free, would
        # send every new sandbox there) until it answers again or is replaced.
        await self._probes.close_nodes({
            node_id: slots[key] for key, node_id in alive.items()
            if (key not in self.hosts or self.hosts[key].silent) and slots[key]})

    async def _start_host(self, key: str, node_id: str) -> None:
        try:
            # get_if_exists asks the GCS, blocking: not on the event loop.
            actor = await asyncio.to_thread(lambda: SandboxHost.options(
                name=f"host-{node_id}", namespace=NAMESPACE, lifetime="detached",
                get_if_exists=True, resources={HOST_RESOURCE: 1},
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(key))
            # The actor of a host drained before this front end started is still
            # there (it outlives its server until the node leaves): known as
            # drained from the start, not counted as serving until three polls
            # had gone unanswered, its containers sent to a server that is gone.
            state = await asyncio.wait_for(asyncio.wrap_future(actor.state.remote().future()),
                                           _HOST_START_SECONDS)
            if state == "drained":
                self._drained.add(key)
                log.info("sandbox host %s was drained: nothing goes to its node", key)
                return
            url = await asyncio.wait_for(asyncio.wrap_future(actor.url.remote().future()),
                                         _HOST_START_SECONDS)
            host = Host(key, node_id, url, actor)
            await self._poll(host)
            self.hosts[key] = host
            log.info("sandbox host %s serves at %s", key, url)
        except Exception as exc:  # noqa: BLE001 - tried again on the next refresh
            log.warning("sandbox host %s could not be started: %s", key, exc)
        finally:
            self._starting.pop(key, None)

    async def _poll(self, host: Host) -> None:
        try:
            body = (await self._client.get(f"{host.url}/health", headers=self._headers)).json()
            # Degraded (draining, full, no uids): still serves what it holds, takes nothing new.
            host.healthy = body.get("status") == "ok"
            host.silent = 0
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            host.healthy = False
            host.silent += 1

    async def _ask(self, host: Host) -> None:
        """A host that stopped answering on a node Ray reports alive: its actor
        says whether its server was drained (the node gets no new host) or died
        (a new host starts there on the next refresh)."""
        try:
            state = await asyncio.wait_for(
                asyncio.wrap_future(host.actor.state.remote().future()), 10)
        except asyncio.TimeoutError:
            return  # busy or slow: asked again next round
        except Exception:  # noqa: BLE001 - the actor is gone with its server
            state = "gone"
        if state == "serving":
            return
        log.warning("sandbox host %s is %s", host.key, state)
        self.hosts.pop(host.key, None)
        if state == "drained":
            self._drained.add(host.key)

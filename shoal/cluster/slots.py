"""A sandbox host's room, as Ray's scheduler sees it.

Ray places everything new (a session, a run, a container no host holds): a
front end asks Ray for one ``shoal_slot`` (a placement group of one bundle, a
*probe*) and sends the request to the host of the node Ray reserved it on.
Every node offers as many ``shoal_slot`` units as sandboxes it may hold
(``ray start --resources '{"shoal_host": 1, "shoal_slot": N}'``); for Ray's
choice to follow free capacity, the units no one has reserved must be the
sandboxes the node's host can still take. This module keeps them so: a host
reserves, in placement groups on its own node (``Reservations``), the slots it
cannot offer:

- one per sandbox it holds (sessions and runs);
- when its memory is short, those its available memory cannot back at a
  sandbox's memory limit;
- all of them while it takes nothing new (draining, disk low, no uids free).

The probe that brought a request the host accepted becomes one of them: the
host *adopts* it (``AdoptProbes``, answering ``Shoal-Slot-Probe: adopted``), so
the slot is reserved without a gap from the moment Ray chose it, and never
twice. The host converges on its figure every tenth of a second, giving back
first what it adopted.

Nothing here outlives its owner: a host's own reservations belong to its
server's Ray job and a probe to its front end's, and Ray drops a job's
placement groups when the job ends (the process exits or its node dies). A
host notices, within seconds, an adopted probe that went with its front end;
and it gives back a probe on its node that it never adopted and that is
seconds old (Ray moves a dead node's placement groups to live nodes, the
probes its host had adopted among them, whose front ends live on).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import ray
from ray.util import get_placement_group
from ray.util.placement_group import (PlacementGroup, placement_group, placement_group_table,
                                      remove_placement_group)

from .driver import connect

log = logging.getLogger("shoal.cluster")

SLOT_RESOURCE = "shoal_slot"
PROBE_HEADER = "shoal-slot-probe"
_PROBE_PREFIX = "shoal-probe-"
_TICK_SECONDS = 0.1
# How often a host checks that what it adopted still exists (a probe goes
# with the front end that asked for it), and sweeps its node of strays.
_AUDIT_SECONDS = 5.0
# A probe on a host's node that it has seen this long, did not adopt and
# brought no request under way is a stray: one a dead host had adopted, which
# Ray moved here with its node's death, or one whose request never came. (How
# long by the host's own clock: a front end's may differ.)
_STRAY_SECONDS = 10.0
# How long a front end waits for Ray beyond the placement's own wait before it
# gives up on an unresponsive GCS (a Ray call's own timeout is a minute).
_GCS_SLACK_SECONDS = 5.0


@dataclass(frozen=True)
class Room:
    """What a host can take now, by its own figures."""
    held: int  # sandboxes it holds (sessions, runs and leases starting)
    max_sessions: int
    blocked: bool  # takes nothing new (draining, disk low, no uids)
    memory_room: int | None  # sandboxes its available memory backs (None: unknown)


def reserved_slots(total: int, room: Room) -> int:
    """How many of the node's ``total`` slots its host keeps reserved: all but
    the sandboxes it can still take."""
    free = 0 if room.blocked else max(0, min(total, room.max_sessions) - room.held)
    if room.memory_room is not None:
        free = min(free, max(0, room.memory_room))
    return total - free


class Reservations:
    """The host's reservations of its own node's slots, kept at ``reserved_slots``."""

    def __init__(self, address: str, node_id: str, namespace: str,
                 room: Callable[[], Room]) -> None:
        self._address, self._node_id, self._namespace = address, node_id, namespace
        self._room = room
        self.total = 0
        # (group, slots, adopted), oldest first; touched by the converging thread only.
        self._held: list[tuple[PlacementGroup, int, bool]] = []
        self._adopting: deque[str] = deque()  # probes' names, appended by requests
        self._expected = 0  # requests placed here by a probe, not answered yet
        self._under_way: Counter[str] = Counter()  # their probes' names
        self._seen: dict[str, float] = {}  # possible strays: when first seen
        self._task: asyncio.Task | None = None
        # One converging thread at a time: a tick's, or the close's after it.
        self._lock = threading.Lock()
        self._closing = False
        self._connected = False
        self._names = itertools.count()  # what `ray list placement-groups` shows
        self._audited = time.monotonic()

    @property
    def reserved(self) -> int:
        return sum(size for _, size, _ in self._held) + len(self._adopting)

    def adopt(self, name: str) -> bool:
        """A request placed here by the probe ``name`` was accepted: the probe
        now stands for what it brought. (A node that offers no slots has no
        reservations to keep: nothing is adopted there.)"""
        if name.startswith(_PROBE_PREFIX) and self.total and not self._closing:
            self._adopting.append(name)
            return True
        return False

    def expect(self, name: str) -> None:
        """A request placed here by the probe ``name`` is under way: what it
        takes, its probe covers (no reservation of the host's own is made for it
        meanwhile, and the probe is no stray however long the request takes)."""
        self._expected += 1
        self._under_way[name] += 1

    def settle(self, name: str, accepted: bool) -> bool:
        """That request answered: its probe adopted if it was accepted (whether
        it was is returned: one not adopted goes back to its front end)."""
        self._expected -= 1
        self._under_way[name] -= 1
        if self._under_way[name] <= 0:
            del self._under_way[name]
        return accepted and self.adopt(name)

    async def hosts_gone(self, keys: set[str]) -> set[str]:
        """Of these sandbox hosts (node keys), those whose node Ray reports dead,
        or no more a host's (as front ends see it: shoal.cluster.membership)."""
        from .host import HOST_RESOURCE, node_key

        if not keys or not ray.is_initialized():
            return set()  # none known gone (before start(), Ray is not asked)
        nodes = await asyncio.to_thread(ray.nodes)
        alive = {node_key(n["NodeID"]) for n in nodes
                 if n.get("Alive") and n.get("Resources", {}).get(HOST_RESOURCE, 0) >= 1}
        return set(keys) - alive

    async def start(self) -> None:
        self._connected = not ray.is_initialized()
        if self._connected:
            await connect(self._address, self._namespace)
        nodes = await asyncio.to_thread(ray.nodes)
        mine = next((n for n in nodes if n["NodeID"] == self._node_id), None)
        self.total = int((mine or {}).get("Resources", {}).get(SLOT_RESOURCE, 0))
        if not self.total:
            log.warning("this node offers no %s: Ray places nothing new here. Start it with "
                        "ray start --resources '{\"shoal_host\": 1, \"%s\": N}' (N: the "
                        "sandboxes it may hold, its max_sessions)", SLOT_RESOURCE, SLOT_RESOURCE)
        self._task = asyncio.create_task(self._forever())

    async def close(self) -> None:
        """Give every reservation back (called once the host holds nothing):
        ending the job would drop its own, but the adopted ones are their front
        ends'; and given back now, no placement waits for the job's end. A GCS
        that does not answer delays the host's exit by seconds, not minutes."""
        self._closing = True  # a tick's thread still running stops making groups
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        giving_back = asyncio.ensure_future(asyncio.to_thread(self._converge, 0, closing=True))
        try:
            await asyncio.wait_for(asyncio.shield(giving_back), 10)
        except Exception:  # noqa: BLE001 - the job's end drops its own; probes are swept
            log.exception("could not give this host's slot reservations back")
        # Ray is not shut down under a thread still calling it: the process's
        # exit ends the job all the same.
        if self._connected and giving_back.done():
            await asyncio.to_thread(ray.shutdown)

    async def _forever(self) -> None:
        failing = False
        while True:
            try:
                if self.total:
                    await self.converge()
                if failing:
                    log.info("this host's slot reservations are kept again")
                failing = False
            except Exception:  # noqa: BLE001 - the next tick tries again
                if not failing:  # once a streak, not ten times a second
                    log.exception("could not keep this host's slot reservations; retrying")
                failing = True
            await asyncio.sleep(_TICK_SECONDS)

    async def converge(self) -> None:
        wanted = reserved_slots(self.total, self._room())
        audit = time.monotonic() - self._audited > _AUDIT_SECONDS
        expected, reserved = self._expected, self.reserved
        # Between what is reserved and that plus the probes of requests under
        # way, nothing to do: those requests' sandboxes are counted already
        # (made a reservation of its own, one would wait in Ray's queue behind
        # its probe, and a probe can take the slot it waits for).
        if not reserved <= wanted <= reserved + expected or self._adopting or audit:
            await asyncio.to_thread(self._converge, wanted, expected, audit)

    def _converge(self, wanted: int, expected: int = 0, audit: bool = False,
                  closing: bool = False) -> None:
        with self._lock:
            if self._closing and not closing:
                return
            self._converge_locked(wanted, expected, audit)

    def _converge_locked(self, wanted: int, expected: int, audit: bool) -> None:
        while self._adopting:
            self._take(self._adopting.popleft())
        if audit:
            self._audited = time.monotonic()
            self._held = [entry for entry in self._held if _state(entry[0]) != "REMOVED"]
            self._sweep()
        # Fewer: what was adopted goes first (a probe each), then the newest;
        # forgotten once Ray has it removed (a failed call is retried next tick).
        # More: a group of one slot each, on this node (one that Ray cannot
        # place yet waits in its queue; one slot free is enough for it).
        while self._held and self.reserved > wanted:
            adopted = [i for i, entry in enumerate(self._held) if entry[2]]
            index = adopted[-1] if adopted else len(self._held) - 1
            try:
                remove_placement_group(self._held[index][0])
            except Exception:
                if _state(self._held[index][0]) != "REMOVED":
                    raise
            del self._held[index]
        for _ in range(wanted - self.reserved - expected):
            group = _slot_on(self._node_id, f"shoal-slots-{self._node_id[:12]}-{next(self._names)}")
            self._held.append((group, 1, False))

    def _sweep(self) -> None:
        adopted = {group.id.hex() for group, _, taken in self._held if taken}
        now = time.monotonic()
        candidates = set()
        for entry in placement_group_table().values():
            name = entry.get("name") or ""
            if not (name.startswith(_PROBE_PREFIX) and entry.get("state") == "CREATED"
                    and entry.get("bundles_to_node_id", {}).get(0) == self._node_id
                    and entry.get("placement_group_id") not in adopted
                    and name not in self._under_way):
                continue
            candidates.add(name)
            if now - self._seen.setdefault(name, now) > _STRAY_SECONDS:
                log.info("giving back a stray probe on this node: %s", name)
                try:
                    remove_placement_group(get_placement_group(name))
                except Exception:  # noqa: BLE001 - gone meanwhile; the others still swept
                    log.debug("the stray probe %s was gone already", name)
        self._seen = {name: seen for name, seen in self._seen.items() if name in candidates}

    def _take(self, name: str) -> None:
        """Hold the probe ``name`` if it is one, reserved on this node, and not
        held already (a request's header names it; it is no proof)."""
        try:
            group = get_placement_group(name)
            table = placement_group_table(group)
        except Exception:  # noqa: BLE001 - gone already (its front end with it)
            return
        if (table.get("state") == "CREATED"
                and table.get("bundles_to_node_id", {}).get(0) == self._node_id
                and all(held.id != group.id for held, _, _ in self._held)):
            self._held.append((group, 1, True))


def _state(group: PlacementGroup) -> str:
    """Ray's state of the group; UNKNOWN when Ray did not say (kept meanwhile)."""
    try:
        return placement_group_table(group).get("state", "REMOVED")
    except Exception:  # noqa: BLE001
        return "UNKNOWN"


class AdoptProbes:
    """ASGI middleware of a cluster's sandbox host: a request that came with a
    probe (``Shoal-Slot-Probe``, set by the front end) and was accepted hands
    the probe to the host's reservations, and says so to the front end."""

    def __init__(self, app, reservations: Reservations) -> None:
        self.app, self.reservations = app, reservations

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        name = next((v.decode("latin-1") for k, v in scope["headers"]
                     if k == PROBE_HEADER.encode()), None)
        if name is None:
            return await self.app(scope, receive, send)

        reservations = self.reservations
        reservations.expect(name)
        settled = False

        async def adopting(message) -> None:
            nonlocal settled
            if message["type"] == "http.response.start" and not settled:
                settled = True
                if reservations.settle(name, message["status"] < 400):
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (PROBE_HEADER.encode(), b"adopted")]}
            await send(message)

        try:
            await self.app(scope, receive, adopting)
        finally:
            if not settled:  # no answer (it failed, or its client left): not adopted
                settled = True
                reservations.settle(name, False)


class Probes:
    """A front end's reservations: its probes, asked for on threads of their own
    (Ray's calls block, a full cluster's for the whole wait), each given back
    unless the host it brought a request to adopted it; and every slot of a
    node whose host does not serve (starting, drained), which no host of its
    own reserves, so that Ray places nothing there meanwhile."""

    def __init__(self) -> None:
        # A wait per placement in flight: as many as a burst of creates.
        self._threads = ThreadPoolExecutor(max_workers=64, thread_name_prefix="shoal-probe")
        self._held: set[PlacementGroup] = set()
        self._closed: dict[str, list[PlacementGroup]] = {}  # node id: its slots, held
        # A refresh's closing still on its thread, and the close's after it.
        self._closing_lock = threading.Lock()

    async def probe(self, timeout: float) -> Probe | None:
        """One slot Ray reserved (where, and the probe that holds it), or None
        if Ray found no free slot in time. Raises if Ray does not answer in
        time; a probe that comes after that, or after the caller gave up
        (cancelled), is given back as it comes."""
        future = asyncio.get_running_loop().run_in_executor(self._threads, _probe, timeout)
        try:
            probe = await asyncio.wait_for(asyncio.shield(future), timeout + _GCS_SLACK_SECONDS)
        except BaseException:
            future.add_done_callback(self._give_back_late)
            raise
        if probe.node_id is None:
            self.give_back(probe)
            return None
        self._held.add(probe.group)
        return probe

    def handed_over(self, probe: Probe) -> None:
        """Its host adopted it: the host gives it back."""
        self._held.discard(probe.group)

    def give_back(self, probe: Probe) -> None:
        self._held.discard(probe.group)
        try:
            self._threads.submit(remove_placement_group, probe.group)
        except RuntimeError:  # closing: the job's end drops it
            pass

    def _give_back_late(self, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self.give_back(future.result())

    async def close_nodes(self, nodes: dict[str, int]) -> None:
        """Hold every slot of these nodes (node id: its slots); open the nodes
        held before and not given now."""
        if nodes.keys() != self._closed.keys():
            await asyncio.get_running_loop().run_in_executor(self._threads, self._close_nodes,
                                                             dict(nodes))

    def _close_nodes(self, nodes: dict[str, int]) -> None:
        with self._closing_lock:
            for node_id in [n for n in self._closed if n not in nodes]:
                for group in self._closed[node_id]:
                    remove_placement_group(group)
                del self._closed[node_id]
            for node_id, total in nodes.items():
                if node_id not in self._closed:
                    self._closed[node_id] = close_node(node_id, total)

    def close(self) -> None:
        for group in list(self._held):
            self._threads.submit(remove_placement_group, group)
        self._held.clear()
        self._close_nodes({})
        self._threads.shutdown(wait=True)


@dataclass(frozen=True)
class Probe:
    name: str
    group: PlacementGroup
    node_id: str | None  # where Ray reserved it; None: nowhere in time


def _probe(timeout: float) -> Probe:
    name = f"{_PROBE_PREFIX}{int(time.time() * 1000)}-{secrets.token_hex(6)}"
    group = placement_group([{SLOT_RESOURCE: 1}], name=name)
    try:
        # The GCS's own wait: nothing runs in the group (ready() would start a worker there).
        if not group.wait(timeout):
            return Probe(name, group, None)
        return Probe(name, group, placement_group_table(group).get("bundles_to_node_id", {}).get(0))
    except BaseException:
        _remove_quietly(group)
        raise


def close_node(node_id: str, total: int) -> list[PlacementGroup]:
    """Hold all ``total`` slots of the node, so that Ray places nothing there:
    a group of one slot each, each placed as soon as its slot is free (one group
    of them all would wait for every slot to be free at once, which on a busy
    node may never be)."""
    tag = f"{node_id[:12]}-{secrets.token_hex(3)}"
    groups: list[PlacementGroup] = []
    try:
        for number in range(total):
            groups.append(_slot_on(node_id, f"shoal-closed-{tag}-{number}"))
    except BaseException:  # none half made: the next try makes them all
        for group in groups:
            _remove_quietly(group)
        raise
    return groups


def _slot_on(node_id: str, name: str) -> PlacementGroup:
    """A reservation of one slot on the node ``node_id`` (Ray places it there
    as soon as one is free there, and nowhere else)."""
    return placement_group([{SLOT_RESOURCE: 1}], name=name,
                           bundle_label_selector=[{"ray.io/node-id": node_id}])


def _remove_quietly(group: PlacementGroup) -> None:
    try:
        remove_placement_group(group)
    except Exception:  # noqa: BLE001 - Ray unreachable: the job's end drops it
        pass

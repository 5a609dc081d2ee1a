"""Placement is Ray's: its scheduler reserves a ``shoal_slot`` where a host left
one unreserved, and each host reserves what it cannot offer.

On a real Ray cluster of three nodes (``ray.cluster_utils.Cluster``): two
sandbox nodes of three slots each, and a head that offers none. The hosts'
side (``Reservations``) is driven with the room a host would report; the
front end's side (``Probes``) asks Ray where new sandboxes go.
"""

from __future__ import annotations

import asyncio
import collections
import time

import pytest

from shoal.cluster import slots
from shoal.cluster.slots import SLOT_RESOURCE, Probes, Reservations, Room, reserved_slots

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("total, room, reserved", [
    (6, Room(held=0, max_sessions=6, blocked=False, memory_room=None), 0),
    (6, Room(held=2, max_sessions=6, blocked=False, memory_room=40), 2),
    # Memory for one more sandbox only: the rest of the free slots reserved too.
    (6, Room(held=2, max_sessions=6, blocked=False, memory_room=1), 5),
    (6, Room(held=2, max_sessions=6, blocked=False, memory_room=0), 6),
    # Draining, disk low, no uids: nothing new, every slot reserved.
    (6, Room(held=1, max_sessions=6, blocked=True, memory_room=40), 6),
    # The node offers more slots than the host's own limit: the excess is never offered.
    (10, Room(held=1, max_sessions=6, blocked=False, memory_room=None), 5),
    # Holding more than the node offers (its limit set higher): never more than all.
    (4, Room(held=6, max_sessions=8, blocked=False, memory_room=None), 4),
], ids=["idle", "holding", "memory-short", "no-memory", "blocked", "limit-below-slots",
        "over-slots"])
def test_a_host_reserves_every_slot_it_cannot_offer(total, room, reserved):
    assert reserved_slots(total, room) == reserved


@pytest.fixture(scope="module")
def ray_cluster():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster()
    cluster.add_node(num_cpus=0)
    nodes = [cluster.add_node(num_cpus=0, resources={SLOT_RESOURCE: 3, "shoal_host": 1})
             for _ in range(2)]
    ray.init(address=cluster.address, namespace="shoal-test", logging_level="error",
             log_to_driver=False)
    try:
        yield [node.node_id for node in nodes]
    finally:
        ray.shutdown()
        cluster.shutdown()


def _free() -> int:
    import ray

    return int(ray.available_resources().get(SLOT_RESOURCE, 0))


async def _until(predicate, what: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def _give_back(probes: Probes, held: list) -> None:
    """Give the probes back, and wait until Ray has them removed: a slot freed
    meanwhile would go to whichever group Ray ranks first (a new probe may
    outrank a host's reservation that waited), and the free count would pass
    through figures the step after does not expect."""
    for probe in held:
        probes.give_back(probe)
    await _until(lambda: all(slots._state(probe.group) == "REMOVED" for probe in held),
                 "the probes given back")


async def _placed(probes: Probes, count: int) -> list[str]:
    """Where Ray reserves ``count`` slots, one probe each; then given back."""
    found = [await probes.probe(2.0) for _ in range(count)]
    await _give_back(probes, found)
    return [probe.node_id for probe in found]


def test_ray_places_each_sandbox_on_a_node_whose_host_left_a_slot(ray_cluster):
    first, second = ray_cluster

    async def scenario() -> None:
        room = {"held": 0, "blocked": False, "memory_room": None}
        reservations = Reservations("", first, "shoal-test",
                                    lambda: Room(max_sessions=3, **room))
        probes = Probes()
        await reservations.start()
        try:
            assert reservations.total == 3 and reservations.reserved == 0

            # The first host holds three sandboxes (its limit): every new one goes
            # to the second, and once both are full Ray finds nothing (a 503).
            room["held"] = 3
            await _until(lambda: _free() == 3, "the first node's slots reserved")
            held = [await probes.probe(2.0) for _ in range(3)]
            assert [probe.node_id for probe in held] == [second] * 3
            assert await probes.probe(0.3) is None
            await _give_back(probes, held)

            # Its memory backs one more sandbox, no more: one of the next goes there.
            room.update(held=0, memory_room=1)
            await _until(lambda: _free() == 4, "two of the first node's slots reserved")
            held = [await probes.probe(2.0) for _ in range(4)]
            assert collections.Counter(p.node_id for p in held) == {first: 1, second: 3}
            await _give_back(probes, held)

            # Draining: nothing new goes there however empty it is.
            room.update(held=0, memory_room=None, blocked=True)
            await _until(lambda: _free() == 3, "every slot of the draining node reserved")
            assert set(await _placed(probes, 3)) == {second}

            # A node whose host does not serve: a front end holds all its slots.
            room.update(blocked=False)
            await _until(lambda: _free() == 6, "the first node open again")
            await probes.close_nodes({first: 3})
            await _until(lambda: _free() == 3, "the node closed by the front end")
            assert set(await _placed(probes, 3)) == {second}
            await probes.close_nodes({})
            await _until(lambda: _free() == 6, "the node opened again")
        finally:
            await reservations.close()
            await asyncio.to_thread(probes.close)
        # Nothing outlives its owner: every slot free again.
        await _until(lambda: _free() == 6, "every reservation given back")

    asyncio.run(scenario())


def test_a_host_adopts_the_probe_that_brought_a_sandbox_and_gives_it_back_after(ray_cluster):
    first, second = ray_cluster

    async def scenario() -> None:
        room = {"held": 0}
        reservations = Reservations("", first, "shoal-test",
                                    lambda: Room(max_sessions=3, blocked=False, memory_room=None,
                                                 **room))
        probes = Probes()
        await reservations.start()
        try:
            # The second node full, so Ray reserves the probe on the first.
            await probes.close_nodes({second: 3})
            await _until(lambda: _free() == 3, "the second node closed")
            probe = await probes.probe(2.0)
            assert probe.node_id == first
            # While the request it brought is under way, its sandbox counted by
            # the host already, the probe covers it: no reservation of the host's
            # own (it would wait behind the probe for the same slot).
            reservations.expect(probe.name)
            room["held"] = 1
            await asyncio.sleep(0.5)  # a few ticks
            assert _free() == 2 and reservations.reserved == 0
            # The host accepted it: the probe is its reservation now, neither
            # given back nor doubled by one of its own.
            reservations.settle(probe.name, accepted=True)
            probes.handed_over(probe)
            await asyncio.sleep(0.5)
            assert _free() == 2 and reservations.reserved == 1
            # The sandbox released: the host gives the probe back.
            room["held"] = 0
            await _until(lambda: _free() == 3, "the adopted probe given back")
            assert reservations.reserved == 0

            # A probe on another node is no slot of this host's: not adopted.
            await probes.close_nodes({first: 3})
            await _until(lambda: _free() == 3, "the first node closed")
            elsewhere = await probes.probe(2.0)
            assert elsewhere.node_id == second
            reservations.adopt(elsewhere.name)
            await asyncio.sleep(0.5)
            assert reservations.reserved == 0 and _free() == 2
            probes.give_back(elsewhere)
            await probes.close_nodes({})
            # A name that is no probe is ignored.
            reservations.adopt("shoal-slots-not-a-probe")
            assert reservations.reserved == 0
        finally:
            await reservations.close()
            await asyncio.to_thread(probes.close)
        await _until(lambda: _free() == 6, "every reservation given back")

    asyncio.run(scenario())


def test_a_host_gives_back_a_stray_probe_on_its_node(ray_cluster, monkeypatch):
    """A probe on the host's node that it never adopted (one a dead host had
    adopted, moved here by Ray; one whose request never answered) is given back."""
    first, second = ray_cluster
    monkeypatch.setattr(slots, "_STRAY_SECONDS", 1.0)
    monkeypatch.setattr(slots, "_AUDIT_SECONDS", 0.3)

    async def scenario() -> None:
        reservations = Reservations("", first, "shoal-test",
                                    lambda: Room(held=0, max_sessions=3, blocked=False,
                                                 memory_room=None))
        probes = Probes()
        await reservations.start()
        try:
            await probes.close_nodes({second: 3})
            await _until(lambda: _free() == 3, "the second node closed")
            stray = await probes.probe(2.0)
            assert stray.node_id == first
            probes.handed_over(stray)  # its front end no longer gives it back
            # While a request it brought is under way (a long one), it is none.
            reservations.expect(stray.name)
            await asyncio.sleep(2.5)  # several audits, each well past the stray's age
            assert _free() == 2
            reservations.settle(stray.name, accepted=False)
            await _until(lambda: _free() == 3, "the stray probe given back")
            await probes.close_nodes({})
        finally:
            await reservations.close()
            await asyncio.to_thread(probes.close)
        await _until(lambda: _free() == 6, "every reservation given back")

    asyncio.run(scenario())


def test_a_busy_node_is_closed_slot_by_slot_as_they_come_free(ray_cluster):
    """A front end closes a node whose host does not serve: its free slots are
    held at once, the others as they come free (not once all are free at once,
    which on a busy node may never be)."""
    first, second = ray_cluster

    async def scenario() -> None:
        probes = Probes()
        try:
            await probes.close_nodes({second: 3})
            await _until(lambda: _free() == 3, "the second node closed")
            busy = await probes.probe(2.0)
            assert busy.node_id == first
            await probes.close_nodes({first: 3, second: 3})
            await _until(lambda: _free() == 0, "the first node's free slots held")
            probes.give_back(busy)
            await _until(lambda: slots._state(busy.group) == "REMOVED", "the busy slot given back")
            # The slot that came free is held too: every group closing the node placed.
            await _until(lambda: all(slots._state(group) == "CREATED"
                                     for group in probes._closed[first]),
                         "the first node's every slot held")
            assert _free() == 0 and await probes.probe(0.3) is None
            await probes.close_nodes({})
            await _until(lambda: _free() == 6, "both nodes open again")
        finally:
            await asyncio.to_thread(probes.close)
        await _until(lambda: _free() == 6, "every reservation given back")

    asyncio.run(scenario())


def test_a_placement_given_up_gives_its_probe_back_when_it_comes(ray_cluster):
    """A request that stops waiting for Ray (its client gone, the server
    stopping) leaves no slot held: the probe, placed later, is given back."""
    first, second = ray_cluster

    async def scenario() -> None:
        probes = Probes()
        try:
            await probes.close_nodes({first: 3, second: 3})
            await _until(lambda: _free() == 0, "both nodes closed")
            waiting = asyncio.create_task(probes.probe(3.0))
            await asyncio.sleep(0.3)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            await probes.close_nodes({})
            # The probe is placed as the slots come free, then given back.
            await _until(lambda: _free() == 6, "the abandoned probe given back")
            await asyncio.sleep(3.5)  # past its own wait too
            assert _free() == 6
        finally:
            await asyncio.to_thread(probes.close)

    asyncio.run(scenario())

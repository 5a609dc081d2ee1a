"""Where a front end places something new: the host with room for the most
sandboxes, by its sessions and by its memory (its /health's figures).

These run the front end's own placement on hosts as their /health described
them; no Ray is needed to choose between hosts already known.
"""

from __future__ import annotations

import pytest

from shoal.cluster.membership import Host, Membership, NoHost

GiB = 1 << 30


def _membership(*hosts: Host) -> Membership:
    membership = Membership("auto")
    membership.hosts = {host.key: host for host in hosts}
    return membership


@pytest.mark.parametrize("other, roomier", [
    # Short of memory: passed over for a host with fewer free slots.
    ((40, 1), (10, 30)),
    # Memory plentiful, or not reported: the free slots decide.
    ((2, 500), (30, None)),
    # Memory caps both alike (a 24 GiB host holds 23 sandboxes at 1 GiB): the
    # one with fewer sessions still gets the next.
    ((40, 23), (60, 23)),
], ids=["memory-short", "slots-decide", "memory-caps-alike"])
def test_the_host_with_the_most_room_gets_the_next_sandbox(other, roomier):
    """(free slots, memory room) of two hosts: the roomier one is chosen every time."""
    membership = _membership(
        Host("n1", "node-1", "http://a", free=other[0], memory_room=other[1]),
        Host("n2", "node-2", "http://b", free=roomier[0], memory_room=roomier[1]))
    assert {membership.roomiest().key for _ in range(20)} == {"n2"}


def test_a_host_with_slots_but_no_memory_for_a_sandbox_takes_nothing():
    full = Host("n1", "node-1", "http://a", free=20, memory_room=0)
    with pytest.raises(NoHost, match="memory"):
        _membership(full).roomiest()


def test_placing_counts_down_until_the_next_poll():
    first = Host("n1", "node-1", "http://a", free=5, memory_room=2)
    second = Host("n2", "node-2", "http://b", free=5, memory_room=1)
    membership = _membership(first, second)
    chosen = []
    for _ in range(3):
        chosen.append(membership.roomiest())
        membership.taken(chosen[-1])
    # Room for 2 and 1: three sandboxes fit, n1's two first, and a fourth does not.
    assert [h.key for h in chosen[:1]] == ["n1"] and [h.key for h in chosen].count("n1") == 2
    with pytest.raises(NoHost):
        membership.roomiest()

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


def test_memory_short_host_is_passed_over_for_one_with_fewer_free_slots():
    crowded = Host("n1", "node-1", "http://a", free=40, memory_room=1)
    roomy = Host("n2", "node-2", "http://b", free=10, memory_room=30)
    membership = _membership(crowded, roomy)
    assert {membership.roomiest().key for _ in range(20)} == {"n2"}


def test_free_slots_decide_when_memory_is_plentiful_or_unknown():
    busy = Host("n1", "node-1", "http://a", free=2, memory_room=500)
    idle = Host("n2", "node-2", "http://b", free=30, memory_room=None)
    assert _membership(busy, idle).roomiest().key == "n2"


def test_between_hosts_their_memory_caps_alike_the_emptier_one_wins():
    # Plenty of memory reads as the same room on both (a 24 GiB host holds 23
    # sandboxes at 1 GiB): the one with fewer sessions still gets the next.
    busier = Host("n1", "node-1", "http://a", free=40, memory_room=23)
    emptier = Host("n2", "node-2", "http://b", free=60, memory_room=23)
    membership = _membership(busier, emptier)
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

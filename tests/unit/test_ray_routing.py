"""Where the Ray ingress sends a request (tfq/ray/routing.py): by its prompt's first full page, then by load."""
from __future__ import annotations

from tfq.ray.routing import BUSIER_BY, ranked, route_key

REPLICAS = [f"replica-{i}" for i in range(5)]


def test_a_prompt_shorter_than_a_page_has_no_key_and_goes_by_load_alone():
    assert route_key(list(range(15)), 16) is None
    assert route_key(list(range(40)), 0) is None  # a plan without pages
    assert ranked(REPLICAS, None) == [REPLICAS]


def test_prompts_that_share_their_first_page_share_a_replica():
    page = list(range(100, 116))
    a, b = route_key(page + [1, 2, 3], 16), route_key(page + [9] * 40, 16)
    assert a == b
    assert ranked(REPLICAS, a)[0] == ranked(REPLICAS, b)[0] and len(ranked(REPLICAS, a)[0]) == 1
    other = route_key([7] + page[1:] + [1, 2, 3], 16)  # control: one token of the page differs
    assert other != a


def test_keys_spread_over_replicas_and_a_leaving_replica_moves_only_its_own():
    keys = [route_key([k, *range(15)], 16) for k in range(400)]
    home = {k: ranked(REPLICAS, k)[0][0] for k in keys}
    assert set(home.values()) == set(REPLICAS)  # each replica is some key's home
    gone = REPLICAS[2]
    rest = [r for r in REPLICAS if r != gone]
    moved = [k for k in keys if ranked(rest, k)[0][0] != home[k]]
    assert moved and all(home[k] == gone for k in moved)


def test_a_busy_home_loses_its_claim_beyond_the_bound():
    key = route_key(list(range(16)), 16)
    home = ranked(REPLICAS, key)[0][0]
    assert ranked(REPLICAS, key, {home: BUSIER_BY})[0] == [home]
    assert len(ranked(REPLICAS, key, {home: BUSIER_BY + 1})[0]) == len(REPLICAS)

"""Routers (policies/routing/) under property tests: every request goes to exactly one offered
replica, decisions are deterministic given the seed, round_robin is balanced, session affinity
holds, the load-based routers pick the least loaded replica, and prefix_aware picks the longest
cached prefix when loads are equal. Plus the snapshot's prefix index and the router configs'
errors."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from property_settings import examples

from policies.request import Request
from policies.routing import ROUTERS, ReplicaSnapshot, make_router, prompt_block_hashes

BS = 4


def snap(replica, outstanding=0, used=0, total=100, kv_tokens=0, cached=frozenset(), taken_at=0.0):
    return ReplicaSnapshot(replica, taken_at, 0, outstanding, 0, outstanding, used, total, kv_tokens, BS, cached)


def request(i, prompt, session=None):
    r = Request(f"r{i}", list(prompt))
    r.session_id = session
    return r


snapshots = st.builds(
    lambda loads, used, tokens: [snap(r, o, u, 100, t) for r, (o, u, t) in enumerate(zip(loads, used, tokens))],
    st.lists(st.integers(0, 50), min_size=1, max_size=6),
    st.lists(st.integers(0, 100), min_size=6, max_size=6),
    st.lists(st.integers(0, 5000), min_size=6, max_size=6))
prompts = st.lists(st.integers(0, 3), min_size=1, max_size=24)  # a tiny vocabulary: prefixes repeat
stream = st.lists(st.tuples(prompts, st.sampled_from([None, "a", "b", "c"]), st.integers(0, 63)), min_size=1,
                  max_size=40)


@pytest.mark.parametrize("name", ROUTERS.names())
@settings(max_examples=examples(60), deadline=None)
@given(fleet=snapshots, requests=stream, seed=st.integers(0, 2**16))
def test_every_request_goes_to_one_offered_replica_deterministically(name, fleet, requests, seed):
    """Offered subsets vary (a replica out of rotation): the choice is always one of them, and two
    routers with the same seed fed the same inputs decide alike."""
    a, b = make_router({"name": name}, seed), make_router({"name": name}, seed)
    for i, (prompt, session, mask) in enumerate(requests):
        offered = [s for s in fleet if mask >> s.replica & 1] or fleet[:1]
        req = request(i, prompt, session)
        chosen = a.route(req, offered)
        assert chosen in {s.replica for s in offered}
        assert b.route(req, offered) == chosen


@settings(max_examples=examples(40), deadline=None)
@given(n=st.integers(1, 8), k=st.integers(1, 100))
def test_round_robin_is_balanced(n, k):
    router = make_router({"name": "round_robin"})
    fleet = [snap(r, outstanding=r * 7) for r in range(n)]
    counts = [0] * n
    for i in range(k):
        counts[router.route(request(i, [1]), fleet)] += 1
    assert max(counts) - min(counts) <= 1


@settings(max_examples=examples(60), deadline=None)
@given(fleet=snapshots, requests=stream)
def test_session_affinity_holds(fleet, requests):
    """Without a key, or for a new key: the least loaded, counting what was routed since the
    (unchanging) snapshots."""
    router = make_router({"name": "session"})
    home, routed = {}, [0] * len(fleet)
    for i, (prompt, session, _) in enumerate(requests):
        least = min(fleet, key=lambda s: (s.num_outstanding + routed[s.replica], s.replica)).replica
        chosen = router.route(request(i, prompt, session), fleet)
        routed[chosen] += 1
        if session is not None and session in home:
            assert chosen == home[session]
        else:
            assert chosen == least
            home.setdefault(session, chosen)


def test_session_affinity_by_tenant():
    router = make_router({"name": "session", "key": "tenant"})
    fleet = [snap(0), snap(1), snap(2)]
    picks = {}
    for i, tenant in enumerate(["a", "b", "a", "c", "b", "a", None]):
        r = request(i, [1], session=f"s{i}")  # a session id per request: ignored with key=tenant
        r.tenant = tenant
        picks.setdefault(tenant, set()).add(router.route(r, fleet))
    assert all(len(p) == 1 for t, p in picks.items() if t is not None)
    assert len(set().union(*(p for t, p in picks.items() if t is not None))) == 3


def test_a_new_session_goes_to_the_least_loaded_replica():
    router = make_router({"name": "session"})
    assert router.route(request(0, [1], "x"), [snap(0, 5), snap(1, 2), snap(2, 9)]) == 1
    assert router.route(request(1, [1], "x"), [snap(0, 0), snap(1, 50), snap(2, 0)]) == 1


@pytest.mark.parametrize("name, key", [
    ("least_requests", lambda s: (s.num_outstanding, s.replica)),
    ("least_kv", lambda s: (s.kv_usage, s.num_outstanding, s.replica)),
    ("least_tokens", lambda s: (s.kv_tokens, s.num_outstanding, s.replica)),
])
@settings(max_examples=examples(60), deadline=None)
@given(fleet=snapshots)
def test_load_routers_pick_the_least_loaded(name, key, fleet):
    assert make_router({"name": name}).route(request(0, [1, 2]), fleet) == min(fleet, key=key).replica


@settings(max_examples=examples(80), deadline=None)
@given(prompt=st.lists(st.integers(0, 9), min_size=2, max_size=60),
       held=st.lists(st.integers(0, 20), min_size=1, max_size=6), load=st.integers(0, 40),
       threshold=st.sampled_from([0.0, 0.5]))
def test_prefix_aware_picks_the_longest_match_when_loads_are_equal(prompt, held, load, threshold):
    """Replica r holds the prompt's first held[r] full blocks (and unrelated ones)."""
    hashes = prompt_block_hashes(prompt, BS)
    fleet = [snap(r, load, cached=frozenset(hashes[:h]) | {-r - 1}) for r, h in enumerate(held)]
    router = make_router({"name": "prefix_aware", "cache_threshold": threshold})
    chosen = router.route(request(0, prompt), fleet)
    matched = [min(h, len(hashes)) for h in held]
    best = max(matched)
    if best and best / len(hashes) >= threshold:
        assert matched[chosen] == best and chosen == matched.index(best)
    else:  # no match worth following: the replica with the most free KV (all equal: the first)
        assert chosen == 0


def test_prefix_aware_leaves_the_cache_when_loads_are_imbalanced():
    prompt = list(range(40))
    hashes = prompt_block_hashes(prompt, BS)
    hot, cold = snap(0, outstanding=100, cached=frozenset(hashes)), snap(1, outstanding=10)
    router = make_router({"name": "prefix_aware"})
    assert router.route(request(0, prompt), [hot, cold]) == 1  # 100 - 10 > 32 and 100 > 10
    assert make_router({"name": "prefix_aware", "balance_abs_threshold": 200}).route(request(1, prompt),
                                                                                      [hot, cold]) == 0


def test_prefix_aware_follows_a_prefix_it_routed_before_the_replica_reports_it():
    prompt = list(range(40))
    fleet = [snap(0), snap(1), snap(2)]
    tracking, blind = make_router({"name": "prefix_aware"}), make_router({"name": "prefix_aware",
                                                                          "track_routed": False})
    assert tracking.route(request(0, prompt), fleet) == 0
    fleet = [snap(0, used=10), snap(1), snap(2)]  # replica 0 now computes the prefix, not yet cached
    assert tracking.route(request(1, prompt + [7]), fleet) == 0
    blind.route(request(0, prompt), [snap(0), snap(1), snap(2)])
    assert blind.route(request(1, prompt + [7]), fleet) == 1  # the most free KV


def test_random_depends_on_the_seed_only():
    fleet = [snap(r) for r in range(5)]
    router = make_router({"name": "random"}, 7)
    first = [router.route(request(i, [1]), fleet) for i in range(50)]
    router = make_router({"name": "random"}, 7)
    assert [router.route(request(i, [1]), fleet) for i in range(50)] == first
    assert set(first) == set(range(5))


def test_a_stale_snapshot_counts_what_was_routed_since():
    router = make_router({"name": "least_requests"})
    fleet = [snap(0, 3), snap(1, 3)]
    assert [router.route(request(i, [1]), fleet) for i in range(4)] == [0, 1, 0, 1]
    blind = make_router({"name": "least_requests", "count_routed": False})
    assert [blind.route(request(i, [1]), fleet) for i in range(4)] == [0, 0, 0, 0]
    fresh = [snap(0, 5, taken_at=1.0), snap(1, 3, taken_at=1.0)]  # a refresh resets the count
    assert router.route(request(9, [1]), fresh) == 1


def test_the_cached_prefix_counts_leading_blocks_only():
    hashes = prompt_block_hashes(list(range(17)), BS)
    assert len(hashes) == 4  # (17 - 1) // 4 full blocks before the one holding the last token
    assert len(prompt_block_hashes(list(range(16)), BS)) == 3
    s = snap(0, cached=frozenset([hashes[0], hashes[2], hashes[3]]))
    assert s.cached_prefix_blocks(hashes) == 1


def test_prefix_hashes_match_the_prefix_caching_block_manager():
    from policies import Scheduler, SchedulerConfig, make_block_manager, make_policy
    from policies.routing import observe
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64),
                      make_policy("fcfs"), make_block_manager("prefix", BS, 32))
    prompt = list(range(21))
    sched.add(request(0, prompt), 0.0)
    out = sched.schedule(0.0)
    sched.update(out, {seq.seq_id: [1] for seq, _, _ in out.scheduled}, 0.1)
    s = observe(0, sched, 1, 0.1, copy_index=True)
    assert s.cached_prefix_blocks(prompt_block_hashes(prompt + [5, 6], BS)) == 5
    assert s.kv_blocks_used == 6 and s.num_running == 1 and isinstance(s.cached_blocks, frozenset)


@pytest.mark.parametrize("cfg, message", [
    ({"name": "nope"}, "name='nope' is unknown: choose a router from"),
    ({"name": "prefix_aware", "threshold": 1}, "threshold is unknown for router 'prefix_aware'"),
    ({"name": "prefix_aware", "cache_threshold": 1.5}, "cache_threshold=1.5 is invalid"),
    ({"name": "prefix_aware", "balance_rel_threshold": 0.5}, "balance_rel_threshold=0.5 is invalid"),
    ({"name": "session", "key": "user"}, "key='user' is invalid"),
    ({"name": "least_requests", "count_routed": "yes"}, "count_routed='yes' is invalid"),
])
def test_bad_router_configs_name_the_key(cfg, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        make_router(cfg)


def test_no_replica_offered_is_an_error():
    with pytest.raises(ValueError, match="no replica is available"):
        make_router({"name": "round_robin"}).route(request(0, [1]), [])

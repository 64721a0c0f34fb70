"""The gateway's routing core (chapter 5): scorers computed by hand, each strategy on crafted
states, load shedding, round-robin fairness and consistent-hash stability as properties, and
the approximate prefix index. Pure logic on a fake clock: no server, no sleep."""

from __future__ import annotations

import collections
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.checks import ParameterError
from labkit.gateway.endpoints import (
    REPORTED_RANGES,
    Endpoint,
    NoEndpointError,
    RoutingRequest,
    SaturatedError,
)
from labkit.gateway.prefix_index import PrefixIndex
from labkit.gateway.plugins import (
    HashRing,
    InFlightScorer,
    KVCacheScorer,
    LatencyScorer,
    PrefixCacheScorer,
    QueueScorer,
    SaturationDetector,
    WeightScorer,
)
from labkit.gateway.routing import STRATEGIES, make_router

NOW = 1000.0  # the injected clock, seconds


def fresh(url: str, waiting: float = 0, kv: float = 0.0, **fields) -> Endpoint:
    """An endpoint scraped 50 ms ago (fresh against the 200 ms staleness default)."""
    return Endpoint(url, num_requests_waiting=waiting, kv_cache_usage=kv,
                    metrics_time=NOW - 0.05, **fields)


def req(prompt: str = "hello", session: str | None = None, model: str = "m") -> RoutingRequest:
    return RoutingRequest(model, prompt, session)


def counts(router, endpoints, n: int, request: RoutingRequest | None = None) -> collections.Counter:
    return collections.Counter(router.pick(request or req(), endpoints, NOW).url for _ in range(n))


# --- scorers, by hand ---------------------------------------------------------------------

def test_queue_scorer_is_min_max_over_waiting_requests():
    scorer = QueueScorer()
    # (max - waiting) / (max - min) with max 4, min 0.
    assert scorer.score(req(), [fresh("a", 0), fresh("b", 2), fresh("c", 4)], NOW) == [1, 0.5, 0]
    # All equal: neutral 1 for everyone (upstream's rule), unknown: 0.
    assert scorer.score(req(), [fresh("a", 3), fresh("b", 3)], NOW) == [1, 1]
    assert scorer.score(req(), [fresh("a", 3), Endpoint("b")], NOW) == [1, 0]


def test_kv_cache_scorer_is_one_minus_usage():
    endpoints = [fresh("a", kv=0.5), fresh("b", kv=0.2), Endpoint("c")]
    assert KVCacheScorer().score(req(), endpoints, NOW) == pytest.approx([0.5, 0.8, 0.0])


def test_prefix_scorer_is_the_share_of_leading_chunks_held():
    index = PrefixIndex(block_size_chars=4)
    scorer = PrefixCacheScorer(index)
    a, b = fresh("a"), fresh("b")
    scorer.record(req("aaaabbbbccccdddd"), a)
    # Four chunks, the first three held by a: 3/4; b holds nothing.
    assert scorer.score(req("aaaabbbbcccceeee"), [a, b], NOW) == [0.75, 0.0]
    # A prompt shorter than one chunk has no chunks: no affinity at all.
    assert scorer.score(req("aaa"), [a, b], NOW) == [0.0, 0.0]


def test_load_latency_and_weight_scorers():
    endpoints = [fresh("a", in_flight=1, ttft_ewma_s=0.2, weight=4.0),
                 fresh("b", in_flight=3, ttft_ewma_s=0.1, weight=1.0),
                 fresh("c", in_flight=5, ttft_ewma_s=None, weight=0.0)]
    assert InFlightScorer().score(req(), endpoints, NOW) == [1.0, 0.5, 0.0]
    assert LatencyScorer().score(req(), endpoints, NOW) == [0.0, 1.0, 0.0]
    assert WeightScorer().score(req(), endpoints, NOW) == [1.0, 0.25, 0.0]


def three_backends() -> list[Endpoint]:
    """a: empty queue, half-full cache; b: 2 waiting, 20% used; c: 4 waiting, 60% used."""
    return [fresh("a", 0, 0.5), fresh("b", 2, 0.2), fresh("c", 4, 0.6)]


def test_endpoint_picker_totals_by_hand():
    router = make_router("endpoint_picker", seed=0)
    a, b, c = three_backends()
    prompt = "x" * 256  # four 64-character chunks
    router.record(req(prompt), c)
    totals = {e.url: s for e, s in router.scored(req(prompt), [a, b, c], NOW)}
    # 2 x queue + 2 x kv + 3 x prefix: a = 2*1 + 2*0.5 = 3.0, b = 2*0.5 + 2*0.8 = 2.6,
    # c = 2*0 + 2*0.4 + 3*(4/4) = 3.8.
    assert totals == pytest.approx({"a": 3.0, "b": 2.6, "c": 3.8})
    assert router.pick(req(prompt), [a, b, c], NOW) is c


def test_prefix_aware_lets_a_partial_match_beat_a_lighter_load():
    a, b, c = three_backends()
    held = "p" * 128 + "q" * 128
    asked = "p" * 128 + "r" * 128  # shares the first two of four chunks with `held`
    choices = {}
    for strategy in ("endpoint_picker", "prefix_aware"):
        router = make_router(strategy, seed=0)
        router.record(req(held), c)
        choices[strategy] = router.pick(req(asked), [a, b, c], NOW).url
    # endpoint_picker: a = 3.0 beats c = 2*0.4 + 3*(2/4) = 2.3.
    # prefix_aware (prefix weight 5): c = 2*0.4 + 5*(2/4) = 3.3 beats a = 3.0.
    assert choices == {"endpoint_picker": "a", "prefix_aware": "c"}


def test_record_makes_a_conversation_stick_to_its_backend():
    router = make_router("endpoint_picker", seed=1)
    endpoints = [fresh(f"e{i}") for i in range(3)]
    turn = "system prompt and first question " * 4
    first = router.pick(req(turn), endpoints, NOW)
    router.record(req(turn), first)
    for _ in range(10):  # every later turn extends the same prefix
        turn += " and a follow-up question"
        chosen = router.pick(req(turn), endpoints, NOW)
        router.record(req(turn), chosen)
        assert chosen is first
    router.forget(first.url)  # e.g. it restarted with an empty cache
    assert router.scored(req(turn), endpoints, NOW) == [(e, 4.0) for e in endpoints]


# --- pickers and strategies on crafted states ---------------------------------------------

def test_max_score_ties_are_broken_at_random():
    endpoints = [fresh(f"e{i}") for i in range(3)]
    for strategy in ("endpoint_picker", "least_requests", "least_latency"):
        picked = counts(make_router(strategy, seed=2), endpoints, 300)
        assert set(picked) == {"e0", "e1", "e2"} and min(picked.values()) > 60, strategy


def test_least_requests_picks_the_fewest_in_flight():
    endpoints = [fresh("a", in_flight=3), fresh("b", in_flight=1), fresh("c", in_flight=2)]
    assert counts(make_router("least_requests", seed=0), endpoints, 20) == {"b": 20}


def test_power_of_two_compares_two_random_candidates():
    endpoints = [fresh("idle", in_flight=0), fresh("busy", in_flight=5),
                 fresh("busiest", in_flight=9)]
    picked = counts(make_router("power_of_two", seed=3), endpoints, 3000)
    # "busiest" loses every pair; "idle" wins every pair it is in (2 of the 3 pairs);
    # "busy" wins only the pair (busy, busiest).
    assert picked["busiest"] == 0
    assert abs(picked["idle"] - 2000) < 150 and abs(picked["busy"] - 1000) < 150


def test_least_latency_explores_unknown_endpoints_first():
    router = make_router("least_latency", seed=0)
    endpoints = [fresh("a", ttft_ewma_s=0.10), fresh("b"), fresh("c", ttft_ewma_s=0.30),
                 fresh("d")]
    assert set(counts(router, endpoints, 50)) == {"b", "d"}
    endpoints[1].ttft_ewma_s, endpoints[3].ttft_ewma_s = 0.20, 0.05
    assert counts(router, endpoints, 20) == {"d": 20}


def test_weighted_sends_traffic_in_proportion_to_weight():
    endpoints = [fresh("a", weight=1.0), fresh("b", weight=2.0), fresh("c", weight=1.0),
                 fresh("off", weight=0.0)]
    picked = counts(make_router("weighted", seed=4), endpoints, 4000)
    # Shares 1/4, 1/2, 1/4 and 0; 150 is about five standard deviations.
    assert picked["off"] == 0
    assert all(abs(picked[u] - n) < 150 for u, n in (("a", 1000), ("b", 2000), ("c", 1000)))
    for e in endpoints:
        e.weight = 0.0  # all zero: uniform, not an error
    assert len(counts(make_router("weighted", seed=4), endpoints, 200)) == 4


def test_round_robin_cycles_and_skips_an_ejected_endpoint():
    router = make_router("round_robin")
    endpoints = [fresh("a"), fresh("b"), fresh("c")]
    assert [router.pick(req(), endpoints, NOW).url for _ in range(6)] == list("abcabc")
    endpoints[1].healthy = False
    assert [router.pick(req(), endpoints, NOW).url for _ in range(4)] == list("acac")
    endpoints[1].healthy = True  # back: it has waited longest, so it goes next
    assert [router.pick(req(), endpoints, NOW).url for _ in range(3)] == list("bac")


def test_consistent_hash_keeps_a_session_on_one_endpoint():
    router = make_router("consistent_hash", seed=0)
    endpoints = [fresh(f"http://10.0.0.{i}:8000") for i in range(3)]
    for session in ("alice", "bob", "carol"):
        assert len(counts(router, endpoints, 10, req(f"turn of {session}", session))) == 1
    # No session header: the prompt is the key, so the same prompt lands together too.
    assert len(counts(router, endpoints, 10, req("same prompt"))) == 1
    # 160 virtual nodes per endpoint spread 3000 sessions about evenly (1/3 each).
    spread = collections.Counter(router.pick(req(session=f"s{i}"), endpoints, NOW).url
                                 for i in range(3000))
    assert all(0.25 < n / 3000 < 0.42 for n in spread.values()) and len(spread) == 3


# --- load shedding and nothing routable ---------------------------------------------------

def test_saturation_thresholds_are_upstream_defaults():
    detector = SaturationDetector()
    assert not detector.saturated(fresh("a", waiting=4, kv=0.79), NOW)
    assert detector.saturated(fresh("a", waiting=5, kv=0.0), NOW)   # queue depth 5
    assert detector.saturated(fresh("a", waiting=0, kv=0.8), NOW)   # KV cache 80%
    assert detector.saturated(Endpoint("a"), NOW)                    # never scraped
    stale = fresh("a")
    stale.metrics_time = NOW - 0.21                                  # older than 200 ms
    assert detector.saturated(stale, NOW)
    stale.metrics_time = NOW - 0.19
    assert not detector.saturated(stale, NOW)


def test_every_endpoint_saturated_sheds_the_request():
    endpoints = [fresh("a", waiting=5), fresh("b", kv=0.95), Endpoint("c")]
    with pytest.raises(SaturatedError) as caught:
        make_router("endpoint_picker", seed=0).pick(req(), endpoints, NOW)
    assert caught.value.retry_after_s == 1.0
    router = make_router("prefix_aware", retry_after_s=3.0)
    with pytest.raises(SaturatedError) as caught:
        router.pick(req(), endpoints, NOW)
    assert caught.value.retry_after_s == 3.0


def test_stale_metrics_count_as_saturated():
    best_but_stale = Endpoint("stale", num_requests_waiting=0, kv_cache_usage=0.0,
                              metrics_time=NOW - 1.0)
    worse_but_fresh = fresh("fresh", waiting=3, kv=0.7)
    router = make_router("endpoint_picker", seed=0)
    assert counts(router, [best_but_stale, worse_but_fresh], 20) == {"fresh": 20}
    with pytest.raises(SaturatedError):
        router.pick(req(), [best_but_stale], NOW)
    # A gateway that scrapes every 2 s says so, and the same metrics are fresh enough.
    lenient = make_router("endpoint_picker", seed=0, metrics_staleness_s=2.0)
    assert lenient.pick(req(), [best_but_stale], NOW) is best_but_stale


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nothing_routable_raises_no_endpoint(strategy):
    router = make_router(strategy, seed=0)
    down, draining = fresh("down", healthy=False), fresh("draining", draining=True)
    for endpoints in ([], [down, draining]):
        with pytest.raises(NoEndpointError):
            router.pick(req(session="s"), endpoints, NOW)
    assert router.pick(req(session="s"), [down, draining, fresh("up")], NOW).url == "up"


# --- properties ---------------------------------------------------------------------------

BAD_OR_GOOD = st.one_of(st.none(), st.just(math.nan), st.just(math.inf), st.just(-math.inf),
                       st.floats(-10, 10), st.floats(0, 2), st.integers(-3, 20))
ENDPOINT_STATES = st.lists(st.fixed_dictionaries({
    "healthy": st.booleans(), "draining": st.booleans(), "in_flight": st.integers(0, 9),
    "num_requests_waiting": BAD_OR_GOOD, "num_requests_running": BAD_OR_GOOD,
    "kv_cache_usage": BAD_OR_GOOD, "ttft_ewma_s": BAD_OR_GOOD,
    "age_s": st.one_of(st.none(), st.floats(0, 1))}), min_size=1, max_size=5)


@settings(max_examples=300, deadline=None)
@given(strategy=st.sampled_from(STRATEGIES), states=ENDPOINT_STATES,
       prompt=st.text(max_size=300), session=st.one_of(st.none(), st.text(max_size=8)))
def test_every_router_picks_a_routable_endpoint_or_refuses_whatever_the_metrics(
        strategy, states, prompt, session):
    """NaN, infinities, negative counts and a KV usage above 1, as a broken exporter may
    report them: each is stored as unknown, and every strategy picks a routable endpoint or
    raises one of its two documented refusals (503 or 429 at the proxy), never anything else."""
    endpoints = []
    for i, state in enumerate(states):
        age_s = state.pop("age_s")
        endpoints.append(Endpoint(f"http://b{i}", metrics_time=None if age_s is None
                                  else NOW - age_s, **state))
    for e in endpoints:
        for name, (low, high) in REPORTED_RANGES.items():
            value = getattr(e, name)
            assert value is None or (math.isfinite(value) and low <= value <= high), (name, value)
    router = make_router(strategy, seed=0)
    request = req(prompt, session)
    try:
        picked = router.pick(request, endpoints, NOW)
    except NoEndpointError:
        assert not any(e.routable for e in endpoints)
        return
    except SaturatedError:
        assert strategy in ("endpoint_picker", "prefix_aware")
        return
    assert picked in endpoints and picked.routable
    router.record(request, picked)


def test_a_nan_queue_is_unknown_so_the_backend_counts_as_saturated():
    # The case: one backend reports vllm:num_requests_waiting NaN. The others still
    # get the traffic, in either order.
    for order in ((0, 1), (1, 0)):
        endpoints = [fresh("nan", waiting=math.nan), fresh("ok", waiting=1)]
        endpoints = [endpoints[i] for i in order]
        assert endpoints[order.index(0)].num_requests_waiting is None
        for strategy in ("endpoint_picker", "prefix_aware"):
            assert counts(make_router(strategy, seed=0), endpoints, 20) == {"ok": 20}


@settings(max_examples=150, deadline=None)
@given(n=st.integers(2, 5),
       ops=st.lists(st.one_of(st.just("pick"), st.integers(0, 4)), max_size=120))
def test_round_robin_stays_fair_whatever_the_health_changes(n, ops):
    """Two endpoints routable at every pick of a window get counts that differ by <= 1 there."""
    endpoints = [Endpoint(f"e{i}") for i in range(n)]
    router = make_router("round_robin")
    picks: list[tuple[str, frozenset[str]]] = []  # (chosen, routable at that moment)
    for op in ops:
        if op != "pick":
            endpoints[op % n].healthy = not endpoints[op % n].healthy
            continue
        routable = frozenset(e.url for e in endpoints if e.routable)
        if not routable:
            with pytest.raises(NoEndpointError):
                router.pick(req(), endpoints, NOW)
            continue
        chosen = router.pick(req(), endpoints, NOW)
        assert chosen.url in routable
        picks.append((chosen.url, routable))
    for a, b in itertools.combinations([e.url for e in endpoints], 2):
        # Walk maximal windows where both were routable; within one, the running difference
        # count(a) - count(b) may span at most 1, i.e. every sub-window differs by <= 1.
        diff, low, high = 0, 0, 0
        for chosen, routable in picks:
            if a not in routable or b not in routable:
                diff, low, high = 0, 0, 0
                continue
            diff += (chosen == a) - (chosen == b)
            low, high = min(low, diff), max(high, diff)
            assert high - low <= 1, (a, b, picks)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 6), leaving=st.integers(0, 5),
       sessions=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=40, unique=True))
def test_consistent_hash_moves_only_the_sessions_of_an_endpoint_that_leaves(n, leaving, sessions):
    endpoints = [Endpoint(f"http://10.0.0.{i}:8000") for i in range(n)]
    router = make_router("consistent_hash")

    def placement() -> dict[str, str]:
        return {s: router.pick(req(session=s), endpoints, NOW).url for s in sessions}

    before = placement()
    gone = endpoints[leaving % n]
    gone.healthy = False
    after = placement()
    for s in sessions:
        if before[s] == gone.url:
            assert after[s] != gone.url
        else:
            assert after[s] == before[s], "a session moved that had no reason to"
    gone.healthy = True
    assert placement() == before  # it comes back to exactly its old sessions


def test_hash_ring_is_independent_of_url_order():
    urls = [f"http://h{i}" for i in range(4)]
    ring, reversed_ring = HashRing(urls), HashRing(urls[::-1])
    assert all(ring.lookup(f"k{i}") == reversed_ring.lookup(f"k{i}") for i in range(200))


# --- the prefix index ---------------------------------------------------------------------

def test_a_prompt_that_diverges_at_chunk_3_matches_2_chunks():
    index = PrefixIndex(block_size_chars=4)
    index.record("aaaabbbbccccdddd", "u")
    assert index.match("aaaabbbbXcccdddd") == {"u": 2}
    assert index.match("aaaabbbbccccdddd") == {"u": 4}
    assert index.match("aaaabbbbccccddddeeee") == {"u": 4}  # a longer turn: all 4 it holds


def test_chunks_are_chained_to_their_prefix_and_model():
    index = PrefixIndex(block_size_chars=4)
    index.record("aaaabbbb", "u", model="m1")
    # Same chunk texts after a different first chunk: chained hashes differ, no match.
    assert index.match("zzzzbbbb", model="m1") == {}
    assert index.match("bbbbaaaa", model="m1") == {}
    # Same text, another model: never shares KV.
    assert index.match("aaaabbbb", model="m2") == {}
    assert index.match("aaaabbbb", model="m1") == {"u": 2}


def test_match_reports_each_endpoint_and_only_leading_runs():
    index = PrefixIndex(block_size_chars=4)
    index.record("aaaabbbb", "u")
    index.record("aaaacccc", "v")
    assert index.match("aaaabbbbcccc") == {"u": 2, "v": 1}
    assert index.match("xxxxbbbb") == {}


def test_chunking_rules():
    index = PrefixIndex(block_size_chars=4, max_chunks=3)
    assert index.chunk_hashes("abc") == [] and index.num_chunks("abc") == 0
    assert len(index.chunk_hashes("aaaabb")) == index.num_chunks("aaaabb") == 2  # short tail
    # Beyond max_chunks the prompt is cut: these two look the same.
    assert index.chunk_hashes("aaaabbbbccccX") == index.chunk_hashes("aaaabbbbccccY")
    assert index.num_chunks("a" * 100) == 3
    assert PrefixIndex().block_size_chars == 64  # llm-d: 16 tokens x 4 characters


def test_lru_evicts_the_oldest_and_tails_first():
    index = PrefixIndex(block_size_chars=4, capacity_per_endpoint=3)
    index.record("aaaabbbbcccc", "u")  # 3 chunks: full
    index.record("xxxxyyyy", "u")      # 2 more: the 2 oldest go, a prompt's tail before its head
    assert index.size("u") == 3
    assert index.match("aaaabbbbcccc") == {"u": 1}
    assert index.match("xxxxyyyy") == {"u": 2}
    index.record("aaaa", "u")          # touched: "aaaa" is now newer than "xxxxyyyy"'s chunks
    index.record("zzzz", "u")          # so this evicts "xxxxyyyy"'s tail, not "aaaa"
    assert index.match("xxxxyyyy") == {"u": 1}
    assert index.match("aaaabbbbcccc") == {"u": 1}
    assert index.match("zzzz") == {"u": 1}


def test_remove_forgets_one_endpoint_only():
    index = PrefixIndex(block_size_chars=4)
    index.record("aaaabbbb", "u")
    index.record("aaaabbbb", "v")
    index.remove("u")
    assert index.match("aaaabbbb") == {"v": 2} and index.size("u") == 0
    index.remove("never-seen")  # a no-op, not an error


# --- bad input ----------------------------------------------------------------------------

def test_strategies_are_the_contract():
    assert STRATEGIES == ("round_robin", "least_requests", "power_of_two", "consistent_hash",
                          "least_latency", "weighted", "endpoint_picker", "prefix_aware")


@pytest.mark.parametrize(("strategy", "options", "param"), [
    ("random", {}, "strategy"),
    ("round_robin", {"virtual_nodes": 10}, "virtual_nodes"),
    ("consistent_hash", {"virtual_nodes": 0}, "virtual_nodes"),
    ("consistent_hash", {"seed": "x"}, "seed"),
    ("endpoint_picker", {"queue_weight": -1.0}, "queue_weight"),
    ("endpoint_picker", {"picker": "best"}, "picker"),
    ("endpoint_picker", {"kv_cache_threshold": 1.5}, "kv_cache_threshold"),
    ("endpoint_picker", {"queue_depth_threshold": 0}, "queue_depth_threshold"),
    ("endpoint_picker", {"metrics_staleness_s": 0.0}, "metrics_staleness_s"),
    ("prefix_aware", {"block_size_chars": 0}, "block_size_chars"),
    ("prefix_aware", {"capacity_per_endpoint": 2.5}, "capacity_per_endpoint"),
    ("prefix_aware", {"virtual_nodes": 8}, "virtual_nodes"),
])
def test_bad_options_name_the_parameter(strategy, options, param):
    with pytest.raises(ParameterError) as caught:
        make_router(strategy, **options)
    assert caught.value.param == param and param in str(caught.value)


def test_bad_endpoint_weight_is_rejected():
    with pytest.raises(ParameterError) as caught:
        make_router("weighted").pick(req(), [fresh("a", weight=-1.0)], NOW)
    assert caught.value.param == "weight"


def test_weighted_random_picker_is_an_option_of_the_endpoint_picker():
    router = make_router("endpoint_picker", seed=5, picker="weighted_random")
    endpoints = three_backends()  # totals 3.0, 2.6 and 0.8 with no prefix held
    picked = counts(router, endpoints, 3200)
    # Shares 3.0/6.4, 2.6/6.4 and 0.8/6.4 of 3200: 1500, 1300 and 400.
    assert all(abs(picked[u] - n) < 150 for u, n in (("a", 1500), ("b", 1300), ("c", 400)))

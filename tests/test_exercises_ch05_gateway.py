"""Lab 05a (chapter 5): its exercise checks, whose right answers, worked out by hand here,
pass and whose listed mistakes are each recognised and named; and the lab's load helpers
(:mod:`labkit.harness`, :mod:`labkit.http.client`) without servers: how a client classifies
a stream, the backends' counters, and the chat sessions' prompts. The lab itself runs them
against real servers under nbval."""

import argparse
import asyncio
import json

import httpx
import pytest
from prometheus_client import generate_latest

from labkit.checks import ParameterError
from labkit.cli import gateway_parser
from labkit.engine.metrics import EngineMetrics
from labkit.exercises import ch05_gateway as ex
from labkit.harness import counters, fleet, load
from labkit.http import client
from labkit.tutorial.ch05_gateway import tutorial_round_robin


def test_round_robin_after_an_ejection():
    # Five requests over a, b, c, d go a, b, c, d, a; with b out, c was picked longest ago.
    assert ex.check_round_robin_next("c")
    # The tutorial's 6 % len([a, c, d]) = 0 gives a again: two in a row.
    assert "request_count % len(available)" in repr(ex.check_round_robin_next("a"))
    assert "ejected" in repr(ex.check_round_robin_next("b"))
    assert "Not quite" in repr(ex.check_round_robin_next("d"))
    assert "Not answered" in repr(ex.check_round_robin_next(None))
    assert "expected one of" in repr(ex.check_round_robin_next("z"))
    # Three requests (a, b, c), then c out: a and b were picked at turns 1 and 2, so a.
    assert ex.check_round_robin_next("a", ("a", "b", "c"), requests_before=3, ejected="c")


def test_tutorial_round_robin_is_count_modulo_the_available_set():
    # The tutorial's index, by hand: 6 % 3 = 0, 7 % 2 = 1.
    assert tutorial_round_robin(6, ["a", "c", "d"]) == "a"
    assert tutorial_round_robin(7, ["a", "b"]) == "b"
    with pytest.raises(ParameterError) as err:
        tutorial_round_robin(1, [])
    assert err.value.param == "available"


def test_queue_score():
    # (max - w) / (max - min) = (9 - 4) / (9 - 1).
    assert ex.check_queue_score(5 / 8)
    assert "scored more waiting requests higher" in repr(ex.check_queue_score(3 / 8))
    assert "1 - w / max" in repr(ex.check_queue_score(1 - 4 / 9))
    assert "waiting share" in repr(ex.check_queue_score(4 / 9))
    # The least loaded scores 1, the most loaded 0.
    assert ex.check_queue_score(1.0, index=0) and ex.check_queue_score(0.0, index=2)


def test_weighted_requests():
    # Weight 2 of a total 4: half of 400.
    assert ex.check_weighted_requests(200)
    assert "equal share" in repr(ex.check_weighted_requests(400 / 3))
    assert "fraction" in repr(ex.check_weighted_requests(0.5))
    assert "heaviest" in repr(ex.check_weighted_requests(400))
    assert ex.check_weighted_requests(100, index=0)


def test_prefix_score():
    # 300 characters: chunks 0-255 in four full chunks plus one partial (256-299). The second
    # turn, 500 characters, has 8 chunks; its fifth (256-319) differs from the partial one,
    # so 4 of 8 match.
    assert ex.check_prefix_score(0.5)
    assert "partial last chunk as a match" in repr(ex.check_prefix_score(5 / 8))
    assert "characters" in repr(ex.check_prefix_score(300 / 500))
    assert "out of the total" in repr(ex.check_prefix_score(4 / 7))
    assert "number of matched chunks" in repr(ex.check_prefix_score(4))
    # Whole chunks only: 256 characters are four chunks, all held, of 7 (256 + 150 = 406).
    assert ex.check_prefix_score(4 / 7, first_chars=256, added_chars=150)


@pytest.mark.parametrize("call, param", [
    (lambda: ex.check_round_robin_next("a", ejected="x"), "ejected"),
    (lambda: ex.check_round_robin_next("a", requests_before=-1), "requests_before"),
    (lambda: ex.check_queue_score(0.5, index=3), "index"),
    (lambda: ex.check_weighted_requests(1, num_requests=0), "num_requests"),
    (lambda: ex.check_prefix_score(0.5, first_chars=0), "first_chars"),
])
def test_bad_parameters_are_named(call, param):
    with pytest.raises(ParameterError) as err:
        call()
    assert err.value.param == param


# -- the lab's load helpers ----------------------------------------------------------------

def _event(data) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def _token(text: str) -> bytes:
    return _event({"choices": [{"index": 0, "text": text}]})


def _stream(*parts: bytes, fail_after: bool = False):
    async def body():
        for part in parts:
            yield part
        if fail_after:
            raise httpx.RemoteProtocolError("peer closed connection")
    return body()


def _classify(handler) -> client.StreamResult:
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler),
                                     base_url="http://gateway") as http:
            return await client.stream_completion(http, "m", "hello", 4)
    return asyncio.run(go())


def _sse(*parts: bytes, fail_after: bool = False):
    return lambda request: httpx.Response(200, headers={"content-type": "text/event-stream"},
                                          content=_stream(*parts, fail_after=fail_after))


def test_stream_outcomes_as_a_client_sees_them():
    complete = _classify(_sse(_token("a"), _token("b"), _event("[DONE]")))
    assert (complete.outcome, complete.text, complete.error) == ("complete", "ab", None)
    assert 0 <= complete.ttft_ms <= complete.e2el_ms
    # labkit.gateway's way to end a stream whose backend died: an error event, then [DONE].
    cut = _classify(_sse(_token("a"), _event({"error": {"message": "backend died"}}),
                         _event("[DONE]")))
    assert (cut.outcome, cut.text, cut.error) == ("cut", "a", "backend died")
    # vllm-router's: the connection closes mid-body, no [DONE].
    broken = _classify(_sse(_token("a"), fail_after=True))
    assert broken.outcome == "broken" and "RemoteProtocolError" in broken.error
    assert _classify(_sse(_token("a"))).outcome == "broken"  # ended cleanly, but no [DONE]
    shed = _classify(lambda request: httpx.Response(429, json={"error": {"code": 429}}))
    assert shed.outcome == "shed" and shed.ttft_ms is None
    assert _classify(lambda request: httpx.Response(503)).outcome == "lost"

    def refuse(request):
        raise httpx.ConnectError("connection refused")

    lost = _classify(refuse)
    assert lost.outcome == "lost" and "ConnectError" in lost.error
    # A stream that never ends: the client's own deadline makes it hung.
    async def held():
        yield _token("a")
        await asyncio.Event().wait()

    async def go_hung():
        handler = lambda request: httpx.Response(  # noqa: E731
            200, headers={"content-type": "text/event-stream"}, content=held())
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler),
                                     base_url="http://gateway") as http:
            return await client.stream_completion(http, "m", "hello", 4, deadline_s=0.2)

    hung = asyncio.run(go_hung())
    assert hung.outcome == "hung" and "still open after 0.2 s" in hung.error
    counts = client.count_outcomes([complete, cut, broken, shed, lost, lost, hung])
    assert counts == {"complete": 1, "cut": 1, "broken": 1, "lost": 2, "shed": 1, "hung": 1}


def test_counters_come_from_the_metrics_page():
    metrics = EngineMetrics("m")
    metrics.prefix_queries.inc(300)
    metrics.prefix_hits.inc(120)
    for seconds in (0.5, 1.5):
        metrics.e2e.observe(seconds)
    before = counters.BackendCounters("http://b", 1, 100, 20)
    after = counters.parse_counters("http://b", generate_latest(metrics.registry).decode())
    assert after == counters.BackendCounters("http://b", 2, 300, 120)
    delta = after.since(before)
    assert delta == counters.BackendCounters("http://b", 1, 200, 100)
    other = counters.BackendCounters("http://c", 0, 200, 0)
    assert counters.fleet_hit_rate([delta, other]) == pytest.approx(100 / 400)
    with pytest.raises(ParameterError):
        after.since(other)
    with pytest.raises(ParameterError):
        counters.fleet_hit_rate([counters.BackendCounters("http://b", 0, 0, 0)])


def test_every_turn_resends_the_previous_turn_and_its_reply():
    (conversation, other) = load.chat_workload(2, turns=3, seed=1)
    assert conversation.system_prompt == other.system_prompt  # shared by default
    assert conversation.user_messages != other.user_messages
    replies = [" one", " two"]
    prompts = [conversation.prompt(replies[:t]) for t in range(3)]
    for t in (1, 2):
        assert prompts[t].startswith(prompts[t - 1] + replies[t - 1])
    assert prompts[2].endswith(f"User: {conversation.user_messages[2]}\nAssistant:")
    with pytest.raises(ParameterError):
        conversation.prompt([" a", " b", " c"])
    own = load.chat_workload(2, turns=1, shared_system_prompt=False, seed=1)
    assert own[0].system_prompt != own[1].system_prompt
    assert load.chat_workload(2, turns=3, seed=1) == [conversation, other]


def test_varied_requests_stay_in_their_ranges_and_repeat():
    requests = load.varied_requests(50, seed=3, prompt_words=(2, 5), max_tokens=(4, 6))
    assert requests == load.varied_requests(50, seed=3, prompt_words=(2, 5), max_tokens=(4, 6))
    assert {len(r.prompt.split()) for r in requests} <= {2, 3, 4, 5}
    assert {r.max_tokens for r in requests} == {4, 5, 6}


@pytest.mark.parametrize("call, param", [
    (lambda: load.varied_requests(3, max_tokens=(5, 4)), "max_tokens"),
    (lambda: load.chat_workload(0, 3), "num_conversations"),
    (lambda: fleet.BackendFleet("model", 3, max_num_seqs=(1, 2)), "max_num_seqs"),
    (lambda: fleet.gateway_command(["http://a"], "fastest", 8000), "strategy"),
    (lambda: fleet.gateway_command([], "round_robin", 0), "port"),
])
def test_load_helpers_name_bad_parameters(call, param):
    with pytest.raises(ParameterError) as err:
        call()
    assert err.value.param == param


def test_gateway_command_parses_with_labkit_gateways_own_parser():
    command = fleet.gateway_command(["http://a:1", "http://b:2"], "prefix_aware", 30123,
                                      seed=7)
    assert command[1:4] == ["-m", "labkit.cli", "gateway"]
    parser = argparse.ArgumentParser()
    gateway_parser(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(command[3:])
    assert (ns.strategy, ns.host, ns.port, ns.seed) == ("prefix_aware", "127.0.0.1", 30123, 7)
    assert ns.backend == ["http://a:1", "http://b:2"]
    # No backend: an empty gateway, for an autoscaler to fill through /add_worker.
    assert parser.parse_args(fleet.gateway_command([], "round_robin", 30123)[3:]).backend == []

"""Checks for the exercises of lab 05a, the gateway (chapter 5).

Each check computes the expected answer with :mod:`labkit.gateway` itself (a router on
crafted endpoint records, the prefix index) and names the usual wrong answers, the tutorial's
round robin first among them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from labkit.checks import ParameterError, positive_int
from labkit.gateway.endpoints import Endpoint, RoutingRequest
from labkit.gateway.prefix_index import PrefixIndex
from labkit.gateway.plugins import QueueScorer, WeightScorer
from labkit.gateway.routing import make_router
from labkit.grading import Feedback, check_number
from labkit.tutorial.ch05_gateway import tutorial_round_robin

_NOW = 0.0  # the routers here read no clock-dependent state: any time will do


def _check_choice(answer: object, expected: str, *, what: str, choices: Sequence[str],
                  mistakes: Mapping[str, str]) -> Feedback:
    """Grade an answer that names one of ``choices``; ``mistakes`` maps a description to
    the choice that mistake gives (the first matching description is told)."""
    if answer is None:
        return Feedback(False, f"Not answered yet: name {what}.")
    if not isinstance(answer, str) or answer not in choices:
        return Feedback(False, f"{what}: expected one of {', '.join(map(repr, choices))}, "
                               f"got {answer!r}.")
    if answer == expected:
        return Feedback(True, f"Correct: {what} is {answer!r}.")
    for description, value in mistakes.items():
        if answer == value:
            return Feedback(False, f"Not quite: {answer!r} is what you get if you "
                                   f"{description}.")
    return Feedback(False, f"Not quite: {answer!r} is not {what}.")


def check_round_robin_next(answer: object, urls: Sequence[str] = ("a", "b", "c", "d"),
                           requests_before: int = 5, ejected: str = "b") -> Feedback:
    """Lab 05a, exercise 1: which backend labkit's round robin picks for the next request
    after ``requests_before`` requests over all of ``urls``, once ``ejected`` is ejected."""
    positive_int("requests_before", requests_before, at_least=0)
    if ejected not in urls:
        raise ParameterError("ejected", f"ejected must be one of {list(urls)}, got {ejected!r}")
    endpoints = [Endpoint(url) for url in urls]
    router = make_router("round_robin")
    request = RoutingRequest(None, "")
    for _ in range(requests_before):
        router.pick(request, endpoints, _NOW)
    endpoints[list(urls).index(ejected)].healthy = False
    expected = router.pick(request, endpoints, _NOW).url
    available = [url for url in urls if url != ejected]
    mistakes = {"use the tutorial's request_count % len(available)":
                tutorial_round_robin(requests_before + 1, available),
                "forget that an ejected backend gets no request": ejected,
                "start over from the first routable backend": available[0]}
    return _check_choice(answer, expected, what="the next backend", choices=list(urls),
                         mistakes=mistakes)


def check_queue_score(answer: object, waiting: Sequence[float] = (1, 4, 9),
                      index: int = 1) -> Feedback:
    """Lab 05a, exercise 2: the endpoint picker's queue score of endpoint ``index`` when
    the candidates have ``waiting`` requests waiting (``vllm:num_requests_waiting``)."""
    if not 0 <= index < len(waiting):
        raise ParameterError("index", f"index must be in [0, {len(waiting)}), got {index!r}")
    endpoints = [Endpoint(f"e{i}", num_requests_waiting=w) for i, w in enumerate(waiting)]
    expected = QueueScorer().score(RoutingRequest(None, ""), endpoints, _NOW)[index]
    low, high, mine = min(waiting), max(waiting), waiting[index]
    mistakes = {"scored more waiting requests higher, (w - min) / (max - min)":
                (mine - low) / (high - low) if high > low else 0.0,
                "divided by the maximum only, 1 - w / max": 1 - mine / high if high else 1.0,
                "gave the waiting share w / max": mine / high if high else 0.0}
    return check_number(answer, expected, what=f"the queue score of endpoint {index}",
                        rel_tol=1e-6, mistakes=mistakes)


def check_weighted_requests(answer: object, weights: Sequence[float] = (1, 1, 2),
                            num_requests: int = 400, index: int = 2) -> Feedback:
    """Lab 05a, exercise 3: how many of ``num_requests`` the ``weighted`` strategy sends to
    endpoint ``index`` on average, when the endpoints have ``weights``."""
    positive_int("num_requests", num_requests)
    if not 0 <= index < len(weights):
        raise ParameterError("index", f"index must be in [0, {len(weights)}), got {index!r}")
    endpoints = [Endpoint(f"e{i}", weight=w) for i, w in enumerate(weights)]
    scores = WeightScorer().score(RoutingRequest(None, ""), endpoints, _NOW)
    # The weighted-random picker chooses each endpoint with probability score / sum.
    expected = num_requests * scores[index] / sum(scores)
    mistakes = {"gave each endpoint an equal share": num_requests / len(weights),
                "gave the fraction of requests, not the number": scores[index] / sum(scores),
                "sent everything to the heaviest, as a min()/max() over scores does":
                num_requests if weights[index] == max(weights) else 0}
    return check_number(answer, expected, what=f"requests to endpoint {index}",
                        unit="requests", rel_tol=0.005, mistakes=mistakes)


def check_prefix_score(answer: object, first_chars: int = 300,
                       added_chars: int = 200) -> Feedback:
    """Lab 05a, exercise 4: the prefix score of the backend that served a first turn of
    ``first_chars`` characters, for a second turn that resends it with ``added_chars`` more
    (the gateway's index: chunks of 64 characters, a trailing partial chunk hashed too)."""
    positive_int("first_chars", first_chars)
    positive_int("added_chars", added_chars)
    index = PrefixIndex()
    text = "".join(chr(ord("a") + i % 26) for i in range(first_chars + added_chars))
    first, second = text[:first_chars], text
    index.record(first, "home")
    matched = index.match(second).get("home", 0)
    total = index.num_chunks(second)
    expected = matched / total
    size = index.block_size_chars
    first_chunks = index.num_chunks(first)
    mistakes = {"counted the first turn's partial last chunk as a match":
                first_chunks / total,
                "divided characters instead of chunks": first_chars / len(second),
                "left the second turn's partial last chunk out of the total":
                matched / (len(second) // size) if len(second) // size else 0.0,
                "gave the number of matched chunks, not a share": matched}
    return check_number(answer, expected, what="the prefix score", rel_tol=0.005,
                        mistakes=mistakes)

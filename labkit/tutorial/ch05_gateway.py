"""The tutorial's gateway (its chapter 5), the one rule of it that we judge in numbers
(:ref:`ch05-choosing-backend`).

Its ``InferenceGateway.select_instance`` picks, for round robin,
``available[request_count % len(available)]``, where ``request_count`` was incremented for this
request and ``available`` holds the instances that are healthy and not full *at that moment*.
With a fixed set that is round robin; when the set changes the index lands on another
instance, so some are skipped and others get two turns in a row. labkit's
``make_router("round_robin")`` gives the turn to the routable endpoint picked least recently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from labkit.checks import ParameterError, positive_int

#: Whatever the caller keeps for one instance (a URL, a record): the function only picks one.
Instance = TypeVar("Instance")


def tutorial_round_robin(request_count: int, available: Sequence[Instance]) -> Instance:
    """The tutorial's round robin, as written: the instance at
    ``request_count % len(available)`` of those available now."""
    positive_int("request_count", request_count, at_least=0)
    if not available:
        raise ParameterError("available", "available must name at least one instance")
    return available[request_count % len(available)]

"""The server-sent events of a streamed OpenAI response (chapters 2 and 5).

vLLM, ``labkit serve`` and ``labkit gateway`` stream ``/v1/completions`` and
``/v1/chat/completions`` as ``data: {json}`` lines, each event followed by a blank line, and
end a stream that finished with ``data: [DONE]``. A stream that stops before ``[DONE]`` was
cut short (a backend died, a proxy timed it out), which a client must tell apart from a
finished one: :func:`read_events` raises :class:`IncompleteStream` then.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator

DATA_PREFIX = "data: "
DONE = "[DONE]"


class IncompleteStream(Exception):
    """The stream ended without ``data: [DONE]``: the answer may be cut short."""


def event_bytes(event: dict) -> bytes:
    """One event as a server writes it: ``data: {json}`` and a blank line, in UTF-8 with
    non-ASCII text as it is (as vLLM writes it, not as ``\\u`` escapes)."""
    return f"{DATA_PREFIX}{json.dumps(event, ensure_ascii=False)}\n\n".encode()


DONE_BYTES = f"{DATA_PREFIX}{DONE}\n\n".encode()


async def read_events(lines: AsyncIterable[str]) -> AsyncIterator[dict]:
    """The JSON events of a stream, given its lines (``response.aiter_lines()``), in order.

    Other lines (blank separators, ``: comments``, ``event:`` fields) are skipped; the
    iteration ends at ``data: [DONE]``, and raises :class:`IncompleteStream` if the lines run
    out before it. An event that is not JSON raises ``json.JSONDecodeError``.
    """
    async for line in lines:
        if not line.startswith(DATA_PREFIX):
            continue
        data = line[len(DATA_PREFIX):]
        if data == DONE:
            return
        yield json.loads(data)
    raise IncompleteStream(f"the stream ended without {DATA_PREFIX}{DONE}")

"""A server's base URL as labkit keys it (chapters 5 and 8)."""

from __future__ import annotations

from urllib.parse import urlsplit

from labkit.checks import ParameterError


def normalize_url(url: str) -> str:
    """``url`` without surrounding space or a trailing slash, so one server has one key in a
    gateway's pool, a scraper's targets and a fleet. An ``http(s)://host[:port]`` is required;
    anything else raises :class:`~labkit.checks.ParameterError`."""
    parts = urlsplit(url.strip()) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ParameterError("url", f"url must be http://host:port or https://host:port, "
                                    f"got {url!r}")
    return url.strip().rstrip("/")


def instance_of(url: str) -> str:
    """The ``instance`` label Prometheus gives a target: its ``host:port``."""
    parts = urlsplit(normalize_url(url))
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"

"""labkit.monitor.scrape and .health (chapter 8) against a real ``labkit serve`` in this
process: vLLM's metric names scraped, token rates equal to what the server reported, TTFT
quantiles from its histogram, ``up`` and the health checker on a dead port."""

import asyncio

import httpx
import pytest
from conftest import serve_tiny_model

from labkit.checks import ParameterError
from labkit.engine import write_tiny_model
from labkit.http.metrics import parse_samples
from labkit.monitor import (HealthChecker, RuleEvaluator, Scraper, backend_down, histogram_quantile,
                            increase, latest_values)
from labkit.process import free_port


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_tiny_model(tmp_path_factory.mktemp("tiny"))
    with serve_tiny_model(model, "tiny", max_model_len=256) as (base, _engine):
        yield base


class Clock:
    def __init__(self):
        self.t_s = 0.0

    def __call__(self):
        return self.t_s


async def scripted_run(base: str, dead: str):
    clock = Clock()
    async with httpx.AsyncClient() as client:
        scraper = Scraper([base, dead], client, clock=clock, timeout_s=5)
        clock.t_s = 1.0
        first = await scraper.scrape_once()
        answers = await asyncio.gather(*(client.post(
            base + "/v1/completions",
            json={"model": "tiny", "prompt": f"hello {i}", "max_tokens": 4, "temperature": 0},
            timeout=60) for i in range(3)))
        clock.t_s = 2.0
        await scraper.scrape_once()
        clock.t_s = 3.0
        await scraper.scrape_once()
    usage = [a.json()["usage"] for a in answers]
    return scraper.store, first, usage


def test_scrape_rates_and_quantiles_of_vllm_metrics(server):
    dead = f"http://127.0.0.1:{free_port()}"
    store, first, usage = asyncio.run(scripted_run(server, dead))
    ok = {r.url: r.ok for r in first}
    assert ok == {server: True, dead: False}
    instance = server.removeprefix("http://")
    # Window (0, 3]: samples at 1, 2, 3 and the counter at 0 on the first: no
    # extrapolation, the increase is exactly the tokens the server reported.
    (tokens,) = store.select("vllm:generation_tokens_total", instance=instance)
    assert increase(tokens, 3, 3) == pytest.approx(sum(u["completion_tokens"] for u in usage))
    (prompt,) = store.select("vllm:prompt_tokens_total", instance=instance)
    assert increase(prompt, 3, 3) == pytest.approx(sum(u["prompt_tokens"] for u in usage))
    (count,) = latest_values(store, "vllm:time_to_first_token_seconds_count", 3,
                             instance=instance).values()
    assert count == 3
    p50 = histogram_quantile(0.5, store, "vllm:time_to_first_token_seconds", 3, window_s=3,
                             by=("instance",))
    assert list(p50) == [(("instance", instance),)]
    assert 0 < p50[(("instance", instance),)] < 60
    ups = {dict(k)["instance"]: v for k, v in latest_values(store, "up", 3).items()}
    assert ups == {instance: 1.0, dead.removeprefix("http://"): 0.0}
    evaluator = RuleEvaluator([backend_down()], store)
    assert [(e.state, dict(e.labels)["instance"]) for e in evaluator.evaluate(3)] == \
        [("pending", dead.removeprefix("http://")), ("firing", dead.removeprefix("http://"))]


def test_health_checker_ejects_after_consecutive_failures(server):
    dead = f"http://127.0.0.1:{free_port()}"
    clock = Clock()

    async def run():
        async with httpx.AsyncClient() as client:
            checker = HealthChecker([server, dead], client, clock=clock, timeout_s=2)
            rounds = []
            for t in (1.0, 2.0, 3.0):
                clock.t_s = t
                rounds.append(await checker.check())
            return checker, rounds

    checker, rounds = asyncio.run(run())
    assert [[s.healthy for s in r] for r in rounds] == [[True, True], [True, True],
                                                        [True, False]]
    assert [(t.url, t.healthy, t.t_s) for t in checker.transitions] == [(dead, False, 3.0)]
    assert checker.healthy(server) and not checker.healthy(dead)
    with pytest.raises(ParameterError):
        HealthChecker([server], None, eject_after=0)


def test_parse_rejects_what_is_not_exposition_format():
    assert parse_samples('# TYPE g gauge\ng{a="1"} 2\n') == [("g", {"a": "1"}, 2.0)]
    with pytest.raises(ParameterError) as error:
        parse_samples("g{a= 1\n")
    assert error.value.param == "text"
    with pytest.raises(ParameterError) as error:
        Scraper(["ftp://x"], None)
    assert error.value.param == "url"

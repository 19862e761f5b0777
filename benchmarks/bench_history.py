"""One long conversation on recipe=local_cpu's llama-server: the first token of each turn once the
history window is full, with the window sliding one turn at a time against dropping its older half.

Run: python benchmarks/bench_history.py [--slots 2 5 9] [--turns 16] [--max-history-turns 8]

Past ``llm.max_history_turns`` older turns leave the prompt, so its start moves and llama-server
(``--cache-reuse``) shifts the kept turns in its KV cache. The shift runs over every slot's cells, so
its cost grows with the slots the server was started with (io=realtime: ``io.max_sessions`` + 1),
and every slot's generation waits for it. Per ``--slots`` value the recipe's own server command
(``recipe=local_cpu io=realtime io.max_sessions=S-1``), one conversation on slot 0, greedy replies
of up to 60 tokens; per window: the first-token ms of every turn, and the median of the turns whose
window was trimmed against the others. Three windows: sliding (the oldest turn leaves with each new
one), older half (a full window drops its older half as the next turn begins), and older half,
prepared (what llm=chat does on its own slot: the window is trimmed before the next turn, when the
user speaks again, and the trimmed prompt sent with one token to write, so the next turn's prompt only
extends it).

Figures depend on the machine and its load: the CPU model is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s2s_flow.machine import cpu_label  # noqa: E402

QUESTIONS = ["What is the capital of Australia?", "How tall is Mount Everest?", "Who wrote Hamlet?",
             "Why is the sky blue?", "What do bees make?", "How many legs does a spider have?",
             "What is the largest ocean?", "Who painted the Mona Lisa?", "What is the speed of light?",
             "How far away is the Moon?", "What is photosynthesis?", "Who was Napoleon?", "What is a black hole?",
             "How do airplanes fly?", "What is the boiling point of water?", "Why do cats purr?"]
SYSTEM = {"role": "system", "content": "You are a helpful voice assistant. Answer briefly."}


def sliding(max_turns: int) -> Any:
    """The window as it was: the oldest exchange leaves with each new one."""
    from nodes.llm._conversation import Conversation, Exchange

    class Sliding(Conversation):
        def add_user(self, user: Any, turn: int, *, speculative: bool = False) -> Exchange:
            exchange = Exchange(user=user, turn=turn)
            self.exchanges = [*self.exchanges, exchange][-self.max_turns:]
            return exchange

    return Sliding(None, max_turns)


def conversation(base_url: str, conv: Any, turns: int, prepare: bool = False) -> list[dict[str, Any]]:
    """Each turn's first-token ms, and whether its window was trimmed since the previous turn."""
    import httpx

    rows, oldest = [], 1
    # a connection per request: llama-server may close one after a stream, and a reused one then fails
    with httpx.Client(timeout=120, trust_env=False, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        for n in range(1, turns + 1):
            exchange = conv.add_user(QUESTIONS[(n - 1) % len(QUESTIONS)], n)
            messages = [SYSTEM, *conv.messages()]
            trimmed, oldest = conv.exchanges[0].turn != oldest, conv.exchanges[0].turn
            start, first, text = time.monotonic(), None, ""
            body = {"messages": messages, "max_tokens": 60, "temperature": 0, "stream": True, "id_slot": 0}
            with client.stream("POST", f"{base_url}/chat/completions", json=body) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    piece = choices[0].get("delta", {}).get("content")
                    if piece and first is None:
                        first = time.monotonic() - start
                    text += piece or ""
            conv.record_reply(exchange, text)
            rows.append({"turn": n, "first_token_ms": round((first or 0.0) * 1000), "trimmed": trimmed})
            if prepare and conv.make_room():
                messages = [SYSTEM, *conv.messages(), {"role": "assistant", "content": text}]
                client.post(f"{base_url}/chat/completions", json={
                    "messages": messages, "max_tokens": 1, "temperature": 0, "id_slot": 0}).raise_for_status()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, nargs="+", default=[2, 5, 9])
    ap.add_argument("--turns", type=int, default=16)
    ap.add_argument("--max-history-turns", type=int, default=8)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from nodes.llm._conversation import Conversation
    from s2s_flow.compose import compose
    from s2s_flow.model_server import managed_server
    from tests.support.servers import free_port

    report: dict[str, Any] = {"cpu": cpu_label(), "turns": args.turns, "max_history_turns": args.max_history_turns,
                              "rows": []}
    for slots in args.slots:
        port = free_port()
        cfg, _ = compose(["recipe=local_cpu", "io=realtime", f"io.max_sessions={slots - 1}",
                          f"llm.base_url=http://127.0.0.1:{port}/v1"])
        print(f"llama-server with {slots} slots ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as run_dir, managed_server(cfg.server, Path(run_dir)):
            for window, conv, prepare in (("sliding", sliding(args.max_history_turns), False),
                                          ("older half", Conversation(None, args.max_history_turns), False),
                                          ("older half, prepared", Conversation(None, args.max_history_turns), True)):
                rows = conversation(f"http://127.0.0.1:{port}/v1", conv, args.turns, prepare)
                trimmed = [r["first_token_ms"] for r in rows[1:] if r["trimmed"]]
                others = [r["first_token_ms"] for r in rows[1:] if not r["trimmed"]]
                row = {"slots": slots, "window": window, "first_token_ms": [r["first_token_ms"] for r in rows],
                       "trimmed_turns": len(trimmed), "trimmed_p50": median(trimmed) if trimmed else None,
                       "others_p50": median(others) if others else None}
                report["rows"].append(row)
                print(f"  {window}: {row['first_token_ms']}", file=sys.stderr, flush=True)
    print(json.dumps(report, indent=1))
    print(f"\n{report['cpu']}, one conversation of {args.turns} turns, llm.max_history_turns="
          f"{args.max_history_turns}, llama-server on slot 0\n")
    print("| slots | window | turns after a trim | their first token p50 ms | the other turns' p50 ms |")
    print("|--:|---|--:|--:|--:|")
    for row in report["rows"]:
        print(f"| {row['slots']} | {row['window']} | {row['trimmed_turns']} | {row['trimmed_p50']} | "
              f"{row['others_p50']} |")


if __name__ == "__main__":
    main()

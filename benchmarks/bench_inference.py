"""What a shared model's scheduler costs a session alone: an uncontended slot, taken and given back.

Run: python benchmarks/bench_inference.py [--calls 200000]

A session alone never waits (s2s_flow/inference.py takes a free slot under one lock, on the
caller's thread), so what it pays is this per call into a shared model: a decode, a TTS chunk,
a local LLM's reply. A turn makes a few dozen such calls; compare with the milliseconds each
of them computes. Printed: microseconds per slot through the node contract and bare.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from s2s_flow import inference
from s2s_flow.machine import hardware
from s2s_flow.node import Context, Node


class _Shared(Node):
    def inference_key(self) -> str:
        return "bench:shared"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200_000)
    args = ap.parse_args()
    node = _Shared()
    node.ctx = Context("bench", Path("."))
    sched = inference.scheduler("bench:bare", 1)
    for label, slot in (("bare Scheduler.slot", lambda: sched.slot("first")),
                        ("node.inference_slot", lambda: node.inference_slot("first", turn=1))):
        start = time.perf_counter()
        for _ in range(args.calls):
            with slot():
                pass
        per = (time.perf_counter() - start) / args.calls
        print(f"{label:>22}: {per * 1e6:.2f} us per uncontended slot ({args.calls} calls)")
    print(f"machine: {hardware()}, load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

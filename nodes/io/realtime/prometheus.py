"""The realtime server's Prometheus figures (``/metrics``): sessions, turns, voice-to-voice, the
sessions it closed and refused and why, the budget admission by load holds them to, the stages that
failed, the managed model server's restarts, the shared models' queues (admission.py's
InferenceCollector), the CPU time by stage, and whether it takes a new session now, as ``/readyz``
says (``s2s_ready``, ``s2s_not_ready{reason}``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nodes.io.realtime.admission import InferenceCollector
from s2s_flow.node import require

__all__ = ["ServerMetrics"]


class ServerMetrics:
    """Prometheus figures of one server (its own registry: several servers in one process)."""

    def __init__(self) -> None:
        prom = require("prometheus_client", "serve", pip_name="prometheus-client")
        self.prom = prom
        self.registry = prom.CollectorRegistry()
        self.sessions = prom.Gauge("s2s_sessions_open", "Realtime sessions open now", registry=self.registry)
        self.sessions_total = prom.Counter("s2s_sessions", "Realtime sessions accepted", registry=self.registry)
        self.turns = prom.Counter("s2s_turns", "Replies completed", registry=self.registry)
        self.dropped = prom.Counter("s2s_sessions_dropped", "Sessions the server closed", ["reason"],
                                    registry=self.registry)
        self.refused = prom.Counter("s2s_sessions_refused", "Connections refused: by io.max_sessions (count), "
                                    "because the sessions open are already slower than io.target_ms (load), or "
                                    "by io.client_limits (client_session_limit, client_rate_limited)",
                                    ["reason"], registry=self.registry)
        for reason in ("count", "load", "client_session_limit", "client_rate_limited"):
            self.refused.labels(reason)
        self.registry.register(InferenceCollector())
        self.failures = prom.Counter("s2s_stage_failures", "Turns whose stage failed (the session went on: "
                                     "llm.fallback_reply, or an error event)", ["stage"], registry=self.registry)
        self.registry.register(_RestartCollector(prom))
        self.registry.register(_CpuCollector(prom))
        self.v2v = prom.Histogram("s2s_voice_to_voice_seconds", "User's end of speech to the first reply audio "
                                  "sent", registry=self.registry,
                                  buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0))

    def admission_target(self, target_s: Callable[[], float | None]) -> None:
        """``target_s()``: the voice-to-voice budget admission by load holds sessions to now (read at
        every scrape): io.target_ms, or what ``auto`` took from this machine; NaN while there is none."""
        gauge = self.prom.Gauge("s2s_admission_target_seconds", "The voice-to-voice budget of admission by load: "
                                "io.target_ms, or auto's 1.5 x this machine's figure for a lone caller (NaN: none "
                                "yet, or admission by count only)", registry=self.registry)
        gauge.set_function(lambda: float("nan") if (target := target_s()) is None else target)

    def readiness(self, state: Any) -> None:
        """``state()``: drain.py's readiness, read at every scrape."""
        self.registry.register(_ReadinessCollector(self.prom, state))

    def observe(self, name: str, value: float) -> None:
        if name == "turn":
            self.turns.inc()
        elif name == "voice_to_voice_s":
            self.v2v.observe(value)
        elif name == "stage_failed":
            self.failures.labels(str(value)).inc()

    def text(self) -> bytes:
        return self.prom.generate_latest(self.registry)


class _RestartCollector:
    """``s2s_model_server_restarts_total{server}``: the restarts of the recipe's model server
    (s2s_flow/server_watch.py counts them for the whole process)."""

    def __init__(self, prom: Any) -> None:
        self._family = prom.metrics_core.CounterMetricFamily

    def collect(self) -> Any:
        from s2s_flow.server_watch import restarts

        family = self._family("s2s_model_server_restarts", "Restarts of a managed model server (it exited "
                              "or stopped answering)", labels=["server"])
        for server, count in restarts().items():
            family.add_metric([server], count)
        yield family


class _CpuCollector:
    """``s2s_stage_cpu_seconds_total{stage}``: the server process's CPU time by stage (each node's
    threads, an engine's own threads as ``native``, the rest as ``other``: s2s_flow/cpu.py)."""

    def __init__(self, prom: Any) -> None:
        self._family = prom.metrics_core.CounterMetricFamily

    def collect(self) -> Any:
        from s2s_flow.cpu import by_stage

        family = self._family("s2s_stage_cpu_seconds", "CPU time of the server process by stage: each node's "
                              "threads (vad, stt, llm, tts, ...), engines' own threads (native), the rest (other)",
                              labels=["stage"])
        for stage, seconds in sorted(by_stage().items()):
            family.add_metric([stage], seconds)
        yield family


class _ReadinessCollector:
    """``s2s_ready`` (1: a new session is taken now, /readyz 200) and ``s2s_not_ready{reason}`` (1 for
    the reason it is not: draining, count, load; 0 for the others)."""

    REASONS = ("draining", "count", "load")

    def __init__(self, prom: Any, state: Any) -> None:
        self._gauge, self.state = prom.metrics_core.GaugeMetricFamily, state

    def describe(self) -> list[Any]:
        return []  # registering must not take the verdict

    def collect(self) -> Any:
        state = self.state()
        reason = "draining" if state["status"] == "draining" else state.get("reason")
        ready = self._gauge("s2s_ready", "1 while a new session is taken (/readyz 200), else 0")
        ready.add_metric([], 1 if state["status"] == "ready" else 0)
        why = self._gauge("s2s_not_ready", "Why /readyz answers 503 now: draining, full by count, or full by "
                          "load (1 for the reason in force)", labels=["reason"])
        for name in self.REASONS:
            why.add_metric([name], 1 if name == reason else 0)
        yield from (ready, why)

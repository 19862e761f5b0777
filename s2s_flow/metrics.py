"""Per-turn latency, computed from the engine's trace alone: the numbers users pick a stack by.

No node measures itself. Stages are found by the messages they emit (``Speech``,
``Transcript``, ``TextDelta``, ``AudioOut``; a sink is a node without outputs) and their
milestones by message marks (``Message.mark()``, recorded by the scheduler as
``out:<mark>`` when a node emits and ``in:<mark>`` when one receives). Every latency is in
milliseconds from the user's true end of speech (the ``speech_end`` mark: VAD stop minus its
silence hangover); voice-to-voice ends when the first reply audio reaches a sink.

The critical path of a turn is cut into stage time (a node between receiving its input
and emitting its output) and ring time (from a message's creation to its pickup
downstream); the two add up exactly to voice-to-voice.

Speculation (``vad.speculate_ms``): the VAD sends the utterance at an early pause and records
``speculation``; the turn is then confirmed (the VAD sends it again) or withdrawn because the
user went on (``speculation_end``, outcome ``confirmed`` / ``wasted``). A speculated turn's
critical path starts at the speculation, and a gate (a node that passes the reply's messages
on unchanged, nodes/vad/gate.py) holds the reply until the confirmation: that hold is a part
of its own. A withdrawn turn is no reply: it is counted, never measured.

    report = metrics.report(trace, scheduler.ring_stats, graph)
    metrics.write(report, run_dir)          # metrics.json (+ timeline.png on request)
    metrics.show(report, console)           # a rich table
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from s2s_flow.messages import AudioOut, Speech, TextDelta, Transcript

__all__ = ["report", "write", "show", "figures", "plot_timeline", "MILESTONES", "STAGES"]

log = logging.getLogger("s2s_flow.metrics")

SCHEMA = 1

#: Stage roles on the critical path, the message type that identifies each, the mark
#: its critical output carries. The LLM's critical output is its first sentence: TTS
#: speaks whole sentences (a first clause may go sooner: the TTS's ``tts_start`` event).
_ROLES: tuple[tuple[str, type, str], ...] = (
    ("vad", Speech, "speech_end"),
    ("stt", Transcript, "transcript_final"),
    ("llm", TextDelta, "sentence"),
    ("tts", AudioOut, "audio"),
)

#: The path after the VAD: (role, the mark its critical output carries). Its input is the
#: previous role's output. A gate takes the TTS's audio and passes it on when the turn is confirmed.
_PATH: tuple[tuple[str, str], ...] = (("stt", "transcript_final"), ("llm", "sentence"), ("tts", "audio"),
                                      ("gate", "audio"))

#: Cumulative milestones, ms after the true end of speech: (key, label).
MILESTONES: tuple[tuple[str, str], ...] = (
    ("vad_ms", "end of turn detected (VAD)"),
    ("turn_confirmed_ms", "turn confirmed (VAD)"),
    ("stt_ms", "STT final transcript"),
    ("llm_first_token_ms", "LLM first token"),
    # what TTS started on (a first clause with tts.first_clause_words, else the first sentence)
    ("llm_first_words_ms", "LLM first words to TTS"),
    # the first full stop the LLM streamed: after the first audio when TTS began on a clause
    # or a piece of a long sentence (a reply with no full stop for a while: seconds after)
    ("llm_first_sentence_ms", "LLM first sentence end (full stop)"),
    ("tts_first_audio_ms", "TTS first audio"),
    ("voice_to_voice_ms", "voice-to-voice (first audio at sink)"),
)

#: The critical path split in parts that add up to voice-to-voice: (key, label).
STAGES: tuple[tuple[str, str], ...] = (
    ("stage_vad_ms", "VAD hangover + decision"),
    ("stage_stt_ms", "STT"),
    ("stage_llm_ms", "LLM to the first words spoken"),
    ("stage_tts_ms", "TTS to first audio"),
    ("stage_gate_ms", "held until the turn is confirmed"),
    ("ring_wait_ms", "ring wait on the critical path"),
)

#: Tool calls (llm.tools): their time on the critical path, and voice-to-voice without it.
TOOLS: tuple[tuple[str, str], ...] = (
    ("tool_ms", "tool calls before the first audio"),
    ("voice_to_voice_without_tools_ms", "voice-to-voice without tool time"),
)

_STATS_KEYS = [k for k, _ in MILESTONES] + [k for k, _ in STAGES] + [k for k, _ in TOOLS]


# -- building the report -----------------------------------------------------------------


def report(trace: Any, ring_stats: Mapping[str, Mapping[str, Any]] | None = None,
           graph: Any = None) -> dict[str, Any]:
    """Per-turn latencies, summary statistics and ring counters of one run.

    ``trace`` is a :class:`s2s_flow.trace.Trace` or its ``to_dict()`` form (trace.json);
    ``graph`` (a :class:`s2s_flow.graph.Graph`) names the stages by the types their class
    emits; without it, stages are recognised by the marks they left in the trace.
    """
    data = trace.to_dict() if hasattr(trace, "to_dict") else dict(trace)
    if ring_stats is None:
        ring_stats = data.get("rings") or {}
    nodes: dict[str, dict[str, dict[str, Any]]] = data.get("nodes", {})
    roles = _roles_from_graph(graph) if graph is not None else _roles_from_marks(nodes)
    chain = list(getattr(graph, "chain", None) or nodes)
    events = data.get("events", [])
    interrupts = [e for e in events if e.get("kind") == "interrupt"]
    tool_calls = [e for e in events if e.get("kind") == "tool_call"]
    conversations = data.get("conversations", {})
    speculations = _speculations(events)
    spoken: dict[int, float] = {}  # per turn: when TTS took the reply's first words (a clause, or the sentence)
    for e in events:
        if e.get("kind") == "tts_start":
            spoken.setdefault(e.get("turn"), e["t"])

    turn_ids = sorted({int(t) for table in nodes.values() for t in table if int(t) > 0})
    turns = [_turn(nodes, roles, chain, t, interrupts, conversations.get(str(t), ""), speculations.get(t),
                   spoken.get(t)) for t in turn_ids]
    for row in turns:
        _tool_time(row, [e for e in tool_calls if e.get("turn") == row["turn"]])
    # what ended each turn, where a turn detector says (vad.turn=smart_turn: the model, or the fallback)
    turn_ends = {e.get("turn"): e for e in events if e.get("kind") == "turn_end"}
    for row in turns:
        if row["turn"] in turn_ends:
            row["turn_end"] = turn_ends[row["turn"]].get("by")
    # live runs: a stage whose endpoint failed on a turn (the session went on; the LLM's fallback)
    failures = [e for e in events if e.get("kind") == "stage_failed"]
    for row in turns:
        row["failures"] = [{k: e.get(k) for k in ("stage", "error", "fallback")} for e in failures
                           if e.get("turn") == row["turn"]]
    replies = [row for row in turns if row["reply"]]  # a withdrawn speculation was never a reply
    warmup = replies[0] if replies else None
    if warmup is not None:
        warmup["warmup"] = True
    measured = replies[1:] if len(replies) > 1 else replies

    outcomes = [s["outcome"] for s in speculations.values()]
    drops = {edge: int(s.get("drops", 0)) for edge, s in ring_stats.items() if s.get("drops")}
    return {
        "schema": SCHEMA,
        "units": "milliseconds after the user's true end of speech; *_s fields are seconds since the run start",
        "roles": roles,
        "turns": turns,
        "warmup_turn": warmup["turn"] if warmup else None,
        "warmup_excluded": len(replies) > 1,
        "measured_turns": len(measured),
        "summary": {key: _stats([t.get(key) for t in measured]) for key in _STATS_KEYS},
        "warmup": {key: warmup.get(key) for key in _STATS_KEYS} if warmup else None,
        # thread counts a stage timed on this machine when its model loaded (threads: auto)
        "calibration": {e["stage"]: {k: e[k] for k in ("option", "threads", "ms", "cores") if k in e}
                        for e in events if e.get("kind") == "calibration"},
        "speculations": len(speculations),
        "speculation_confirmed": outcomes.count("confirmed"),
        "speculation_wasted": outcomes.count("wasted"),
        # when each conversation's audio began (its source says so, else its session began): turn
        # times minus these are times in its stream
        "sessions": {e["conversation"]: e["t"] for e in events if e.get("kind") in ("session", "playback")},
        "rings": {edge: dict(s) for edge, s in ring_stats.items()},
        "drops": drops,
        "drops_total": sum(drops.values()),
        "stage_failures": len(failures),
    }


def _speculations(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per speculated turn: when the VAD sent it early, and how it ended (None: the run stopped first)."""
    found: dict[int, dict[str, Any]] = {}
    for e in events:
        if e.get("kind") == "speculation":
            found.setdefault(int(e["turn"]), {"t": e["t"], "outcome": None})
    for e in events:
        if e.get("kind") == "speculation_end" and int(e["turn"]) in found:
            found[int(e["turn"])]["outcome"] = e.get("outcome")
    return found


def _relay(cls: type) -> bool:
    """A node that emits only types it also takes passes messages on; it makes none (a gate)."""
    outs, ins = cls.outputs.values(), cls.inputs.values()
    return bool(outs) and all(any(issubclass(o, i) for i in ins) for o in outs)


def _roles_from_graph(graph: Any) -> dict[str, list[str]]:
    """Each stage is the node whose class emits its type; relays (the gate) pass them on and are
    their own role, not the stage that made the messages."""
    relays = [name for name, spec in graph.nodes.items() if _relay(spec.cls)]
    roles: dict[str, list[str]] = {}
    for role, typ, _ in _ROLES:
        roles[role] = [name for name, spec in graph.nodes.items() if name not in relays
                       and any(issubclass(t, typ) for t in spec.cls.outputs.values())]
    roles["gate"] = [n for n in relays if any(issubclass(t, AudioOut) for t in graph.nodes[n].cls.outputs.values())]
    roles["sink"] = [name for name, spec in graph.nodes.items() if spec.cls.inputs and not spec.cls.outputs]
    return roles


def _roles_from_marks(nodes: Mapping[str, Mapping[str, Any]]) -> dict[str, list[str]]:
    """Without the graph: a stage is the node that emitted its marks; a sink emitted nothing; a
    relay (the gate) emitted only marks it had also received."""
    def marks(name: str, way: str) -> set[str]:
        return {m.removeprefix(way) for rec in nodes[name].values() for m in rec["marks"] if m.startswith(way)}

    relays = [n for n in nodes if marks(n, "out:") and marks(n, "out:") <= marks(n, "in:")]
    outs = {"vad": ("speech_end",), "stt": ("transcript_final",), "llm": ("token", "sentence"), "tts": ("audio",)}
    roles = {role: [n for n in nodes if n not in relays and marks(n, "out:") & set(keys)]
             for role, keys in outs.items()}
    roles["gate"] = [n for n in relays if "audio" in marks(n, "out:")]
    roles["sink"] = [n for n in nodes if any(r["n_in"] for r in nodes[n].values())
                     and not any(r["n_out"] for r in nodes[n].values())]
    return roles


def _turn(nodes: Mapping[str, Mapping[str, Any]], roles: Mapping[str, list[str]], chain: list[str],
          turn: int, interrupts: list[dict[str, Any]], conversation: str,
          speculation: Mapping[str, Any] | None = None, spoken: float | None = None) -> dict[str, Any]:
    key = str(turn)
    recs = {name: table[key] for name, table in nodes.items() if key in table}

    def first(role: str, name: str) -> tuple[str | None, float | None]:
        """The node of ``role`` that reached mark ``name`` first in this turn, and when."""
        found = [(recs[n]["marks"][name], n) for n in roles.get(role, ()) if n in recs and name in recs[n]["marks"]]
        return (min(found)[1], min(found)[0]) if found else (None, None)

    def mark(role: str, name: str) -> float | None:
        return first(role, name)[1]

    end = mark("vad", "out:speech_end")
    outcome = speculation["outcome"] if speculation else None
    row: dict[str, Any] = {"turn": turn, "conversation": conversation, "warmup": False,
                           "reply": outcome != "wasted", "speculated": speculation is not None,
                           "speculation": outcome, "speech_end_s": end}
    # When the VAD let go of the utterance: its emit time, not the (back-dated) mark. Its last
    # emission is the confirmation; a speculated turn's reply started at the speculation.
    vad_emit = min((recs[n]["last_out"] for n in roles.get("vad", ())
                    if n in recs and "out:speech_end" in recs[n]["marks"] and recs[n]["last_out"] is not None),
                   default=end)
    released = speculation["t"] if speculation else vad_emit
    token = [t for t in (mark("llm", "out:token"), mark("llm", "out:sentence")) if t is not None]
    at = {
        "vad_ms": released,
        "turn_confirmed_ms": vad_emit if row["reply"] else None,
        "stt_ms": mark("stt", "out:transcript_final"),
        "llm_first_token_ms": min(token) if token else None,
        "llm_first_words_ms": spoken if spoken is not None else mark("llm", "out:sentence"),
        "llm_first_sentence_ms": mark("llm", "out:sentence"),
        "tts_first_audio_ms": mark("tts", "out:audio"),
        "voice_to_voice_ms": mark("sink", "in:audio"),
    }
    for k, t in at.items():
        row[k] = _ms(t, end)

    # The critical path: stage, ring, stage, ring ... each piece from its own two marks.
    segments: list[tuple[str, float, float]] = []
    if end is not None and released is not None:
        segments.append(("vad", end, released))
        prev_mark, prev_t = "speech_end", released
        for role, out_mark in _PATH:
            if not roles.get(role):
                continue  # the stage is not in this graph (stt=none, no gate)
            # in and out of the same node: a side node (a partial transcriber) may also take the input
            node, t_out = first(role, "out:" + out_mark)
            t_in = recs[node]["marks"].get("in:" + prev_mark) if node else None
            if role == "gate" and t_in is not None:
                t_out = _released(recs[node], t_in, t_out, vad_emit)
            # the LLM's part ends, and the TTS's begins, when TTS took the first words: with
            # tts.first_clause_words that is a clause, before the first sentence's mark
            if role == "llm" and spoken is not None and t_in is not None:
                t_out = spoken
            if role == "tts" and spoken is not None:
                t_in = spoken
            if t_in is None or t_out is None:
                prev_mark = ""
                break
            segments += [("ring", prev_t, t_in), (role, t_in, t_out)]
            prev_mark, prev_t = out_mark, t_out
        t_sink = mark("sink", "in:" + prev_mark) if prev_mark else None
        if t_sink is not None:
            segments.append(("ring", prev_t, t_sink))
    for role in ("vad", "stt", "llm", "tts", "gate"):
        row[f"stage_{role}_ms"] = next((_ms(b, a) for r, a, b in segments if r == role), None)
    rings = [b - a for r, a, b in segments if r == "ring"]
    row["ring_wait_ms"] = _ms(sum(rings), 0.0) if rings and row["voice_to_voice_ms"] is not None else None
    row["queued_ms"] = _ms(sum(recs[n]["wait_s"] for n in chain if n in recs), 0.0)
    row["segments"] = [{"part": r, "from_ms": _ms(a, end), "to_ms": _ms(b, end)} for r, a, b in segments]

    done = max((r["last_out"] or r["last_in"] or 0.0 for r in recs.values()), default=0.0)
    row["interrupted"] = any(e.get("turn", 0) > turn and e["t"] < done for e in interrupts)
    return row


def _released(rec: Mapping[str, Any], t_in: float, t_out: float | None, confirmed: float | None) -> float:
    """When a gate let the turn's first audio go. It passes messages on as they are, so their
    marks keep the time TTS made them; it lets go once the audio is in and the turn confirmed,
    and all it held goes out together: its first emission of the turn, if later than both."""
    return max(t for t in (t_in, rec.get("first_out"), t_out, confirmed) if t is not None)


def _tool_time(row: dict[str, Any], calls: list[dict[str, Any]]) -> None:
    """Which tools a turn called, and how much of its voice-to-voice they took: the time any
    call ran between the end of speech and the first audio (parallel calls counted once)."""
    row["tool_calls"] = [{"tool": e["tool"], "args_bytes": e["args_bytes"], "ms": round(e["seconds"] * 1000, 1),
                          "status": e["status"]} for e in calls]
    end, v2v = row["speech_end_s"], row["voice_to_voice_ms"]
    row["tool_ms"] = None
    if calls and end is not None:
        stop = end + v2v / 1000 if v2v is not None else float("inf")
        covered, reach = 0.0, end
        for a, b in sorted((e["t"] - e["seconds"], e["t"]) for e in calls):
            a, b = max(a, reach), min(b, stop)
            if b > a:
                covered, reach = covered + b - a, b
        row["tool_ms"] = round(covered * 1000, 1)
    row["voice_to_voice_without_tools_ms"] = None if v2v is None else round(v2v - (row["tool_ms"] or 0.0), 1)


def _ms(t: float | None, since: float | None) -> float | None:
    if t is None or since is None:
        return None
    return round((t - since) * 1000.0, 1)


def _stats(values: list[float | None]) -> dict[str, Any]:
    import numpy as np

    xs = np.array([v for v in values if v is not None], dtype=float)
    if not len(xs):
        return {"n": 0, "p50": None, "p95": None, "max": None, "mean": None}
    return {"n": int(len(xs)), "p50": round(float(np.percentile(xs, 50)), 1),
            "p95": round(float(np.percentile(xs, 95)), 1), "max": round(float(xs.max()), 1),
            "mean": round(float(xs.mean()), 1)}


# -- outputs -----------------------------------------------------------------------------


def figures(rep: Mapping[str, Any]) -> dict[str, Any]:
    """The headline numbers as a flat dict: a job's return value in a Hydra sweep."""
    out: dict[str, Any] = {"measured_turns": rep["measured_turns"], "drops_total": rep["drops_total"]}
    for key in _STATS_KEYS:
        name = key.removesuffix("_ms")
        s = rep["summary"][key]
        out[f"{name}_p50_ms"], out[f"{name}_p95_ms"] = s["p50"], s["p95"]
    out["voice_to_voice_max_ms"] = rep["summary"]["voice_to_voice_ms"]["max"]
    out["warmup_voice_to_voice_ms"] = (rep["warmup"] or {}).get("voice_to_voice_ms")
    out["calibration"] = calibrated(rep)
    for key in ("speculations", "speculation_confirmed", "speculation_wasted"):
        out[key] = rep.get(key, 0)
    return out


def calibrated(rep: Mapping[str, Any]) -> str:
    """The thread counts chosen on this machine, as ``stt.cpu_threads=1 tts.threads=1`` ('' if none)."""
    return " ".join(f"{c['option']}={c['threads']}" for c in (rep.get("calibration") or {}).values())


def write(rep: Mapping[str, Any], run_dir: Path | str, *, timeline: bool = False) -> Path:
    """``metrics.json`` in the run dir, and ``timeline.png`` when asked (needs the `plot` extra)."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.json"
    path.write_text(json.dumps(rep, indent=1))
    if timeline and rep["turns"]:
        try:
            plot_timeline(rep, run_dir / "timeline.png")
        except ImportError as exc:
            log.warning("metrics.timeline=true needs matplotlib (%s): pip install 's2s-flow[plot]'", exc)
    return path


QUEUED_NOTE_MS = 50.0  # ring waits this long are queueing behind earlier turns, not hand-overs


def show(rep: Mapping[str, Any], console: Any) -> None:
    """The run's latencies as a rich table (ms after the true end of user speech)."""
    from rich.table import Table

    turns = rep["turns"]
    replies = [t for t in turns if t.get("reply", True)]
    if not replies:
        return
    title = "latency (ms after the user's true end of speech)"
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("", no_wrap=True)
    hidden = set()  # rows only a speculating run fills
    if not any(t.get("speculated") for t in turns):
        hidden.add("turn_confirmed_ms")
    if not rep["roles"].get("gate"):
        hidden.add("stage_gate_ms")
    shown = [[(k, label) for k, label in part if k not in hidden]
             for part in (MILESTONES, STAGES, TOOLS if any(t.get("tool_calls") for t in turns) else ())]
    rows = [row for part in shown for row in part]
    sections = (len(shown[0]) - 1, len(shown[0]) + len(shown[1]) - 1)
    if len(replies) == 1:
        table.add_column(f"turn {replies[0]['turn']}", justify="right")
        for i, (key, label) in enumerate(rows):
            table.add_row(label, _fmt(replies[0].get(key)), end_section=i in sections)
    else:
        table.add_column(f"warm-up (turn {rep['warmup_turn']})", justify="right", style="dim")
        for col in ("p50", "p95", "max"):
            table.add_column(col, justify="right", style="bold" if col == "p50" else None)
        table.add_column("n", justify="right", style="dim")
        for i, (key, label) in enumerate(rows):
            s = rep["summary"][key]
            table.add_row(label, _fmt((rep["warmup"] or {}).get(key)), _fmt(s["p50"]), _fmt(s["p95"]),
                          _fmt(s["max"]), str(s["n"]), end_section=i in sections)
    n = len(replies)
    notes = [f"{n} turn{'s' * (n != 1)}"]
    if rep["warmup_excluded"]:
        notes.append(f"warm-up turn {rep['warmup_turn']} not in the statistics")
    interrupted = sum(t["interrupted"] for t in replies)
    if interrupted:
        notes.append(f"{interrupted} interrupted")
    missing = sum(t["voice_to_voice_ms"] is None for t in replies)
    if missing:
        notes.append(f"{missing} without reply audio")
    if rep.get("speculations"):
        notes.append(f"{rep['speculations']} speculative replies: {rep['speculation_confirmed']} confirmed, "
                     f"{rep['speculation_wasted']} withdrawn (the user went on; never played)")
    if rep.get("calibration"):
        times = {c["option"]: ", ".join(f"{n}: {ms:.0f} ms" for n, ms in c["ms"].items())
                 for c in rep["calibration"].values()}
        notes.append("threads timed on this machine: " + "; ".join(
            f"{c['option']}={c['threads']}" + (f" ({times[c['option']]})" if times[c["option"]] else
                                               f" (the budget of {c['cores']} cores)")
            for c in rep["calibration"].values()))
    drops = rep["drops"]
    notes.append("drops: " + (", ".join(f"{e} {d}" for e, d in drops.items()) if drops else "none"))
    waited = rep["summary"].get("ring_wait_ms", {}).get("p50")
    if waited is not None and waited >= QUEUED_NOTE_MS:
        notes.append(f"turns waited {waited:.0f} ms (p50) in rings for a stage still busy with an earlier "
                     "turn: the input came faster than the stages could take it")
    table.caption = "; ".join(notes)
    table.caption_justify = "left"
    console.print(table)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


#: the parts of the critical path in the charts (timeline.png, sweep.png): part -> (label, colour)
PARTS = {"vad": ("VAD hangover", "#9ecae1"), "stt": ("STT", "#3182bd"),
         "llm": ("LLM to the first words spoken", "#e6550d"),
         "tts": ("TTS to first audio", "#31a354"), "gate": ("held until confirmed", "#fdd0a2"),
         "ring": ("rings", "#bdbdbd")}


def plot_timeline(rep: Mapping[str, Any], path: Path | str) -> Path:
    """One bar per turn: the stages of its critical path from end of speech to first audio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = rep["turns"]
    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.32 * len(turns)))
    seen: set[str] = set()
    for y, t in enumerate(turns):
        for seg in t["segments"]:
            part = seg["part"]
            ax.barh(y, seg["to_ms"] - seg["from_ms"], left=seg["from_ms"], height=0.6, color=PARTS[part][1],
                    label=None if part in seen else PARTS[part][0])
            seen.add(part)
        if t.get("llm_first_token_ms") is not None:
            ax.plot([t["llm_first_token_ms"]] * 2, [y - 0.3, y + 0.3], color="black", lw=1,
                    label=None if "token" in seen else "LLM first token")
            seen.add("token")
    ax.set_yticks(range(len(turns)))
    notes = {True: "", False: " (withdrawn)"}
    ax.set_yticklabels([f"{t['turn']}{' (warm-up)' if t['warmup'] else ''}{notes[t.get('reply', True)]} "
                        f"{t['conversation']}".strip() for t in turns], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms after the user's true end of speech")
    ax.set_title("critical path per turn: end of speech -> first audio at the sink", fontsize=10)
    fig.tight_layout()
    ax.legend(fontsize=8, ncol=6, frameon=False, loc="upper center",
              bbox_to_anchor=(0.5, 0), bbox_transform=fig.transFigure)  # below; bbox_inches="tight" keeps it
    ax.grid(axis="x", alpha=0.3)
    path = Path(path)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path

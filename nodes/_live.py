"""What a stage does when its endpoint fails in a live run (``ctx.live``: the microphone, a
server's client): the failure costs that turn, not the session. The stage logs it, records it
in the trace (``stage_failed``: turn, stage, error, the fallback spoken if any: the metrics count
it) and tells the session (a server's client gets an ``error`` event naming the stage); then it
goes on with the next turn. A file run has nobody listening: the failure fails the run, as before.

    except RemoteError as exc:
        if not turn_failed(self.ctx, "stt", msg.turn, exc):
            raise
"""

from __future__ import annotations

from typing import Any

__all__ = ["turn_failed"]


def turn_failed(ctx: Any, stage: str, turn: int, exc: BaseException, *, fallback: str | None = None) -> bool:
    """Whether the session goes on after ``stage`` failed on ``turn`` (a live run: logged, traced
    and told); False: the caller raises, and the run fails."""
    if not ctx.live:
        return False
    error = str(exc) or type(exc).__name__
    said = f"; saying the fallback reply {fallback!r}" if fallback else ""
    ctx.log.error("turn %d: %s failed: %s%s; the session goes on", turn, stage, error, said)
    ctx.record("stage_failed", turn=turn, stage=stage, error=error, fallback=fallback or None)
    ctx.session.stage_failed(stage, turn, f"{stage} failed: {error}")
    return True

"""``s2s-talk``: talk to a Realtime server from the terminal, through the microphone and speaker.

    s2s-talk                                              # ws://127.0.0.1:8765/v1/realtime (s2s-run ... io=realtime)
    s2s-talk --url ws://HOST:8765/v1/realtime --voice alba --instructions "Be brief."
    OPENAI_API_KEY=... s2s-talk --url "wss://api.openai.com/v1/realtime?model=gpt-realtime" --voice marin

Any server of the OpenAI Realtime protocol (GA events) will do: it sends PCM16 at 24 kHz
(``input_audio_buffer.append``), lets the server's VAD end the turns, and plays the reply's
audio as it comes. Both transcripts show as they happen (the user's live while they speak, when
the server sends transcription deltas; the agent's sentence by sentence). Speaking over a reply
stops its playback at once, and the client tells the server how much of it was heard
(``conversation.item.truncate``), so the agent remembers only that. The key: ``--api-key``, else
$S2S_API_KEY, else $OPENAI_API_KEY; sent as a bearer header, never printed. Use headphones:
without echo cancellation, the agent's voice in the microphone interrupts the agent.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import faulthandler
import json
import os
import re
import signal
import sys
from typing import Any

import numpy as np

from s2s_flow.audio import LowLatencyResampler, StreamResampler, to_float32
from s2s_flow.errors import S2SError
from s2s_flow.node import require

__all__ = ["main", "Talk", "session_update"]

RATE = 24000  # the protocol's PCM rate, both ways
BLOCK_MS = 20
KEY_ENVS = ("S2S_API_KEY", "OPENAI_API_KEY")
_SENTENCE = re.compile(r"(.+?[.!?])(\s+|$)", re.S)


class TalkError(S2SError):
    """What stops the client, said in one paragraph with the fix."""


def session_update(voice: str | None, instructions: str | None, transcription: str | None) -> dict[str, Any]:
    """The client's settings, as one ``session.update``: PCM16 at 24 kHz both ways, server VAD."""
    pcm = {"type": "audio/pcm", "rate": RATE}
    audio: dict[str, Any] = {"input": {"format": pcm, "turn_detection": {"type": "server_vad"}},
                             "output": {"format": pcm}}
    if transcription:
        audio["input"]["transcription"] = {"model": transcription}
    if voice:
        audio["output"]["voice"] = voice
    session: dict[str, Any] = {"type": "realtime", "output_modalities": ["audio"], "audio": audio}
    if instructions is not None:
        session["instructions"] = instructions
    return {"type": "session.update", "session": session}


class _Reply:
    """One response as this client plays it."""

    def __init__(self, turn: int, out_rate: int) -> None:
        self.turn, self.item_id = turn, None
        self.resample = StreamResampler(RATE, out_rate)
        self.sent_ms = 0.0  # audio the server sent (its 24 kHz ms: what a truncate counts in)
        self.text, self.shown = "", 0  # its transcript, and how much of it is on screen
        self.done = False  # its response.done came
        self.cut_ms: int | None = None  # a barge-in stopped it here: the truncate to send once it is done


class Talk:
    """One conversation: the mic to the server, the server's events to the speaker and the screen."""

    def __init__(self, url: str, *, api_key: str | None = None, voice: str | None = None,
                 instructions: str | None = None, transcription: str | None = "gpt-4o-mini-transcribe",
                 input_device: str | None = None, output_device: str | None = None, console: Any = None) -> None:
        from nodes.io._console import ConsoleView
        from nodes.io._devices import find_device, load_sounddevice, stream_rate

        if not url.startswith(("ws://", "wss://")):
            raise TalkError(f"--url {url!r} is not a WebSocket URL: give ws://HOST:PORT/v1/realtime (s2s-flow) or "
                            "wss://api.openai.com/v1/realtime?model=gpt-realtime")
        self.url, self._key = url, api_key
        self.update = session_update(voice, instructions, transcription)
        self.sd = sd = load_sounddevice()
        self.in_dev = find_device(sd, input_device, "input", "--input-device")
        self.out_dev = find_device(sd, output_device, "output", "--output-device")
        self.in_rate = stream_rate(sd, self.in_dev, "input", None, RATE, "--input-device")
        self.out_rate = stream_rate(sd, self.out_dev, "output", None, RATE, "--output-device")
        self.view = ConsoleView(console)
        self.replies: dict[str, _Reply] = {}  # by response id
        self.user: dict[str, str] = {}  # live transcripts, by item
        self.turn = 0
        self.player: Any = None
        self.ws: Any = None

    def say(self, text: str, style: str = "dim") -> None:
        from rich.text import Text

        self.view.console.print(Text(text, style=style))

    # -- the connection ---------------------------------------------------------------------

    async def run(self) -> None:
        """Talk until the server closes the connection (or Ctrl-C)."""
        require("websockets", "talk")
        from websockets.asyncio.client import connect
        from websockets.exceptions import ConnectionClosed, InvalidStatus

        headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
        try:
            self.ws = await connect(self.url, additional_headers=headers, max_size=None, open_timeout=15,
                                    ping_interval=None)
        except InvalidStatus as exc:
            status = exc.response.status_code
            if status in (401, 403):
                raise TalkError(f"{self.url} refused the key (HTTP {status}): pass the server's key with --api-key "
                                f"or ${KEY_ENVS[0]} (${KEY_ENVS[1]} for OpenAI)") from None
            raise TalkError(f"{self.url} answered HTTP {status} instead of a WebSocket: is that the Realtime "
                            "endpoint (…/v1/realtime)?") from None
        except (TimeoutError, OSError) as exc:
            raise TalkError(f"cannot connect to {self.url} ({exc}): is the server running? For s2s-flow: "
                            "`s2s-run recipe=local_cpu io=realtime`") from None
        loop = asyncio.get_running_loop()
        mic: asyncio.Queue[np.ndarray] = asyncio.Queue(maxsize=200)
        with self._devices(loop, mic):
            await self.ws.send(json.dumps(self.update))
            self.say(f"connected to {self.url}: speak (Ctrl-C ends)")
            sender = asyncio.create_task(self._send_mic(mic))
            try:
                async for text in self.ws:
                    self._event(json.loads(text))
            except ConnectionClosed:
                pass
            finally:
                sender.cancel()
                await self.ws.close()
        close = self.ws.close_rcvd
        if close is not None and close.code not in (1000, 1001):
            raise TalkError(f"the server closed the session ({close.code} {close.reason or ''})".strip())

    def _devices(self, loop: asyncio.AbstractEventLoop, mic: asyncio.Queue) -> Any:
        """The microphone (its blocks onto ``mic``) and the speaker, open for the conversation."""
        import contextlib

        from nodes.io._player import Player

        sd, talk = self.sd, self

        def block(indata: np.ndarray, frames: int, time_info: Any, status: Any) -> None:
            with contextlib.suppress(RuntimeError, asyncio.QueueFull):  # the loop is gone, or it is behind
                loop.call_soon_threadsafe(mic.put_nowait, indata[:, 0].copy())

        @contextlib.contextmanager
        def opened() -> Any:
            out_block = self.out_rate * BLOCK_MS // 1000
            speaker = sd.OutputStream(device=self.out_dev, samplerate=self.out_rate, channels=1, dtype="float32",
                                      blocksize=out_block, latency="low")
            talk.player = Player(speaker, rate=self.out_rate, block=out_block)
            talk.player.start()
            stream = sd.InputStream(device=self.in_dev, samplerate=self.in_rate, channels=1, dtype="float32",
                                    blocksize=self.in_rate * BLOCK_MS // 1000, latency="low", callback=block)
            stream.start()
            try:
                yield
            finally:
                stream.stop()
                stream.close()
                talk.player.stop()
                talk.view.close()

        return opened()

    async def _send_mic(self, mic: asyncio.Queue) -> None:
        resample = LowLatencyResampler(self.in_rate, RATE) if self.in_rate != RATE else None
        while True:
            pcm = await mic.get()
            pcm = resample(pcm) if resample is not None else pcm
            data = (np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()
            await self.ws.send(json.dumps({"type": "input_audio_buffer.append",
                                           "audio": base64.b64encode(data).decode("ascii")}))

    # -- the server's events ------------------------------------------------------------------

    def _event(self, event: dict[str, Any]) -> None:
        kind = event.get("type", "")
        if kind == "input_audio_buffer.speech_started":
            self._barge_in()
        elif kind == "conversation.item.input_audio_transcription.delta":
            said = self.user[event["item_id"]] = self.user.get(event["item_id"], "") + event.get("delta", "")
            self.view.partial(said.strip())
        elif kind == "conversation.item.input_audio_transcription.completed":
            self.user.pop(event["item_id"], None)
            if event.get("transcript", "").strip():
                self.view.user(event["transcript"].strip())
        elif kind == "response.created":
            self.turn += 1
            self.replies[event["response"]["id"]] = _Reply(self.turn, self.out_rate)
        elif kind == "response.output_audio.delta" and event["response_id"] in self.replies:
            reply = self.replies[event["response_id"]]
            reply.item_id = event["item_id"]
            pcm = to_float32(np.frombuffer(base64.b64decode(event["delta"]), "<i2"))
            reply.sent_ms += 1000 * len(pcm) / RATE
            self.player.add(reply.turn, reply.resample(pcm), "")
        elif kind in ("response.output_audio_transcript.delta", "response.output_text.delta"):
            reply = self.replies.get(event["response_id"])
            if reply is not None:
                reply.text += event.get("delta", "")
                self._show(reply, final=False)
        elif kind == "response.done":
            self._done(event["response"])
        elif kind == "error":
            error = event.get("error") or {}
            self.say(f"server error {error.get('code')}: {error.get('message')}", "red")
        elif kind == "session.updated":
            output = (event.get("session") or {}).get("audio", {}).get("output", {})
            self.say(f"session: voice {output.get('voice')}, {output.get('format', {}).get('type')}")

    def _show(self, reply: _Reply, final: bool) -> None:
        """The agent's words on screen, a sentence at a time (the rest at the end)."""
        rest = reply.text[reply.shown:]
        for match in _SENTENCE.finditer(rest):
            if not final and not match.group(2):
                break  # a sentence end that may go on ("3." of "3.5")
            self.view.agent(reply.turn, match.group(1).strip())
            reply.shown += match.end()
        if final and reply.text[reply.shown:].strip():
            self.view.agent(reply.turn, reply.text[reply.shown:].strip())
            reply.shown = len(reply.text)

    def _done(self, response: dict[str, Any]) -> None:
        reply = self.replies.get(response.get("id", ""))
        if reply is None:
            return
        reply.done = True
        self._show(reply, final=True)
        if reply.cut_ms is not None:
            self._truncate(reply)
        tail = reply.resample(np.zeros(0, np.float32), last=True)
        self.player.add(reply.turn, tail, "")
        self.player.end(reply.turn)
        if response.get("status") == "failed":
            error = ((response.get("status_details") or {}).get("error") or {})
            self.say(f"the reply failed: {error.get('message') or error.get('code') or 'no reason given'}", "red")

    def _barge_in(self) -> None:
        """The user speaks: stop what plays now, and tell the server how much of it was heard."""
        cut = {r.turn: r for r in self.player.cut(self.turn + 1)}
        for reply in [r for r in self.replies.values() if r.turn in cut]:
            played_ms = min(reply.sent_ms, 1000 * cut[reply.turn].played / self.out_rate)
            words = reply.text.split()
            heard = " ".join(words[: int(len(words) * played_ms / reply.sent_ms)]) if reply.sent_ms else ""
            self.view.interrupted(heard)
            reply.cut_ms = int(played_ms)
            if reply.done:  # else once the server has ended it: a server that ends it later keeps the truncate
                self._truncate(reply)

    def _truncate(self, reply: _Reply) -> None:
        if reply.item_id is not None and reply.cut_ms is not None:
            asyncio.get_running_loop().create_task(self.ws.send(json.dumps({
                "type": "conversation.item.truncate", "item_id": reply.item_id, "content_index": 0,
                "audio_end_ms": reply.cut_ms})))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="s2s-talk", description="Talk to a Realtime server (s2s-flow's "
                                     "io=realtime, OpenAI's, any other) through the microphone and speaker.")
    parser.add_argument("--url", default="ws://127.0.0.1:8765/v1/realtime",
                        help="the server's Realtime WebSocket (default: %(default)s)")
    parser.add_argument("--api-key", help=f"the server's key (default: ${KEY_ENVS[0]}, else ${KEY_ENVS[1]})")
    parser.add_argument("--voice", help="the voice to answer with (the server's voice names)")
    parser.add_argument("--instructions", help="the system prompt of the session")
    parser.add_argument("--transcription-model", default="gpt-4o-mini-transcribe",
                        help="the model that transcribes you, for servers that need one named (OpenAI); 'none' "
                        "sends none (default: %(default)s)")
    parser.add_argument("--input-device", help="microphone: a name (substring) or an index (s2s-run --list-devices)")
    parser.add_argument("--output-device", help="speaker: a name (substring) or an index")
    args = parser.parse_args(argv)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>`: every thread's stack on stderr (a hang)
    # Ctrl-C ends the conversation even when started with SIGINT ignored (a script's background job
    # inherits that, and asyncio.run then installs no handler of its own): as s2s-run, which sets its own
    signal.signal(signal.SIGINT, signal.default_int_handler)
    key = args.api_key or next((os.environ[k] for k in KEY_ENVS if os.environ.get(k)), None)
    transcription = None if args.transcription_model.lower() == "none" else args.transcription_model
    try:
        talk = Talk(args.url, api_key=key, voice=args.voice, instructions=args.instructions,
                    transcription=transcription, input_device=args.input_device, output_device=args.output_device)
        asyncio.run(talk.run())
    except KeyboardInterrupt:
        return 0
    except S2SError as exc:
        text = str(exc).replace(key, "***") if key else str(exc)
        print(f"s2s-talk: {text}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

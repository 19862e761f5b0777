"""``io=realtime``: the graph served over WebSocket with the OpenAI Realtime protocol (GA events).

    s2s-run recipe=local_cpu io=realtime                    # ws://127.0.0.1:8765/v1/realtime

One connection is one session: its own instance of the graph (rings, threads, VAD state,
history), built per connection from the composed config, while the heavy resources (weights,
ONNX / CTranslate2 sessions) are loaded once per process and shared (``Node.shared()``).
User speech during a reply interrupts it (``response.done`` cancelled); the history keeps what
was sent, or what the client says was heard (``conversation.item.truncate``).

Turns: with ``turn_detection`` server_vad (the default) the session's own VAD ends each turn,
with the client's threshold, silence and padding; ``create_response: false`` holds a turn's
reply until ``response.create``; ``turn_detection: null`` leaves the VAD out and the client
ends each turn with ``input_audio_buffer.commit``.

The package, each module one concern, imported one way (server -> client_events -> session ->
the rest; the nodes import the session, never the server):

- ``nodes.py``: the graph's source and sink (the ``_target_`` of conf/io/realtime.yaml).
- ``session.py``: one conversation and its responses; the one owner of a response's lifecycle,
  and what the graph's nodes ask through ``ctx.session``. ``response.py``: a response's state;
  ``history.py``: what the LLM sees of the conversation; ``node_settings.py`` and
  ``client_tools.py``: what the client changes in the session's own nodes (through the node
  contract's interfaces) and the calls of its own tools.
- ``protocol.py``: the protocol as data: session settings, one builder per server event, errors.
- ``client_events.py``: one handler per client event.
- ``server.py``: Starlette/uvicorn, auth, backpressure, ``/metrics``; the transport moves text.
- ``webrtc.py``: ``/v1/realtime/calls``, the same sessions over WebRTC (aiortc): the events on the
  ``oai-events`` data channel, the audio as Opus; ``speaker.py``: the reply's paced outgoing track;
  ``ice.py``: the host candidates' addresses, STUN/TURN.
- ``guard.py``: the Origin and Host checks of every route; ``drain.py``: SIGTERM, ``/healthz`` and
  ``/readyz``; ``limits.py``: a client's event rate; ``prometheus.py``: the server's ``/metrics``.
"""

from nodes.io.realtime.nodes import API_KEY_ENV, RealtimeSink, RealtimeSource

__all__ = ["RealtimeSource", "RealtimeSink", "API_KEY_ENV"]

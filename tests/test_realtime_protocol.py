"""io=realtime: what a stock client of the GA protocol relies on, with the official ``openai``
SDK against the real offline stack (Silero, Whisper, SmolLM2 on llama-server, Piper): items
retrieved, the parts of a cut response closed, usage, the client's voice name, one response at
a time, out-of-band responses, and the refusals a client must hear (images, transcription
sessions). The Agents SDK's own test is tests/test_realtime_agents.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.recording_proxy import RecordingProxy, recording_proxy
from tests.test_realtime import (  # noqa: F401  (the module's llama-server fixtures)
    COMPLETED,
    WEATHER_TOOL,
    _collect,
    _compose,
    _server,
    appends,
    llama,
    sdk,
    serving,
    spoken,
    tool_llama,
)

pytest.importorskip("openai", reason="pip install 's2s-flow[bench]'")

from nodes.io.realtime.server import RealtimeServer  # noqa: E402

TEXT = {"output_modalities": ["text"]}
MARATHON = "How many kilometers are there in a marathon?"


@pytest.fixture(scope="module")
def proxy(llama) -> Iterator[RecordingProxy]:  # noqa: F811
    with recording_proxy(llama) as recording:
        yield recording


@pytest.fixture(scope="module")
def served(proxy, tmp_path_factory) -> Iterator[tuple[str, Any]]:
    server = _server(proxy.url, tmp_path_factory.mktemp("protocol"), "io.max_sessions=4")
    url = server.start()
    yield url, server
    server.stop()


def run(talk: Any, timeout: float = 300) -> Any:
    """Run a client coroutine; a server that never answers fails the test instead of hanging it."""
    return asyncio.run(asyncio.wait_for(talk, timeout))


def user(text: str, **extra: Any) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}], **extra}


async def speak(conn: Any, pcm: bytes) -> None:
    for chunk in appends(pcm):
        await conn.input_audio_buffer.append(audio=chunk)


async def until_type(conn: Any, *kinds: str, events: list[Any] | None = None) -> Any:
    """The next event of one of ``kinds`` (what came before it goes to ``events``)."""
    async for event in conn:
        if events is not None:
            events.append(event)
        if event.type in kinds:
            return event
    raise AssertionError(f"the connection closed before {kinds}")


# -- 1. conversation.item.retrieve ------------------------------------------------------------


def test_an_item_is_retrieved_as_the_client_last_heard_of_it(served):
    url, _ = served

    async def talk():
        async with sdk(url) as conn:
            await conn.conversation.item.create(item=user("What is the capital of France?", id="item_mine"))
            await until_type(conn, "conversation.item.done")
            await conn.conversation.item.retrieve(item_id="item_mine")
            mine = await until_type(conn, "conversation.item.retrieved")
            await conn.response.create(response=TEXT)
            done = (await _collect(conn))[-1]
            await conn.conversation.item.retrieve(item_id=done.response.output[0].id)
            reply = await until_type(conn, "conversation.item.retrieved")
            await conn.conversation.item.retrieve(item_id="item_nope", event_id="evt_nope")
            refused = await until_type(conn, "error")
            return mine, done, reply, refused

    mine, done, reply, refused = run(talk())
    assert mine.item.id == "item_mine" and mine.item.content[0].text == "What is the capital of France?"
    assert reply.item.role == "assistant" and reply.item.status == "completed"
    assert reply.item.content[0].text == done.response.output[0].content[0].text
    assert (refused.error.code, refused.error.event_id, refused.error.param) == ("item_not_found", "evt_nope",
                                                                                 "item_id")


# -- 2. a cancelled response closes its open parts ----------------------------------------------


@pytest.mark.parametrize("modality", ["text", "audio"])
def test_response_cancel_mid_reply_closes_the_open_parts_before_response_done(served, modality):
    url, _ = served
    first_delta = "response.output_text.delta" if modality == "text" else "response.output_audio.delta"

    async def talk():
        async with sdk(url) as conn:
            await conn.conversation.item.create(item=user("Tell me a long story about a dragon who learns to cook."))
            await conn.response.create(response={"output_modalities": [modality]})
            events: list[Any] = []
            await until_type(conn, first_delta, events=events)
            await conn.response.cancel()
            events += await _collect(conn)
            return events

    events = run(talk())
    done = events[-1]
    assert done.response.status == "cancelled" and done.response.status_details.reason == "client_cancelled"
    mine = [e.type for e in events if getattr(e, "response_id", None) == done.response.id]
    closing = (["response.output_text.done"] if modality == "text" else
               ["response.output_audio.done", "response.output_audio_transcript.done"])
    assert mine[-len(closing) - 2:] == [*closing, "response.content_part.done", "response.output_item.done"], mine
    assert done.response.output[0].status == "incomplete"


# -- 4. usage; 6. the conversation's id ---------------------------------------------------------


def test_a_voice_turn_reports_its_audio_seconds_and_token_counts_in_one_conversation(served):
    url, _ = served
    pcm = spoken(MARATHON)

    async def talk():
        async with sdk(url) as conn:
            await speak(conn, pcm)
            voice = await _collect(conn, also=(COMPLETED,))
            await conn.conversation.item.create(item=user("Say hello."))
            await conn.response.create(response=TEXT)
            text = (await _collect(conn))[-1]
        async with sdk(url) as other:
            await other.conversation.item.create(item=user("Say hello."))
            await other.response.create(response=TEXT)
            elsewhere = (await _collect(other))[-1]
        return voice, text, elsewhere

    voice, text, elsewhere = run(talk())
    completed = next(e for e in voice if e.type == "conversation.item.input_audio_transcription.completed")
    assert completed.usage.type == "duration"
    assert 1.0 < completed.usage.seconds <= len(pcm) / 2 / 24000, "the turn's speech, in seconds"
    done = next(e for e in voice if e.type == "response.done")
    usage = done.response.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    ids = {done.response.conversation_id, text.response.conversation_id}
    assert len(ids) == 1 and None not in ids and "conv" not in ids, "one conversation per session"
    assert elsewhere.response.conversation_id not in ids, "another session, another conversation"


# -- 3. the client's voice name ------------------------------------------------------------------


def test_an_openai_voice_name_is_echoed_as_the_client_sent_it(served):
    url, _ = served

    async def talk():
        async with sdk(url) as conn:
            created = await conn.recv()
            await conn.session.update(session={"type": "realtime", "audio": {"output": {"voice": "coral"}}})
            updated = await until_type(conn, "session.updated")
            return created, updated

    created, updated = run(talk())
    assert created.session.audio.output.voice == "en_US-joe-medium"
    assert updated.session.audio.output.voice == "coral", "the SDK sees its own setting kept"


# -- 8. one response at a time ------------------------------------------------------------------


def test_response_create_while_a_voice_reply_is_on_its_way_is_refused_as_active(served):
    url, _ = served

    async def talk():
        async with sdk(url) as conn:
            await speak(conn, spoken(MARATHON))
            events: list[Any] = []
            await until_type(conn, "input_audio_buffer.committed", events=events)
            await conn.conversation.item.create(item=user("Say hello."))
            await conn.response.create(response=TEXT, event_id="evt_race")
            events += await _collect(conn)
            return events

    events = run(talk())
    errors = [e.error for e in events if e.type == "error"]
    assert [(e.code, e.event_id) for e in errors] == [("conversation_already_has_active_response", "evt_race")]
    assert [e.type for e in events].count("response.created") == 1 and events[-1].response.status == "completed"


def test_a_text_response_asked_for_as_a_voice_turn_commits_never_overlaps_its_reply(served):
    """The text message and its response.create go right behind the last audio: whichever the
    server sees first, the responses follow one another. A probing response.create at the end
    is answered (the voice turn waited for it), refused as active (its reply is on its way) or
    finds nothing to answer; in each case every response has ended before the next began."""
    url, _ = served

    async def talk():
        async with sdk(url) as conn:
            await speak(conn, spoken(MARATHON))
            await conn.conversation.item.create(item=user("Say hello."))
            await conn.response.create(response=TEXT)
            events: list[Any] = []
            await until_type(conn, "response.done", events=events)
            while "conversation.item.input_audio_transcription.completed" not in [e.type for e in events]:
                events.append(await conn.recv())
            await conn.response.create(response=TEXT, event_id="evt_probe")
            answer = await until_type(conn, "response.done", "error", events=events)
            if answer.type == "error" and answer.error.code == "conversation_already_has_active_response":
                await until_type(conn, "response.done", events=events)
            return events

    events = run(talk())
    open_responses = 0
    for event in events:
        if event.type == "response.created":
            assert open_responses == 0, "a response began while another was in progress"
            open_responses += 1
        elif event.type == "response.done":
            open_responses -= 1
    assert open_responses == 0
    assert [e for e in events if e.type == "response.done"], "at least the text response"
    assert [e.error.code for e in events if e.type == "error"] in (
        [], ["conversation_already_has_active_response"], ["unsupported_value"])


# -- 9. live transcription deltas ------------------------------------------------------------


def test_live_transcription_deltas_only_append_and_end_before_completed(proxy, tmp_path):
    async def talk(url):
        async with sdk(url) as conn:
            pcm = spoken("Please explain how many kilometers there are in a marathon race.")
            loop = asyncio.get_running_loop()
            start, step = loop.time(), 2 * 24000 // 50  # 20 ms appends at a microphone's pace
            for i, chunk in enumerate(appends(pcm, step)):
                await asyncio.sleep(max(0.0, start + i * 0.02 - loop.time()))
                await conn.input_audio_buffer.append(audio=chunk)
            return await _collect(conn, also=(COMPLETED,))

    with serving(proxy.url, tmp_path, "io.partials.interval_ms=300") as (url, _):
        events = run(talk(url))
    kinds = [e.type for e in events]
    assert "conversation.item.input_audio_transcription.completed" in kinds, kinds
    completed_at = kinds.index("conversation.item.input_audio_transcription.completed")
    deltas = [(i, e.delta) for i, e in enumerate(events)
              if e.type == "conversation.item.input_audio_transcription.delta"]
    assert deltas and deltas[0][0] < kinds.index("input_audio_buffer.speech_stopped"), "while the user speaks"
    assert all(i < completed_at for i, _ in deltas), "none after completed"
    assert "".join(d for _, d in deltas) == events[completed_at].transcript, "appended, they make the transcript"
    assert len({d for _, d in deltas}) == len(deltas), "no hypothesis sent twice"


# -- 10. transcription sessions; 12. images ----------------------------------------------------


def test_a_transcription_session_sends_the_users_transcripts_and_makes_no_response(served, proxy):
    """A spoken turn in a transcription session is transcribed and not answered: no response, and
    no request to the LLM, through 3 s of silence after its transcript (paced like a microphone:
    time for a reply to begin if one were made); a response.create is refused."""
    url, _ = served

    async def talk():
        async with sdk(url) as conn:
            await conn.session.update(session={"type": "transcription", "audio": {"input": {
                "transcription": {"model": "gpt-4o-transcribe"}, "turn_detection": {"type": "server_vad"}}}})
            events: list[Any] = []
            updated = await until_type(conn, "session.updated", events=events)
            since = len(proxy.requests)
            await speak(conn, spoken(MARATHON))
            await until_type(conn, "conversation.item.input_audio_transcription.completed", events=events)
            loop = asyncio.get_running_loop()
            start, silence = loop.time(), base64.b64encode(bytes(2 * 24000 // 50)).decode("ascii")
            for i in range(150):  # 3 s of 20 ms appends
                await asyncio.sleep(max(0.0, start + i * 0.02 - loop.time()))
                await conn.input_audio_buffer.append(audio=silence)
            await conn.response.create(event_id="evt_reply")
            await until_type(conn, "error", events=events)
            await conn.session.update(event_id="evt_kind", session={"type": "conversation"})
            await until_type(conn, "error", events=events)
            return updated, events, proxy.bodies("/chat/completions", since)

    updated, events, requests = run(talk())
    assert updated.session.type == "transcription" and updated.session.audio.input.format.rate == 24000
    heard = [e.transcript.lower() for e in events if e.type == "conversation.item.input_audio_transcription.completed"]
    assert len(heard) == 1 and "marathon" in heard[0]
    assert not [e for e in events if e.type.startswith("response.")], "no response, by itself or asked for"
    assert requests == [], "the LLM was never asked"
    errors = {e.error.event_id: e.error for e in events if e.type == "error"}
    assert errors["evt_reply"].code == "unsupported_value" and "transcription session" in errors["evt_reply"].message
    assert (errors["evt_kind"].code, errors["evt_kind"].param) == ("invalid_value", "session.type")


def png_data_url() -> str:
    """A real 8x8 red PNG as a data URL, the form a browser's canvas.toDataURL() gives."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + b"\xff\x00\x00" * 8 for _ in range(8))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 8, 8, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode()


def test_an_image_is_refused_clearly_naming_llm_vision_and_its_item_is_not_half_added(served):
    url, _ = served
    image = {"type": "input_image", "image_url": png_data_url()}

    async def talk():
        async with sdk(url) as conn:
            item = {"type": "message", "role": "user", "id": "item_img",
                    "content": [{"type": "input_text", "text": "What is in this picture?"}, image]}
            await conn.conversation.item.create(item=item, event_id="evt_img")
            img = await until_type(conn, "error", "conversation.item.done")
            await conn.conversation.item.retrieve(item_id="item_img")
            gone = await until_type(conn, "error", "conversation.item.retrieved")
            return img, gone

    img, gone = run(talk())
    assert img.type == "error", "the item was added"
    assert (img.error.code, img.error.event_id) == ("invalid_value", "evt_img")
    assert img.error.param == "item.content[1]" and "image" in img.error.message
    assert "llm.vision" in img.error.message, "the error names the setting that makes images go through"
    assert gone.type == "error" and gone.error.code == "item_not_found", "the whole item was refused, not half of it"


def test_with_llm_vision_an_image_goes_to_the_model_as_an_image_url_part_and_a_refusal_is_told(proxy, tmp_path):
    """llm.vision=true: a text+image item stays in the conversation with its image, and the request
    carries it as the Chat Completions image_url part. The fixtures' llama-server has no vision
    projector (no --mmproj; no vision model is available offline), so it refuses the request: the
    client gets an error event that says why, and the session goes on (the item deleted, a text
    turn is answered)."""
    url = (server := _server(proxy.url, tmp_path, "llm.vision=true", "llm.fallback_reply=null",
                             "llm.max_retries=0")).start()
    data_url = png_data_url()

    async def next_of(conn: Any, *kinds: str, seen: list[Any] | None = None) -> Any:
        while (event := await conn.recv()).type not in kinds:
            (seen if seen is not None else []).append(event)
        (seen if seen is not None else []).append(event)
        return event

    async def talk():
        async with sdk(url) as conn:
            since = len(proxy.requests)
            await conn.conversation.item.create(item={"type": "message", "role": "user", "id": "item_img", "content": [
                {"type": "input_text", "text": "What colour is this picture?"},
                {"type": "input_image", "image_url": data_url}]})
            added = await next_of(conn, "conversation.item.done", "error")
            await conn.response.create(response=TEXT)
            seen: list[Any] = []
            failed = await next_of(conn, "response.done", seen=seen)
            if not any(e.type == "error" for e in seen):  # the stage's failure: before or after response.done
                await next_of(conn, "error", seen=seen)
            request = proxy.bodies("/chat/completions", since)
            await conn.conversation.item.delete(item_id="item_img")
            await next_of(conn, "conversation.item.deleted", "error")
            await conn.conversation.item.create(item=user("Say hello."))
            await conn.response.create(response=TEXT)
            later = await next_of(conn, "response.done", "error")
            return added, seen, failed, request, later

    try:
        added, seen, failed, requests, later = run(talk())
    finally:
        server.stop()
    assert added.type == "conversation.item.done", added
    assert [p.type for p in added.item.content] == ["input_text", "input_image"]
    assert added.item.content[1].image_url == data_url, "the item keeps its image"
    content = requests[-1]["messages"][-1]["content"]
    assert content == [{"type": "text", "text": "What colour is this picture?"},
                       {"type": "image_url", "image_url": {"url": data_url}}], content
    errors = [e.error for e in seen if e.type == "error"]
    assert errors and errors[0].code == "llm_failed", [e.type for e in seen]
    assert "takes no images" in errors[0].message and "mmproj" in errors[0].message, errors[0].message
    assert failed.response.status == "failed" and "takes no images" in failed.response.status_details.error.message
    assert later.type == "response.done" and later.response.status == "completed", later
    assert later.response.output[0].content[0].text.strip()


# -- 11. out-of-band responses ---------------------------------------------------------------


def test_an_out_of_band_response_answers_its_input_keeps_its_metadata_and_stays_out_of_the_conversation(
        served, proxy):
    url, _ = served

    async def talk():
        async with sdk(url) as conn:
            await conn.response.create(response={
                **TEXT, "conversation": "none", "metadata": {"purpose": "classify"},
                "input": [user("Answer with one word: what color is a banana?")]})
            events = await _collect(conn)
            await conn.conversation.item.retrieve(item_id=events[-1].response.output[0].id)
            retrieved = await until_type(conn, "error", "conversation.item.retrieved")
            since = len(proxy.requests)
            await conn.conversation.item.create(item=user("What is the capital of France?"))
            await conn.response.create(response=TEXT)
            after = (await _collect(conn))[-1]
            return events, retrieved, after, since

    events, retrieved, after, since = run(talk())
    created, done = next(e for e in events if e.type == "response.created"), events[-1]
    assert done.response.status == "completed" and done.response.output[0].content[0].text.strip()
    assert created.response.metadata == done.response.metadata == {"purpose": "classify"}
    assert done.response.conversation_id is None
    assert not [e for e in events if e.type.startswith("conversation.item.")], "no item of the conversation"
    assert retrieved.type == "error" and retrieved.error.code == "item_not_found"
    request = proxy.bodies("/chat/completions", since)[-1]
    said = json.dumps(request["messages"]).lower()
    assert "france" in said and "banana" not in said, "later requests do not carry the out-of-band exchange"
    assert after.response.metadata is None and after.response.conversation_id is not None


# -- 7. a named tool_choice -------------------------------------------------------------------

TIME_TOOL = {"type": "function", "name": "get_time", "description": "Get the current time in a city.",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_a_named_tool_choice_calls_that_tool_through_llama_server(tool_llama, tmp_path):  # noqa: F811
    from s2s_flow.cli import plan

    with recording_proxy(tool_llama) as recording:
        cfg, choices = _compose(recording.url, "llm.max_tokens=60")

        def make_graph():
            graph = plan(cfg, choices)
            graph.nodes["llm"].node.tool_call_prefill = "<tool_call>\n"  # the model can only write the call
            return graph

        server = RealtimeServer(make_graph, plan(cfg, choices).nodes["source"].node, tmp_path)
        url = server.start()

        async def talk():
            async with sdk(url) as conn:
                await conn.session.update(session={"type": "realtime", "tools": [WEATHER_TOOL, TIME_TOOL],
                                                   "tool_choice": {"type": "function", "name": "get_time"}})
                await conn.conversation.item.create(item=user("What is the weather in Paris?"))
                await conn.response.create(response=TEXT)
                return (await _collect(conn))[-1]

        try:
            done = run(talk())
        finally:
            server.stop()
        request = recording.bodies("/chat/completions")[0]
    assert request["tool_choice"] == "required" and [t["function"]["name"] for t in request["tools"]] == ["get_time"]
    calls = [item for item in done.response.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_time"], "the tool the client named, though the question is the weather's"

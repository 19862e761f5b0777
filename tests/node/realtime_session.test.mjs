// The Agents SDK (@openai/agents) against s2s-flow's Realtime server: a RealtimeSession over the
// SDK's WebSocket transport, as a new user would write it. Run by tests/test_realtime_agents.py,
// which starts the server and gives S2S_REALTIME_URL (ws://host:port/v1/realtime) and
// S2S_SPEECH_PCM (a spoken question as PCM16 mono at 24 kHz, then silence).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { OpenAIRealtimeWebSocket, RealtimeAgent, RealtimeSession } from '@openai/agents/realtime';

const url = process.env.S2S_REALTIME_URL;
const speech = process.env.S2S_SPEECH_PCM;
const skip = url ? false : 'S2S_REALTIME_URL is not set: run tests/test_realtime_agents.py';

/** A connected session; `errors`: every session error the SDK reports, `events`: every raw server event. */
async function open(t, config = {}) {
  const agent = new RealtimeAgent({ name: 'Assistant', instructions: 'You are a terse assistant.' });
  const transport = new OpenAIRealtimeWebSocket({ url });
  const session = new RealtimeSession(agent, { transport, model: 's2s-flow', config });
  const errors = [];
  const events = [];
  session.on('error', (error) => errors.push(error));
  transport.on('*', (event) => events.push(event));
  t.after(() => session.close()); // passed or failed: the socket closes, the runner ends
  await session.connect({ apiKey: 'unused', url });
  return { session, transport, errors, events };
}

/** The next raw server event of `type` that satisfies `match`; an error event fails it at once
 * (no timer: the caller's runner bounds the run). */
function next(transport, type, match = () => true) {
  return new Promise((resolve, reject) => {
    const on = (event) => {
      if (event.type === type && match(event)) {
        transport.off('*', on);
        resolve(event);
      } else if (event.type === 'error') {
        transport.off('*', on);
        reject(new Error(`a session error while waiting for ${type}: ${JSON.stringify(event.error)}`));
      }
    };
    transport.on('*', on);
  });
}

function describe(errors) {
  return JSON.stringify(errors.map((e) => e.error ?? e), null, 1);
}

test('a text turn: the reply arrives and the history has both messages', { skip }, async (t) => {
  const { session, transport, errors } = await open(t, { outputModalities: ['text'] });
  const done = next(transport, 'response.done');
  session.sendMessage('What is the capital of France?');
  const event = await done;
  assert.equal(event.response.status, 'completed');
  const assistant = session.history.find((item) => item.type === 'message' && item.role === 'assistant');
  assert.ok(assistant, 'the reply is in the SDK history');
  assert.ok(event.response.usage.output_tokens > 0, 'token counts in response.done');
  assert.deepEqual(errors, [], describe(errors));
});

test('a voice turn interrupted mid-reply: cancelled, truncated, its items retrieved, no session error',
  { skip: skip || (!speech && 'S2S_SPEECH_PCM is not set') }, async (t) => {
    const { session, transport, errors, events } = await open(t);
    const pcm = readFileSync(speech);
    const firstAudio = next(transport, 'response.output_audio.delta');
    const transcribed = next(transport, 'conversation.item.input_audio_transcription.completed');
    for (let i = 0; i < pcm.length; i += 4800) { // 100 ms appends
      const piece = pcm.subarray(i, Math.min(i + 4800, pcm.length));
      session.sendAudio(piece.buffer.slice(piece.byteOffset, piece.byteOffset + piece.length));
    }
    const heard = await transcribed;
    const audio = await firstAudio;
    const done = next(transport, 'response.done');
    const truncated = next(transport, 'conversation.item.truncated');
    // the SDK retrieves the reply's item once truncated: that may come before the cut's response.done
    const retrieved = next(transport, 'conversation.item.retrieved', (e) => e.item.id === audio.item_id);
    session.interrupt();
    const event = await done;
    assert.equal(event.response.status, 'cancelled');
    const closed = events.filter((e) => e.response_id === event.response.id).map((e) => e.type);
    assert.deepEqual(closed.slice(-4), ['response.output_audio.done', 'response.output_audio_transcript.done',
      'response.content_part.done', 'response.output_item.done'], 'its open parts closed before response.done');
    await truncated;
    await retrieved; // the SDK keeps its history by retrieving the items it was told changed
    assert.ok(events.some((e) => e.type === 'conversation.item.retrieved' && e.item.id === heard.item_id),
      "the user's item was retrieved after its transcript");
    assert.equal(heard.usage.type, 'duration');
    const userItem = session.history.find((item) => item.itemId === heard.item_id);
    assert.ok(userItem, "the user's turn is in the SDK history");
    assert.deepEqual(errors, [], describe(errors));
  });

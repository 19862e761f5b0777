// The Agents SDK's WebRTC transport (OpenAIRealtimeWebRTC, @openai/agents 0.20) in headless
// Chromium against an s2s-flow server: run by tests/test_realtime_webrtc.py, which reads what
// this writes to $S2S_OUT and listens to the recorded reply with Whisper.
//
//   S2S_BASE_URL=http://127.0.0.1:PORT S2S_API_KEY=... S2S_WAV=mic.wav S2S_CHROMIUM=/usr/bin/chromium \
//   S2S_OUT=result.json node webrtc_browser.mjs
//
// Chromium's fake capture device plays S2S_WAV as the microphone (the user asks for a long story);
// once a second of the story has played, the page mixes S2S_OVER_WAV into the microphone (the user
// speaks over the reply). The page is served on the server's own origin (intercepted by Playwright,
// so the SDK's fetch of /v1/realtime/calls is same-origin) and records the audio the server sends
// with Web Audio, marking when each data-channel event came, in samples heard.
import { readFile, writeFile } from 'node:fs/promises';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';

const here = path.dirname(fileURLToPath(import.meta.url));
const bundle = path.join(here, 'node_modules', '@openai', 'agents-realtime', 'dist', 'bundle');
const { S2S_BASE_URL: base, S2S_API_KEY: apiKey, S2S_WAV: wav, S2S_OVER_WAV: overWav, S2S_CHROMIUM: executablePath,
  S2S_OUT: out } = process.env;
const TIMEOUT_MS = Number(process.env.S2S_TIMEOUT_MS || 300000);

const PAGE = `<!doctype html><meta charset="utf-8"><title>s2s-flow WebRTC test</title>
<script type="module">
import { RealtimeAgent, RealtimeSession, OpenAIRealtimeWebRTC } from './openai-realtime-agents.mjs';
const s = window.s2s = { events: [], errors: [], pcm: [], samples: 0, done: false, failed: null,
                         storyAt: null, storyHeard: 0, spokeOver: null };
const audio = new AudioContext({ sampleRate: 48000 });
// the microphone: Chromium's fake capture (the WAV), and the words spoken over the reply, mixed
const mix = audio.createMediaStreamDestination();
const over = await audio.decodeAudioData(await (await fetch('over.wav')).arrayBuffer());
function speakOver() {
  const words = audio.createBufferSource();
  words.buffer = over;
  words.connect(mix);
  words.start();
  s.spokeOver = s.samples;
}
function record(stream) {
  const source = audio.createMediaStreamSource(stream);
  const tap = audio.createScriptProcessor(4096, 1, 1);
  tap.onaudioprocess = (e) => {
    const data = e.inputBuffer.getChannelData(0);
    s.pcm.push(Float32Array.from(data));
    s.samples += data.length;
    if (s.storyAt !== null && s.spokeOver === null) {  // a second of the story heard: speak over it
      s.storyHeard += data.filter((v) => Math.abs(v) > 0.01).length > 0 ? data.length : 0;
      if (s.storyHeard >= 48000) speakOver();
    }
  };
  source.connect(tap);
  tap.connect(audio.destination);
}
const audioElement = document.createElement('audio');
audioElement.muted = true;  // Web Audio records it; the element only keeps the remote stream flowing
const transport = new OpenAIRealtimeWebRTC({
  baseUrl: location.origin + '/v1/realtime/calls',
  audioElement,
  mediaStream: mix.stream,
  useInsecureApiKey: true,
  changePeerConnection: async (pc) => {
    pc.addEventListener('track', (e) => record(e.streams[0] || new MediaStream([e.track])));
    return pc;
  },
});
const agent = new RealtimeAgent({ name: 'assistant', instructions: 'You are a helpful assistant.' });
const session = new RealtimeSession(agent, { transport, model: 's2s-flow' });
session.on('transport_event', (e) => {
  if (e.type === 'output_audio_buffer.started' && s.storyAt === null) s.storyAt = s.samples;
  const { delta, audio: _a, ...rest } = e;
  s.events.push({ at: s.samples, ...rest, delta: typeof delta === 'string' ? delta : undefined });
});
session.on('error', (e) => s.errors.push(String(e?.error?.error?.message ?? e?.error?.message ?? e?.error ?? e)));
session.on('audio_interrupted', () => s.events.push({ at: s.samples, type: 'sdk.audio_interrupted' }));
s.finish = () => {
  const pcm = new Int16Array(s.samples);
  let i = 0;
  for (const block of s.pcm) for (const v of block) pcm[i++] = Math.max(-1, Math.min(1, v)) * 32767;
  let bin = '';
  const bytes = new Uint8Array(pcm.buffer);
  for (let j = 0; j < bytes.length; j += 0x8000) bin += String.fromCharCode(...bytes.subarray(j, j + 0x8000));
  const history = session.history.map((item) => JSON.parse(JSON.stringify(item)));
  return { events: s.events, errors: s.errors, pcm16: btoa(bin), rate: audio.sampleRate, history, spokeOver: s.spokeOver,
           callId: transport.callId, status: transport.status };
};
s.close = () => session.close();
try {
  await audio.resume();
  const mic = await navigator.mediaDevices.getUserMedia({ audio: true });
  audio.createMediaStreamSource(mic).connect(mix);
  await session.connect({ apiKey: ${JSON.stringify(apiKey || 'unused')} });
  s.connected = true;
} catch (error) {
  s.failed = String(error?.message ?? error);
}
</script>`;

// Done: the first reply was cut by the barge-in (cleared), and the answer to what was said over
// it has played to its end (output_audio_buffer.stopped after a response.done).
function finished() {
  const s = window.s2s;
  if (!s || s.failed) return Boolean(s?.failed);
  const types = s.events.map((e) => e.type);
  const cleared = types.indexOf('output_audio_buffer.cleared');
  if (cleared < 0) return false;
  const later = s.events.slice(cleared + 1);
  const started = later.find((e) => e.type === 'output_audio_buffer.started');
  return Boolean(started && later.some((e) => e.type === 'output_audio_buffer.stopped'
    && e.response_id === started.response_id));
}

const browser = await chromium.launch({
  executablePath,
  headless: true,
  args: ['--no-sandbox', '--use-fake-ui-for-media-stream', '--use-fake-device-for-media-stream',
         `--use-file-for-fake-audio-capture=${wav}%noloop`, '--autoplay-policy=no-user-gesture-required',
         '--allow-loopback-in-peer-connection', '--disable-features=WebRtcHideLocalIpsWithMdns'],
});
let result;
try {
  const context = await browser.newContext();
  await context.grantPermissions(['microphone'], { origin: base });
  const page = await context.newPage();
  page.on('console', (m) => { if (m.type() === 'error') console.error('[page]', m.text()); });
  await page.route(`${base}/__webrtc_test/**`, async (route) => {
    const name = new URL(route.request().url()).pathname.split('/').pop();
    if (name === 'index.html') return route.fulfill({ contentType: 'text/html', body: PAGE });
    if (name === 'over.wav') return route.fulfill({ contentType: 'audio/wav', body: await readFile(overWav) });
    return route.fulfill({ contentType: 'text/javascript', body: await readFile(path.join(bundle, name)) });
  });
  await page.goto(`${base}/__webrtc_test/index.html`);
  try {
    await page.waitForFunction(finished, null, { timeout: TIMEOUT_MS, polling: 200 });
  } catch (error) {
    console.error(`the page did not finish: ${error.message}`);
  }
  result = await page.evaluate(() => ({ ...window.s2s.finish(), failed: window.s2s.failed }));
  await page.evaluate(() => window.s2s.close());  // hangs up: the server's session ends
  await context.close();
} finally {
  await browser.close();
}
await writeFile(out, JSON.stringify(result));
console.log(`wrote ${out}: ${result.events.length} events, ${result.errors.length} errors`);

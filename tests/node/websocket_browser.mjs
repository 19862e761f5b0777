// The Agents SDK's WebSocket transport (OpenAIRealtimeWebSocket, @openai/agents 0.20) in headless
// Chromium against an s2s-flow server: run by tests/test_realtime_agents.py, which reads what this
// writes to $S2S_OUT.
//
//   S2S_BASE_URL=http://127.0.0.1:PORT S2S_SPEECH_PCM=question.pcm S2S_CHROMIUM=/usr/bin/chromium \
//   S2S_OUT=result.json node websocket_browser.mjs
//
// In the page, as a browser app would: a text turn, then a spoken question (PCM16 at 24 kHz, sent
// with session.sendAudio) whose reply is interrupted once its audio comes. The browser's WebSocket
// takes no headers: the SDK sends the key as the `openai-insecure-api-key.` subprotocol.
import { readFile, writeFile } from 'node:fs/promises';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';

const here = path.dirname(fileURLToPath(import.meta.url));
const bundle = path.join(here, 'node_modules', '@openai', 'agents-realtime', 'dist', 'bundle');
const { S2S_BASE_URL: base, S2S_SPEECH_PCM: speech, S2S_CHROMIUM: executablePath, S2S_OUT: out } = process.env;
const TIMEOUT_MS = Number(process.env.S2S_TIMEOUT_MS || 300000);

const PAGE = `<!doctype html><meta charset="utf-8"><title>s2s-flow WebSocket test</title>
<script type="module">
import { RealtimeAgent, RealtimeSession, OpenAIRealtimeWebSocket } from './openai-realtime-agents.mjs';
const s = window.s2s = { events: [], errors: [], result: null, failed: null, step: 'connect' };
const url = location.origin.replace(/^http/, 'ws') + '/v1/realtime';
const transport = new OpenAIRealtimeWebSocket({ url, useInsecureApiKey: true });
const agent = new RealtimeAgent({ name: 'assistant', instructions: 'You are a terse assistant.' });
const session = new RealtimeSession(agent, { transport, model: 's2s-flow' });
session.on('error', (e) => s.errors.push(JSON.stringify(e?.error?.error ?? e?.error ?? String(e))));
transport.on('*', (e) => { const { delta, audio, ...rest } = e; s.events.push(rest); });
const next = (type, match = () => true) => new Promise((resolve, reject) => {
  const on = (e) => {
    if (e.type === type && match(e)) { transport.off('*', on); resolve(e); }
    else if (e.type === 'error') { transport.off('*', on); reject(new Error('a session error: ' + JSON.stringify(e.error))); }
  };
  transport.on('*', on);
});
try {
  await session.connect({ apiKey: 'unused', url });
  const text = next('response.done');
  session.sendMessage('What is the capital of France?');
  s.step = 'text reply';
  const textDone = await text;
  const pcm = await (await fetch('speech.pcm')).arrayBuffer();
  const firstAudio = next('response.output_audio.delta');
  const transcribed = next('conversation.item.input_audio_transcription.completed');
  for (let i = 0; i < pcm.byteLength; i += 4800) session.sendAudio(pcm.slice(i, Math.min(i + 4800, pcm.byteLength)));
  s.step = 'transcript';
  const heard = await transcribed;
  s.step = 'reply audio';
  const audio = await firstAudio;
  const cut = next('response.done');
  const truncated = next('conversation.item.truncated');
  // the SDK retrieves the reply's item once truncated: that may come before the cut's response.done
  const retrieved = next('conversation.item.retrieved', (e) => e.item.id === audio.item_id);
  session.interrupt();
  s.step = 'cut';
  const cutDone = await cut;
  s.step = 'truncated';
  await truncated;
  s.step = 'retrieved';
  await retrieved;
  s.result = { text: textDone.response, cut: cutDone.response, transcript: heard.transcript,
               history: session.history.map((item) => JSON.parse(JSON.stringify(item))) };
} catch (error) {
  s.failed = String(error?.message ?? error);
} finally {
  session.close();
}
</script>`;

// The page comes from Playwright's interception, which Chromium's local-network checks do not count
// as the loopback server's own: they would block its WebSocket to that server.
const browser = await chromium.launch({ executablePath, headless: true,
  args: ['--no-sandbox', '--disable-features=LocalNetworkAccessChecks'] });
let result;
try {
  const page = await browser.newPage();
  page.on('console', (m) => { if (m.type() === 'error') console.error('[page]', m.text()); });
  await page.route(`${base}/__websocket_test/**`, async (route) => {
    const name = new URL(route.request().url()).pathname.split('/').pop();
    if (name === 'index.html') return route.fulfill({ contentType: 'text/html', body: PAGE });
    if (name === 'speech.pcm') return route.fulfill({ contentType: 'application/octet-stream', body: await readFile(speech) });
    return route.fulfill({ contentType: 'text/javascript', body: await readFile(path.join(bundle, name)) });
  });
  await page.goto(`${base}/__websocket_test/index.html`);
  try {
    await page.waitForFunction(() => window.s2s && (window.s2s.result || window.s2s.failed), null,
      { timeout: TIMEOUT_MS, polling: 200 });
  } catch (error) {
    console.error(`the page did not finish: ${error.message}`);
  }
  result = await page.evaluate(() => window.s2s);
} finally {
  await browser.close();
}
await writeFile(out, JSON.stringify(result));
console.log(`wrote ${out}: ${result.events.length} events, ${result.errors.length} errors`);

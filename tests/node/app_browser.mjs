// s2s-flow's own browser app (the page the server serves at /) in headless Chromium, driven as a
// user would: run by tests/test_realtime_app.py, which reads what this writes to $S2S_OUT.
//
//   S2S_BASE_URL=http://127.0.0.1:PORT S2S_API_KEY=... S2S_WAV=mic.wav S2S_CHROMIUM=/usr/bin/chromium \
//   S2S_OUT=result.json S2S_SHOTS=screenshots/ node app_browser.mjs
//
// The server must allow one session (io.max_sessions=1) and want S2S_API_KEY. Chromium's fake
// capture device plays S2S_WAV as the microphone (a question after some silence). In order:
//   webrtc     the default transport: a settings change (voice, instructions), then the spoken turn
//              (a screenshot while the user speaks, one at a phone's width)
//   full       while that call is open, a second page over each transport: the server is full
//   wrongkey   a wrong API key over each transport
//   websocket  ?transport=websocket in a fresh browser: the spoken turn
//   denied     a browser that refuses the microphone
// Each step records the page's window.s2s and what it shows, and takes a screenshot.
import { mkdir, writeFile } from 'node:fs/promises';
import path from 'node:path';
import { chromium } from 'playwright-core';

const { S2S_BASE_URL: base, S2S_API_KEY: key, S2S_WAV: wav, S2S_CHROMIUM: executablePath, S2S_OUT: out } = process.env;
const shots = process.env.S2S_SHOTS || path.dirname(out);
const TIMEOUT_MS = Number(process.env.S2S_TIMEOUT_MS || 240000);
const MIC = ['--use-fake-ui-for-media-stream', '--use-fake-device-for-media-stream',
             `--use-file-for-fake-audio-capture=${wav}%noloop`, '--autoplay-policy=no-user-gesture-required',
             '--allow-loopback-in-peer-connection', '--disable-features=WebRtcHideLocalIpsWithMdns'];
const result = { steps: {}, shots: [] };

async function launch(args) {
  return chromium.launch({ executablePath, headless: true, args: ['--no-sandbox', ...args] });
}

async function open(browser, query, { grant = true, viewport = { width: 1200, height: 820 } } = {}) {
  const context = await browser.newContext({ viewport });
  if (grant) await context.grantPermissions(['microphone'], { origin: base });
  const page = await context.newPage();
  page.on('console', (m) => { if (m.type() === 'error') console.error('[page]', m.text()); });
  page.on('pageerror', (e) => console.error('[page error]', e.message));
  await page.goto(`${base}/${query}`);
  return page;
}

async function shown(page) {  // what the user sees, besides window.s2s
  return page.evaluate(() => ({
    state: document.getElementById('state-text').textContent,
    error: document.getElementById('error').hidden ? null : document.getElementById('error').innerText,
    chat: [...document.querySelectorAll('#chat .turn')].map((li) => ({
      who: li.classList.contains('user') ? 'user' : 'agent', words: li.querySelector('.words').textContent,
      meta: li.querySelector('.meta').textContent })),
    applied: document.getElementById('applied').textContent,
  }));
}

async function record(name, page) {
  const file = path.join(shots, `${name}.png`);
  await page.screenshot({ path: file, fullPage: true });
  result.shots.push(file);
  result.steps[name] = { s2s: await page.evaluate(() => window.s2s), shown: await shown(page) };
}

async function until(page, what, fn, arg) {
  try {
    await page.waitForFunction(fn, arg, { timeout: TIMEOUT_MS, polling: 200 });
  } catch (error) {
    result.timeouts = [...(result.timeouts || []), `${what}: ${error.message.split('\n')[0]}`];
  }
}

const conversed = () => {
  const s = window.s2s;
  return s.userTranscripts.length > 0 && s.agentTranscripts.length > 0 && s.v2v.length > 0;
};
const failed = () => window.s2s.state === 'error' || window.s2s.state === 'closed';

async function readyAgain() {  // the server has no session open: /readyz says 200 again
  for (let i = 0; i < 300; i++) {
    if ((await fetch(`${base}/readyz`)).ok) return;
    await new Promise((r) => setTimeout(r, 100));
  }
}

async function converse(page, name) {
  await until(page, `${name}: connected`, () => window.s2s.state === 'live' || window.s2s.state === 'error');
  await until(page, `${name}: the conversation`, conversed);
  await page.waitForTimeout(500);  // the reply's last words on screen
  await record(name, page);
}

await mkdir(shots, { recursive: true });
const first = await launch(MIC);
try {
  const page = await open(first, `?key=${encodeURIComponent(key)}`);
  await page.click('#start');
  await until(page, 'webrtc: connected', () => window.s2s.state === 'live' || window.s2s.state === 'error');
  await page.fill('#voice', 'coral');
  await page.fill('#instructions', 'You are a terse assistant. Answer in one short sentence.');
  await page.click('#apply');
  await until(page, 'webrtc: session.updated', () => window.s2s.sessions.some((x) => x.voice === 'coral'));
  // a look at the page while the user speaks (the meter, the live bubble): not a check
  await page.waitForFunction(() => document.querySelector('#speaking.on') || window.s2s.userTranscripts.length,
    null, { timeout: TIMEOUT_MS, polling: 50 }).catch(() => {});
  await page.waitForTimeout(800);
  const speaking = path.join(shots, 'webrtc_speaking.png');
  await page.screenshot({ path: speaking, fullPage: true });
  result.shots.push(speaking);
  await converse(page, 'webrtc');
  await page.setViewportSize({ width: 420, height: 900 });
  const narrow = path.join(shots, 'webrtc_narrow.png');
  await page.screenshot({ path: narrow, fullPage: true });
  result.shots.push(narrow);
  await page.setViewportSize({ width: 1200, height: 820 });

  for (const transport of ['websocket', 'webrtc']) {  // the call above holds the server's one session
    const other = await open(first, `?transport=${transport}&key=${encodeURIComponent(key)}`);
    await other.click('#start');
    await until(other, `full ${transport}`, failed);
    await record(`full_${transport}`, other);
    await other.context().close();
  }
  await page.click('#start');  // Stop: hangs up
  result.steps.webrtc.after = await shown(page);
  await readyAgain();
  for (const transport of ['websocket', 'webrtc']) {
    const other = await open(first, `?transport=${transport}&key=wrong-key`);
    await other.click('#start');
    await until(other, `wrong key ${transport}`, failed);
    await record(`wrongkey_${transport}`, other);
    await other.context().close();
  }
} finally {
  await first.close();
}
await readyAgain();

const second = await launch(MIC);  // a fresh fake microphone: the WAV from its start
try {
  const page = await open(second, `?transport=websocket&key=${encodeURIComponent(key)}`);
  await page.click('#start');
  await converse(page, 'websocket');
  await page.click('#start');
} finally {
  await second.close();
}

const third = await launch(['--use-fake-device-for-media-stream', '--deny-permission-prompts']);
try {
  const page = await open(third, `?key=${encodeURIComponent(key)}`, { grant: false });
  await page.click('#start');
  await until(page, 'denied', failed);
  await record('denied', page);
} finally {
  await third.close();
}

await writeFile(out, JSON.stringify(result));
console.log(`wrote ${out}: ${Object.keys(result.steps).join(', ')}; screenshots: ${result.shots.join(' ')}`);

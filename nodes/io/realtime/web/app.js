// s2s-flow's browser app (page.html): a conversation with the server's agent, both sides' words
// shown as they are said, each reply's voice-to-voice, the microphone's level, the session's voice
// and instructions, and what went wrong in words. Two links carry the same Realtime events:
// WebRTC (the default: audio both ways on the peer connection, events on `oai-events`) and the
// WebSocket (PCM16 in input_audio_buffer.append, the reply in response.output_audio.delta).
// window.s2s holds what the page shows, for tests and for a curious reader's console.
"use strict";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const OPENAI_VOICES = ["alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar"];
const LOUD = 0.004;  // a reply's first sound: a block of the remote track above this RMS (the server's silence is 0)

const app = window.s2s = {
  state: "idle", transport: null, events: 0, errors: [], shownErrors: [], levelMax: 0, levelBlocks: 0,
  userTranscripts: [], agentTranscripts: [], playedSamples: 0, userDeltas: 0, agentDeltas: 0, v2v: [], turns: [], sessions: [],
};
const stored = JSON.parse(localStorage.getItem("s2s-settings") || "{}");  // voice, instructions, transport: not the key

// -- what the page shows ----------------------------------------------------------------------

function setState(kind, text) {
  app.state = kind;
  $("state").className = "state " + kind;
  $("state-text").textContent = text;
  const live = kind === "connecting" || kind === "live";
  $("start").textContent = live ? "Stop" : "Start talking";
  $("start").classList.toggle("primary", !live);
  $("start").classList.toggle("stop", live);
  if (kind !== "live") speaking(null);
  $("typed-text").disabled = $("typed-send").disabled = kind !== "live";
}

function speaking(on) {  // the server's voice detector: null when not connected
  $("speaking").classList.toggle("on", Boolean(on));
  $("speaking").textContent = on == null ? "not connected" : on ? "you are speaking" : "listening";
}

function showError(title, detail) {
  app.shownErrors.push(title + " " + detail);
  $("error-title").textContent = title;
  $("error-detail").textContent = detail;
  $("error").hidden = false;
}
$("error-close").onclick = () => { $("error").hidden = true; };

function bubble(who, text = "") {
  $("hint")?.remove();
  const li = document.createElement("li");
  li.className = "turn " + who;
  const label = document.createElement("span"); label.className = "who"; label.textContent = who === "user" ? "You" : "Agent";
  const words = document.createElement("p"); words.className = "words"; words.textContent = text;
  const meta = document.createElement("span"); meta.className = "meta";
  li.append(label, words, meta);
  $("chat").append(li);
  li.scrollIntoView({ block: "end" });
  return { li, words, meta };
}

function summary() {
  const v = [...app.v2v].sort((a, b) => a - b);
  $("v2v-summary").textContent = v.length ? `This conversation: ${v.length} repl${v.length > 1 ? "ies" : "y"}, ` +
    `median ${v[v.length >> 1]} ms, last ${app.v2v[app.v2v.length - 1]} ms.` : "";
}

// -- settings ---------------------------------------------------------------------------------

function settings() {
  const out = { type: "realtime" };
  const voice = $("voice").value.trim(), instructions = $("instructions").value.trim();
  if (instructions) out.instructions = instructions;
  if (voice) out.audio = { output: { voice } };
  return out;
}
function transportChosen() { return document.querySelector("input[name=transport]:checked").value; }
function remember() {
  localStorage.setItem("s2s-settings", JSON.stringify(
    { voice: $("voice").value, instructions: $("instructions").value, transport: transportChosen() }));
}
function showSession(session) {
  const voice = session.audio?.output?.voice ?? session.voice;
  app.sessions.push({ voice, instructions: session.instructions });
  const names = new Set([voice, ...OPENAI_VOICES].filter(Boolean));
  $("voices").replaceChildren(...[...names].map((n) => Object.assign(document.createElement("option"), { value: n })));
  $("voice").placeholder = voice || "the server's own";
  if (!$("instructions").value) $("instructions").placeholder = session.instructions || "the server's own system prompt";
  $("applied").textContent = `In effect: voice ${voice || "the server's"}; instructions ` +
    (session.instructions ? `“${session.instructions.slice(0, 80)}${session.instructions.length > 80 ? "…" : ""}”` : "the server's");
}
$("apply").onclick = () => {
  remember();
  if (link && app.state === "live") { $("applied").textContent = "Applying…"; link.send({ type: "session.update", session: settings() }); }
  else $("applied").textContent = "Saved: they apply when you start.";
};
for (const name of ["voice", "instructions"]) if (stored[name]) $(name).value = stored[name];
const asked = params.get("transport") || stored.transport;
if (asked) for (const r of document.querySelectorAll("input[name=transport]")) r.checked = r.value === asked;
if (params.get("key")) $("key").value = params.get("key");

// -- the conversation: both transcripts, and each turn's voice-to-voice ------------------------

const users = new Map();    // user item id -> its bubble and turn
const replies = new Map();  // response id -> { bubble, turn, heard }
let lastTurn = null;        // the user turn a reply answers
let awaitingSound = null;   // the reply whose first sound has not been played yet

function userTurn(itemId) {
  let t = users.get(itemId);
  if (!t) { t = { bubble: bubble("user", ""), speechEnd: null, typed: false }; users.set(itemId, t); }
  return t;
}

function firstSound(at) {  // the link played a reply's first sound, at performance.now() time `at`
  const r = awaitingSound; awaitingSound = null;
  if (!r || r.heard) return;
  r.heard = true;
  if (!r.bubble) r.bubble = bubble("agent");
  if (!r.turn || r.turn.speechEnd == null) { r.bubble.meta.textContent = "typed: no voice-to-voice"; return; }
  const ms = Math.round(at - r.turn.speechEnd), told = Math.round(r.turn.toldAt - r.turn.speechEnd);
  app.v2v.push(ms);
  app.turns.push({ v2v: ms, told });
  r.bubble.meta.textContent = `voice-to-voice ${ms} ms`;
  r.bubble.meta.title = `the server's detector said you stopped ${told} ms after your speech ended`;
  r.bubble.meta.classList.add("v2v");
  summary();
}

function cut(r) {  // the user spoke over the reply (or it was cancelled): what follows was not said
  if (r.bubble.li.classList.contains("cut")) return;
  r.bubble.li.classList.add("cut");
  r.bubble.meta.textContent = [r.bubble.meta.textContent, "interrupted"].filter(Boolean).join(" · ");
}

function onEvent(ev) {
  if (!link) return;  // a closed link's last words
  app.events++;
  switch (ev.type) {
    case "session.created": case "session.updated":
      showSession(ev.session); break;
    case "input_audio_buffer.speech_started":
      { const t = userTurn(ev.item_id); t.bubble.li.classList.add("live"); t.bubble.meta.textContent = "listening…"; }
      speaking(true);
      link.bargeIn?.();
      break;
    case "input_audio_buffer.speech_stopped":
      { const t = userTurn(ev.item_id); t.speechEnd = link.clockAt(ev.audio_end_ms); t.toldAt = performance.now(); t.bubble.meta.textContent = "…"; lastTurn = t; }
      speaking(false);
      break;
    case "input_audio_buffer.committed":
      { const t = userTurn(ev.item_id); if (t.speechEnd == null) t.speechEnd = t.toldAt = performance.now(); lastTurn = t; } break;
    case "conversation.item.input_audio_transcription.delta":
      { const t = userTurn(ev.item_id); t.bubble.words.textContent += ev.delta; app.userDeltas++; } break;
    case "conversation.item.input_audio_transcription.completed":
      { const t = userTurn(ev.item_id); t.bubble.words.textContent = ev.transcript; t.bubble.li.classList.remove("live");
        if (t.bubble.meta.textContent === "listening…" || t.bubble.meta.textContent === "…") t.bubble.meta.textContent = "";
        app.userTranscripts.push(ev.transcript); } break;
    case "conversation.item.input_audio_transcription.failed":
      { const t = userTurn(ev.item_id); t.bubble.meta.textContent = "not transcribed: " + (ev.error?.message || "failed"); } break;
    case "response.created": {
      const r = { bubble: null, turn: lastTurn, heard: false, id: ev.response.id };
      lastTurn = null;
      replies.set(ev.response.id, r);
      awaitingSound = r;
      break;
    }
    case "response.output_item.added":
      if (ev.item.type === "message") { const r = replies.get(ev.response_id); if (r && !r.bubble) { r.bubble = bubble("agent"); r.bubble.li.classList.add("live"); } }
      break;
    case "response.output_audio_transcript.delta": case "response.output_text.delta":
      { const r = replies.get(ev.response_id); if (r?.bubble) { r.bubble.words.textContent += ev.delta; app.agentDeltas++; } } break;
    case "response.output_audio.delta":
      link.play?.(ev); break;
    case "response.output_audio.done":
      link.flush?.(); break;
    case "response.done": {
      const r = replies.get(ev.response.id);
      if (!r?.bubble) break;
      r.bubble.li.classList.remove("live");
      const status = ev.response.status;
      if (status === "cancelled") cut(r);
      if (status === "failed") r.bubble.meta.textContent = "failed: " + (ev.response.status_details?.error?.message || "the server's reply failed");
      app.agentTranscripts.push(r.bubble.words.textContent);
      break;
    }
    case "conversation.item.truncated":
      for (const r of replies.values()) if (r.bubble && r.item === ev.item_id) cut(r);
      break;
    case "error": {
      const e = ev.error || {};
      app.errors.push(e.message);
      const about = e.event_id ? ` (about your event ${e.event_id})` : "";
      showError(`The server says${about}:`, `${e.message} [${e.code || e.type}]`);
      if (e.param?.startsWith("session")) $("applied").textContent = "Not applied: see the message above.";
      break;
    }
  }
  if (ev.type === "response.output_item.added" && ev.item.type === "message") {
    const r = replies.get(ev.response_id); if (r) r.item = ev.item.id;
  }
}

// -- the links --------------------------------------------------------------------------------

async function worklets(ctx) { await ctx.audioWorklet.addModule("/web/worklets.js"); }

function meter(ctx, stream, onBlock) {  // the level of a stream, every 10 ms
  const node = new AudioWorkletNode(ctx, "meter", { processorOptions: { block: Math.round(ctx.sampleRate / 100) } });
  ctx.createMediaStreamSource(stream).connect(node);
  const mute = ctx.createGain(); mute.gain.value = 0; node.connect(mute).connect(ctx.destination);  // keeps it pulled
  node.port.onmessage = (e) => onBlock(e.data.rms, performance.now());
  return node;
}

function showLevel(rms) {
  const db = 20 * Math.log10(Math.max(rms, 1e-5));
  $("level").style.width = `${100 - Math.max(0, Math.min(100, (db + 60) * 100 / 60))}%`;  // the cover above the level
  if (rms > app.levelMax) app.levelMax = rms;
  if (rms > 0.01) app.levelBlocks++;
}

async function errorOf(response) {  // a refused HTTP request's message, from the server's error body
  try { const e = (await response.json()).error; return `${e.message} [${response.status} ${e.code || e.type}]`; }
  catch { return `HTTP ${response.status} ${response.statusText}`; }
}

class WebRTCLink {
  constructor(key) { this.key = key; this.name = "WebRTC"; }
  async connect(mic, ctx) {
    // across NATs: ?ice=stun:HOST:PORT (repeatable), as the server has its io.webrtc.ice_servers
    const pc = this.pc = new RTCPeerConnection({ iceServers: params.getAll("ice").map((urls) => ({ urls })) });
    for (const track of mic.getAudioTracks()) pc.addTrack(track, mic);
    this.audio = Object.assign(document.createElement("audio"), { autoplay: true });
    pc.ontrack = (e) => {
      const stream = e.streams[0] || new MediaStream([e.track]);
      this.audio.srcObject = stream;  // plays it (and makes Chromium's Web Audio see a remote track's samples)
      const block = Math.round(ctx.sampleRate / 100);
      meter(ctx, stream, (rms, at) => {
        if (rms <= LOUD) return;
        app.playedSamples += block;
        if (awaitingSound) firstSound(at);
      });
    };
    pc.onconnectionstatechange = () => {
      if (pc.connectionState === "connected" && this.t0 == null) this.t0 = performance.now();
      if (pc.connectionState === "failed") this.lost("The WebRTC connection failed:", "no network path to the server " +
        "(ICE). Across networks the server needs a reachable io.host and STUN/TURN servers (io.webrtc.ice_servers).");
    };
    const dc = this.dc = pc.createDataChannel("oai-events");
    dc.onmessage = (m) => onEvent(JSON.parse(m.data));
    const opened = new Promise((resolve) => { dc.onopen = resolve; });
    dc.onclose = () => this.lost(null, "the server ended the call");
    await pc.setLocalDescription(await pc.createOffer());
    await new Promise((resolve) => {  // all candidates in the offer: the server takes no trickled ones
      if (pc.iceGatheringState === "complete") return resolve();
      pc.addEventListener("icegatheringstatechange", () => pc.iceGatheringState === "complete" && resolve());
      setTimeout(resolve, 3000);
    });
    const headers = { "Content-Type": "application/sdp" };
    if (this.key) headers.Authorization = "Bearer " + this.key;
    let response;
    try { response = await fetch("/v1/realtime/calls", { method: "POST", body: pc.localDescription.sdp, headers }); }
    catch (e) { throw new LinkError("The server is not reachable:", `POST /v1/realtime/calls failed (${e.message}): is s2s-run still running?`); }
    if (!response.ok) throw new LinkError("The server refused the call:", await errorOf(response));
    this.location = response.headers.get("Location");
    await pc.setRemoteDescription({ type: "answer", sdp: await response.text() });
    await opened;
    if (this.t0 == null) this.t0 = performance.now();
  }
  clockAt(ms) { return this.t0 + ms; }  // the server counts the microphone's audio from the call's first RTP frame
  send(ev) { if (this.dc?.readyState === "open") this.dc.send(JSON.stringify(ev)); }
  lost(title, detail) { if (!this.closing) { this.closing = true; this.close(); ended(title, detail); } }
  close() {
    this.closing = true;
    if (this.location) fetch(this.location, { method: "DELETE", headers: this.key ? { Authorization: "Bearer " + this.key } : {} }).catch(() => {});
    this.location = null;
    this.pc?.close();
    if (this.audio) this.audio.srcObject = null;
  }
}

class WebSocketLink {
  constructor(key) { this.key = key; this.name = "WebSocket"; this.sent = 0; this.marks = []; this.played = 0; this.queued = 0; }
  async connect(mic, ctx) {
    this.ctx = ctx;
    const rate = this.rate = ctx.sampleRate;
    this.player = new AudioWorkletNode(ctx, "player", { processorOptions: { jitter: rate * 0.12 } });
    this.player.connect(ctx.destination);
    this.player.port.onmessage = (e) => {
      this.played = app.playedSamples = e.data;
      if (awaitingSound && awaitingSound.item === this.item && this.played > this.replyStart) firstSound(performance.now());
    };
    const protocols = ["realtime"];
    if (this.key) protocols.push("openai-insecure-api-key." + this.key);
    const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/realtime`;
    const ws = this.ws = new WebSocket(url, protocols);
    let lastError = null;
    await new Promise((resolve, reject) => {
      ws.onopen = resolve;
      ws.onclose = async (e) => {
        // closed before it opened: the browser tells no status; the server's /healthz says whether it is up
        const up = await fetch("/healthz").then((r) => r.ok, () => false);
        reject(new LinkError("Could not connect:", up
          ? "the server is running (its /healthz answers) but refused the WebSocket: the API key is missing or " +
            "wrong (Settings, API key: the server's io.api_key)."
          : `the server does not answer at ${url} (code ${e.code}): is s2s-run still running?`));
      };
    });
    ws.onmessage = (m) => { const ev = JSON.parse(m.data); if (ev.type === "error") lastError = ev.error; onEvent(ev); };
    ws.onclose = (e) => {
      if (this.closing) return;
      const why = e.reason || (lastError ? lastError.code : "");
      ended(lastError && e.code !== 1000 ? "The server closed the connection:" : null,
        lastError && e.code !== 1000 ? `${lastError.message} [${e.code} ${why}]` : `the server closed it (code ${e.code}${why ? ", " + why : ""})`);
    };
    const capture = new AudioWorkletNode(ctx, "capture");
    ctx.createMediaStreamSource(mic).connect(capture);
    const mute = ctx.createGain(); mute.gain.value = 0; capture.connect(mute).connect(ctx.destination);
    capture.port.onmessage = (e) => {
      if (ws.readyState !== 1) return;
      this.sent += e.data.length;
      this.marks.push([this.sent, performance.now()]);  // the sample count the server has had, and when
      if (this.marks.length > 6000) this.marks.splice(0, 3000);
      ws.send(JSON.stringify({ type: "input_audio_buffer.append", audio: pcm16base64(e.data) }));
    };
  }
  clockAt(ms) {  // when this page captured the server's audio_end_ms (it counts from the first append)
    const sample = ms * this.rate / 1000;
    const mark = this.marks.find(([n]) => n >= sample) || this.marks[this.marks.length - 1];
    return mark ? mark[1] - (mark[0] - sample) * 1000 / this.rate : performance.now();
  }
  send(ev) { if (this.ws?.readyState === 1) this.ws.send(JSON.stringify(ev)); }
  play(ev) {
    const pcm = float32(ev.delta);
    if (this.item !== ev.item_id) { this.item = ev.item_id; this.replyStart = Math.max(this.played, this.queued); }
    this.queued = Math.max(this.queued, this.played) + pcm.length;
    this.player.port.postMessage(pcm);
  }
  flush() { this.player.port.postMessage("flush"); }
  bargeIn() {  // the user speaks over the reply: stop its voice now, tell the server what was heard
    if (!this.item || this.played >= this.queued) return;
    const heardMs = Math.max(0, Math.round((this.played - this.replyStart) * 1000 / this.rate));
    this.player.port.postMessage("clear");
    this.queued = this.played;
    this.send({ type: "conversation.item.truncate", item_id: this.item, content_index: 0, audio_end_ms: heardMs });
  }
  close() { this.closing = true; this.ws?.close(1000); }
}

class LinkError extends Error { constructor(title, detail) { super(detail); this.title = title; } }

function pcm16base64(f32) {
  const pcm = new Int16Array(f32.length);
  for (let i = 0; i < f32.length; i++) pcm[i] = Math.max(-1, Math.min(1, f32[i])) * 32767;
  const bytes = new Uint8Array(pcm.buffer); let s = "";
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  return btoa(s);
}
function float32(b64) {
  const bin = atob(b64), n = bin.length >> 1, out = new Float32Array(n);
  for (let i = 0; i < n; i++) { const v = bin.charCodeAt(2 * i) | (bin.charCodeAt(2 * i + 1) << 8); out[i] = (v > 32767 ? v - 65536 : v) / 32768; }
  return out;
}

// -- start and stop ---------------------------------------------------------------------------

let link = null, mic = null, ctx = null;

function micError(e) {
  if (!navigator.mediaDevices) return new LinkError("No microphone here:", "browsers give the microphone only to " +
    "https pages and to localhost: open this page as http://localhost:PORT, or through an https proxy.");
  if (e.name === "NotAllowedError" || e.name === "SecurityError") return new LinkError("Microphone access was denied:",
    "allow this page to use the microphone (the icon at the left of the address bar, or the browser's site settings), then press Start talking.");
  if (e.name === "NotFoundError") return new LinkError("No microphone found:", "plug one in (or choose one in the system's sound settings) and press Start talking.");
  if (e.name === "NotReadableError") return new LinkError("The microphone is busy:", "another program holds it; close that, then press Start talking.");
  return new LinkError("The microphone did not open:", `${e.name}: ${e.message}`);
}

async function start() {
  remember();
  $("error").hidden = true;
  const key = $("key").value.trim();
  const mine = link = transportChosen() === "websocket" ? new WebSocketLink(key) : new WebRTCLink(key);
  app.transport = link.name;
  setState("connecting", `Connecting over ${link.name}…`);
  try {
    let got;
    try { got = await navigator.mediaDevices.getUserMedia({ audio: { echoCancellation: true, noiseSuppression: true, channelCount: 1 } }); }
    catch (e) { throw micError(e); }
    if (link !== mine) { got.getTracks().forEach((t) => t.stop()); return; }  // stopped while the browser asked
    mic = got;
    ctx = new AudioContext(link instanceof WebSocketLink ? { sampleRate: 24000 } : {});  // 24 kHz: the protocol's PCM
    await ctx.resume();
    await worklets(ctx);
    meter(ctx, mic, showLevel);
    await link.connect(mic, ctx);
    if (link !== mine) return;  // stopped while it connected
    setState("live", `Connected over ${link.name}`);
    speaking(false);
    const update = settings();
    if (update.instructions || update.audio) link.send({ type: "session.update", session: update });
  } catch (e) {
    if (link !== mine) return;  // stopped while it connected: what failed after is no news
    const title = e instanceof LinkError ? e.title : "Could not start:";
    ended(title, e.message);
  }
}

function ended(title, detail) {  // the conversation is over: by the user, the server, or an error
  link?.close();
  link = null;
  mic?.getTracks().forEach((t) => t.stop());
  ctx?.close();
  mic = ctx = null;
  $("level").style.width = "100%";
  for (const li of document.querySelectorAll(".turn.live")) li.classList.remove("live");
  if (title) { showError(title, detail); setState("error", "Not connected: " + title.replace(/:$/, "").toLowerCase()); }
  else setState("closed", "Closed: " + detail);
}

$("start").onclick = () => (app.state === "connecting" || app.state === "live" ? ended(null, "you hung up") : start());
$("typed").onsubmit = (e) => {
  e.preventDefault();
  const text = $("typed-text").value.trim();
  if (!text || !link) return;
  $("typed-text").value = "";
  bubble("user", text).meta.textContent = "typed";
  lastTurn = null;
  link.send({ type: "conversation.item.create", item: { type: "message", role: "user", content: [{ type: "input_text", text }] } });
  link.send({ type: "response.create" });
};
if (params.get("autostart")) start();

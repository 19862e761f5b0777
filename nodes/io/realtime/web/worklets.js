// The app's audio processors (AudioWorklet, loaded by app.js): run on the browser's audio thread.
"use strict";

// The level of what passes, as RMS every `block` samples (the meter, and the first reply audio heard).
class Meter extends AudioWorkletProcessor {
  constructor(opts) {
    super(); this.block = opts.processorOptions.block; this.sum = 0; this.n = 0; this.samples = 0;
  }
  process(inputs) {
    const ch = inputs[0][0]; if (!ch) return true;
    for (let i = 0; i < ch.length; i++) {
      this.sum += ch[i] * ch[i];
      if (++this.n === this.block) {
        this.samples += this.n;
        this.port.postMessage({ rms: Math.sqrt(this.sum / this.n), samples: this.samples });
        this.sum = 0; this.n = 0;
      }
    }
    return true;
  }
}
registerProcessor("meter", Meter);

// Capture (WebSocket): the microphone in 20 ms Float32 blocks, for input_audio_buffer.append.
class Capture extends AudioWorkletProcessor {
  constructor() { super(); this.buf = new Float32Array(sampleRate / 50); this.n = 0; }
  process(inputs) {
    const ch = inputs[0][0]; if (!ch) return true;
    for (let i = 0; i < ch.length; i++) {
      this.buf[this.n++] = ch[i];
      if (this.n === this.buf.length) { this.port.postMessage(this.buf.slice()); this.n = 0; }
    }
    return true;
  }
}
registerProcessor("capture", Capture);

// Playback (WebSocket): the reply's audio queued; a reply starts once `jitter` samples wait, so the
// network's hiccups do not cut it ("flush" plays a short tail); "clear" drops what is queued (barge-in). Posts the samples played.
class Player extends AudioWorkletProcessor {
  constructor(opts) {
    super(); this.chunks = []; this.offset = 0; this.queued = 0; this.playing = false; this.played = 0;
    this.jitter = opts.processorOptions.jitter;
    this.port.onmessage = (e) => {
      if (e.data === "clear") { this.chunks = []; this.offset = 0; this.queued = 0; this.playing = false; return; }
      if (e.data === "flush") { this.playing = this.queued > 0; return; }  // the reply's end: play its tail
      this.chunks.push(e.data); this.queued += e.data.length;
    };
  }
  process(inputs, outputs) {
    const out = outputs[0][0];
    if (!this.playing && this.queued >= this.jitter) this.playing = true;
    let i = 0;
    while (this.playing && i < out.length && this.chunks.length) {
      const c = this.chunks[0], n = Math.min(out.length - i, c.length - this.offset);
      out.set(c.subarray(this.offset, this.offset + n), i);
      i += n; this.offset += n; this.queued -= n; this.played += n;
      if (this.offset === c.length) { this.chunks.shift(); this.offset = 0; }
    }
    if (!this.chunks.length) this.playing = false;
    if (i) this.port.postMessage(this.played);
    return true;
  }
}
registerProcessor("player", Player);

// AudioWorklet player: a small jitter buffer in front of the speakers, for one utterance at a time.
//
// Receives float mono samples at the stream's rate (`inputRate`), resamples linearly when the AudioContext
// runs at another rate, waits for `prebufferMs` of audio before starting (and again after running dry), and
// counts what was played, underruns and the silence they caused. Knows nothing about WebSockets or the page.
//
// Messages in:  {type: "start", id, prebufferMs} | {type: "audio", samples: Float32Array} | {type: "end"} |
//               {type: "clear"}
// Messages out: {type: "stats", id, played, underruns, gapMs, bufferedMs, peak, rms, started, final}
//               {type: "started", id} (first sample played) | {type: "drained", id} (all audio played after end)

const STATS_EVERY_FRAMES = 1024; // ~23 ms at 44.1 kHz: smooth meters without flooding the main thread

class FishgatePlayer extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const opts = options.processorOptions || {};
    this.inputRate = opts.inputRate || sampleRate;
    this.step = this.inputRate / sampleRate; // input samples per output frame
    this.id = -1;
    this.active = false;
    this.reset(opts.prebufferMs ?? 100);
    this.port.onmessage = (e) => this.onMessage(e.data);
  }

  reset(prebufferMs) {
    this.chunks = [];
    this.head = 0; // read offset into chunks[0]
    this.buffered = 0; // input samples queued
    this.prebuffer = Math.max(1, Math.round((prebufferMs * this.inputRate) / 1000));
    this.ended = false;
    this.playing = false;
    this.started = false;
    this.played = 0; // input samples consumed
    this.underruns = 0;
    this.gapFrames = 0;
    this.a = 0; // resampler: samples around the read position, and the fraction between them
    this.b = 0;
    this.frac = 2; // two samples must be read before the first output
    this.peak = 0;
    this.sumSq = 0;
    this.levelFrames = 0;
    this.sinceStats = 0;
  }

  onMessage(msg) {
    if (msg.type === "start") {
      this.id = msg.id;
      this.reset(msg.prebufferMs ?? 100);
      this.active = true;
    } else if (msg.type === "audio") {
      if (!this.active || msg.samples.length === 0) return;
      this.chunks.push(msg.samples);
      this.buffered += msg.samples.length;
    } else if (msg.type === "end") {
      this.ended = true;
    } else if (msg.type === "clear") {
      this.chunks = [];
      this.head = 0;
      this.buffered = 0;
      this.playing = false;
      if (this.active) this.postStats(true);
      this.active = false;
    }
  }

  pop() {
    const chunk = this.chunks[0];
    const s = chunk[this.head++];
    if (this.head >= chunk.length) {
      this.chunks.shift();
      this.head = 0;
    }
    this.buffered--;
    this.played++;
    return s;
  }

  // Fill out[from:] with audio; return how many frames were written before the buffer ran dry.
  render(out) {
    const n = out.length;
    if (this.step === 1) {
      let i = 0;
      while (i < n && this.buffered > 0) out[i++] = this.pop();
      return i;
    }
    for (let i = 0; i < n; i++) {
      while (this.frac >= 1) {
        if (this.buffered === 0) return i;
        this.a = this.b;
        this.b = this.pop();
        this.frac -= 1;
      }
      out[i] = this.a + (this.b - this.a) * this.frac;
      this.frac += this.step;
    }
    return n;
  }

  process(_inputs, outputs) {
    const out = outputs[0][0];
    if (!out || !this.active) return true;
    const n = out.length;
    if (!this.playing && (this.buffered >= this.prebuffer || (this.ended && this.buffered > 0))) {
      this.playing = true;
      if (!this.started) {
        this.started = true;
        this.port.postMessage({ type: "started", id: this.id });
      }
    }
    let written = 0;
    if (this.playing) {
      written = this.render(out);
      if (written < n) this.playing = false;
      if (written < n && !this.ended) this.underruns++;
    }
    if (this.started && written < n && !this.ended) this.gapFrames += n - written;
    for (let i = 0; i < written; i++) {
      const v = out[i];
      const m = v < 0 ? -v : v;
      if (m > this.peak) this.peak = m;
      this.sumSq += v * v;
    }
    this.levelFrames += n;
    this.sinceStats += n;
    if (this.ended && this.buffered === 0 && !this.playing) {
      this.postStats(true);
      this.port.postMessage({ type: "drained", id: this.id });
      this.active = false;
      return true;
    }
    if (this.sinceStats >= STATS_EVERY_FRAMES) this.postStats(false);
    return true;
  }

  postStats(final) {
    const rms = this.levelFrames > 0 ? Math.sqrt(this.sumSq / this.levelFrames) : 0;
    this.port.postMessage({
      type: "stats",
      id: this.id,
      played: this.played,
      underruns: this.underruns,
      gapMs: (this.gapFrames / sampleRate) * 1000,
      bufferedMs: (this.buffered / this.inputRate) * 1000,
      peak: this.peak,
      rms,
      started: this.started,
      final,
    });
    this.peak = 0;
    this.sumSq = 0;
    this.levelFrames = 0;
    this.sinceStats = 0;
  }
}

registerProcessor("fishgate-player", FishgatePlayer);

// Playback: one AudioContext with the jitter-buffer worklet, and what was received kept for the WAV download.
//
// The AudioContext is created at the stream's sample rate when the browser allows it (Chromium and Firefox
// do); otherwise the worklet resamples. Audio arrives as raw s16le mono bytes; they are converted to float
// here. Knows nothing about the protocol or the page's widgets.

const PEAK_BUCKET_SAMPLES = 256; // waveform resolution: one max-abs value per this many samples

export class Player {
  constructor() {
    this.ctx = null;
    this.node = null;
    this.gain = null;
    this.rate = 0;
    this.contextRate = 0;
    this.volume = 0.6;
    this.nextId = 1;
    this.id = 0;
    this.onStats = () => {};
    this.onStarted = () => {};
    this.onDrained = () => {};
    this.resetRecording(44100);
  }

  resetRecording(rate) {
    this.recRate = rate;
    this.chunks = []; // Int16Array per received frame, in order
    this.received = 0;
    this.carry = null; // an odd trailing byte from the previous frame
    this.peaks = []; // max |sample| per PEAK_BUCKET_SAMPLES, for the waveform
    this.bucketMax = 0;
    this.bucketFill = 0;
  }

  /** Create (or reuse) the AudioContext for a stream at `rate` Hz. Call from a user gesture so the browser lets
   * audio start. `contextRate` forces the context's own rate (the worklet then resamples); 0 = the stream's. */
  async prepare(rate, contextRate = 0) {
    if (this.ctx && this.rate === rate && this.contextRate === contextRate && this.ctx.state !== "closed") {
      if (this.ctx.state === "suspended") await this.ctx.resume();
      return;
    }
    if (this.ctx) {
      const old = this.ctx;
      this.ctx = null;
      this.node = null;
      await old.close().catch(() => {});
    }
    let ctx;
    try {
      ctx = new AudioContext({ sampleRate: contextRate || rate, latencyHint: "interactive" });
    } catch {
      ctx = new AudioContext({ latencyHint: "interactive" }); // the worklet resamples
    }
    this.ctx = ctx;
    this.rate = rate;
    this.contextRate = contextRate;
    await ctx.audioWorklet.addModule(new URL("./worklet.js", import.meta.url));
    const node = new AudioWorkletNode(ctx, "fishgate-player", {
      numberOfInputs: 0,
      numberOfOutputs: 1,
      outputChannelCount: [1],
      processorOptions: { inputRate: rate },
    });
    const gain = new GainNode(ctx, { gain: this.volume });
    node.connect(gain).connect(ctx.destination);
    node.port.onmessage = (e) => this.handle(e.data);
    this.node = node;
    this.gain = gain;
    if (ctx.state === "suspended") await ctx.resume();
  }

  get running() {
    return this.ctx !== null && this.ctx.state === "running";
  }

  setVolume(v) {
    this.volume = v;
    if (this.gain) this.gain.gain.setTargetAtTime(v, this.ctx.currentTime, 0.02);
  }

  /** Start a new utterance: forget the previous one's audio. Returns the utterance's playback id. */
  begin(prebufferMs) {
    this.id = this.nextId++;
    this.resetRecording(this.rate);
    this.node.port.postMessage({ type: "start", id: this.id, prebufferMs });
    return this.id;
  }

  /** Raw s16le mono bytes from the server → recording + worklet. Returns the number of samples. */
  push(buffer) {
    let bytes = new Uint8Array(buffer);
    if (this.carry !== null) {
      const joined = new Uint8Array(bytes.length + 1);
      joined[0] = this.carry;
      joined.set(bytes, 1);
      bytes = joined;
      this.carry = null;
    }
    if (bytes.length % 2 === 1) {
      this.carry = bytes[bytes.length - 1];
      bytes = bytes.subarray(0, bytes.length - 1);
    }
    const n = bytes.length / 2;
    if (n === 0) return 0;
    const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    const pcm = new Int16Array(n);
    const floats = new Float32Array(n);
    for (let i = 0; i < n; i++) {
      const s = view.getInt16(2 * i, true);
      pcm[i] = s;
      floats[i] = s / 32768;
      const m = s < 0 ? -s : s;
      if (m > this.bucketMax) this.bucketMax = m;
      if (++this.bucketFill === PEAK_BUCKET_SAMPLES) {
        this.peaks.push(this.bucketMax / 32768);
        this.bucketMax = 0;
        this.bucketFill = 0;
      }
    }
    this.chunks.push(pcm);
    this.received += n;
    this.node.port.postMessage({ type: "audio", samples: floats }, [floats.buffer]);
    return n;
  }

  /** No more audio for this utterance: play out what is buffered, then `onDrained`. */
  end() {
    if (this.node) this.node.port.postMessage({ type: "end" });
  }

  /** Stop at once: drop everything buffered. */
  clear() {
    if (this.node) this.node.port.postMessage({ type: "clear" });
  }

  handle(msg) {
    if (msg.id !== this.id) return; // a message about an earlier utterance
    if (msg.type === "stats") this.onStats(msg);
    else if (msg.type === "started") this.onStarted();
    else if (msg.type === "drained") this.onDrained();
  }

  /** The first `samples` received samples (what was played) as a 16-bit mono WAV file. */
  wav(samples) {
    const n = Math.min(samples, this.received);
    const out = new ArrayBuffer(44 + 2 * n);
    const v = new DataView(out);
    const text = (o, s) => [...s].forEach((c, i) => v.setUint8(o + i, c.charCodeAt(0)));
    text(0, "RIFF");
    v.setUint32(4, 36 + 2 * n, true);
    text(8, "WAVE");
    text(12, "fmt ");
    v.setUint32(16, 16, true);
    v.setUint16(20, 1, true); // PCM
    v.setUint16(22, 1, true); // mono
    v.setUint32(24, this.recRate, true);
    v.setUint32(28, this.recRate * 2, true);
    v.setUint16(32, 2, true);
    v.setUint16(34, 16, true);
    text(36, "data");
    v.setUint32(40, 2 * n, true);
    const dst = new Int16Array(out, 44, n);
    let at = 0;
    for (const chunk of this.chunks) {
      if (at >= n) break;
      const take = Math.min(chunk.length, n - at);
      dst.set(take === chunk.length ? chunk : chunk.subarray(0, take), at);
      at += take;
    }
    return new Blob([out], { type: "audio/wav" });
  }
}

export { PEAK_BUCKET_SAMPLES };

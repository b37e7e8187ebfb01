// The demo page's controller: utterances (one live WebSocket each), the two text modes, voices, settings,
// and the automation surface `window.fishgate.stats()`.
//
// "Send all": Speak sends the whole text box, then `stop`. "Type-ahead": complete words go to the server as
// they are typed (the diff of the text box), Enter sends the rest and `flush`, Speak sends the rest and `stop`;
// Speak with no typing session open replays the box as an LLM-like token stream at the chosen tokens/s.

import { getHealth } from "./api.js";
import { LiveSession, liveUrl } from "./live.js";
import { Player } from "./player.js";
import * as settings from "./settings.js";
import * as view from "./view.js";
import { VoicePanel } from "./voices.js";

const $ = view.$;
const HEALTH_POLL_MS = 15000;
const HISTORY_ROWS = 6;
// a typing session with no keystroke for this long is finished (stop), well before the server's idle timeout
const TYPING_IDLE_STOP_MS = 30000;
// a complete word ends at whitespace or punctuation; CJK characters are words of their own
const WORD_END = /[\s.,!?;:\u3000-\u303f\uff01-\uff1f\p{Script=Han}\p{Script=Hiragana}\p{Script=Katakana}]/u;
// LLM-like tokens: a word with its leading space (long words in pieces), or one punctuation mark
const TOKEN = /\s*[\p{L}\p{M}\p{N}']+|\s*[^\s\p{L}\p{M}\p{N}']|\s+/gu;
const TOKEN_MAX_LETTERS = 6;

/** One utterance: its socket, timings and playback counters. */
class Utterance {
  constructor(n, mode, rate, replay) {
    Object.assign(this, { n, mode, rate, replay });
    this.state = "speaking";
    this.reason = null; // "finish" | "cancelled" | "error"
    this.error = null;
    this.session = null;
    this.t0 = null; // first text sent (performance.now ms)
    this.tFirstAudio = null;
    this.tLastAudio = null;
    this.tTextEnd = null; // stop sent
    this.received = 0;
    this.played = 0;
    this.underruns = 0;
    this.gapMs = 0;
    this.playStarted = false;
    this.serverTtfaMs = null;
    this.started = false; // the server accepted `start`
    this.finished = false;
    this.streamText = ""; // text sent in this utterance
    this.pendingAudio = []; // audio that arrived before the player was ready
    this.playerReady = false;
  }
  get ttfaMs() {
    return this.t0 !== null && this.tFirstAudio !== null ? this.tFirstAudio - this.t0 : null;
  }
  get rtf() {
    const audioS = this.received / this.rate;
    return audioS > 0 && this.t0 !== null ? (this.tLastAudio - this.t0) / 1000 / audioS : null;
  }
  get headStartMs() {
    if (this.mode !== "type-ahead" || this.tFirstAudio === null) return null;
    return (this.tTextEnd ?? performance.now()) - this.tFirstAudio;
  }
}

class Demo {
  constructor() {
    this.player = new Player();
    this.utt = null; // the active utterance
    this.last = null; // the most recent one (active or not)
    this.count = 0;
    this.sent = ""; // type-ahead: the prefix of the text box already sent (the diff baseline)
    this.replayTimer = null;
    this.drawQueued = false;
    this.voices = null;
    this.contextRate = 0;
    this.typingIdleTimer = 0;
    this.player.onStats = (m) => this.onPlayerStats(m);
    this.player.onStarted = () => {
      if (this.utt) this.utt.playStarted = true;
    };
    this.player.onDrained = () => this.onDrained();
  }

  // ---- setup ---------------------------------------------------------------------------------------------------
  init() {
    const savedVoice = settings.loadSettings();
    this.voices = new VoicePanel(settings.apiKey, settings.saveSettings, savedVoice);
    const query = new URLSearchParams(location.search);
    // ?audio_context_rate=<Hz> runs the AudioContext at that rate, so the worklet resamples (for testing)
    this.contextRate = Number(query.get("audio_context_rate")) || 0;
    const urlKey = query.get("api_key");
    if (urlKey) {
      $("api-key").value = urlKey;
      const clean = new URL(location.href);
      clean.searchParams.delete("api_key");
      history.replaceState(null, "", clean.href); // keep the key out of the address bar and history
    }
    $("speak").addEventListener("click", () => this.speak());
    $("stop").addEventListener("click", () => this.cancel());
    $("download").addEventListener("click", () => this.download());
    $("mode").addEventListener("change", () => this.onModeChange());
    const text = $("text");
    text.addEventListener("input", (e) => {
      if (!e.isComposing) this.onTextInput();
    });
    text.addEventListener("compositionend", () => this.onTextInput());
    text.addEventListener("keydown", (e) => this.onTextKey(e));
    $("volume").addEventListener("input", () => this.player.setVolume(Number($("volume").value)));
    for (const id of ["temperature", "top_p", "repetition_penalty", "tps", "volume"]) {
      $(id).addEventListener("input", settings.syncOutputs);
    }
    for (const id of [...Object.keys(settings.PARAMS), "tps", "volume", "voice", "mode"]) {
      $(id).addEventListener("change", settings.saveSettings);
    }
    $("params-reset").addEventListener("click", settings.resetParams);
    const applyKey = () => {
      settings.saveKey();
      this.voices.load();
    };
    $("api-key").addEventListener("change", applyKey);
    $("api-key-remember").addEventListener("change", settings.saveKey);
    $("key-form").addEventListener("submit", (e) => {
      e.preventDefault(); // Enter in the key field: apply it
      applyKey();
    });
    window.addEventListener("resize", () => this.queueDraw());
    matchMedia("(prefers-color-scheme: dark)").addEventListener("change", () => this.queueDraw());
    this.player.setVolume(Number($("volume").value));
    settings.syncOutputs();
    this.onModeChange();
    this.updateButtons();
    this.queueDraw();
    this.pollHealth();
    this.voices.load();
  }

  get mode() {
    return $("mode").value === "type-ahead" ? "type-ahead" : "all";
  }

  // ---- utterances ----------------------------------------------------------------------------------------------
  /** Open a session for a new utterance; the player gets ready meanwhile (audio waits for it). */
  begin(replay = false) {
    view.clearError();
    const rate = Number($("sample_rate").value) || 44100;
    const u = new Utterance(++this.count, this.mode, rate, replay);
    this.utt = this.last = u;
    u.session = new LiveSession(liveUrl(settings.apiKey()), this.request(), {
      onEvent: (ev) => this.onEvent(u, ev),
      onAudio: (buf) => this.onAudio(u, buf),
      onClose: (ev) => this.onClose(u, ev),
    });
    const prebufferMs = Number($("jitter_ms").value) || 100;
    this.player
      .prepare(rate, this.contextRate)
      .then(() => {
        if (u !== this.utt) return;
        this.player.begin(prebufferMs);
        u.playerReady = true;
        for (const buf of u.pendingAudio) u.received += this.player.push(buf);
        u.pendingAudio = [];
        if (u.finished) this.player.end();
        if (!this.player.running) {
          view.showError("audio_blocked", "Click anywhere on the page to allow sound, then press Speak again.");
        }
      })
      .catch((err) => this.fail(u, "audio_blocked", `Audio output could not start: ${err.message || err}`));
    this.updateButtons();
    this.queueDraw();
    return u;
  }

  request() {
    const p = settings.params();
    return {
      text: "",
      format: "pcm",
      sample_rate: p.sample_rate,
      temperature: p.temperature,
      top_p: p.top_p,
      repetition_penalty: p.repetition_penalty,
      max_new_tokens: p.max_new_tokens,
      chunk_length: p.chunk_length,
      latency: p.latency,
      normalize: p.normalize,
      seed: p.seed === "" || Number.isNaN(p.seed) ? null : p.seed,
      reference_id: this.voices.referenceId,
      references: [],
    };
  }

  sendText(u, text) {
    if (!text) return;
    if (u.t0 === null) u.t0 = performance.now();
    u.streamText += text;
    u.session.text(text);
  }

  endText(u) {
    if (u.session.stopped) return;
    u.tTextEnd = performance.now();
    u.session.stop();
    this.updateButtons();
  }

  onEvent(u, ev) {
    if (u.reason === "cancelled") return;
    if (ev.event === "started") {
      u.started = true;
      this.showModel(ev.model, ev.untrained_model);
    } else if (ev.event === "timing") {
      u.serverTtfaMs = ev.first_audio_ms ?? null;
    } else if (ev.event === "error") {
      u.error = u.error ?? { code: ev.code || "error", message: ev.message || "" };
      view.showError(u.error.code, u.error.message);
      if (ev.code === "unauthorized") $("api-key").focus();
      if (!u.started) this.fail(u, u.error.code, u.error.message); // start was refused; the socket stays open
    } else if (ev.event === "finish") {
      u.finished = true;
      if (ev.reason === "error") this.fail(u, u.error?.code ?? "error", u.error?.message ?? "");
      else if (u.playerReady) this.player.end();
    }
  }

  onAudio(u, buf) {
    if (u.reason === "cancelled" || u !== this.utt) return;
    const now = performance.now();
    if (u.tFirstAudio === null) u.tFirstAudio = now;
    u.tLastAudio = now;
    if (u.playerReady) u.received += this.player.push(buf);
    else u.pendingAudio.push(buf);
    this.queueDraw();
  }

  onClose(u, ev) {
    if (u.reason !== null || u.session.closedByUs) return;
    if (!u.finished) {
      if (u.t0 === null && u.error === null && ev.code === 1000) {
        this.complete(u, "done", "finish"); // a session closed before any text: nothing to report
        return;
      }
      const err = u.error ?? { code: "connection_closed", message: view.closeText(ev.code) };
      this.fail(u, err.code, err.message);
    }
  }

  onPlayerStats(m) {
    const u = this.utt ?? this.last;
    if (!u || !u.playerReady) return;
    u.played = m.played;
    u.underruns = m.underruns;
    u.gapMs = m.gapMs;
    u.playStarted = u.playStarted || m.started;
    view.renderMeter(m.final ? 0 : m.rms);
    this.queueDraw();
  }

  onDrained() {
    const u = this.utt;
    if (u && u.finished && u.state === "speaking") this.complete(u, "done", "finish");
  }

  fail(u, code, message) {
    if (u.state !== "speaking") return;
    u.error = u.error ?? { code, message };
    view.showError(u.error.code, u.error.message);
    if (u.playerReady) this.player.end(); // what arrived still plays
    u.session.close();
    this.complete(u, "error", "error");
  }

  complete(u, state, reason) {
    if (u.state !== "speaking") return;
    u.state = state;
    u.reason = reason;
    this.stopReplay();
    if (this.utt === u) this.utt = null;
    view.addHistoryRow(u, HISTORY_ROWS);
    this.renderStream();
    this.updateButtons();
    this.queueDraw();
    if (reason === "finish" && this.mode === "type-ahead") this.onTextInput(); // typed while it finished
  }

  // ---- buttons -------------------------------------------------------------------------------------------------
  speak() {
    const u = this.utt;
    if (this.mode === "all") {
      if (u) return;
      const text = $("text").value;
      if (!text.trim()) return view.showError("empty_text", "Type some text first.");
      const nu = this.begin();
      this.sendText(nu, text);
      this.endText(nu);
      return;
    }
    if (u && !u.replay && !u.session.stopped) {
      this.sendPending(u, true);
      this.endText(u);
    } else if (!u) {
      this.replay();
    }
  }

  /** Stop button: cancel on the server, silence at once, close the socket. */
  cancel() {
    const u = this.utt;
    if (!u) return;
    this.stopReplay();
    u.session.cancel();
    if (u.playerReady) this.player.clear();
    this.sent = $("text").value; // what was typed but not sent is dropped with the utterance
    view.renderMeter(0);
    this.complete(u, "done", "cancelled");
  }

  download() {
    const u = this.last;
    if (!u || u.played === 0) return;
    const a = document.createElement("a");
    a.href = URL.createObjectURL(this.player.wav(u.played));
    a.download = `fishgate-utterance-${u.n}.wav`;
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 10000);
  }

  updateButtons() {
    const u = this.utt;
    const typing = u && this.mode === "type-ahead" && !u.replay && !u.session.stopped;
    $("speak").disabled = !!u && !typing;
    $("speak").lastChild.textContent = typing ? "Finish" : "Speak";
    $("stop").disabled = !u;
    $("mode").disabled = !!u;
    $("text").readOnly = !!(u && u.replay);
  }

  // ---- type-ahead ----------------------------------------------------------------------------------------------
  onModeChange() {
    const typeAhead = this.mode === "type-ahead";
    $("replay-row").hidden = !typeAhead;
    $("stream-view").hidden = !typeAhead;
    $("mode-hint").textContent = typeAhead
      ? "Words go to the server as you type; Enter speaks what is there so far, Shift+Enter adds a line, " +
        "Finish (Ctrl+Enter) ends the utterance, Esc stops. Speak with no session open replays the box as an " +
        "LLM token stream."
      : "Speak (Ctrl+Enter) sends the whole text at once; audio starts while the rest is still being " +
        "synthesized. Esc stops.";
    this.sent = $("text").value; // text already in the box is not spoken by typing; Speak replays it
    this.renderStream();
    this.updateButtons();
    this.updateCharCount();
  }

  /** Drop the part of the baseline the user edited away: sent text cannot be taken back, new text follows it. */
  syncBaseline(value) {
    if (value.startsWith(this.sent)) return;
    let p = 0;
    while (p < this.sent.length && p < value.length && value[p] === this.sent[p]) p++;
    this.sent = this.sent.slice(0, p);
  }

  onTextInput() {
    this.updateCharCount();
    if (this.mode !== "type-ahead") return;
    const u = this.utt;
    if (u && (u.replay || u.session.stopped)) return this.renderStream(); // picked up when it completes
    const value = $("text").value;
    this.syncBaseline(value);
    const pending = value.slice(this.sent.length);
    let cut = 0;
    for (let i = pending.length - 1; i >= 0; i--) {
      if (WORD_END.test(pending[i])) {
        cut = i + 1;
        break;
      }
    }
    if (pending.trim()) {
      const target = u ?? this.begin();
      if (cut > 0 && pending.slice(0, cut).trim()) {
        this.sendText(target, pending.slice(0, cut));
        this.sent += pending.slice(0, cut);
      }
      clearTimeout(this.typingIdleTimer);
      this.typingIdleTimer = setTimeout(() => {
        if (this.utt === target && !target.session.stopped) this.speak(); // sends the rest, then stop
      }, TYPING_IDLE_STOP_MS);
    }
    this.renderStream();
  }

  sendPending(u, all) {
    const value = $("text").value;
    this.syncBaseline(value);
    const pending = value.slice(this.sent.length);
    if (all && pending) {
      this.sendText(u, pending);
      this.sent += pending;
    }
    this.renderStream();
  }

  onTextKey(e) {
    if (e.key === "Escape" && this.utt) return this.cancel();
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      return this.speak();
    }
    if (this.mode !== "type-ahead" || e.key !== "Enter" || e.shiftKey || e.isComposing) return;
    e.preventDefault();
    let u = this.utt;
    if (u && (u.replay || u.session.stopped)) return;
    if (!u) {
      if (!$("text").value.slice(this.sent.length).trim()) return;
      u = this.begin();
    }
    this.sendPending(u, true);
    u.session.flush();
  }

  replay() {
    const text = $("text").value;
    if (!text.trim()) return view.showError("empty_text", "Type or paste some text to replay first.");
    const tokens = [];
    for (const [tok] of text.matchAll(TOKEN)) {
      let end = tok.length - tok.trimStart().length + TOKEN_MAX_LETTERS; // a long word comes in pieces
      for (let i = 0; i < tok.length; i = end, end += TOKEN_MAX_LETTERS) tokens.push(tok.slice(i, end));
    }
    const u = this.begin(true);
    this.sent = "";
    let i = 0;
    const tick = () => {
      if (u !== this.utt) return this.stopReplay();
      if (i < tokens.length) {
        this.sendText(u, tokens[i]);
        this.sent += tokens[i++];
        this.renderStream();
      }
      if (i >= tokens.length) {
        this.stopReplay();
        this.endText(u);
      }
    };
    this.replayTimer = setInterval(tick, 1000 / Number($("tps").value));
    tick();
    this.updateButtons();
  }

  stopReplay() {
    if (this.replayTimer !== null) clearInterval(this.replayTimer);
    this.replayTimer = null;
    $("text").readOnly = false;
  }

  renderStream() {
    const u = this.utt ?? this.last;
    const streamed = u && u.mode === "type-ahead" ? u.streamText : "";
    const value = $("text").value;
    $("stream-sent").textContent = streamed;
    $("stream-pending").textContent = this.utt ? value.slice(this.sent.length) : "";
    const box = $("stream-view");
    box.scrollTop = box.scrollHeight;
  }

  updateCharCount() {
    const n = $("text").value.length;
    $("char-count").textContent = `${n} character${n === 1 ? "" : "s"}`;
  }

  // ---- drawing -------------------------------------------------------------------------------------------------
  queueDraw() {
    if (this.drawQueued) return;
    this.drawQueued = true;
    requestAnimationFrame(() => {
      this.drawQueued = false;
      const u = this.utt ?? this.last;
      view.renderStats(u);
      const peaks = u && u.playerReady ? this.player.peaks : [];
      view.renderWave($("wave"), peaks, u ? u.played : 0, u ? u.rate : 44100);
      $("download").disabled = !this.last || this.last.played === 0;
    });
  }

  // ---- server info, voices, settings ---------------------------------------------------------------------------
  showModel(name, untrained) {
    if (name) $("model-name").textContent = name;
    if (untrained !== undefined) $("untrained-warning").hidden = !untrained;
  }

  async pollHealth() {
    const dot = $("health-dot");
    try {
      const h = await getHealth();
      this.showModel(h.model, !!h.untrained_default_model);
      if (h.sampling && !this.modelDefaultsApplied) {
        settings.applyModelDefaults(h.sampling);
        this.modelDefaultsApplied = true;
      }
      const meta = [h.device, h.dtype, h.version ? `v${h.version}` : null].filter(Boolean).join(" · ");
      $("server-meta").textContent = meta;
      dot.className = `dot ${h.status !== "ok" ? "bad" : h.engine === "ready" ? "ok" : "busy"}`;
      dot.title = `engine ${h.engine}`;
    } catch (err) {
      dot.className = "dot bad";
      dot.title = `health check failed: ${err.message || err}`;
      if ($("model-name").textContent === "connecting…") $("model-name").textContent = "unreachable";
    }
    setTimeout(() => this.pollHealth(), HEALTH_POLL_MS);
  }

  /** The automation surface: the current utterance, or the last one. */
  stats() {
    const u = this.utt ?? this.last;
    if (!u) return { state: "idle", ttfaMs: null, samplesPlayed: 0, underruns: 0, gapMs: 0 };
    return {
      state: u.state,
      ttfaMs: u.ttfaMs,
      samplesPlayed: u.played,
      underruns: u.underruns,
      gapMs: u.gapMs,
      samplesReceived: u.received,
      sampleRate: u.rate,
      outputRate: this.player.ctx ? this.player.ctx.sampleRate : null,
      rtf: u.rtf,
      serverTtfaMs: u.serverTtfaMs,
      mode: u.replay ? "replay" : u.mode,
      reason: u.reason,
      error: u.error,
    };
  }
}

const demo = new Demo();
window.fishgate = Object.freeze({ stats: () => demo.stats(), version: 1 });
demo.init();

// Rendering helpers of the page: number formats, the error banner, the stats tiles, the level meter, the
// waveform and the history table. Pure DOM/canvas output; knows nothing about sockets or audio nodes.

import { PEAK_BUCKET_SAMPLES } from "./player.js";

export const $ = (id) => document.getElementById(id);

const MIN_WAVE_WINDOW_S = 6; // the waveform grows from the left until an utterance is longer than this
const METER_FLOOR_DB = -60;

// Error codes (server `error` events and HTTP errors) → a sentence a person understands; the server's own
// message follows it.
const ERROR_TITLES = {
  unauthorized: "This server needs a valid API key — enter it under Connection.",
  forbidden_origin: "This page's address may not open sessions on the server.",
  rate_limited: "Too many requests in a short time.",
  overloaded: "The server is busy: every session slot is in use. Try again in a moment.",
  not_ready: "The server is still loading its model.",
  shutting_down: "The server is shutting down.",
  value_out_of_range: "A parameter is outside the accepted range.",
  bad_request: "The server rejected the request.",
  text_too_long: "The text is too long for one message.",
  prompt_too_long: "The voice references and text do not fit in the model's context.",
  unknown_voice: "That voice is not stored on the server.",
  bad_reference_audio: "The reference audio could not be used.",
  idle_timeout: "The session was idle for too long.",
  session_too_long: "The session reached its time limit.",
  max_audio: "The utterance reached the audio length limit.",
  internal_error: "The server hit an internal error.",
  connection_closed: "The connection closed before the audio finished.",
  audio_blocked: "The browser is not playing audio.",
  empty_text: "Nothing to say.",
};

const CLOSE_REASONS = {
  1001: "the server is going away",
  1006: "the connection dropped — is the server still running?",
  1008: "closed by the server's policy",
  1009: "a message was too big",
  1011: "the server hit an internal error",
  1012: "the server is restarting",
  1013: "the server is busy; try again later",
};

export function closeText(code) {
  return `WebSocket closed with code ${code}: ${CLOSE_REASONS[code] || "unexpected close"}.`;
}

export function showError(code, message) {
  $("error-title").textContent = ERROR_TITLES[code] || "The server reported an error.";
  $("error-detail").textContent = message ? `${message}${code ? ` (${code})` : ""}` : code ? `(${code})` : "";
  $("error").hidden = false;
}

export function clearError() {
  $("error").hidden = true;
}

export const fmtMs = (ms) => (ms === null || ms === undefined ? "—" : `${Math.round(ms)} ms`);
export const fmtRtf = (rtf) => (rtf === null || rtf === undefined || !isFinite(rtf) ? "—" : rtf.toFixed(2));
export const fmtSeconds = (s) => `${s.toFixed(s < 10 ? 2 : 1)} s`;

export function renderStats(u) {
  $("ttfa").textContent = u ? fmtMs(u.ttfaMs) : "—";
  $("rtf").textContent = u ? fmtRtf(u.rtf) : "—";
  $("underruns").textContent = u && u.playStarted ? String(u.underruns) : "—";
  $("gap").textContent = u && u.playStarted ? fmtMs(u.gapMs) : "—";
  $("played").textContent = u ? fmtSeconds(u.played / u.rate) : "—";
  const head = u ? u.headStartMs : null;
  $("headstart").textContent = head === null ? "—" : `${head >= 0 ? "" : "−"}${fmtSeconds(Math.abs(head) / 1000)}`;
  const badge = $("state");
  const label = u ? (u.reason === "cancelled" ? "stopped" : u.state) : "idle";
  badge.dataset.state = u ? u.state : "idle";
  badge.textContent = label;
}

export function renderMeter(rms) {
  const db = rms > 0 ? Math.max(METER_FLOOR_DB, 20 * Math.log10(rms)) : METER_FLOOR_DB;
  const meter = $("meter");
  const pct = ((db - METER_FLOOR_DB) / -METER_FLOOR_DB) * 100;
  $("meter-fill").style.width = `${pct.toFixed(1)}%`;
  meter.style.setProperty("--meter-width", `${meter.clientWidth}px`);
  meter.setAttribute("aria-valuenow", db.toFixed(0));
  const shown = Math.round(db) || 0; // no "-0"
  $("meter-db").textContent = db <= METER_FLOOR_DB ? "−∞ dB" : `${shown < 0 ? "−" : ""}${Math.abs(shown)} dB`;
}

/** Waveform of the current utterance: max |sample| per column; played audio in the accent colour. */
export function renderWave(canvas, peaks, playedSamples, rate) {
  const dpr = window.devicePixelRatio || 1;
  const w = Math.max(1, Math.round(canvas.clientWidth * dpr));
  const h = Math.max(1, Math.round(canvas.clientHeight * dpr));
  if (canvas.width !== w || canvas.height !== h) {
    canvas.width = w;
    canvas.height = h;
  }
  const g = canvas.getContext("2d");
  g.clearRect(0, 0, w, h);
  const style = getComputedStyle(document.documentElement);
  const mid = h / 2;
  g.fillStyle = style.getPropertyValue("--border").trim() || "#ccc";
  g.fillRect(0, Math.floor(mid), w, Math.max(1, Math.round(dpr)));
  if (peaks.length === 0) return;
  const windowBuckets = Math.max(peaks.length, Math.ceil((MIN_WAVE_WINDOW_S * rate) / PEAK_BUCKET_SAMPLES));
  const playedBuckets = playedSamples / PEAK_BUCKET_SAMPLES;
  const bar = Math.max(1, Math.round(2 * dpr));
  const stepPx = bar + Math.max(1, Math.round(dpr));
  const played = style.getPropertyValue("--played").trim() || "#0e7490";
  const unplayed = style.getPropertyValue("--unplayed").trim() || "#bbb";
  for (let x = 0; x < w; x += stepPx) {
    const from = Math.floor((x / w) * windowBuckets);
    const to = Math.min(peaks.length, Math.max(from + 1, Math.floor(((x + stepPx) / w) * windowBuckets)));
    if (from >= peaks.length) break;
    let m = 0;
    for (let i = from; i < to; i++) if (peaks[i] > m) m = peaks[i];
    const half = Math.max(dpr / 2, m * (mid - 4 * dpr));
    g.fillStyle = from < playedBuckets ? played : unplayed;
    g.fillRect(x, mid - half, bar, 2 * half);
  }
  const headX = (playedBuckets / windowBuckets) * w;
  if (playedSamples > 0 && headX < w) {
    g.fillStyle = style.getPropertyValue("--text").trim() || "#000";
    g.fillRect(Math.round(headX), 0, Math.max(1, Math.round(dpr)), h);
  }
}

export function addHistoryRow(u, limit) {
  const body = $("history");
  const empty = body.querySelector("tr.empty");
  if (empty) empty.remove();
  const row = document.createElement("tr");
  const result = u.reason === "cancelled" ? "stopped" : u.state === "error" ? "error" : "done";
  const cells = [
    String(u.n),
    u.replay ? "replay" : u.mode,
    fmtMs(u.ttfaMs),
    fmtRtf(u.rtf),
    u.playStarted ? String(u.underruns) : "—",
    u.playStarted ? fmtMs(u.gapMs) : "—",
    fmtSeconds(u.played / u.rate),
    result,
  ];
  for (const text of cells) {
    const td = document.createElement("td");
    td.textContent = text;
    row.append(td);
  }
  row.lastChild.className = u.state === "error" ? "res-error" : u.reason === "cancelled" ? "res-cancelled" : "";
  if (u.error) row.lastChild.title = `${u.error.code}: ${u.error.message}`;
  body.prepend(row);
  while (body.rows.length > limit) body.deleteRow(body.rows.length - 1);
}

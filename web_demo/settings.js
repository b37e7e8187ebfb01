// The page's settings: synthesis parameters (the Fish TTSRequest fields the WebUI exposes), mode, replay speed,
// volume and the picked voice, kept in localStorage; the API key only when "remember" is ticked.
// Knows nothing about sockets or audio.

import { $ } from "./view.js";

const STORAGE_KEY = "fishgate.demo.v1";
const KEY_STORAGE_KEY = "fishgate.demo.apiKey";
// field id → default and type; the ids are the TTSRequest field names (jitter_ms is the page's own)
export const PARAMS = {
  max_new_tokens: { def: 1024, int: true },
  chunk_length: { def: 200, int: true },
  temperature: { def: 0.7 },
  top_p: { def: 0.7 },
  repetition_penalty: { def: 1.2 },
  sample_rate: { def: 44100, int: true },
  latency: { def: "balanced", text: true },
  seed: { def: "", int: true },
  jitter_ms: { def: 100, int: true },
  normalize: { def: true, bool: true },
};

export function apiKey() {
  return $("api-key").value.trim();
}

export function params() {
  const out = {};
  for (const [id, spec] of Object.entries(PARAMS)) {
    const el = $(id);
    if (spec.bool) out[id] = el.checked;
    else if (spec.text) out[id] = el.value;
    else if (el.value === "") out[id] = "";
    else out[id] = spec.int ? Math.round(Number(el.value)) : Number(el.value);
  }
  return out;
}

export function syncOutputs() {
  for (const id of ["temperature", "top_p", "repetition_penalty"]) {
    $(id).nextElementSibling.textContent = Number($(id).value).toFixed(2);
  }
  $("tps-out").textContent = `${$("tps").value} tokens/s`;
  $("volume-out").textContent = `${Math.round(Number($("volume").value) * 100)} %`;
}

/** The served model's sampling defaults (/healthz `sampling`) become the sliders' defaults; a slider the last
 *  visit saved keeps its value, the others move to the model's. */
export function applyModelDefaults(sampling) {
  for (const id of ["temperature", "top_p", "repetition_penalty"]) {
    const v = Number(sampling?.[id]);
    if (!Number.isFinite(v)) continue;
    PARAMS[id].def = v;
    if (!restored.has(id)) $(id).value = String(v);
  }
  syncOutputs();
}

export function resetParams() {
  for (const [id, spec] of Object.entries(PARAMS)) {
    if (spec.bool) $(id).checked = spec.def;
    else $(id).value = String(spec.def);
  }
  syncOutputs();
  saveSettings();
}

export function saveSettings() {
  const s = { params: params(), mode: $("mode").value, tps: $("tps").value, volume: $("volume").value };
  s.voice = $("voice").value;
  try {
    localStorage.setItem(STORAGE_KEY, JSON.stringify(s));
  } catch {
    // storage may be disabled; settings then last for this page only
  }
}

// parameters restored from the last visit: the served model's defaults do not overwrite them
const restored = new Set();

/** Restore the last visit's settings; returns the voice picked then (or null). */
export function loadSettings() {
  let s = null;
  try {
    s = JSON.parse(localStorage.getItem(STORAGE_KEY) || "null");
    const key = localStorage.getItem(KEY_STORAGE_KEY);
    if (key) {
      $("api-key").value = key;
      $("api-key-remember").checked = true;
    }
  } catch {
    s = null;
  }
  if (!s || typeof s !== "object") return null;
  for (const [id, spec] of Object.entries(PARAMS)) {
    const v = s.params?.[id];
    if (v === undefined) continue;
    if (spec.bool) $(id).checked = !!v;
    else $(id).value = String(v);
    restored.add(id);
  }
  if (s.mode === "all" || s.mode === "type-ahead") $("mode").value = s.mode;
  if (s.tps) $("tps").value = s.tps;
  if (s.volume) $("volume").value = s.volume;
  return typeof s.voice === "string" ? s.voice : null;
}

export function saveKey() {
  try {
    if ($("api-key-remember").checked && apiKey()) localStorage.setItem(KEY_STORAGE_KEY, apiKey());
    else localStorage.removeItem(KEY_STORAGE_KEY);
  } catch {
    // storage disabled: the key lasts for this page only
  }
}

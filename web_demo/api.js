// Same-origin HTTP calls of the page: health, stored voices, voice cloning. The API key rides as a Bearer header.
// Errors become HttpError with the server's code and message when its body has them. Knows nothing about widgets.

export class HttpError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

function headers(apiKey) {
  return apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
}

async function errorOf(res) {
  let body = null;
  try {
    body = await res.json();
  } catch {
    // not JSON: keep the status text
  }
  const err = body && typeof body === "object" ? (body.error ?? body) : {};
  const code = (typeof err === "object" && err.code) || `http_${res.status}`;
  const message =
    (typeof err === "string" && err) ||
    (typeof err === "object" && (err.message || err.detail)) ||
    (body && body.detail) ||
    `${res.status} ${res.statusText || "error"}`;
  return new HttpError(res.status, String(code), String(message));
}

export async function getHealth() {
  const res = await fetch("healthz", { cache: "no-store" });
  if (!res.ok) throw await errorOf(res);
  return res.json();
}

/** Stored voices as [{id, text?, duration_s?}], without the reserved "default". Accepts a bare list or
 * an object holding one (references / voices / items / data), and ids given as plain strings. */
export function normalizeVoices(body) {
  const list = Array.isArray(body)
    ? body
    : (body && (body.references ?? body.voices ?? body.items ?? body.data)) || [];
  if (!Array.isArray(list)) return [];
  return list
    .map((v) => (typeof v === "string" ? { id: v } : { ...v, id: v && (v.id ?? v.reference_id ?? v.name) }))
    .filter((v) => typeof v.id === "string" && v.id && v.id !== "default");
}

export async function listVoices(apiKey) {
  const res = await fetch("v1/references", { headers: headers(apiKey), cache: "no-store" });
  if (!res.ok) throw await errorOf(res);
  return normalizeVoices(await res.json());
}

/** POST /v1/references (multipart: id, text, audio; replace=true overwrites). Returns the stored voice's summary. */
export async function uploadVoice(apiKey, id, text, file, replace = false) {
  const form = new FormData();
  form.append("id", id);
  form.append("text", text);
  if (replace) form.append("replace", "true");
  form.append("audio", file, file.name || "reference.wav");
  const res = await fetch("v1/references", { method: "POST", headers: headers(apiKey), body: form });
  if (!res.ok) throw await errorOf(res);
  try {
    return await res.json();
  } catch {
    return { id };
  }
}

/** DELETE /v1/references/{id}. */
export async function deleteVoice(apiKey, id) {
  const res = await fetch(`v1/references/${encodeURIComponent(id)}`, { method: "DELETE", headers: headers(apiKey) });
  if (!res.ok) throw await errorOf(res);
}

// The Voice card: stored voices (GET /v1/references; "default" is the model's own voice), cloning from an
// uploaded clip (POST, multipart id/text/audio), deleting. Degrades to the model's own voice when the list call
// fails. Knows nothing about utterances.

import { deleteVoice, HttpError, listVoices, uploadVoice } from "./api.js";
import { $ } from "./view.js";

const CLONE_ADVISED_S = [10, 30]; // clip lengths that clone well
const VOICE_ID = /^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$/; // what the server accepts as an id

export class VoicePanel {
  /** @param {() => string} apiKey @param {() => void} onChange (the picked voice changed) */
  constructor(apiKey, onChange, savedVoice) {
    this.apiKey = apiKey;
    this.onChange = onChange;
    this.savedVoice = savedVoice; // the voice picked on the last visit
    this.listed = null; // null: not listed yet; then whether the last GET /v1/references worked
    $("voices-refresh").addEventListener("click", () => this.load());
    $("voice").addEventListener("change", () => this.syncButtons());
    $("voice-delete").addEventListener("click", () => this.remove());
    $("clone-form").addEventListener("submit", (e) => {
      e.preventDefault();
      this.clone();
    });
    $("clone-audio").addEventListener("change", () => this.inspectClip());
  }

  /** The request's reference_id: null for the model's own voice. */
  get referenceId() {
    const v = $("voice").value;
    return v && v !== "default" ? v : null;
  }

  async load() {
    const select = $("voice");
    const status = $("voice-status");
    // until a listing works, the voice picked last time is the one to restore; then the current pick is kept
    const wanted = this.listed ? select.value : this.savedVoice || select.value || "default";
    status.className = "hint";
    try {
      const voices = await listVoices(this.apiKey());
      select.replaceChildren(new Option("Default (the model's own voice)", "default"));
      for (const v of voices) {
        const extra = v.duration_s ? ` · ${Number(v.duration_s).toFixed(1)} s` : "";
        select.append(new Option(`${v.id}${extra}`, v.id));
      }
      select.value = [...select.options].some((o) => o.value === wanted) ? wanted : "default";
      this.listed = true;
      status.textContent = voices.length
        ? `${voices.length} stored voice${voices.length === 1 ? "" : "s"} on this server.`
        : "No stored voices yet — clone one below.";
    } catch (err) {
      select.replaceChildren(new Option("Default (the model's own voice)", "default"));
      this.listed = false;
      this.savedVoice = wanted;
      const http = err instanceof HttpError ? err : null;
      status.className = "hint bad";
      status.textContent =
        http && http.status === 401
          ? "Enter the server's API key under Connection to see stored voices."
          : http && (http.status === 404 || http.status === 405)
            ? "This server does not list stored voices; using the model's own voice."
            : `Could not load stored voices (${err.message || err}); using the model's own voice.`;
    }
    this.syncButtons();
  }

  syncButtons() {
    $("voice-delete").disabled = !this.listed || $("voice").value === "default";
  }

  async remove() {
    const id = $("voice").value;
    if (id === "default" || !confirm(`Delete the voice “${id}” from the server?`)) return;
    const status = $("voice-status");
    try {
      await deleteVoice(this.apiKey(), id);
      $("voice").value = "default";
      await this.load();
      status.className = "hint good";
      status.textContent = `Deleted “${id}”.`;
    } catch (err) {
      status.className = "hint bad";
      status.textContent = `Could not delete “${id}”: ${err.message || err}`;
    }
    this.onChange();
  }

  async inspectClip() {
    const file = $("clone-audio").files[0];
    const info = $("clone-audio-info");
    info.className = "hint";
    info.textContent = "";
    if (!file) return;
    try {
      const decoded = await new OfflineAudioContext(1, 1, 44100).decodeAudioData(await file.arrayBuffer());
      const s = decoded.duration;
      const [lo, hi] = CLONE_ADVISED_S;
      const ok = s >= lo && s <= hi;
      info.className = ok ? "hint good" : "hint bad";
      info.textContent = `${s.toFixed(1)} s, ${(decoded.sampleRate / 1000).toFixed(1)} kHz` +
        (ok ? "" : ` — clips of ${lo}–${hi} s clone best.`);
    } catch {
      info.textContent = `${(file.size / 1024).toFixed(0)} KiB — the browser cannot decode it; the server may.`;
    }
  }

  async clone() {
    const id = $("clone-id").value.trim();
    const text = $("clone-text").value.trim();
    const file = $("clone-audio").files[0];
    const status = $("clone-status");
    status.className = "hint bad";
    if (!VOICE_ID.test(id) || id.includes("..")) {
      status.textContent = "The id is 1–64 letters, digits, '_', '-' or '.', starting with a letter or digit.";
      return $("clone-id").focus();
    }
    if (id === "default") {
      status.textContent = "'default' is the model's own voice; pick another id.";
      return $("clone-id").focus();
    }
    if (!file) {
      status.textContent = "Choose an audio clip.";
      return $("clone-audio").focus();
    }
    if (!text) {
      status.textContent = "Type what is said in the clip.";
      return $("clone-text").focus();
    }
    $("clone-upload").disabled = true;
    status.className = "hint";
    status.textContent = "Uploading and encoding…";
    try {
      const voice = await uploadVoice(this.apiKey(), id, text, file, $("clone-replace").checked);
      await this.load();
      if ([...$("voice").options].some((o) => o.value === id)) $("voice").value = id;
      this.syncButtons();
      this.onChange();
      // only now: "Saved" means the new voice is listed and selected, ready to speak with
      status.className = "hint good";
      const dur = voice && voice.duration_s ? ` (${Number(voice.duration_s).toFixed(1)} s)` : "";
      status.textContent = `Saved voice “${id}”${dur}.`;
    } catch (err) {
      const http = err instanceof HttpError ? err : null;
      status.className = "hint bad";
      status.textContent =
        http && (http.status === 404 || http.status === 405)
          ? "This server does not accept voice uploads (POST /v1/references is not available)."
          : http && http.code === "voice_exists"
            ? `A voice “${id}” is already stored: tick “Replace” to overwrite it, or pick another id.`
            : http && http.status === 401
              ? "The server needs a valid API key (see Connection)."
              : `Upload failed: ${err.message || err}`;
    } finally {
      $("clone-upload").disabled = false;
    }
  }
}

// One `/v1/tts/live` WebSocket per utterance here, JSON variant: the first frame (start) is a text frame, so
// control messages are JSON text frames and audio arrives as raw binary frames in the requested format. The server
// would keep the socket open for another `start` after `finish`; this page opens a fresh one per utterance (each
// may have its own voice and format) and closes it at `finish`.
//
// Queues messages until the socket opens; reports server events, audio and the close. Knows nothing about
// playback or the page.

const MAX_TEXT_EVENT_CHARS = 8000; // below the server's per-event limit (20,000 by default); longer text is split

/** ws:// or wss:// (matching the page) URL of the live endpoint, relative to the page (works behind a path prefix). */
export function liveUrl(apiKey) {
  const url = new URL("v1/tts/live", document.baseURI);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  if (apiKey) url.searchParams.set("api_key", apiKey);
  return url.href;
}

export class LiveSession {
  /**
   * @param {string} url
   * @param {object} request the TTSRequest sent with `start`
   * @param {{onEvent: (e: object) => void, onAudio: (b: ArrayBuffer) => void, onClose: (c: CloseEvent) => void}} handlers
   */
  constructor(url, request, handlers) {
    this.handlers = handlers;
    this.queue = [];
    this.closedByUs = false;
    this.stopped = false;
    this.ws = new WebSocket(url);
    this.ws.binaryType = "arraybuffer";
    this.ws.onopen = () => {
      for (const frame of this.queue) this.ws.send(frame);
      this.queue = [];
    };
    this.started = false;
    this.ws.onmessage = (e) => {
      let event = null;
      if (typeof e.data === "string") {
        try {
          event = JSON.parse(e.data);
        } catch {
          return;
        }
      } else if (!this.started) {
        // no audio comes before `started`: a binary frame now is an event the server sent before it knew our
        // encoding (e.g. a refused API key), in MessagePack
        event = decodeMsgpack(new Uint8Array(e.data));
      } else {
        handlers.onAudio(e.data);
        return;
      }
      if (event === null || typeof event !== "object") return;
      if (event.event === "started") this.started = true;
      handlers.onEvent(event);
      if (event.event === "finish") this.close(); // this utterance is over; the page starts the next on a new socket
    };
    this.ws.onclose = (e) => handlers.onClose(e);
    this.ws.onerror = () => {}; // the close event that follows carries what we report
    this.send({ event: "start", request });
  }

  get open() {
    return this.ws.readyState === WebSocket.CONNECTING || this.ws.readyState === WebSocket.OPEN;
  }

  send(message) {
    const frame = JSON.stringify(message);
    if (this.ws.readyState === WebSocket.OPEN) this.ws.send(frame);
    else if (this.ws.readyState === WebSocket.CONNECTING) this.queue.push(frame);
  }

  text(text) {
    for (let i = 0; i < text.length; i += MAX_TEXT_EVENT_CHARS) {
      this.send({ event: "text", text: text.slice(i, i + MAX_TEXT_EVENT_CHARS) });
    }
  }

  flush() {
    this.send({ event: "flush" });
  }

  /** No more text: the server speaks the rest and sends `finish` (then we close). */
  stop() {
    if (this.stopped) return;
    this.stopped = true;
    this.send({ event: "stop" });
  }

  /** Barge-in: the server drops queued text and audio. We then close the socket ourselves. */
  cancel() {
    this.send({ event: "cancel" });
    this.close();
  }

  close() {
    this.closedByUs = true;
    if (this.ws.readyState === WebSocket.CONNECTING) {
      // closing a connecting socket logs a console error in Chromium; close as soon as it opens instead
      this.ws.onopen = () => {
        for (const frame of this.queue) this.ws.send(frame);
        this.ws.close(1000);
      };
    } else if (this.ws.readyState === WebSocket.OPEN) {
      this.ws.close(1000);
    }
  }
}

/** A minimal MessagePack decoder (maps, arrays, strings, numbers, booleans, nil, bin); null if malformed. */
export function decodeMsgpack(bytes) {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const utf8 = new TextDecoder();
  let at = 0;
  const take = (n) => {
    if (at + n > bytes.length) throw new RangeError("truncated");
    const out = bytes.subarray(at, at + n);
    at += n;
    return out;
  };
  const u8 = () => take(1)[0];
  const u16 = () => view.getUint16((take(2), at - 2));
  const u32 = () => view.getUint32((take(4), at - 4));
  const str = (n) => utf8.decode(take(n));
  const items = (n, map) => {
    const out = map ? {} : [];
    for (let i = 0; i < n; i++) {
      if (map) out[String(value())] = value();
      else out.push(value());
    }
    return out;
  };
  function value() {
    const t = u8();
    if (t <= 0x7f) return t;
    if (t >= 0xe0) return t - 0x100;
    if ((t & 0xf0) === 0x80) return items(t & 0x0f, true);
    if ((t & 0xf0) === 0x90) return items(t & 0x0f, false);
    if ((t & 0xe0) === 0xa0) return str(t & 0x1f);
    switch (t) {
      case 0xc0: return null;
      case 0xc2: return false;
      case 0xc3: return true;
      case 0xc4: return take(u8()).slice();
      case 0xc5: return take(u16()).slice();
      case 0xc6: return take(u32()).slice();
      case 0xca: return view.getFloat32((take(4), at - 4));
      case 0xcb: return view.getFloat64((take(8), at - 8));
      case 0xcc: return u8();
      case 0xcd: return u16();
      case 0xce: return u32();
      case 0xd0: return view.getInt8((take(1), at - 1));
      case 0xd1: return view.getInt16((take(2), at - 2));
      case 0xd2: return view.getInt32((take(4), at - 4));
      case 0xd9: return str(u8());
      case 0xda: return str(u16());
      case 0xdb: return str(u32());
      case 0xdc: return items(u16(), false);
      case 0xdd: return items(u32(), false);
      case 0xde: return items(u16(), true);
      case 0xdf: return items(u32(), true);
      default: throw new TypeError(`unsupported MessagePack type 0x${t.toString(16)}`);
    }
  }
  try {
    const out = value();
    return at === bytes.length ? out : null;
  } catch {
    return null;
  }
}

"""The demo page in headless Chromium against a real fishgate server: both text modes, Stop, the API key, cloning.

Drives the page through its automation surface (#text, #mode, #speak, #stop, `window.fishgate.stats()`) plus
the key, voice and download controls, and asserts on what the AudioWorklet actually played. Uses Debian's chromium (never a downloaded browser);
skips when it or playwright is missing. Saves a screenshot to test-artifacts/web_demo.png.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from tests.server.conftest import API_KEY, ServerHandle
from tests.server.http_helpers import FRAME_SAMPLES

playwright_api = pytest.importorskip("playwright.sync_api")

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--autoplay-policy=no-user-gesture-required",
]  # fmt: skip
SCREENSHOT = Path(__file__).resolve().parents[2] / "test-artifacts" / "web_demo.png"
# the untrained default model speaks at most ~1.5 codec frames per input character; a long text stopped after a
# moment played well under one frame per character
MIN_SAMPLES_PER_CHAR = 1.0 * FRAME_SAMPLES
SPEAK_TIMEOUT_MS = 30_000
SENTENCE = "Hello from the fishgate demo page."
TYPED = "Typing ahead, word by word."
LONG = " ".join(["This paragraph keeps the speaker busy so that the stop button has something to stop."] * 3)

pytestmark = pytest.mark.skipif(not shutil.which(CHROMIUM), reason=f"needs Debian chromium at {CHROMIUM}")


@pytest.fixture(scope="module")
def browser_context(tmp_path_factory) -> Iterator:
    with playwright_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1280, "height": 900},
        )  # fmt: skip
        yield context
        context.close()


class Console:
    """Console errors and uncaught exceptions of a page."""

    def __init__(self, page) -> None:
        self.errors: list[str] = []
        page.on("console", self._on_console)
        page.on("pageerror", lambda exc: self.errors.append(f"uncaught: {exc}"))

    def _on_console(self, msg) -> None:
        if msg.type != "error":
            return
        # the page lists voices before a key is entered: on a server that wants one (401), or one without the
        # endpoint (404), Chromium logs the failed fetch; the page itself says why and uses the model's voice
        if "Failed to load resource" in msg.text and "/v1/references" in (msg.location or {}).get("url", ""):
            return
        self.errors.append(msg.text)


def stats(page) -> dict:
    return page.evaluate("window.fishgate.stats()")


def wait_for(page, expression: str, timeout_ms: float = 30_000) -> None:
    """Poll a JavaScript expression until it is truthy. Not page.wait_for_function: Playwright evaluates its string
    predicate with eval inside the page, which the page's content security policy (no 'unsafe-eval') refuses;
    page.evaluate goes through the DevTools protocol, outside the policy."""
    deadline = time.monotonic() + timeout_ms / 1000
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_ms:.0f} ms waiting for {expression}")
        time.sleep(0.05)


def open_page(context, url: str):
    page = context.new_page()
    console = Console(page)
    page.goto(url)
    page.evaluate("localStorage.clear()")  # the page keeps its settings; every test starts from the defaults
    page.reload()
    wait_for(page, "document.getElementById('model-name').textContent.startsWith('fishgate')")
    return page, console


def wait_until_finished(page) -> dict:
    wait_for(page, "window.fishgate.stats().state !== 'speaking'", SPEAK_TIMEOUT_MS)
    return stats(page)


def assert_spoken(page, server: ServerHandle, frames_before: int) -> dict:
    """The utterance finished and the page played every sample the server's vocoder made for it.

    The count comes from the engine, not from the text: the random default model may sample its end token after
    a few frames, so a per-character bound would be flaky; this one fails on any lost, truncated or unplayed audio.
    """
    s = wait_until_finished(page)
    assert s["state"] == "done" and s["reason"] == "finish", s
    made = (server.vocoded_frames() - frames_before) * FRAME_SAMPLES
    assert made > 0 and s["samplesPlayed"] == s["samplesReceived"] == made, (s, made)
    assert s["ttfaMs"] is not None and 0 < s["ttfaMs"] < 10_000, s
    assert re.fullmatch(r"\d+ ms", page.locator("#ttfa").inner_text()), page.locator("#ttfa").inner_text()
    return s


def test_send_all_mode_plays_the_whole_sentence(server: ServerHandle, browser_context) -> None:
    page, console = open_page(browser_context, server.base_url + "/")
    assert stats(page) == {"state": "idle", "ttfaMs": None, "samplesPlayed": 0, "underruns": 0, "gapMs": 0}
    info = server.gateway.engine.info
    assert info is not None
    # the warning shows exactly when the served model has random weights (today's embedded default)
    assert page.locator("#untrained-warning").is_visible() == info.untrained
    page.select_option("#mode", "all")
    page.fill("#text", SENTENCE)
    frames_before = server.vocoded_frames()
    page.click("#speak")
    assert page.evaluate("window.fishgate.stats().state") == "speaking"
    s = assert_spoken(page, server, frames_before)
    assert s["mode"] == "all" and s["gapMs"] >= 0 and s["underruns"] >= 0
    assert page.locator("#history tr").count() == 1

    with page.expect_download() as download:  # what was played, as a WAV file
        page.click("#download")
    data, rate = sf.read(download.value.path(), dtype="int16")
    assert rate == 44100 and len(data) == s["samplesPlayed"] and np.abs(data).max() > 100
    assert console.errors == []
    page.close()


def test_the_page_refuses_injected_inline_scripts(server: ServerHandle, browser_context) -> None:
    """The content security policy is enforced by the browser (every other test here runs the whole page under it
    with no console error): an inline script injected into the page does not run and raises a violation."""
    page, console = open_page(browser_context, server.base_url + "/")
    violated = page.evaluate(
        """() => new Promise((resolve) => {
            document.addEventListener("securitypolicyviolation", (e) => resolve(e.violatedDirective), {once: true});
            setTimeout(() => resolve("no violation"), 3000);
            const s = document.createElement("script");
            s.textContent = "window.__injected = 1";
            document.body.appendChild(s);
        })"""
    )
    assert violated.startswith("script-src")
    assert page.evaluate("window.__injected") is None
    assert all("Content Security Policy" in e for e in console.errors), console.errors


def test_worklet_resamples_when_the_audio_context_runs_at_another_rate(server: ServerHandle, browser_context) -> None:
    page, console = open_page(browser_context, server.base_url + "/?audio_context_rate=48000")
    page.select_option("#mode", "all")
    page.select_option("#sample_rate", "16000")
    page.fill("#text", SENTENCE)
    frames_before = server.vocoded_frames()
    page.click("#speak")
    s = wait_until_finished(page)
    assert s["state"] == "done" and s["sampleRate"] == 16000 and s["outputRate"] == 48000, s
    made_16k = (server.vocoded_frames() - frames_before) * FRAME_SAMPLES * 16000 / 44100
    assert s["samplesPlayed"] == s["samplesReceived"] > 0, s
    assert abs(s["samplesReceived"] - made_16k) <= 64, (s, made_16k)  # the streaming resampler's edge only
    assert console.errors == []
    page.close()


def test_type_ahead_mode_speaks_while_typing(server: ServerHandle, browser_context) -> None:
    page, console = open_page(browser_context, server.base_url + "/")
    page.select_option("#mode", "type-ahead")
    page.fill("#text", "")
    page.click("#text")
    frames_before = server.vocoded_frames()
    page.keyboard.type(TYPED, delay=10)
    assert stats(page)["state"] == "speaking"  # the session opened at the first keystroke
    page.click("#speak")  # "Finish": the rest of the text, then stop
    s = assert_spoken(page, server, frames_before)
    assert s["mode"] == "type-ahead"
    assert page.locator("#stream-sent").inner_text() == TYPED  # the server got exactly the typed text

    # Speak with no typing session replays the box as a token stream
    page.eval_on_selector("#tps", "el => { el.value = '40'; el.dispatchEvent(new Event('input')); }")
    frames_before = server.vocoded_frames()
    page.click("#speak")
    assert stats(page)["mode"] == "replay"
    assert_spoken(page, server, frames_before)
    assert page.locator("#history tr").count() == 2
    assert console.errors == []
    SCREENSHOT.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(SCREENSHOT), full_page=True)
    page.close()


def test_stop_cancels_playback_at_once(server: ServerHandle, browser_context) -> None:
    page, console = open_page(browser_context, server.base_url + "/")
    page.select_option("#mode", "all")
    page.fill("#seed", "1")  # seeded: the random model's audio is long, not an end token after a few frames
    page.fill("#text", LONG)
    # count the player's final reports (the one after a clear comes last): a listener on each worklet node's port
    page.evaluate(
        """() => {
            window.finalReports = 0;
            const Base = window.AudioWorkletNode;
            window.AudioWorkletNode = class extends Base {
                constructor(...args) {
                    super(...args);
                    this.port.addEventListener("message", (e) => {
                        if (e.data.type === "stats" && e.data.final) window.finalReports++;
                    });
                }
            };
        }"""
    )
    page.click("#speak")
    wait_for(page, "window.fishgate.stats().samplesPlayed > 20000", SPEAK_TIMEOUT_MS)
    page.click("#stop")
    wait_for(page, "window.finalReports > 0")  # the worklet's last report after the clear
    before = stats(page)
    assert before["state"] == "done" and before["reason"] == "cancelled", before
    assert before["samplesPlayed"] < MIN_SAMPLES_PER_CHAR * len(LONG)  # it really was cut short
    page.wait_for_timeout(600)
    after = stats(page)
    assert after["samplesPlayed"] == before["samplesPlayed"] and after["state"] != "speaking", (before, after)
    assert page.locator("#stop").is_disabled() and page.locator("#speak").is_enabled()
    assert console.errors == []
    page.close()


def test_api_key_from_the_key_field(secured_server: ServerHandle, browser_context) -> None:
    page, console = open_page(browser_context, secured_server.base_url + "/")
    page.fill("#text", SENTENCE)
    page.click("#speak")
    s = wait_until_finished(page)
    assert s["state"] == "error" and s["error"]["code"] == "unauthorized", s
    assert page.locator("#error").is_visible() and "API key" in page.locator("#error").inner_text()

    page.fill("#api-key", API_KEY)
    frames_before = secured_server.vocoded_frames()
    page.click("#speak")
    assert_spoken(page, secured_server, frames_before)
    assert page.locator("#error").is_hidden()
    assert console.errors == []
    page.close()


def test_clone_a_voice_from_a_clip_and_speak_with_it(server: ServerHandle, browser_context, tmp_path) -> None:
    if httpx.get(server.base_url + "/v1/references").status_code in (404, 405):
        pytest.skip("this server has no /v1/references endpoints yet")
    clip = tmp_path / "clip.wav"
    t = np.arange(12 * 44100) / 44100  # 12 s: inside the 10–30 s the page advises
    sf.write(clip, (0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(3 * t))).astype(np.float32), 44100)
    page, console = open_page(browser_context, server.base_url + "/")
    page.click("#clone summary")
    page.fill("#clone-id", "web-demo-voice")
    page.set_input_files("#clone-audio", str(clip))
    page.fill("#clone-text", "A steady tone standing in for a speaker.")
    page.click("#clone-upload")
    wait_for(
        page,
        "document.getElementById('clone-status').textContent.startsWith('Saved')"
        " || document.getElementById('clone-status').classList.contains('bad')",
        SPEAK_TIMEOUT_MS,
    )
    assert page.locator("#clone-status").inner_text().startswith("Saved"), page.locator("#clone-status").inner_text()
    assert page.locator("#voice").input_value() == "web-demo-voice"
    assert "web-demo-voice" in [v["id"] for v in normalize_voices(httpx.get(server.base_url + "/v1/references"))]
    page.select_option("#mode", "all")
    page.fill("#text", SENTENCE)
    sent: list[str] = []  # the page's WebSocket frames (JSON text)
    page.on("websocket", lambda ws: ws.on("framesent", lambda payload: sent.append(str(payload))))
    frames_before = server.vocoded_frames()
    page.click("#speak")
    assert_spoken(page, server, frames_before)
    starts = [json.loads(f) for f in sent if '"start"' in f]
    assert starts and starts[0]["request"]["reference_id"] == "web-demo-voice", sent[:2]  # spoken in the new voice
    assert console.errors == []
    page.close()


def normalize_voices(response: httpx.Response) -> list[dict]:
    """The page accepts a bare list or {references|voices|items|data: [...]}; so does this check."""
    body = response.json()
    if isinstance(body, dict):
        body = next((body[k] for k in ("references", "voices", "items", "data") if k in body), [])
    return [{"id": v} if isinstance(v, str) else v for v in body]


@pytest.fixture(scope="module")
def greedy_server(tmp_path_factory) -> Iterator[ServerHandle]:
    from tests.server.conftest import start_server
    from tests.server.test_model_sampling_defaults import greedy_folder

    tmp = tmp_path_factory.mktemp("greedy-demo")
    with start_server(tmp, checkpoint=greedy_folder(tmp)) as handle:
        yield handle


def test_sliders_start_at_the_served_models_sampling_defaults(greedy_server: ServerHandle, browser_context) -> None:
    """A model folder declaring `sampling` (here temperature 0) moves the page's sliders there, unless the last visit
    saved its own value."""
    page, console = open_page(browser_context, greedy_server.base_url + "/")
    wait_for(page, "document.getElementById('temperature').value === '0'")
    assert page.locator("#temperature + output").inner_text() == "0.00"
    assert page.locator("#top_p").input_value() == "0.7"  # the model declares no top-p: Fish's default
    page.evaluate("""localStorage.setItem('fishgate.demo.v1', JSON.stringify({params: {temperature: 0.9}}))""")
    page.reload()
    # the health poll names the model and applies its defaults in one step: once the name shows, they are applied
    wait_for(page, "document.getElementById('model-name').textContent.startsWith('fishgate')")
    assert page.locator("#temperature").input_value() == "0.9"
    assert not console.errors, console.errors
    page.close()

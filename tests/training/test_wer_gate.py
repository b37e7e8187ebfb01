"""The WER gate end to end: a real server on the embedded default model, held-out sentences over /v1/tts/live,
Whisper tiny.en (faster-whisper, offline) and the reversed-audio control.

While the embedded default is the random-weight model, the threshold test is a strict xfail: it fails the suite the
day a trained default passes without this marker being removed (and it can never pass on noise).
"""

from __future__ import annotations

import json
import wave
from collections.abc import Iterator
from pathlib import Path

import pytest

from model.text_normalize import words_for_scoring
from streaming.backend import METADATA_FILE, default_checkpoint
from tests.server.conftest import start_server
from training.wer import WER_PASS, WerReport, load_whisper
from training.wer_gate import HeldOut, read_heldout, run_gate, verdict

N_SENTENCES = 6
DEFAULT_IS_UNTRAINED = bool(json.loads((default_checkpoint() / METADATA_FILE).read_text()).get("untrained"))


@pytest.fixture(scope="module")
def gate(tmp_path_factory) -> Iterator[tuple[list[HeldOut], WerReport, Path]]:
    tmp = tmp_path_factory.mktemp("gate")
    items = read_heldout(limit=N_SENTENCES)
    with start_server(tmp) as srv:
        report = run_gate(srv.ws_url, items, tmp / "wav", whisper=load_whisper())
    yield items, report, tmp / "wav"


def test_heldout_set_is_the_corpus_test_split() -> None:
    items = read_heldout()
    assert len(items) == 300 and len({i.id for i in items}) == 300
    assert all(i.id.split("-")[0] in ("fortunes", "devil") for i in items)
    assert all(5 <= len(words_for_scoring(i.norm)) <= 25 for i in items)


def test_gate_speaks_every_sentence_over_the_websocket_and_scores_it(gate) -> None:
    items, report, wav_dir = gate
    assert report.clips == N_SENTENCES and len(report.control_scores) == N_SENTENCES
    assert report.ref_words == sum(len(words_for_scoring(i.norm)) for i in items)
    for item, score in zip(items, report.scores, strict=True):
        assert score.id == item.id and score.reference == item.norm
        with wave.open(str(wav_dir / f"{item.id}.wav"), "rb") as w:
            assert w.getframerate() == 44_100 and w.getnframes() > 0.3 * 44_100
    assert report.wer == report.errors / report.ref_words
    assert verdict(report.wer) in ("target", "pass", "fail")


@pytest.mark.xfail(
    DEFAULT_IS_UNTRAINED, strict=True, reason="the embedded default model is random noise until issue 6's voice ships"
)
def test_default_voice_meets_the_wer_gate(gate) -> None:
    _, report, _ = gate
    assert report.wer <= WER_PASS, [(s.reference, s.transcript) for s in report.scores]
    assert report.control_wer is not None and report.control_wer > 0.6  # reversed speech must not transcribe

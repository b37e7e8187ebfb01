"""The WER gate end to end: a real server on the embedded default model, held-out sentences over /v1/tts/live,
Whisper tiny.en (faster-whisper, offline) and the reversed-audio control.

The embedded default is the trained voice of model/default_model/README.md (21.4 % on all 300 held-out sentences,
13.3 % on the first six, which this suite speaks). Six sentences are too few to decide the voice's gate (≤ 12 % on each
held-out set, judged on the full sets in the card), so the suite asserts what it can: the voice is intelligible — a
regression bound well under babble (a model that ignores the text: ~100 %) with room for another CPU's rounding to change a few samples — and
the reversed-audio control fails. A folder marked untrained (random weights) makes the bound a strict xfail.
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
from training.wer import WerReport, load_whisper
from training.wer_gate import SETS, SHORT_PHRASES, HeldOut, read_heldout, run_gate

N_SENTENCES = 6
# what the shipped default must keep doing on these six sentences (it scores 0.13; random weights score ~1.0 and more)
INTELLIGIBLE_WER = 0.35
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
    assert report.edge_slips == sum(s.start_slip or s.end_slip for s in report.scores)


@pytest.mark.xfail(DEFAULT_IS_UNTRAINED, strict=True, reason="an untrained default model's output is noise")
def test_default_voice_is_intelligible(gate) -> None:
    _, report, _ = gate
    assert report.wer <= INTELLIGIBLE_WER, [(s.reference, s.transcript) for s in report.scores]
    assert report.control_wer is not None and report.control_wer > 0.6  # reversed speech must not transcribe


def test_short_phrase_set_is_conversational_and_apart_from_the_sentences() -> None:
    items = read_heldout(SHORT_PHRASES)
    assert len(items) == 80 and len({i.id for i in items}) == 80 and len({i.text for i in items}) == 80
    assert all(1 <= len(words_for_scoring(i.norm)) <= 5 for i in items)
    assert not {i.norm for i in items} & {i.norm for i in read_heldout()}
    assert SETS["short"][0] == SHORT_PHRASES

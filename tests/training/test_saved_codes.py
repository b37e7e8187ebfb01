"""The teacher's codes kept in git (training/data/codes/): what a later GPU hold starts from instead of speaking the
items again (`device_pipeline start-teacher --base-codes`). Each part must load as a pack of training items only,
coded for the shipped codec, and say none of the gate's held-out text."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from model.codec_config import CodecConfig
from model.config import DualARConfig
from model.text_normalize import words_for_scoring
from training.corpus import load_phrase_keys
from training.dual_ar_data import CodesPack
from training.wer_gate import read_heldout

ROOT = Path(__file__).resolve().parents[2]
PARTS = sorted((ROOT / "training" / "data" / "codes").glob("*.npz"))


def test_the_kept_codes_are_there() -> None:
    assert PARTS, "training/data/codes/ holds the teacher's codes of earlier holds"


@pytest.mark.parametrize("path", PARTS, ids=[p.name for p in PARTS])
def test_a_kept_part_is_training_items_coded_for_the_shipped_codec(path: Path) -> None:
    shipped = ROOT / "model" / "default_model"
    config = DualARConfig.from_json(shipped / "config.json")
    codec = CodecConfig.from_dict(json.loads((shipped / "codec_config.json").read_text()))
    pack = CodesPack.load(path)
    assert len(pack.ids) == len(set(pack.ids)) == len(pack.texts) == len(pack.codes) > 0
    assert set(pack.splits) == {"train"}
    assert pack.sample_rate_hz == codec.sample_rate and pack.samples_per_frame == codec.samples_per_frame
    for codes, text in zip(pack.codes, pack.texts, strict=True):
        assert codes.dtype == np.int16 and codes.shape[0] == config.num_codebooks
        assert codes.min() >= 0 and codes.max() < config.codebook_size
        # 21.5 frames a second: 2-40 frames a word (the pack: 3.8-28, median 6.4), no empty or runaway utterance
        assert 2 <= codes.shape[1] / len(words_for_scoring(text)) <= 40, text
    heldout = read_heldout()
    assert not set(pack.ids) & {item.id for item in heldout}
    said = {" ".join(words_for_scoring(t)) for t in pack.texts}
    assert not said & {" ".join(words_for_scoring(item.norm)) for item in heldout}
    assert not said & load_phrase_keys()


def test_kept_parts_do_not_overlap() -> None:
    ids = [i for path in PARTS for i in CodesPack.load(path).ids]
    assert len(ids) == len(set(ids))

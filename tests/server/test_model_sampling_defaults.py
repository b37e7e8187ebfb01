"""A model folder's own sampling defaults (fishgate.json `sampling`) reach every endpoint; a request's values win.

The served folder is the embedded default with `"sampling": {"temperature": 0}` (greedy): requests that name no
temperature must then give the same audio whatever their seed, while a request naming a temperature samples again.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from streaming.backend import default_checkpoint
from tests.server.conftest import ServerHandle, start_server
from tests.server.test_seeded_equality import fish_pcm, live_pcm, openai_pcm

TEXT = "Greedy decoding ignores the seed."


def greedy_folder(tmp: Path) -> Path:
    folder = tmp / "greedy-model"
    shutil.copytree(default_checkpoint(), folder)
    meta = json.loads((folder / "fishgate.json").read_text())
    (folder / "fishgate.json").write_text(json.dumps({**meta, "sampling": {"temperature": 0}}))
    return folder


@pytest.fixture(scope="module")
def greedy_server(tmp_path_factory) -> Iterator[ServerHandle]:
    tmp = tmp_path_factory.mktemp("greedy")
    with start_server(tmp, checkpoint=greedy_folder(tmp)) as handle:
        yield handle


def test_the_model_default_applies_when_the_request_names_no_temperature(greedy_server: ServerHandle) -> None:
    info = greedy_server.gateway.engine.info
    assert info is not None and info.sampling.temperature == 0.0 and info.sampling.top_p == 0.7
    for pcm in (live_pcm, fish_pcm, openai_pcm):
        one, two = pcm(greedy_server, TEXT, 1), pcm(greedy_server, TEXT, 2)
        assert len(one) > 0 and one == two, pcm.__name__


def test_a_temperature_in_the_request_wins(greedy_server: ServerHandle) -> None:
    one, two = (live_pcm(greedy_server, TEXT, seed, temperature=0.9) for seed in (1, 2))
    assert len(one) > 0 and one != two


def test_a_folder_trained_without_history_reads_each_segment_alone_unless_the_request_asks() -> None:
    """`"condition_on_previous_chunks": false` in fishgate.json's `sampling` (a DualAR trained on single utterances,
    as the embedded default voice): the Fish, live and OpenAI parsers default to it; a request's own value wins."""
    from server.openai_http import parse_speech_request
    from server.params import parse_tts_request
    from streaming.sampling_defaults import SamplingDefaults

    alone = SamplingDefaults(temperature=0.4, condition_on_previous_chunks=False)
    assert parse_tts_request({"text": "Hi."}, max_text_chars=99).settings.condition_on_previous_chunks is True
    assert (
        parse_tts_request({"text": "Hi."}, max_text_chars=99, sampling=alone).settings.condition_on_previous_chunks
        is False
    )
    asked = parse_tts_request({"text": "Hi.", "condition_on_previous_chunks": True}, max_text_chars=99, sampling=alone)
    assert asked.settings.condition_on_previous_chunks is True
    openai = parse_speech_request({"input": "Hi.", "voice": "default"}, max_text_chars=99, sampling=alone)
    assert openai.params.settings.condition_on_previous_chunks is False and openai.params.settings.temperature == 0.4

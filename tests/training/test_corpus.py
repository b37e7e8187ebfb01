"""Tests for training/corpus.py: sentence splitting, the speakability filter, dedupe, the held-out split, the caps
and the short items.

Synthetic sources run everywhere; the Debian sources (fortunes, dict-devil, wamerican) are read when installed and
skipped otherwise. No Piper, no Whisper.
"""

from __future__ import annotations

import gzip
import hashlib
import re
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from training import corpus
from training.corpus import (
    CorpusConfig,
    CorpusItem,
    Source,
    build_corpus,
    heldout_mismatch,
    load_phrase_keys,
    read_corpus,
    speakable,
    split_sentences,
    write_corpus,
)

_WORDS = [
    "the",
    "a",
    "an",
    "cat",
    "dog",
    "sat",
    "on",
    "mat",
    "ran",
    "far",
    "away",
    "and",
    "then",
    "slept",
    "quietly",
    "under",
    "warm",
    "sun",
    "every",
    "morning",
    "bird",
    "sang",
    "song",
    "it",
    "was",
    "good",
    "day",
    "for",
    "walk",
    "in",
    "park",
    "with",
    "old",
    "friend",
    "we",
    "talked",
    "about",
    "life",
    "work",
    "books",
    "music",
    "rain",
    "fell",
    "softly",
    "she",
    "he",
    "they",
    "said",
    "that",
    "this",
    "is",
    "not",
    "what",
    "i",
    "want",
    "to",
    "know",
    "why",
    "how",
    "when",
    "where",
    "children",
    "played",
    "games",
    "all",
    "afternoon",
    "long",
    "river",
    "flowed",
    "past",
    "town",
    "mister",
    "smith",
    "doctor",
    "jones",
    "paid",
    "five",
    "dollars",
    "fifty",
    "cents",
    "at",
    "three",
    "thirty",
]
DICTIONARY = frozenset(_WORDS)


def _sentences(n: int, seed: int) -> list[str]:
    """n distinct dictionary-only sentences of 6..14 words, deterministic."""
    out = []
    for i in range(n):
        digest = hashlib.sha256(f"{seed}-{i}".encode()).digest()
        length = 6 + digest[0] % 9
        words = [_WORDS[b % len(_WORDS)] for b in digest[1 : 1 + length]]
        out.append(" ".join(words).capitalize() + ".")
    return out


def _source(name: str, passages: list[str], **kw: object) -> Source:
    def reader() -> Iterator[str]:
        yield from passages

    return Source(name, "test", "test-licence", reader, **kw)  # type: ignore[arg-type]


def test_split_sentences_keeps_abbreviations_and_initials() -> None:
    text = 'Mr. Smith met Dr. Jones at 5 p.m. today. J. R. R. Tolkien wrote it! Did he? "Yes," she said. Done'
    assert split_sentences(text) == [
        "Mr. Smith met Dr. Jones at 5 p.m. today.",
        "J. R. R. Tolkien wrote it!",
        "Did he?",
        '"Yes," she said.',
        "Done",
    ]


def test_speakable_filter() -> None:
    config = CorpusConfig()
    good = speakable("Mister Smith paid $5.50 at 3:30.", DICTIONARY, config)
    assert good is not None
    norm, n_words, share = good
    assert norm == "Mister Smith paid five dollars and fifty cents at three thirty."
    assert n_words == 11
    assert share == 1.0
    rejected = [
        "The cat sat.  x = foo_bar(1)",  # code
        "See http://example.com for the dog.",  # address
        "The cat sat on the mat",  # no sentence end
        "the cat sat on the mat.",  # no capital start
        "THE CAT SAT ON THE MAT.",  # shouting
        "The cat.",  # too short (2 words)
        "Zorblax quuxed the flimflam of glorp.",  # unknown words
        "Alice: the cat sat on the mat.",  # speaker label
        "Cat, n. A dog that sat on the mat.",  # dictionary-entry marker
        " ".join(["The cat sat on the mat."] * 6),  # too long (36 words)
    ]
    for sentence in rejected:
        assert speakable(sentence, DICTIONARY, config) is None, sentence


def test_blocked_words_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = frozenset({hashlib.sha256(b"sun").hexdigest()[:16]})
    monkeypatch.setattr(corpus, "BLOCKED_WORD_HASHES", blocked)
    assert speakable("The dog slept under the warm sun.", DICTIONARY, CorpusConfig()) is None
    assert speakable("The dog slept under the warm rain.", DICTIONARY, CorpusConfig()) is not None


def test_build_corpus_split_is_deterministic_disjoint_and_clean() -> None:
    passages = [" ".join(s) for s in zip(*[iter(_sentences(600, seed=1))] * 2, strict=True)]
    passages += [f"The dog ran {n} miles and then slept under the warm sun." for n in range(2, 60)]
    passages += passages[:50]  # exact duplicates must collapse
    config = CorpusConfig(n_test=40)
    sources = [_source("alpha", passages), _source("beta", [" ".join(_sentences(200, seed=2))], test_eligible=False)]
    items, stats = build_corpus(sources, config=config, dictionary=DICTIONARY)
    again, _ = build_corpus(sources, config=config, dictionary=DICTIONARY)
    assert [(i.id, i.split, i.norm) for i in items] == [(i.id, i.split, i.norm) for i in again]

    test = [i for i in items if i.split == "test"]
    train = [i for i in items if i.split == "train"]
    assert len(test) == 40 == stats.n_test
    assert items[:40] == test  # held-out items come first
    assert all(i.source == "alpha" and config.test_min_words <= i.n_words <= config.test_max_words for i in test)
    assert not any(re.search(r"\d", i.text) for i in test)  # digits: Whisper's formatting, not the voice
    assert any(re.search(r"\d", i.text) for i in train)
    assert len({i.id for i in items}) == len(items)
    keys = [" ".join(re.findall(r"[a-z']+", i.norm.lower())) for i in items]
    assert len(set(keys)) == len(keys)
    test_keys = keys[:40]
    for key in keys[40:]:
        assert not any(t in key or key in t for t in test_keys)
    for item in items:
        assert config.min_words <= item.n_words <= config.max_words
        assert re.fullmatch(r"[A-Za-z .,?!;:'-]+", item.norm)
    assert {i.source for i in train} == {"alpha", "beta"}
    assert stats.n_train == len(train)


def test_a_training_passage_holding_a_held_out_sentence_is_dropped() -> None:
    """The hold-out stays unseen: text from another source that quotes a held-out sentence never reaches training
    (the disjointness check above holds on input where nothing overlaps; this input does)."""
    passages = [" ".join(s) for s in zip(*[iter(_sentences(600, seed=1))] * 2, strict=True)]
    config = CorpusConfig(n_test=40)
    alpha = _source("alpha", passages)
    first, first_stats = build_corpus([alpha], config=config, dictionary=DICTIONARY)
    held = [i for i in first if i.split == "test"]
    quoting = [f"Then she said: {h.text} And the long story went on for a while." for h in held[:3]]
    items, stats = build_corpus(
        [alpha, _source("beta", quoting, test_eligible=False)], config=config, dictionary=DICTIONARY
    )
    assert [i.id for i in items if i.split == "test"] == [h.id for h in held]  # the same hold-out
    assert stats.dropped_overlap > first_stats.dropped_overlap
    held_keys = [" ".join(re.findall(r"[a-z']+", h.norm.lower())) for h in held]
    for item in items:
        if item.split == "train":
            key = " ".join(re.findall(r"[a-z']+", item.norm.lower()))
            assert not any(h in key for h in held_keys), item.text


def test_source_cap_keeps_a_stable_subset() -> None:
    capped = [_source("gamma", _sentences(300, seed=3))]
    config = CorpusConfig(n_test=0, max_items={"gamma": 50})
    items, stats = build_corpus(capped, config=config, dictionary=DICTIONARY)
    assert len(items) == 50 == stats.sources["gamma"].items
    again, _ = build_corpus(capped, config=config, dictionary=DICTIONARY)
    assert [i.id for i in items] == [i.id for i in again]


def _short_passages() -> list[str]:
    """Prose with short sentences between long ones, dialogue, a speaker label, a cross-reference, a list number."""
    long = _sentences(400, seed=5)
    short = [" ".join(s.split()[:n]).rstrip(".") + "." for n, s in zip([1, 2, 3, 4, 5] * 80, long, strict=True)]
    passages = [f"{a} {b} {c}" for a, b, c in zip(long[::2], short, long[1::2], strict=False)]
    passages += ['"Yes," she said to the old dog in the park.', "Doctor: Why not?\nJones: Because.",
                 "See the dog.", "(3) The cat sat.", "The cat sat on the mat."]  # fmt: skip
    return passages


def test_short_items_are_single_sentences_capped_and_training_only() -> None:
    dictionary = DICTIONARY | {"yes", "because"}
    sources = [_source("alpha", _short_passages())]
    config = CorpusConfig(n_test=20, max_items={}, short_max_items=60)
    items, stats = build_corpus(sources, config=config, dictionary=dictionary, held_out_phrases=frozenset())
    short = [i for i in items if "-short-" in i.id]
    assert len(short) == 60 == stats.n_short < stats.short_candidates
    assert all(i.split == "train" and 1 <= i.n_words <= config.short_max_words for i in short)
    assert {i.n_words for i in short} == {1, 2, 3, 4, 5}
    keys = [corpus._key(i.norm) for i in items]
    assert len(set(keys)) == len(keys)  # a short sentence that already is an item isn't added twice

    uncapped, all_stats = build_corpus(sources, config=replace(config, short_max_items=10_000),
                                       dictionary=dictionary, held_out_phrases=frozenset())  # fmt: skip
    texts = {i.text for i in uncapped if "-short-" in i.id}
    assert {"Yes.", "Why not?", "Because."} <= texts  # dialogue: quoted speech and labelled lines
    assert not {"See the dog.", "(3) The cat sat.", "The cat sat."} & texts  # cross-reference, list number, known
    assert set(short) <= set(uncapped) and len(texts) == all_stats.short_candidates
    assert [i for i in uncapped if i.split == "test"] == [i for i in items if i.split == "test"]

    none, _ = build_corpus(sources, config=replace(config, short_max_items=0), dictionary=dictionary,
                           held_out_phrases=frozenset())  # fmt: skip
    assert none == [i for i in items if "-short-" not in i.id]  # short items only add, and move no split


def test_held_out_short_phrases_never_reach_training() -> None:
    phrases = frozenset({"why not", "the cat sat on the mat", "she said"})
    items, stats = build_corpus([_source("alpha", _short_passages())], config=CorpusConfig(n_test=20),
                                dictionary=DICTIONARY, held_out_phrases=phrases)  # fmt: skip
    said = {" ".join(re.findall(r"[a-z']+", i.norm.lower())) for i in items}
    assert not phrases & said
    assert stats.dropped_phrases == 2  # 'Why not?' (short) and 'The cat sat on the mat.' (a packed item)
    assert len(load_phrase_keys()) == 80  # the gate's set (training/data/short_phrases.jsonl)
    assert "thank you" in load_phrase_keys()


def test_raising_a_cap_adds_items_and_keeps_ids() -> None:
    sources = [_source("alpha", [" ".join(_sentences(3, seed=n)) for n in range(100)]),
               _source("beta", _short_passages(), test_eligible=False)]  # fmt: skip
    small = CorpusConfig(n_test=30, max_items={"beta": 80}, short_max_items=40)
    large = replace(small, max_items={"beta": 160}, short_max_items=80)
    before, before_stats = build_corpus(sources, config=small, dictionary=DICTIONARY)
    after, after_stats = build_corpus(sources, config=large, dictionary=DICTIONARY)
    assert before_stats.sources["beta"].items == 80 and after_stats.sources["beta"].items == 160
    assert before_stats.n_short == 40 and after_stats.n_short == 80
    assert set(before) < set(after)  # every earlier item, same id, text and split; new ones in addition
    assert [i for i in before if i.split == "test"] == [i for i in after if i.split == "test"]


def test_heldout_mismatch_names_the_difference(tmp_path: Path) -> None:
    items = [CorpusItem("a-1", "a", "One two three.", "One two three.", 3, "test"),
             CorpusItem("a-2", "a", "Four five six.", "Four five six.", 3)]  # fmt: skip
    path = tmp_path / "heldout.jsonl"
    path.write_text('{"id": "a-1", "source": "a", "text": "One two three.", "norm": "One two three."}\n')
    assert heldout_mismatch(items, path) is None
    path.write_text('{"id": "a-2", "source": "a", "text": "Four five six.", "norm": "Four five six."}\n')
    assert heldout_mismatch(items, path) == f"1 test items, 1 in {path}, 1 of those missing or changed"


def test_write_and_read_round_trip(tmp_path: Path) -> None:
    items, _ = build_corpus([_source("alpha", _sentences(30, seed=4))], config=CorpusConfig(n_test=5),
                            dictionary=DICTIONARY)  # fmt: skip
    path = tmp_path / "corpus.jsonl"
    write_corpus(items, path)
    assert read_corpus(path) == items


def _require(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"{path} not installed (apt-get install the package named in training/README.md)")


def test_real_fortunes_give_clean_items(tmp_path: Path) -> None:
    _require(corpus.FORTUNE_DIR / "literature")
    _require(corpus.DICTIONARY_PATH)
    for name in ("literature", "science"):
        if (corpus.FORTUNE_DIR / name).is_file():
            shutil.copy(corpus.FORTUNE_DIR / name, tmp_path / name)
    source = Source("fortunes", "fortunes", "BSD", lambda: corpus.read_fortunes(tmp_path))
    items, stats = build_corpus([source], config=CorpusConfig(n_test=20))
    assert stats.sources["fortunes"].passages > 100
    assert len(items) > 200
    assert sum(i.split == "test" for i in items) == 20
    assert sum("-short-" in i.id for i in items) > 20  # dialogue and one-liners
    for item in items:
        assert (1 if "-short-" in item.id else 3) <= item.n_words <= 30
        assert re.fullmatch(r"[A-Za-z .,?!;:'-]+", item.norm), item.norm
        assert not re.search(r"--\s*[A-Z][\w.]*(\s+[A-Z][\w.]*)*\s*$", item.text), item.text  # attributions cut


def test_fortune_definitions_lose_their_part_of_speech(tmp_path: Path) -> None:
    (tmp_path / "defs").write_text("Creditor, n.: A man who has a better memory than a debtor.\n%\n")
    assert list(corpus.read_fortunes(tmp_path)) == ["Creditor, A man who has a better memory than a debtor.", ""]


def test_fortune_attributions_are_cut_everywhere(tmp_path: Path) -> None:
    """The synthetic twin of test_real_fortunes_give_clean_items, which needs the Debian package."""
    (tmp_path / "quotes").write_text(
        "Wit is educated insolence.\n\t\t-- Aristotle\n%\n"
        "A classic is something that everybody wants to have read.\n    - Mark Twain\n%\n"
        "No attribution here.\n"
    )
    (tmp_path / "quotes.dat").write_text("index files are skipped")
    assert [p.strip() for p in corpus.read_fortunes(tmp_path)] == [
        "Wit is educated insolence.", "A classic is something that everybody wants to have read.",
        "No attribution here.",
    ]  # fmt: skip


def test_devil_headwords_and_verse_are_cut(tmp_path: Path) -> None:
    """The synthetic twin of test_real_devil_passages_lose_their_headwords, which needs the Debian package."""
    path = tmp_path / "devil.dict.dz"
    with gzip.open(path, "wt") as f:
        f.write(
            "preamble to skip\n\nABASEMENT, n.  A decent and customary mental attitude\nin the presence of wealth.\n\n"
            "ABNORMAL, adj.  Not conforming to standard.\n    An indented verse line.\nAnd _emphasis_ kept.\n"
        )
    assert [p for p in corpus.read_devil(path) if p.strip()] == [
        "A decent and customary mental attitude in the presence of wealth.",
        "Not conforming to standard. And emphasis kept.",
    ]


def test_real_devil_passages_lose_their_headwords() -> None:
    _require(corpus.DEVIL_PATH)
    passages = [p for p in corpus.read_devil() if p.strip()][:20]
    assert passages
    assert not any(re.match(r"^[A-Z]{3,},", p) for p in passages)

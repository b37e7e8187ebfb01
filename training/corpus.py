"""Sentence corpus for the teacher voice: read English text shipped in Debian and Python packages, split it into
speakable sentences, pack them into items of 3-30 words, add single short sentences of 1-5 words (training only),
dedupe, and split off a fixed held-out test set that training never sees.

Owns the sources (paths, licences, caps), sentence splitting, the speakability filter and the split. It doesn't
know how text is spoken (model/text_normalize.py) nor about audio (teacher.py). Run ``python -m training.corpus``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from model.text_normalize import normalize_text, words_for_scoring

# Bump to change every id and the held-out draw on purpose; anything else keeps the split stable.
SPLIT_SALT = "fishgate-corpus-v1"
# Held-out size: enough for a WER estimate with about +-1.5 points of sampling noise at 10% WER.
N_TEST = 300
FORTUNE_DIR = Path("/usr/share/games/fortunes")
# Fortune files left out: pictures, translation exercises, and jokes about groups of people.
FORTUNE_SKIP = frozenset({"ascii-art", "translate-me", "ethnic", "men-women"})
DEVIL_PATH = Path("/usr/share/dictd/devil.dict.dz")
JARGON_PATH = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
DICTIONARY_PATH = Path("/usr/share/dict/american-english")
# The voice gate's two held-out sets (training/wer_gate.py reads them from here): never trained on.
HELDOUT_PATH = Path(__file__).with_name("data") / "heldout.jsonl"
SHORT_PHRASES_PATH = Path(__file__).with_name("data") / "short_phrases.jsonl"
# Items kept per source, a hash-chosen subset so that raising a cap only adds items: archaic or technical text
# shouldn't dominate the voice. Corpus v1 (e638f06d...) had jargon 2,000 and kjv 3,000; issue 41 raised both.
MAX_ITEMS: Mapping[str, int] = {"jargon": 6000, "kjv": 6000, "pyref": 1000}
# Words the normaliser itself writes that the word list lacks.
NORMALISER_WORDS = frozenset({"cetera", "miz", "missus", "messieurs"})
# Slurs and strong profanity, stored as sha256(word)[:16] so the list itself stays unreadable; a unit holding any
# of these words is dropped (a default voice should not be trained to say them).
_BLOCKED_HASHES_TEXT = (
    "120f6e5b4ea32f65 5b3ae48be122f7ed 08a841e996781e9e 341d56384afc0f47 8f5083e3e5c7dc89 1e02eec4f1095143 "
    "9915ba2d822280f2 17bde8b4064612e2 c3de533e9b7fe63b 268651b3ece98010 98b52c4b6b7d1f48 044eb98b18769b88 "
    "f9d0d9b18ae9033a 45cd3e1bb472d8e2 cc02032349c833ac 82159dd02870c13e eef3bd091670c344 0ce875d620076b53 "
    "158869a97379229b c1cabb6f6e431f9c 16ea09fc78ca83ca 402f7ebd98864afe 886d51e97ad7931d 92a9bf818e7e0002 "
    "6ac3c336e4094835 522788b65f01ccc0 b690cdbe59f14b3b bb61ef40814ce34c 63333e4b5d1cde54 31506a8448a761a4 "
    "2f5f6ce5ae30b54a acd9193a33ddc5c6 566f532d486c9477 517ae3f73216da64 85fc17f7069acd39 45fb7c3b72b6856c "
    "986c99004163a6c5 30a989afc82c0a21 9ae315a94e428a7e 937d56e49744d206 c2c3b68b48832afd 11cf8376a1575fdc"
)
BLOCKED_WORD_HASHES = frozenset(_BLOCKED_HASHES_TEXT.split())
# Characters that mark a line as code, markup or a table rather than prose.
_UNSPEAKABLE_RAW = re.compile(
    r"[<>{}\[\]|\\^~_*=]|https?:|www\.|\.com\b|\t|::|\.\w+\(|\b\w+_\w+\b|\$[A-Za-z]|(?<![\w.])\.[A-Za-z]|"
    r"\b[A-Z]+(?:-[A-Z]+){2,}\b"
)
_SPEAKER_LABEL = re.compile(r"^\s*[A-Z][\w .']{0,20}:\s")
# Short items only. Dialogue is the most conversational text the sources hold, so a speaker label ('Wife: ...') is
# cut and quoted speech ('"Yes," she said.') is also taken alone; dictionary cross-references and list numbers aren't.
_QUOTED = re.compile(r'"([A-Z][^"]{0,60}?)([.!?,])"')
_NOT_SHORT = re.compile(r"^(?:See|Compare|Cf\.)\s|^\(?\d+[.)]")
# Dictionary-entry markers ('Viking, n. Daring...'): Piper would spell the letter out.
_PART_OF_SPEECH = re.compile(r",\s*(?:n|adj|adv|v|vt|vi|pp|pl|pro|prep|conj|interj)\.?:?(?=\s)")
# Held-out text must not hinge on how Whisper formats digits or acronyms, which the voice can't influence.
_NOT_FOR_TEST = re.compile(r"\d|\b[A-Z]{2,}\b")
_ATTRIBUTION = re.compile(r"^\s*--\s*\S|^\s+-\s*[A-Z]")
_SENTENCE_END = re.compile(r"""([.!?]+["')]*)\s+(?=["'(]?[A-Z0-9])""")
_NO_BREAK_BEFORE = re.compile(
    r"\b(?:Mr|Mrs|Ms|Dr|St|Jr|Sr|Prof|Gen|Capt|Lt|Col|Sgt|Rev|Hon|Gov|Sen|Rep|Mt|Ft|vs|etc|No|Inc|Co|Corp|"
    r"e\.g|i\.e|[A-Z])\.$"
)


@dataclass(frozen=True, slots=True)
class Source:
    """One body of text: where it lies, which package ships it, and its licence (recorded in the corpus stats)."""

    name: str
    package: str
    licence: str
    reader: Callable[[], Iterator[str]]
    test_eligible: bool = True  # False for text whose words Whisper can't be expected to know
    dpkg_package: str | None = None  # whose version is recorded (None: the running Python's)


@dataclass(frozen=True, slots=True)
class CorpusConfig:
    min_words: int = 3
    max_words: int = 30
    n_test: int = N_TEST
    test_min_words: int = 6
    test_max_words: int = 25
    min_known_fraction: float = 0.9  # share of words found in the word list (test items need all of them)
    salt: str = SPLIT_SALT
    max_items: Mapping[str, int] = field(default_factory=lambda: dict(MAX_ITEMS))  # by source name; absent: no cap
    # Single sentences of 1..short_max_words words (never packed, never held out) so the teacher also speaks short
    # utterances (issue 41); short_max_items=0 leaves them out, as corpus v1 did.
    short_max_words: int = 5
    short_max_items: int = 4000


@dataclass(frozen=True, slots=True)
class CorpusItem:
    id: str
    source: str
    text: str
    norm: str
    n_words: int
    split: str = "train"


@dataclass(slots=True)
class SourceStats:
    package: str
    licence: str
    passages: int
    items: int  # packed items after the cap (held-out ones included, overlap drops not yet taken)
    short_items: int = 0
    version: str = ""


@dataclass(slots=True)
class CorpusStats:
    sources: dict[str, SourceStats] = field(default_factory=dict)
    n_train: int = 0
    n_test: int = 0
    n_train_words: int = 0
    n_short: int = 0  # short training items (1..short_max_words words), part of n_train
    short_candidates: int = 0  # distinct new short sentences before short_max_items
    dropped_overlap: int = 0  # packed training items that hold a held-out item or lie inside one
    dropped_phrases: int = 0  # items (packed or short) whose words equal a held-out short phrase


def _read_text(path: Path) -> str:
    if path.suffix in (".gz", ".dz"):  # dictzip files are gzip-compatible
        with gzip.open(path) as f:
            raw = f.read()
    else:
        raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    return re.sub(r".\x08", "", text)  # nroff overstriking (underline/bold) in the fortune files


def read_fortunes(directory: Path = FORTUNE_DIR) -> Iterator[str]:
    """Each fortune cookie as one passage, attribution lines ('-- Mark Twain') removed."""
    for path in sorted(directory.iterdir()):
        if path.suffix or path.is_symlink() or path.name in FORTUNE_SKIP or not path.is_file():
            continue
        for cookie in re.split(r"^%\s*$", _read_text(path), flags=re.MULTILINE):
            lines: list[str] = []
            for line in cookie.splitlines():
                if _ATTRIBUTION.match(line):
                    break
                lines.append(line)
            yield _PART_OF_SPEECH.sub(",", "\n".join(lines))  # 'Creditor, n.: A man who...' -> 'Creditor, A man who...'


def read_devil(path: Path = DEVIL_PATH) -> Iterator[str]:
    """The Devil's Dictionary: prose paragraphs of each definition, headwords and indented verse removed."""
    text = _read_text(path)
    start = text.find("ABASEMENT")
    for paragraph in re.split(r"\n\s*\n", text[max(start, 0) :]):
        lines = [line for line in paragraph.splitlines() if not line.startswith("    ")]
        body = " ".join(lines)
        body = re.sub(r"^[A-Z][A-Z' -]+,\s*(?:[a-z]{1,6}\.\s*)+", "", body)  # 'ABNORMAL, adj.  '
        yield body.replace("_", "")


def read_jargon(path: Path = JARGON_PATH) -> Iterator[str]:
    """The Jargon File: prose paragraphs of the entries; {cross-references} keep their words."""
    for paragraph in re.split(r"\n\s*\n", _read_text(path)):
        lines = [line.strip() for line in paragraph.splitlines()]
        if not lines or lines[0].startswith(":") or any(line.startswith(("+", "|")) for line in lines):
            continue
        body = " ".join(lines)
        body = re.sub(r"\{([^}]*)\}", r"\1", body)
        body = re.sub(r"^\[[^\]]*\]\s*", "", body)
        yield re.sub(r"^\d+\.\s+", "", body)


def read_kjv(command: str = "bible") -> Iterator[str]:
    """King James Bible verses through Debian's ``bible`` program (bible-kjv), run as an external tool."""
    exe = shutil.which(command)
    if exe is None:
        return
    out = subprocess.run([exe, "-l100000", "gen1:1-rev22:21"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        match = re.match(r"^\s*\d+\s+(.*)$", line)
        if match:
            yield match.group(1)


def read_python_reference() -> Iterator[str]:
    """Prose paragraphs of the Python language reference that ships with the interpreter (pydoc_data)."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        for paragraph in re.split(r"\n\s*\n", topics[name]):
            if paragraph.startswith((" ", "*", "=", "-")) or "\n   " in paragraph:
                continue
            yield paragraph.replace("\n", " ")


def _dpkg_version(package: str) -> str:
    exe = shutil.which("dpkg-query")
    if exe is None:
        return "unknown"
    result = subprocess.run([exe, "-W", "-f=${Version}", package], capture_output=True, text=True, check=False)
    return result.stdout.strip() or "not installed"


SOURCES: tuple[Source, ...] = (
    Source("fortunes", "fortunes, fortunes-min", "BSD-3-Clause (fortune-mod); quotations of mixed provenance",
           read_fortunes, dpkg_package="fortunes-min"),
    Source("devil", "dict-devil", "public domain (Ambrose Bierce, The Devil's Dictionary, 1911)", read_devil,
           dpkg_package="dict-devil"),
    Source("jargon", "jargon-text", "public domain (The Jargon File 4.4.7)", read_jargon, test_eligible=False,
           dpkg_package="jargon-text"),
    Source("kjv", "bible-kjv-text (read with bible-kjv)", "public domain (King James Version, 1611)", read_kjv,
           test_eligible=False, dpkg_package="bible-kjv-text"),
    Source("pyref", "python3 stdlib pydoc_data", "PSF-2.0 (Python language reference)", read_python_reference,
           test_eligible=False),
)  # fmt: skip


def split_sentences(passage: str) -> list[str]:
    """Split a passage at sentence ends, not after titles, common abbreviations or initials."""
    text = re.sub(r"\s+", " ", passage).strip()
    sentences: list[str] = []
    start = 0
    for match in _SENTENCE_END.finditer(text):
        if _NO_BREAK_BEFORE.search(text[start : match.start(1) + 1]) and match.group(1) == ".":
            continue
        sentences.append(text[start : match.end(1)].strip())
        start = match.end()
    if start < len(text):
        sentences.append(text[start:].strip())
    return [s for s in sentences if s]


def load_dictionary(path: Path = DICTIONARY_PATH) -> frozenset[str]:
    """Lower-cased word list used to reject garbled or jargon-heavy sentences."""
    words = {w.strip().lower() for w in path.read_text(encoding="utf-8", errors="replace").splitlines()}
    return frozenset(words | NORMALISER_WORDS)


def known_fraction(words: list[str], dictionary: frozenset[str]) -> float:
    """Share of ``words`` (as produced by words_for_scoring) found in ``dictionary``."""
    if not words:
        return 0.0
    known = sum(1 for w in words if w in dictionary or w.removesuffix("'s") in dictionary)
    return known / len(words)


def _raw_ok(sentence: str) -> bool:
    """Cheap checks on the written form: prose punctuation, a capital start, no code, no shouting."""
    letters = [c for c in sentence if c.isalpha()]
    return bool(
        letters
        and not _UNSPEAKABLE_RAW.search(sentence)
        and not _SPEAKER_LABEL.match(sentence)
        and not _PART_OF_SPEECH.search(sentence)
        and re.search(r"""[.!?]["')]*$""", sentence)
        and re.match(r"""^["'(]?[A-Z0-9$]""", sentence)
        and sum(c.isupper() for c in letters) <= 0.5 * len(letters)
    )


def speakable(sentence: str, dictionary: frozenset[str], config: CorpusConfig) -> tuple[str, int, float] | None:
    """Return (normalised text, word count, known-word share) if ``sentence`` is good teacher text, else None."""
    if not _raw_ok(sentence):
        return None
    norm = normalize_text(sentence)
    words = words_for_scoring(norm)
    if not config.min_words <= len(words) <= config.max_words:
        return None
    if any(hashlib.sha256(w.encode()).hexdigest()[:16] in BLOCKED_WORD_HASHES for w in words):
        return None
    share = known_fraction(words, dictionary)
    return (norm, len(words), share) if share >= config.min_known_fraction else None


def _digest(text: str, salt: str) -> str:
    return hashlib.sha256((salt + "\0" + text).encode()).hexdigest()


def _key(norm: str) -> str:
    """Dedupe key: letters and single spaces only, lower case."""
    return " ".join(re.sub(r"[^a-z' ]", " ", norm.lower().replace("-", " ")).split())


def passage_units(
    passage: str, dictionary: frozenset[str], config: CorpusConfig
) -> Iterator[tuple[str, str, int, float]]:
    """Speakable units of one passage: runs of consecutive good sentences packed up to a length drawn from the
    passage's hash (10..max_words words), so the corpus mixes single sentences with short multi-sentence items."""
    target = 10 + int(_digest(passage, config.salt)[:8], 16) % (config.max_words - 9)
    run: list[tuple[str, str, int, float]] = []
    for sentence in split_sentences(passage):
        good = speakable(sentence, dictionary, config)
        if good is None:
            yield from _pack(run, target, config)
            run = []
        else:
            run.append((sentence, *good))
    yield from _pack(run, target, config)


def short_sentences(passage: str, dictionary: frozenset[str], config: CorpusConfig) -> Iterator[tuple[str, str, int]]:
    """Sentences (and quoted speech) of 1..short_max_words words that pass the speakability rules, unpacked, as
    (text, norm, n_words)."""
    short = replace(config, min_words=1, max_words=config.short_max_words)
    for sentence in split_sentences(re.sub(_SPEAKER_LABEL.pattern, "", passage, flags=re.MULTILINE)):
        quoted = [m[1] + m[2].replace(",", ".") for m in _QUOTED.finditer(sentence)]
        for text in (sentence, *quoted):
            # the length check spares normalising long sentences (the slow part)
            if len(text.split()) <= 2 * config.short_max_words and not _NOT_SHORT.match(text):
                good = speakable(text, dictionary, short)
                if good is not None:
                    yield text, good[0], good[1]


def load_phrase_keys(path: Path = SHORT_PHRASES_PATH) -> frozenset[str]:
    """The gate's short phrases as scoring words ('thank you'): no training item may say exactly one of them."""
    with path.open(encoding="utf-8") as f:
        return frozenset(" ".join(words_for_scoring(json.loads(line)["norm"])) for line in f if line.strip())


def _pack(
    run: list[tuple[str, str, int, float]], target: int, config: CorpusConfig
) -> Iterator[tuple[str, str, int, float]]:
    text, norm, n_words, known = "", "", 0, 0.0
    for sentence, s_norm, s_words, s_known in run:
        if n_words and (n_words + s_words > min(target, config.max_words)):
            yield text, norm, n_words, known / n_words
            text, norm, n_words, known = "", "", 0, 0.0
        text = f"{text} {sentence}".strip()
        norm = f"{norm} {s_norm}".strip()
        n_words += s_words
        known += s_known * s_words
    if n_words >= config.min_words:
        yield text, norm, n_words, known / n_words


def _chosen(ids: list[str], cap: int | None, salt: str) -> set[str]:
    """The ``cap`` ids with the smallest salted hash (all of them without a cap): a larger cap keeps a superset."""
    return set(ids if cap is None else sorted(ids, key=lambda i: _digest(i, salt))[:cap])


def build_corpus(
    sources: Iterable[Source] = SOURCES,
    *,
    config: CorpusConfig | None = None,
    dictionary: frozenset[str] | None = None,
    held_out_phrases: frozenset[str] | None = None,
) -> tuple[list[CorpusItem], CorpusStats]:
    """Read every available source, filter, dedupe and split; deterministic for the same installed sources.

    Packed items are drawn first and alone decide the held-out split, so the short items and the caps never move
    it. ``held_out_phrases``: scoring words of the gate's short phrases (default: training/data's file)."""
    config = config or CorpusConfig()
    dictionary = dictionary if dictionary is not None else load_dictionary()
    held_out_phrases = held_out_phrases if held_out_phrases is not None else load_phrase_keys()
    stats = CorpusStats()
    seen: set[str] = set()
    candidates: list[tuple[CorpusItem, bool]] = []
    short_candidates: list[CorpusItem] = []
    for source in sources:
        n_passages, kept = 0, []
        for passage in source.reader():
            n_passages += 1
            if config.short_max_items:
                for text, norm, n_words in short_sentences(passage, dictionary, config):
                    item_id = f"{source.name}-short-{_digest(_key(norm), config.salt)[:12]}"
                    short_candidates.append(CorpusItem(item_id, source.name, text, norm, n_words))
            for text, norm, n_words, known in passage_units(passage, dictionary, config):
                key = _key(norm)
                if key in seen:
                    continue
                seen.add(key)
                item = CorpusItem(f"{source.name}-{_digest(key, config.salt)[:12]}", source.name, text, norm, n_words)
                eligible = (source.test_eligible and known == 1.0 and not _NOT_FOR_TEST.search(text)
                            and config.test_min_words <= n_words <= config.test_max_words)  # fmt: skip
                kept.append((item, eligible))
        chosen = _chosen([item.id for item, _ in kept], config.max_items.get(source.name), config.salt)
        kept = [k for k in kept if k[0].id in chosen]
        stats.sources[source.name] = SourceStats(source.package, source.licence, n_passages, len(kept))
        candidates.extend(kept)
    test_ids = {
        item.id
        for item, _ in sorted((c for c in candidates if c[1]), key=lambda c: _digest(c[0].id, config.salt))[
            : config.n_test
        ]
    }
    test_keys = [_key(item.norm) for item, _ in candidates if item.id in test_ids]
    items: list[CorpusItem] = []
    for item, _ in candidates:
        if item.id in test_ids:
            items.append(CorpusItem(item.id, item.source, item.text, item.norm, item.n_words, "test"))
            continue
        key = _key(item.norm)
        if any(t in key or key in t for t in test_keys):  # a held-out sentence inside a training item, or vice versa
            stats.dropped_overlap += 1
        elif " ".join(words_for_scoring(item.norm)) in held_out_phrases:
            stats.dropped_phrases += 1
        else:
            items.append(item)
    # Short items: new text only (not already an item of any source, capped or not, so the caps don't move them),
    # not a held-out phrase, not inside a held-out item (whole words: 'no' is no leak of 'nothing').
    shorts: list[CorpusItem] = []
    for item in short_candidates:
        key = _key(item.norm)
        if key in seen:
            continue
        seen.add(key)
        if " ".join(words_for_scoring(item.norm)) in held_out_phrases:
            stats.dropped_phrases += 1
        elif not any(f" {key} " in f" {t} " for t in test_keys):
            shorts.append(item)
    stats.short_candidates = len(shorts)
    chosen = _chosen([item.id for item in shorts], config.short_max_items, config.salt)
    shorts = [item for item in shorts if item.id in chosen]
    for item in shorts:
        stats.sources[item.source].short_items += 1
    items.extend(shorts)
    # held-out items first (they are synthesised first), then training items in a hash order so that any prefix of
    # the corpus is a representative mix of all sources
    items.sort(key=lambda i: (i.split != "test", _digest(i.id, config.salt)))
    stats.n_test = sum(1 for i in items if i.split == "test")
    stats.n_train = len(items) - stats.n_test
    stats.n_train_words = sum(i.n_words for i in items if i.split == "train")
    stats.n_short = len(shorts)
    return items, stats


def heldout_mismatch(items: Iterable[CorpusItem], path: Path = HELDOUT_PATH) -> str | None:
    """None when the corpus's test items are exactly the gate's held-out file (ids, text, norm), else why not."""
    with path.open(encoding="utf-8") as f:
        expected = [(r["id"], r["text"], r["norm"]) for r in map(json.loads, f)]
    got = [(i.id, i.text, i.norm) for i in items if i.split == "test"]
    if got == expected:
        return None
    missing = len(set(expected) - set(got))
    return f"{len(got)} test items, {len(expected)} in {path}, {missing} of those missing or changed"


def write_corpus(items: Iterable[CorpusItem], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(asdict(item), ensure_ascii=True) + "\n")
    tmp.replace(path)


def read_corpus(path: Path) -> list[CorpusItem]:
    with path.open(encoding="utf-8") as f:
        return [CorpusItem(**json.loads(line)) for line in f if line.strip()]


def available_sources(sources: Iterable[Source] = SOURCES) -> list[Source]:
    """Sources whose files (or program) are present on this machine."""
    present = {
        "fortunes": FORTUNE_DIR.is_dir(),
        "devil": DEVIL_PATH.is_file(),
        "jargon": JARGON_PATH.is_file(),
        "kjv": shutil.which("bible") is not None,
        "pyref": True,
    }
    return [s for s in sources if present.get(s.name, True)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("build/training/corpus.jsonl"))
    parser.add_argument("--n-test", type=int, default=N_TEST)
    args = parser.parse_args(argv)
    sources = available_sources()
    missing = sorted({s.name for s in SOURCES} - {s.name for s in sources})
    if missing:
        print(f"warning: sources missing (apt-get install the packages in training/README.md): {missing}",
              file=sys.stderr)  # fmt: skip
    items, stats = build_corpus(sources, config=CorpusConfig(n_test=args.n_test))
    mismatch = heldout_mismatch(items) if args.n_test == N_TEST else None
    if mismatch:
        print(
            f"error: the held-out split moved ({mismatch}); build with the package versions training/README.md "
            "lists, or change SPLIT_SALT and regenerate training/data/heldout.jsonl on purpose",
            file=sys.stderr,
        )
        return 1
    write_corpus(items, args.out)
    for source in sources:
        version = _dpkg_version(source.dpkg_package) if source.dpkg_package else sys.version.split()[0]
        stats.sources[source.name].version = version
    summary = asdict(stats)
    args.out.with_suffix(".stats.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Segmenter tests: exact segment lists for hand-written streams, then seeded random streams checking the invariants
(segments re-join to the input; spoken text within limits; cuts never inside words/numbers; the same segments for any
way of splitting the text into tokens)."""

from __future__ import annotations

import itertools
import random
import re

import pytest

from streaming.chunking import Latency
from streaming.errors import TextTooLong
from streaming.segmenter import (
    MAX_BUFFER_CHARS,
    Reason,
    Segmenter,
    SegmenterConfig,
    SegmenterOverflow,
    TextSegment,
)
from streaming.text_units import (
    CLOSER_CHARS,
    END_CHARS,
    HAN_HANGUL_WEIGHT,
    is_grapheme_break,
    is_speakable,
    spoken_length,
)

S, C, M, FL, IDLE, FIN = Reason.SENTENCE, Reason.CLAUSE, Reason.MAX_LENGTH, Reason.FLUSH, Reason.IDLE, Reason.FINISH
CFG = SegmenterConfig(max_chars=60, min_chars=20, clause_min_chars=30, first_min_chars=8, idle_timeout_s=0.5)


def run(tokens: list[str], config: SegmenterConfig = CFG) -> list[tuple[object, str, Reason]]:
    """(index of the feed that produced it | "fin", text, reason) for every segment."""
    seg = Segmenter(config)
    out: list[tuple[object, str, Reason]] = []
    for i, token in enumerate(tokens):
        out += [(i, s.text, s.reason) for s in seg.feed(token, 0.0)]
    out += [("fin", s.text, s.reason) for s in seg.finish()]
    return out


def test_sentence_end_waits_for_the_next_visible_char():
    tokens = ["Hello", " there", ".", " How", " are", " you", "?", " I", " am", " fine", "."]
    assert run(tokens) == [(3, "Hello there. ", S), ("fin", "How are you? I am fine.", FIN)]
    assert run(['He said "Go."', " Then", " he left."]) == [(1, 'He said "Go." ', S), ("fin", "Then he left.", FIN)]


def test_clause_cut_for_first_segment_only_once_long_enough():
    assert run(["Well, I think that we should go, because it is late and the sun is down."]) == [
        (0, "Well, I think that we should go, ", C),
        ("fin", "because it is late and the sun is down.", FIN),
    ]


def test_numbers_abbreviations_urls_are_not_sentence_ends():
    config = SegmenterConfig(max_chars=200, min_chars=200, clause_min_chars=200, first_min_chars=200)
    text = (
        "Mr. Smith paid $3.14 for 1,000,000 items, e.g. apples from the U.S. today. "
        "Dr. J. Doe wrote to a.b@mail.example.com at 10:30... He read https://x.org/a.b?c=1. Wow."
    )
    assert run(list(text), config) == [
        (75, "Mr. Smith paid $3.14 for 1,000,000 items, e.g. apples from the U.S. today. ", S),
        ("fin", "Dr. J. Doe wrote to a.b@mail.example.com at 10:30... He read https://x.org/a.b?c=1. Wow.", FIN),
    ]
    later = SegmenterConfig(max_chars=200, min_chars=1, clause_min_chars=200, first_min_chars=200)
    assert [t for _, t, _ in run([text], later)][1:] == [
        "Dr. J. Doe wrote to a.b@mail.example.com at 10:30... ",
        "He read https://x.org/a.b?c=1. ",
        "Wow.",
    ]
    assert run(["So did I. Then:\n1. first\n2. second"], later) == [
        (0, "So did I. ", S),  # "I" is not taken for an initial
        ("fin", "Then:\n1. first\n2. second", FIN),  # a list number at a line start is not a sentence end
    ]


def test_tokens_split_mid_word_and_with_leading_spaces():
    seg = Segmenter(CFG)
    assert seg.feed("Hel", 0.0) == [] and seg.feed("lo wor", 0.0) == [] and seg.feed("ld.", 0.0) == []
    assert seg.feed(" Nex", 0.0) == [TextSegment("Hello world. ", "Hello world.", S)]
    assert seg.feed("t one.", 0.0) == []
    assert seg.finish() == [TextSegment("Next one.", "Next one.", FIN)]


def test_cjk_full_width_punctuation():
    config = SegmenterConfig(max_chars=60, min_chars=5, clause_min_chars=20, first_min_chars=4)
    assert run(list("你好。今天天气很好，我们去公园吧！好的。"), config) == [
        (3, "你好。", S),  # cut once "今" shows that no closing quote follows
        (17, "今天天气很好，我们去公园吧！", S),  # the clause "今天天气很好，" (6 × 3 + 1 = 19) is under 20
        ("fin", "好的。", FIN),
    ]
    assert run(["他说：「走吧。」然后走了。English too."], config) == [
        (0, "他说：", C),  # 2 × 3 + 1 = 7 spoken letters: a first clause of first_min_chars (4)
        (0, "「走吧。」", S),  # the closing quote stays with its sentence
        (0, "然后走了。", S),  # full-width punctuation needs no space after it
        ("fin", "English too.", FIN),
    ]


def test_flush_mid_sentence_and_first_segment_after_flush():
    seg = Segmenter(CFG)
    assert seg.feed("The quick brown fox", 0.0) == []
    assert seg.flush() == [TextSegment("The quick brown fox", "The quick brown fox", FL)]
    assert seg.flush() == []
    assert seg.feed(" jumps. Over", 0.0) == [TextSegment(" jumps. ", "jumps.", S)]  # first after flush: any sentence
    assert seg.feed("  \n", 0.0) == []
    assert seg.flush() == [TextSegment("Over  \n", "Over", FL)]
    assert seg.feed(" \n", 0.0) == [] and seg.flush() == []  # whitespace only: kept, joins the next segment
    assert seg.feed("Ok.", 0.0) == []
    assert seg.finish() == [TextSegment(" \nOk.", "Ok.", FIN)]


def test_idle_timer_fires_after_a_pause_with_a_unit_buffered():
    seg = Segmenter(CFG)
    assert seg.feed("Sure, let me check", 10.0) == []  # "Sure," (5) is under first_min_chars (8)
    assert seg.deadline_s() == 10.5
    assert seg.poll(10.49) == []
    assert seg.poll(10.5) == [TextSegment("Sure, ", "Sure,", IDLE)]
    assert seg.deadline_s() is None and seg.poll(99.0) == []  # "let me check" has no unit end
    assert seg.feed(" the weather.", 11.0) == []  # "." at the buffer end: a unit end only for the idle cut
    assert seg.deadline_s() == 11.5
    assert seg.feed(" It", 11.3) == [TextSegment("let me check the weather. ", "let me check the weather.", S)]
    assert seg.deadline_s() is None


def test_idle_timer_does_not_fire_without_a_unit_or_while_text_keeps_coming():
    seg = Segmenter(CFG)
    seg.feed("Hello", 0.0)
    assert seg.deadline_s() is None and seg.poll(100.0) == []
    seg.feed(", we", 0.2)
    assert seg.deadline_s() == pytest.approx(0.7)
    seg.feed(" are", 0.6)  # activity re-arms the timer
    assert seg.poll(0.7) == [] and seg.deadline_s() == pytest.approx(1.1)
    assert seg.poll(1.1) == [TextSegment("Hello, ", "Hello,", IDLE)]
    off = Segmenter(SegmenterConfig(idle_timeout_s=None))
    off.feed("Hi,", 0.0)
    assert off.deadline_s() is None and off.poll(1e9) == []
    off.finish()
    assert off.deadline_s() is None and off.poll(1e9) == []


def test_max_length_splits_at_a_space_then_cjk_then_graphemes():
    small = SegmenterConfig(max_chars=20, min_chars=5, clause_min_chars=20, first_min_chars=20)
    assert run(["aaa bbb ccc ddd eee fff ggg hhh"], small) == [
        (0, "aaa bbb ccc ddd eee ", M),
        ("fin", "fff ggg hhh", FIN),
    ]
    # a clause end holding half of max_chars beats the last space, a shorter one does not; "1,000" stays whole
    assert [t for _, t, _ in run(["alpha beta, gamma de epsilon"], small)] == ["alpha beta, ", "gamma de epsilon"]
    assert [t for _, t, _ in run(["one, two three four five six"], small)] == ["one, two three four ", "five six"]
    assert [t for _, t, _ in run(["one two three 1,000,000,000 seven eight"], small)] == [
        "one two three ",
        "1,000,000,000 seven ",
        "eight",
    ]
    ten = SegmenterConfig(max_chars=10, min_chars=5, clause_min_chars=8, first_min_chars=4)
    thirty = SegmenterConfig(max_chars=30, min_chars=5, clause_min_chars=8, first_min_chars=4)
    assert run(["一二三四五六七八九十一二三四五六七八九十一二三"], thirty) == [  # a Han character counts 3
        (0, "一二三四五六七八九十", M),
        (0, "一二三四五六七八九十", M),
        ("fin", "一二三", FIN),
    ]
    assert [t for _, t, _ in run(["中文abcdefghijkl"], ten)] == ["中文", "abcdefghij", "kl"]  # not inside "abc…"
    family = "👨\u200d👩\u200d👧"  # 5 code points, one grapheme
    assert [t for _, t, _ in run(["abcdefgh" + family + "xyz"], ten)] == ["abcdefgh", family + "xyz"]
    assert [t for _, t, _ in run(["abcdefghie\u0301xyz"], ten)] == ["abcdefghi", "e\u0301xyz"]  # e + combining
    assert [t for _, t, _ in run(["abcdefghi🇫🇷🇩🇪"], ten)] == ["abcdefghi", "🇫🇷🇩🇪"]  # a flag is two code points
    assert [t for _, t, _ in run(["https://example.com/a/very/long/path"], ten)] == [
        "https://ex",
        "ample.com/",
        "a/very/lon",
        "g/path",
    ]


def test_first_segment_latency_and_latency_modes():
    text = "Yes, I can help you with that request today. Let me look it up."
    low, normal = SegmenterConfig.from_fish(latency="low"), SegmenterConfig.from_fish(latency=Latency.NORMAL)
    assert run([text], low)[0][1:] == ("Yes, I can help you with that request today. ", S)  # "Yes," (4) < 8
    assert run(["Okay, " + text], low)[0][1:] == ("Okay, Yes, ", C)
    assert run(["Hi! " + text], normal)[0][1:] == ("Hi! ", S)  # the first sentence end always cuts
    assert run(["Okay, " + text], normal)[0][1:] == ("Okay, Yes, I can help you with that request today. ", S)
    assert SegmenterConfig() == SegmenterConfig.from_fish()  # defaults are Fish's (200, 50, "balanced")
    assert low.idle_timeout_s < SegmenterConfig().idle_timeout_s < normal.idle_timeout_s  # type: ignore[operator]
    assert (low.clause_min_chars, SegmenterConfig().clause_min_chars, normal.clause_min_chars) == (50, 100, 150)
    assert SegmenterConfig.from_fish(300, 0, "low").min_chars == 0
    for field, bad in [("chunk_length", 99), ("min_chunk_length", 101), ("latency", "fast")]:
        with pytest.raises(ValueError, match=field):
            SegmenterConfig.from_fish(**{field: bad})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lower it or raise max_chars"):
        SegmenterConfig(max_chars=100, min_chars=150)


def test_paragraphs_lines_and_unspeakable_pieces_merge_forward():
    config = SegmenterConfig(max_chars=100, min_chars=1, clause_min_chars=1, first_min_chars=1)
    assert [(t, r) for _, t, r in run(["Title\n\nBody text\n- one\n- two\n"], config)] == [
        ("Title\n\n", S),
        ("Body text\n", C),
        ("- one\n", C),
        ("- two\n", FIN),
    ]
    segs = Segmenter(config)
    out = segs.feed("Hello. ... 🎉 Next one! 🎉\n", 0.0) + segs.finish()
    assert out == [
        TextSegment("Hello. ", "Hello.", S),
        TextSegment("... 🎉 Next one! ", "... 🎉 Next one!", S),  # "... " and "🎉 " alone are not spoken segments
        TextSegment("🎉\n", "", FIN),  # an unspeakable tail is still accounted for, with nothing to synthesize
    ]


def test_buffer_limit_and_misuse():
    seg = Segmenter(SegmenterConfig(max_chars=100))
    seg.feed("x" * 50, 0.0)
    with pytest.raises(SegmenterOverflow, match=f"limit of {MAX_BUFFER_CHARS} characters") as info:
        seg.feed("y" * MAX_BUFFER_CHARS, 0.0)
    assert info.value.code == "text_too_long" and isinstance(info.value, TextTooLong)
    assert seg.finish() == [TextSegment("x" * 50, "x" * 50, FIN)]  # the refused text was not buffered
    with pytest.raises(RuntimeError, match="new Segmenter"):
        seg.feed("more", 0.0)
    assert seg.finish() == [] and seg.flush() == []
    big = Segmenter(SegmenterConfig(max_chars=300))
    out = big.feed("word " * 1999, 0.0) + big.finish()  # 9995 chars in one feed: cut at max length as it goes
    assert "".join(s.text for s in out) == "word " * 1999 and max(len(s.spoken_text) for s in out) <= 300


# -- random streams -----------------------------------------------------------------------------------------------

PIECES = [
    "Hello", "world", "the", "quick", "brown", "fox", "Mr.", "Dr.", "e.g.", "U.S.", "3.14", "1,000,000", "10:30",
    "https://ex.com/a.b", "a.b@c.org", "...", "…", ".", ",", "!", "?", ";", ":", "?!", '"', "”", ")", "(", "'",
    "你好", "今天天气很好", "。", "，", "、", "！", "？", "「", "」", "こんにちは", "안녕하세요", "Привет",
    "🎉", "👍🏽", "👨\u200d👩\u200d👧", "🇫🇷🇩🇪", "e\u0301", " ", "  ", "\n", "\n\n", "\t", " \n ", "\u3000",
    "1.", "I.", "J.", "etc.", "a,b", "x" * 40, "字" * 30,
]  # fmt: skip


def random_text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(0, 80)):
        parts.append(rng.choice(PIECES))
        if rng.random() < 0.6:
            parts.append(" ")
    return "".join(parts)


def random_tokens(rng: random.Random, text: str) -> list[str]:
    if len(text) < 2:
        return [text] if text else []
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, len(text)))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def random_config(rng: random.Random) -> SegmenterConfig:
    max_chars = rng.choice([5, 12, 30, 100, 200])
    pick = lambda: rng.randint(0, max_chars)  # noqa: E731
    return SegmenterConfig(max_chars, pick(), pick(), pick(), rng.choice([0.3, None]))


def check_segments(text: str, segments: list[TextSegment], config: SegmenterConfig) -> None:
    assert "".join(s.text for s in segments) == text
    position = 0
    for k, s in enumerate(segments):
        position += len(s.text)
        assert s.text, "empty segment"
        if s.spoken_text:
            assert s.spoken_text == s.text.strip() and is_speakable(s.text)
            assert len(s.spoken_text) <= config.max_chars
        else:  # nothing speakable: only the finish tail, or a max-length split of punctuation/emoji
            assert not is_speakable(s.text)
            assert (s.reason is FIN and k == len(segments) - 1) or s.reason is M
        if position < len(text) and s.reason is not FL:  # flush takes all text received, even half an emoji
            assert is_grapheme_break(text, position), "cut inside a grapheme"
        after_unit = text[position - 1].isspace() or text[position - 1] in END_CHARS + CLOSER_CHARS
        if s.reason in (S, C) and position < len(text):  # a unit end followed by whitespace, or CJK punctuation
            assert after_unit and not text[position].isspace()
        if s.reason is M and not after_unit:  # inside a word only when no space follows speakable text
            last_space = max((k for k, ch in enumerate(s.spoken_text) if ch.isspace()), default=0)
            assert not is_speakable(s.spoken_text[:last_space])


def test_random_streams_rejoin_and_do_not_depend_on_token_boundaries():
    rng = random.Random(1234)
    for _ in range(2500):
        text, config = random_text(rng), random_config(rng)
        whole = Segmenter(config)
        reference = whole.feed(text, 0.0) + whole.finish()
        check_segments(text, reference, config)
        streamed = Segmenter(config)
        segments = [s for token in random_tokens(rng, text) for s in streamed.feed(token, 0.0)] + streamed.finish()
        assert segments == reference, (text, config)


def test_random_streams_with_flush_and_idle_polls_rejoin():
    rng = random.Random(99)
    for _ in range(1500):
        text, config = random_text(rng), random_config(rng)
        seg, now_s, segments = Segmenter(config), 0.0, []
        for token in random_tokens(rng, text):
            now_s += rng.choice([0.01, 0.05, 0.4])
            segments += seg.feed(token, now_s)
            roll = rng.random()
            if roll < 0.05:
                segments += seg.flush()
            elif roll < 0.3:
                deadline_s = seg.deadline_s()
                segments += seg.poll(now_s + rng.choice([0.1, 0.35]))
                assert deadline_s is None or seg.deadline_s() is None or seg.deadline_s() == deadline_s
        segments += seg.finish()
        check_segments(text, segments, config)


def llm_tokens(text: str) -> list[str]:
    """Text as an LLM streams it: CJK one or two characters a token, Latin words with their leading space."""
    tokens: list[str] = []
    for piece in re.findall(r" ?[A-Za-z]+|[^\x00-\x7f]{1,2}|.", text):
        tokens.append(piece)
    assert "".join(tokens) == text
    return tokens


def first_segment(text: str, config: SegmenterConfig) -> tuple[int, str, Reason]:
    """(characters fed before the token that let the first segment out, its text, why)."""
    seg, fed = Segmenter(config), 0
    for token in llm_tokens(text):
        out = seg.feed(token, 0.0)
        if out:
            return fed, out[0].text, out[0].reason
        fed += len(token)
    raise AssertionError("no segment before the end of the stream")


EN = "Today we will talk about how artificial intelligence has grown, above all in language models, over ten years."
ZH = "今天我们来聊一聊人工智能的发展，尤其是语言模型在过去十年里取得的巨大进步，以及它对日常生活的影响。"
JA = "本日は人工知能の最新の研究について、わかりやすくご説明いたしますので、最後までお付き合いください。"
KO = "오늘은 인공지능의 발전에 대해 이야기하겠습니다, 특히 언어 모델의 발전이 놀랍습니다."


@pytest.mark.parametrize("latency", ["low", "balanced", "normal"])
def test_cjk_streams_start_speaking_at_the_first_clause_as_english_does(latency):
    """A Han character or Hangul syllable counts 3 spoken letters, a kana 2: Chinese, Japanese and Korean reach the
    first clause's minimum as soon as English of the same spoken length does (counted in characters, the 16-character
    Chinese clause was under `balanced`'s 20 and waited for the second clause)."""
    config = SegmenterConfig.from_fish(latency=latency)
    for text, clause in [
        (EN, "Today we will talk about how artificial intelligence has grown, "),
        (ZH, "今天我们来聊一聊人工智能的发展，"),
        (JA, "本日は人工知能の最新の研究について、"),
        (KO, "오늘은 인공지능의 발전에 대해 이야기하겠습니다, "),
    ]:
        fed, segment, reason = first_segment(text, config)
        assert (segment, reason) == (clause, C), (latency, text)
        assert fed <= len(clause)  # out with the token that brings the next visible character
        assert spoken_length(clause.strip()) >= config.first_min_chars


def test_a_cjk_run_without_punctuation_is_cut_after_a_bounded_spoken_length():
    config = SegmenterConfig.from_fish()  # chunk_length 200
    run_zh = "我们今天讨论人工智能" * 12  # 120 characters, no punctuation: 360 spoken letters
    fed, segment, reason = first_segment(run_zh + "。", config)
    assert reason is M and segment == run_zh[: config.max_chars // HAN_HANGUL_WEIGHT]  # 66 characters, not 200
    assert fed <= len(segment) + 1
    english_fed, english, _ = first_segment("word " * 60, config)
    assert spoken_length(segment) <= config.max_chars and len(english.strip()) <= config.max_chars
    assert fed < english_fed  # a third of the characters: the same spoken length

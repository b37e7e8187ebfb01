"""Tests for model/text_normalize.py: spelled numbers, money, times, symbols, abbreviations, and the output charset."""

from __future__ import annotations

import re

import pytest

from model.text_normalize import (
    normalize_text,
    spell_cardinal,
    spell_money,
    spell_ordinal,
    spell_time,
    spell_year,
    unreadable_chars,
    words_for_scoring,
)

_ALLOWED = re.compile(r"^[A-Za-z .,?!;:'-]*$")


def _independent_cardinal(n: int) -> str:
    """A second, table-driven speller for 0..999999 used to cross-check spell_cardinal."""
    small = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
             "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]  # fmt: skip
    tens = {2: "twenty", 3: "thirty", 4: "forty", 5: "fifty", 6: "sixty", 7: "seventy", 8: "eighty", 9: "ninety"}

    def below_thousand(k: int) -> list[str]:
        words: list[str] = []
        if k >= 100:
            words += [small[k // 100], "hundred"]
            k %= 100
        if k >= 20:
            words.append(tens[k // 10] + (f"-{small[k % 10]}" if k % 10 else ""))
        elif k or not words:
            words.append(small[k])
        return words

    if n < 1000:
        return " ".join(below_thousand(n))
    head, rest = divmod(n, 1000)
    words = [*below_thousand(head), "thousand"]
    if rest:
        words += below_thousand(rest)
    return " ".join(words)


@pytest.mark.parametrize("n", [*range(0, 130), 999, 1000, 1001, 1010, 2024, 12345, 100000, 999999, 700007])
def test_cardinal_matches_independent_speller(n: int) -> None:
    assert spell_cardinal(n) == _independent_cardinal(n)


@pytest.mark.parametrize(
    ("n", "spoken"),
    [(1_000_000, "one million"), (2_500_000_001, "two billion five hundred million one"), (-7, "minus seven")],
)
def test_cardinal_large_and_negative(n: int, spoken: str) -> None:
    assert spell_cardinal(n) == spoken


@pytest.mark.parametrize(
    ("n", "spoken"),
    [(1, "first"), (2, "second"), (3, "third"), (4, "fourth"), (5, "fifth"), (8, "eighth"), (9, "ninth"),
     (12, "twelfth"), (20, "twentieth"), (21, "twenty-first"), (100, "one hundredth"), (112, "one hundred twelfth"),
     (1000, "one thousandth"), (43, "forty-third")],
)  # fmt: skip
def test_ordinals(n: int, spoken: str) -> None:
    assert spell_ordinal(n) == spoken


@pytest.mark.parametrize(
    ("n", "spoken"),
    [(1984, "nineteen eighty-four"), (1905, "nineteen oh five"), (1900, "nineteen hundred"),
     (2000, "two thousand"), (2007, "two thousand seven"), (2024, "twenty twenty-four"), (1066, "ten sixty-six")],
)  # fmt: skip
def test_years(n: int, spoken: str) -> None:
    assert spell_year(n) == spoken


def test_money_and_time_helpers() -> None:
    assert spell_money("5.50", "$") == "five dollars and fifty cents"
    assert spell_money("1", "$") == "one dollar"
    assert spell_money("0.99", "$") == "ninety-nine cents"
    assert spell_money("1.01", "$") == "one dollar and one cent"
    assert spell_money("2.5", "$", "million") == "two point five million dollars"
    assert spell_money("20", "£") == "twenty pounds"
    assert spell_time(3, 30) == "three thirty"
    assert spell_time(3, 5) == "three oh five"
    assert spell_time(3, 0) == "three o'clock"
    assert spell_time(7, 0, "p") == "seven P M"


@pytest.mark.parametrize(
    ("text", "spoken"),
    [
        ("Mr. Smith paid $5.50 at 3:30 p.m. on Jan. 5th, 1984.",
         "Mister Smith paid five dollars and fifty cents at three thirty P M on January fifth, nineteen eighty-four."),
        ("Dr. Who lives on Baker St. near St. Paul's, etc.",
         "Doctor Who lives on Baker Street near Saint Paul's, et cetera."),
        ("It's 50% off -- only $2.5 million!", "It's fifty percent off, only two point five million dollars!"),
        ("The 1990s were great; the '60s were wild.", "The nineteen nineties were great; the sixties were wild."),
        ("We had 1,234,567 visitors.",
         "We had one million two hundred thirty-four thousand five hundred sixty-seven visitors."),
        ("Temperatures of -5°C and 98.6°F.",
         "Temperatures of minus five degrees Celsius and ninety-eight point six degrees Fahrenheit."),
        ("The balance was -42 today, and -3.5 later.", "The balance was minus forty-two today, and minus three point five later."),
        ("Henry VIII and World War II, chapter IV.", "Henry the eighth and World War two, chapter four."),
        ("Rock & roll @ home: 2+2=4.", "Rock and roll at home: two plus two equals four."),
        ("\u201cHello,\u201d she said\u2014\u2026quietly.", "Hello, she said, quietly."),
        ("The U.S. Army met J. R. R. Tolkien in the U.S.", "The U S Army met J R R Tolkien in the U S."),
        ("He ran 5 km in 20 mins at 10 mph.", "He ran five kilometers in twenty minutes at ten miles per hour."),
        ("Add 1/2 cup, e.g. sugar, or 3/4 of it.", "Add one half cup, for example, sugar, or three quarters of it."),
        ("Call #5 or No. 7 at 10-20% off.", "Call number five or number seven at ten to twenty percent off."),
        ("We left at 7 PM, at 12:05 and at 3:00.", "We left at seven P M, at twelve oh five and at three o'clock."),
        ("Pi is 3.14 and 007 is a spy.", "Pi is three point one four and zero zero seven is a spy."),
        ("He said 'no' to the dogs' bones, didn't he?", "He said no to the dogs' bones, didn't he?"),
        ("café naïve résumé", "cafe naive resume"),
        ("From 1939-1945 it raged.", "From nineteen thirty-nine to nineteen forty-five it raged."),
        ("Q: What (if anything) is it?", "Q: What, if anything, is it?"),
        ('"Well, mysteries, science fiction..."', "Well, mysteries, science fiction."),
        ("Wait... what?", "Wait, what?"),
        ("And then, (she said)", "And then, she said."),
    ],
)  # fmt: skip
def test_normalize_sentences(text: str, spoken: str) -> None:
    assert normalize_text(text) == spoken


@pytest.mark.parametrize(
    "text",
    ["Price: ¥500 <b>bold</b> {x} [y] | ~z ^ \\ _ * # § ©", "Tab\there\nnewline", "\u00bd of 42 \u00d7 3 \u2212 1"],
)
def test_output_uses_only_allowed_characters(text: str) -> None:
    spoken = normalize_text(text)
    assert _ALLOWED.match(spoken), spoken
    assert not re.search(r"\d", spoken)
    assert "  " not in spoken


def test_normalize_is_idempotent_on_its_output() -> None:
    for text in ["Mr. Smith paid $5.50 at 3:30 p.m.", "In 2024, 50% of 1,000 people agreed.", "Louis XIV was king."]:
        once = normalize_text(text)
        assert normalize_text(once) == once


def test_words_for_scoring_reduces_both_sides_alike() -> None:
    reference = "Mr. Smith has twenty-one dogs in the U.S."
    transcript = "mister smith has 21 dogs in the US"
    assert words_for_scoring(reference) == words_for_scoring(transcript)
    assert words_for_scoring(reference) == ["mister", "smith", "has", "twenty", "one", "dogs", "in", "the", "us"]


@pytest.mark.parametrize(
    ("text", "dropped"),
    [
        ("Café crème brûlée, naïve Zoë at 5 pm & 50% off ½ ① x² 😀", ""),  # accents, numbers, symbols: all read
        ("Please call 王小明 tomorrow.", "王小明"),
        ("Привет, мир!", "Приветмир"),
        ("こんにちは、世界。", "こんにちは世界"),
        ("안녕하세요", "안녕하세요"),
        ("مرحبا ٣", "مرحبا"),  # an Arabic-Indic digit is a decimal digit: spelled out
        ("Łódź", "Ł"),  # a Latin letter NFKD cannot reduce to ASCII
        ("二〇二四", "二〇二四"),
    ],
)
def test_unreadable_chars_are_exactly_the_letters_normalize_drops(text: str, dropped: str) -> None:
    assert unreadable_chars(text) == dropped
    kept = re.sub(r"[^A-Za-z]", "", normalize_text(text.replace(dropped, "") if dropped else text))
    assert re.sub(r"[^A-Za-z]", "", normalize_text(text)) == kept  # what is listed adds nothing to the output


def test_format_characters_and_full_width_forms() -> None:
    assert normalize_text("the\u200bre ｈｅｌｌｏ\u00ad world") == normalize_text("there hello world")

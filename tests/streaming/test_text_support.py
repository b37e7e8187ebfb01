"""The refusal rule for text a model's normaliser would drop (streaming/text_support.py), with the English default
voice's normaliser: mixed text a user would send, and the message that names the fix."""

from __future__ import annotations

import pytest

from model.text_normalize import unreadable_chars
from streaming.errors import RequestError, UnsupportedLanguage
from streaming.text_support import MAX_DROPPED_SHARE, check_readable

SPOKEN = [
    "Please call 王小明 tomorrow at 5 pm.",  # an English sentence with a Chinese name: 9 of 32 spoken letters dropped
    "Meet Zoë and François at the Café Müller, 3 rue de la Paix, at 10:30 — €25 each!",  # accents only
    "It costs $5.50 (about 40 ₽) & takes 2–3 days 😀.",
    "Łódź is a city in Poland.",  # one letter of one word dropped
    "The word for thank you in Russian is спасибо, said with a smile at the end.",  # 7 of 58
    "",
    "!!! ... 😀",
]
REFUSED = [
    ("你好，世界！", "Han"),
    ("王小明 called.", "Han"),  # a name and one English word: 9 of 15 dropped
    ("Привет, мир! How are you?", "Cyrillic"),
    ("こんにちは、元気ですか？", "Hiragana"),
    ("안녕하세요, 반갑습니다.", "Hangul"),
    ("مرحبا بالعالم", "Arabic"),
    ("Καλημέρα κόσμε, good morning.", "Greek"),
]


@pytest.mark.parametrize("text", SPOKEN)
def test_mostly_readable_text_is_spoken(text: str) -> None:
    check_readable(text, unreadable_chars)


@pytest.mark.parametrize(("text", "script"), REFUSED)
def test_text_mostly_in_other_scripts_is_refused_naming_the_fix(text: str, script: str) -> None:
    with pytest.raises(UnsupportedLanguage) as caught:
        check_readable(text, unreadable_chars)
    message = str(caught.value)
    assert script in message and "Fish Speech 1.5" in message and "--checkpoint" in message
    assert isinstance(caught.value, RequestError) and caught.value.code == "unsupported_language"


def test_the_share_is_weighed_in_spoken_length_and_a_model_without_normaliser_reads_everything() -> None:
    # 4 Han characters weigh 12 letters: beside 24 English letters that is 1/3 (spoken), beside 23 it is more
    check_readable("abcdefgh abcdefgh abcdefgh 北京上海", unreadable_chars)
    with pytest.raises(UnsupportedLanguage):
        check_readable("abcdefgh abcdefgh abcdefg 北京上海", unreadable_chars)
    assert MAX_DROPPED_SHARE == 1 / 3
    for text, _ in REFUSED:
        check_readable(text, None)  # Fish Speech 1.5 weights declare no normaliser: every script is read

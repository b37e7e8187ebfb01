"""Whether the served model can read a text: the refusal of text in scripts a model's own normaliser would drop.

A model folder that declares a text normaliser (the English default voice) reads only what that normaliser keeps;
Fish Speech 1.5 weights declare none and read every script. The rule, per text segment (the segmenter's cut, the
same for every API): letters the normaliser would drop are weighed in spoken length (`text_units.spoken_length`);
when they are more than MAX_DROPPED_SHARE of the segment's letters and digits the segment is refused with
UnsupportedLanguage, naming the scripts and the fix; below that the rest is spoken and the dropped word skipped.
Knows nothing about models or the wire: the normaliser's drop function comes in as an argument.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable

from .errors import UnsupportedLanguage
from .text_units import spoken_length

# Above this share of a segment's letters (spoken length) dropped, the segment is refused. An English sentence with a
# foreign name ("Please call 王小明 tomorrow at 5 pm.": 9 of 32) is spoken without the name; a sentence that is
# mostly another script ("王小明 called.": 9 of 15), or entirely ("Привет, мир"), is refused.
MAX_DROPPED_SHARE = 1 / 3
# How much of the dropped text a refusal quotes.
QUOTED_CHARS = 24
FIX = (
    "the default voice speaks English only; for other languages serve Fish Speech 1.5 weights "
    "(fishgate serve --checkpoint <fish-speech-1.5 folder>; README: Using your Fish Speech 1.5 weights)"
)


def check_readable(text: str, unreadable: Callable[[str], str] | None) -> None:
    """Raise UnsupportedLanguage when `unreadable(text)` (the letters the model's normaliser drops) weighs more than
    MAX_DROPPED_SHARE of the letters and digits of `text`. `unreadable` None: the model reads every script."""
    if unreadable is None:
        return
    dropped = unreadable(text)
    if not dropped:
        return
    letters = "".join(c for c in text if c.isalnum())
    if spoken_length(dropped) <= MAX_DROPPED_SHARE * spoken_length(letters):
        return
    scripts = ", ".join(dict.fromkeys(_script(c) for c in dropped))
    quoted = dropped if len(dropped) <= QUOTED_CHARS else dropped[:QUOTED_CHARS] + "…"
    raise UnsupportedLanguage(
        f"too much of this text is in scripts the served model cannot read ({scripts}: {quoted}); {FIX}"
    )


def _script(char: str) -> str:
    """A readable script name from the Unicode name: CJK, HIRAGANA, HANGUL, CYRILLIC, ARABIC, ..."""
    name = unicodedata.name(char, "UNKNOWN")
    return name.split()[0].title() if not name.startswith("CJK") else "Han"

"""English text normaliser: numbers, money, times and symbols spelled out, abbreviations expanded.

Owns the mapping from written English to a speakable string of ASCII letters, spaces and basic punctuation
(``. , ? ! ; : ' -``): what the default voice's teacher was asked to say, what that model was trained on, and so
what the engine feeds a model whose folder declares ``"text_normalizer": "english"`` in fishgate.json (official
Fish checkpoints read raw text and declare none). Also the word reduction both sides of the WER gate use. Knows
nothing about corpora, audio or models.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable

# Largest magnitude spelled out; beyond it digits are read one by one (no corpus sentence needs more).
MAX_SPELLED = 10**15 - 1
# Characters a normalised string may contain (letters, space, basic punctuation).
ALLOWED_PUNCTUATION = ".,?!;:'-"

_ONES = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
]
_TENS = ["_", "_", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_SCALES = ((10**12, "trillion"), (10**9, "billion"), (10**6, "million"), (10**3, "thousand"))
_ORDINAL_IRREGULAR = {
    "one": "first",
    "two": "second",
    "three": "third",
    "five": "fifth",
    "eight": "eighth",
    "nine": "ninth",
    "twelve": "twelfth",
}
_FRACTION_DENOMINATORS = {2: ("half", "halves"), 4: ("quarter", "quarters")}

# Single characters mapped before anything else (typography to ASCII, symbols that have a spoken form).
_CHAR_MAP = {
    "\u2018": "'", "\u2019": "'", "\u201a": "'", "\u201b": "'", "\u2032": "'", "`": "'",
    "\u201c": '"', "\u201d": '"', "\u201e": '"', "\u2033": '"', "\u00ab": '"', "\u00bb": '"',
    "\u2010": "-", "\u2011": "-", "\u2012": "-", "\u2013": "-", "\u2014": " -- ", "\u2015": " -- ", "\u2212": "-",
    "\u2026": "...", "\u00a0": " ", "\u00d7": " times ", "\u00f7": " divided by ", "\u00b1": " plus or minus ",
    "\u00bd": " 1/2", "\u00bc": " 1/4", "\u00be": " 3/4", "\u2153": " 1/3", "\u2154": " 2/3",
    "\u00e6": "ae", "\u00c6": "Ae", "\u0153": "oe", "\u0152": "Oe", "\u00df": "ss", "\u00f8": "o", "\u00d8": "O",
    "\u00a3": "\u00a3", "\u20ac": "\u20ac", "\u00b0": "\u00b0",
}  # fmt: skip
_CURRENCIES = {"$": ("dollar", "dollars", "cent", "cents"), "£": ("pound", "pounds", "penny", "pence"),
               "€": ("euro", "euros", "cent", "cents")}  # fmt: skip
_UNITS = {
    "km": ("kilometer", "kilometers"), "kg": ("kilogram", "kilograms"), "cm": ("centimeter", "centimeters"),
    "mm": ("millimeter", "millimeters"), "mph": ("mile per hour", "miles per hour"), "lb": ("pound", "pounds"),
    "lbs": ("pound", "pounds"), "oz": ("ounce", "ounces"), "ft": ("foot", "feet"), "mi": ("mile", "miles"),
    "kph": ("kilometer per hour", "kilometers per hour"), "hrs": ("hour", "hours"), "mins": ("minute", "minutes"),
}  # fmt: skip
# Titles that precede a name: the period is dropped, never read as a sentence end.
_TITLES = {
    "Mr": "Mister", "Mrs": "Missus", "Ms": "Miz", "Prof": "Professor", "Gen": "General", "Capt": "Captain",
    "Lt": "Lieutenant", "Col": "Colonel", "Sgt": "Sergeant", "Rev": "Reverend", "Hon": "Honorable",
    "Gov": "Governor", "Sen": "Senator", "Rep": "Representative", "Pres": "President", "Mt": "Mount", "Ft": "Fort",
    "Messrs": "Messieurs", "Cpl": "Corporal", "Adm": "Admiral", "Maj": "Major", "Fr": "Father",
}  # fmt: skip
# Abbreviations that may end a sentence: the period survives when a sentence plausibly ends there.
_ABBREVIATIONS = {
    "Jr": "Junior", "Sr": "Senior", "Inc": "Incorporated", "Co": "Company", "Corp": "Corporation",
    "Ltd": "Limited", "Bros": "Brothers", "Dept": "Department", "Univ": "University", "Ave": "Avenue",
    "Blvd": "Boulevard", "Rd": "Road", "vs": "versus", "etc": "et cetera", "approx": "approximately",
    "Jan": "January", "Feb": "February", "Mar": "March", "Apr": "April", "Jun": "June", "Jul": "July",
    "Aug": "August", "Sep": "September", "Sept": "September", "Oct": "October", "Nov": "November",
    "Dec": "December", "cf": "compare", "viz": "namely", "ca": "circa", "esp": "especially", "dept": "department",
}  # fmt: skip
_ROMAN_COUNTED = ("War", "Chapter", "Part", "Act", "Book", "Volume", "Section", "Scene", "Article", "Psalm", "Phase")
_ROMAN_VALUES = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100}

_NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+"
_RE_MONEY = re.compile(rf"([$£€])\s?({_NUMBER})(?:\s?(thousand|million|billion|trillion)\b)?")
_RE_PERCENT = re.compile(rf"(?<![\w-])(-?)({_NUMBER})\s?%")
_RE_TIME = re.compile(r"\b([01]?\d|2[0-3]):([0-5]\d)\b(?!:\d)(?:\s?([AaPp])\.?\s?[Mm]\b\.?)?")
_RE_HOUR_MERIDIEM = re.compile(r"\b(1[0-2]|0?[1-9])\s?([AaPp])\.?\s?[Mm]\b\.?")
_RE_MERIDIEM_WORD = re.compile(r"\b([ap])\.m\.", re.IGNORECASE)
_RE_DEGREES = re.compile(rf"(?<![\w-])(-?)({_NUMBER})\s?°\s?([CF])\b")
_RE_ORDINAL = re.compile(r"\b(\d{1,3}(?:,\d{3})+|\d+)(st|nd|rd|th)\b", re.IGNORECASE)
_RE_DECADE = re.compile(r"(?<![\w])'?(1\d|20)?(\d)0'?s\b")
_RE_RANGE = re.compile(r"(?<![\w.,:-])(\d+)\s?(?:-|--|to)\s?(\d+)(?![\w.,:]\d)")
_RE_FRACTION = re.compile(r"(?<![\w/])(\d+)/(\d+)(?![\w/])")
_RE_UNIT = re.compile(rf"({_NUMBER})\s?({'|'.join(sorted(_UNITS, key=len, reverse=True))})\b(?:\.(?=\s+[a-z]))?")
_RE_NUMBER_SIGN = re.compile(r"(?:#|\bNo\.|\bno\.|\bNos\.)\s?(?=\d)")
_RE_NUMBER = re.compile(rf"(?<![\w.])(-)?({_NUMBER})(?![\w])")
_RE_ALNUM_SPLIT = re.compile(r"(?<=[A-Za-z])(?=\d)|(?<=\d)(?=[A-Za-z])")
_RE_ACRONYM = re.compile(r"\b((?:[A-Za-z]\.){2,})")
_RE_INITIAL = re.compile(r"\b([A-HJ-Z])\.(?=\s+[A-Z])")
_RE_TITLE = re.compile(rf"\b({'|'.join(_TITLES)})\.(?=\s)")
_RE_DR_ST = re.compile(r"\b(Dr|St)\.(\s+[A-Z])?")
_RE_ABBREVIATION = re.compile(rf"\b({'|'.join(_ABBREVIATIONS)})\.(\s+[A-Z])?")
_RE_LATIN = re.compile(r"\b(e\.g|i\.e)\.,?", re.IGNORECASE)
_RE_ROMAN_COUNTED = re.compile(rf"\b((?i:{'|'.join(_ROMAN_COUNTED)}))\s+([IVXLC]{{1,7}})\b")
_RE_ROMAN_REGNAL = re.compile(r"\b([A-Z][a-z]+)\s+([IVX]{2,6})\b")


def spell_cardinal(n: int) -> str:
    """Spell an integer in American English without 'and': 123 -> 'one hundred twenty-three'."""
    if n < 0:
        return "minus " + spell_cardinal(-n)
    if n > MAX_SPELLED:
        return spell_digits(str(n))
    if n < 20:
        return _ONES[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return _TENS[tens] + ("-" + _ONES[ones] if ones else "")
    if n < 1000:
        hundreds, rest = divmod(n, 100)
        return _ONES[hundreds] + " hundred" + (" " + spell_cardinal(rest) if rest else "")
    for scale, name in _SCALES:
        if n >= scale:
            head, rest = divmod(n, scale)
            return spell_cardinal(head) + " " + name + (" " + spell_cardinal(rest) if rest else "")
    raise AssertionError("unreachable")


def spell_ordinal(n: int) -> str:
    """Spell an ordinal: 1 -> 'first', 21 -> 'twenty-first', 100 -> 'one hundredth'."""
    words = spell_cardinal(n)
    head, sep, last = words.rpartition("-") if "-" in words.rsplit(" ", 1)[-1] else words.rpartition(" ")
    if last in _ORDINAL_IRREGULAR:
        last = _ORDINAL_IRREGULAR[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return head + sep + last


def spell_year(n: int) -> str:
    """Spell a year the way it is said: 1984 -> 'nineteen eighty-four', 1905 -> 'nineteen oh five', 2007 ->
    'two thousand seven', 2024 -> 'twenty twenty-four', 1900 -> 'nineteen hundred'."""
    if not 1000 <= n <= 9999 or n % 1000 == 0 or 2000 <= n <= 2009:
        return spell_cardinal(n)
    high, low = divmod(n, 100)
    if low == 0:
        return spell_cardinal(high) + " hundred"
    if low < 10:
        return spell_cardinal(high) + " oh " + _ONES[low]
    return spell_cardinal(high) + " " + spell_cardinal(low)


def spell_digits(digits: str) -> str:
    """Read a digit string one digit at a time: '007' -> 'zero zero seven'."""
    return " ".join(_ONES[int(d)] for d in digits if d.isdigit())


def spell_number(text: str, *, as_year: bool = True) -> str:
    """Spell a written number: '1,234' / '3.14' / '.5' / '0042' / '1984' (a year when ``as_year``)."""
    whole, _, frac = text.replace(",", "").partition(".")
    if whole and len(whole) > 1 and whole.startswith("0"):
        spoken = spell_digits(whole)
    elif whole:
        value = int(whole)
        plain = "," not in text and "." not in text and len(whole) == 4
        spoken = spell_year(value) if as_year and plain and 1000 <= value <= 2099 else spell_cardinal(value)
    else:
        spoken = ""
    if frac:
        spoken = (spoken + " point " if spoken else "point ") + spell_digits(frac)
    return spoken


def _plural(word_pair: tuple[str, str], amount: str) -> str:
    return word_pair[0] if amount.replace(",", "") in ("1", "1.0", "1.00") else word_pair[1]


def spell_money(amount: str, currency: str, scale: str | None = None) -> str:
    """Spell an amount of money: ('5.50', '$') -> 'five dollars and fifty cents', ('2.5', '$', 'million') ->
    'two point five million dollars', ('0.99', '$') -> 'ninety-nine cents'."""
    unit, units, sub, subs = _CURRENCIES[currency]
    if scale:
        return f"{spell_number(amount, as_year=False)} {scale} {units}"
    whole, _, frac = amount.replace(",", "").partition(".")
    whole_value = int(whole) if whole else 0
    cents = int((frac + "00")[:2]) if frac and len(frac) <= 2 else None
    if frac and cents is None:  # more than two decimals: read as a decimal amount
        return f"{spell_number(amount, as_year=False)} {units}"
    parts = []
    if whole_value or not cents:
        parts.append(f"{spell_cardinal(whole_value)} {unit if whole_value == 1 else units}")
    if cents:
        parts.append(f"{spell_cardinal(cents)} {sub if cents == 1 else subs}")
    return " and ".join(parts)


def spell_time(hours: int, minutes: int, meridiem: str | None = None) -> str:
    """Spell a clock time: (3, 30) -> 'three thirty', (3, 5) -> 'three oh five', (3, 0) -> 'three o'clock',
    (3, 0, 'p') -> 'three P M'."""
    spoken = spell_cardinal(hours)
    if minutes:
        spoken += (" oh " if minutes < 10 else " ") + spell_cardinal(minutes)
    elif not meridiem:
        spoken += " o'clock"
    if meridiem:
        spoken += " A M" if meridiem.lower() == "a" else " P M"
    return spoken


def _roman_value(numeral: str) -> int | None:
    values = [_ROMAN_VALUES[c] for c in numeral]
    total = sum(-v if i + 1 < len(values) and v < values[i + 1] else v for i, v in enumerate(values))
    return total if total > 0 and _to_roman(total) == numeral else None


def _to_roman(value: int) -> str:
    out = ""
    for number, letters in ((100, "C"), (90, "XC"), (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"),
                            (4, "IV"), (1, "I")):  # fmt: skip
        while value >= number:
            out += letters
            value -= number
    return out


def _sentence_end(follow: str | None, text: str, end: int) -> str:
    """A period survives an expanded abbreviation when the text ends there or a capitalised word follows."""
    return "." if follow is not None or not text[end:].strip() else ""


def _expand_abbreviations(text: str) -> str:
    text = _RE_LATIN.sub(lambda m: "for example," if m.group(1).lower() == "e.g" else "that is,", text)
    text = _RE_MERIDIEM_WORD.sub(lambda m: m.group(1).upper() + " M ", text)
    text = _RE_TITLE.sub(lambda m: _TITLES[m.group(1)], text)

    def dr_st(m: re.Match[str]) -> str:
        follow = m.group(2)
        if follow:  # 'Dr. Smith', 'St. Louis': a title before a name
            return ("Doctor" if m.group(1) == "Dr" else "Saint") + follow
        word = "Drive" if m.group(1) == "Dr" else "Street"
        return word + _sentence_end(None, m.string, m.end())

    text = _RE_DR_ST.sub(dr_st, text)
    text = _RE_ABBREVIATION.sub(
        lambda m: _ABBREVIATIONS[m.group(1)] + _sentence_end(m.group(2), m.string, m.end()) + (m.group(2) or ""),
        text,
    )
    text = _RE_ACRONYM.sub(
        lambda m: " ".join(m.group(1).replace(".", "")) + _sentence_end(None, m.string, m.end()),
        text,
    )
    return _RE_INITIAL.sub(r"\1", text)


def _expand_numbers(text: str) -> str:
    text = _RE_NUMBER_SIGN.sub("number ", text)
    text = _RE_MONEY.sub(lambda m: " " + spell_money(m.group(2), m.group(1), m.group(3)), text)
    text = _RE_TIME.sub(lambda m: spell_time(int(m.group(1)), int(m.group(2)), m.group(3)), text)
    text = _RE_HOUR_MERIDIEM.sub(lambda m: spell_time(int(m.group(1)), 0, m.group(2)), text)
    text = _RE_RANGE.sub(lambda m: spell_number(m.group(1)) + " to " + spell_number(m.group(2)), text)
    text = _RE_PERCENT.sub(lambda m: ("minus " if m.group(1) else "") + spell_number(m.group(2)) + " percent", text)
    text = _RE_DEGREES.sub(
        lambda m: (
            ("minus " if m.group(1) else "")
            + spell_number(m.group(2), as_year=False)
            + (" degrees Celsius" if m.group(3) == "C" else " degrees Fahrenheit")
        ),
        text,
    )
    text = _RE_ORDINAL.sub(lambda m: spell_ordinal(int(m.group(1).replace(",", ""))), text)

    def decade(m: re.Match[str]) -> str:
        century, tens = m.group(1), int(m.group(2))
        if century is None:
            return spell_cardinal(tens * 10)[:-1] + "ies" if tens >= 2 else m.group(0)
        spoken = spell_year(int(century) * 100 + tens * 10)
        return spoken[:-1] + "ies" if spoken.endswith("y") else spoken + "s"

    text = _RE_DECADE.sub(decade, text)
    text = _RE_UNIT.sub(lambda m: spell_number(m.group(1), as_year=False) + " " + _plural(_UNITS[m.group(2)],
                                                                                        m.group(1)), text)  # fmt: skip

    def fraction(m: re.Match[str]) -> str:
        numerator, denominator = int(m.group(1)), int(m.group(2))
        if not 1 <= numerator < denominator <= 10:
            return spell_number(m.group(1)) + " slash " + spell_number(m.group(2))
        names = _FRACTION_DENOMINATORS.get(denominator)
        if names is None:
            single = spell_ordinal(denominator)
            names = (single, single + "s")
        return spell_cardinal(numerator) + " " + (names[0] if numerator == 1 else names[1])

    text = _RE_FRACTION.sub(fraction, text)
    text = _RE_ALNUM_SPLIT.sub(" ", text)
    return _RE_NUMBER.sub(lambda m: ("minus " if m.group(1) else "") + spell_number(m.group(2)), text)


def _expand_romans(text: str) -> str:
    def counted(m: re.Match[str]) -> str:
        value = _roman_value(m.group(2))
        return m.group(0) if value is None else f"{m.group(1)} {spell_cardinal(value)}"

    def regnal(m: re.Match[str]) -> str:
        value = _roman_value(m.group(2))
        return m.group(0) if value is None else f"{m.group(1)} the {spell_ordinal(value)}"

    return _RE_ROMAN_REGNAL.sub(regnal, _RE_ROMAN_COUNTED.sub(counted, text))


def _to_ascii(text: str) -> str:
    # format characters (zero-width spaces and joiners, soft hyphens) go first: they sit inside words
    text = "".join(_CHAR_MAP.get(c, c) for c in text if unicodedata.category(c) != "Cf")
    text = unicodedata.normalize("NFKD", text)  # also folds full-width forms and ligatures
    return "".join(c for c in text if not unicodedata.combining(c))


def unreadable_chars(text: str) -> str:
    """The letters and digits of `text` that `normalize_text` drops, in order: scripts it has no rules for (Han,
    kana, Hangul, Cyrillic, Arabic, Greek, ...). Accented Latin letters lose only their accents and decimal digits
    of any script are spelled out, so neither is listed; punctuation, symbols and emoji are not letters."""
    return "".join(c for c in text if c.isalnum() and not c.isdecimal() and not _has_ascii_alnum(_to_ascii(c)))


def _has_ascii_alnum(text: str) -> bool:
    return any(c.isascii() and c.isalnum() for c in text)


def _expand_symbols(text: str) -> str:
    text = re.sub(r"\s*&\s*", " and ", text)
    text = re.sub(r"\s*\+\s*", " plus ", text)
    text = re.sub(r"\s*=\s*", " equals ", text)
    text = re.sub(r"\s*@\s*", " at ", text)
    text = re.sub(r"\s*°\s*", " degrees ", text)
    text = re.sub(r"\s*%", " percent", text)
    text = text.replace("$", " dollars ").replace("£", " pounds ").replace("€", " euros ")
    text = re.sub(r"(?<=[A-Za-z])/(?=[A-Za-z])", " ", text)  # and/or -> and or
    return text


def _tidy_punctuation(text: str) -> str:
    text = re.sub(r"\.{2,}(?=[\"')\]]*\s*$)", ".", text)  # a closing ellipsis ends the sentence
    text = re.sub(r"\.{2,}", ",", text)
    text = re.sub(r"\s*--+\s*", ", ", text)
    text = re.sub(r"[()\[\]{}]", ",", text)
    text = text.replace('"', " ")
    # apostrophes survive only inside words (don't) or after a plural s (dogs'); quotes around words go
    text = re.sub(r"(?<![A-Za-z])'(?!(em|tis|twas)\b)|(?<![sS])'(?![A-Za-z])", " ", text)
    # hyphens survive only between letters (twenty-one, well-known)
    text = re.sub(r"(?<![A-Za-z])-|-(?![A-Za-z])", " ", text)
    allowed = set(ALLOWED_PUNCTUATION)
    text = "".join(c if (c.isascii() and c.isalpha()) or c in allowed or c == " " else " " for c in text)
    text = re.sub(r"\s+", " ", text).strip()
    text = re.sub(r"\s+([.,?!;:])", r"\1", text)
    text = re.sub(r"([,;:])(?:\s*[,;:])+", r"\1", text)  # ', ,' -> ','
    text = re.sub(r"[,;:]\s*([.?!])", r"\1", text)  # ', .' -> '.'
    text = re.sub(r"([.?!])(?:\s*[.?!,;:])+", r"\1", text)
    text = re.sub(r"([.,?!;:])(?=[A-Za-z])", r"\1 ", text)
    text = re.sub(r"[,;:]$", ".", text)
    return text.lstrip(ALLOWED_PUNCTUATION + " ")


def normalize_text(text: str) -> str:
    """Return ``text`` as a speakable string of ASCII letters, spaces and ``. , ? ! ; : ' -``.

    Numbers (cardinals, ordinals, years, decades, decimals, money, percentages, times, ranges, fractions, units)
    are spelled out, symbols with a spoken form read (& % $ £ € @ + = °), abbreviations expanded (Mr., Dr., St.,
    etc., e.g.), acronyms with periods spaced out (U.S. -> U S); anything else unspeakable is dropped.
    """
    text = _to_ascii(text)
    text = _expand_numbers(text)  # before abbreviations: 'No. 5', '5 p.m.' and '$3' need their punctuation
    text = _expand_abbreviations(text)
    text = _expand_romans(text)
    text = _expand_symbols(text)
    return _tidy_punctuation(text)


def words_for_scoring(text: str) -> list[str]:
    """Normalise and reduce to lowercase words for WER: punctuation dropped, hyphens split ('twenty-one' -> 2)."""
    spoken = normalize_text(text).lower().replace("-", " ")
    words = [w.strip("'") for w in re.sub(r"[.,?!;:]", " ", spoken).split()]
    merged: list[str] = []
    in_letter_run = False
    for word in filter(None, words):
        # spelled-out letters join into one token ('u s' == 'us'), so 'U.S.', 'U S' and 'US' score alike
        if len(word) == 1 and in_letter_run:
            merged[-1] += word
        else:
            merged.append(word)
            in_letter_run = len(word) == 1
    return merged


# Normalisers a checkpoint folder can declare in fishgate.json ("text_normalizer"), by name.
NORMALIZERS: dict[str, Callable[[str], str]] = {"english": normalize_text}
# For each normaliser: the letters of a text it would drop (what a model reading only its output cannot say).
UNREADABLE: dict[str, Callable[[str], str]] = {"english": unreadable_chars}


def get_normalizer(name: str | None) -> Callable[[str], str] | None:
    """The normaliser a model folder declares (None: the model reads raw text); an unknown name is an error."""
    if name is None:
        return None
    if name not in NORMALIZERS:
        raise ValueError(f"unknown text_normalizer {name!r} in fishgate.json; known: {', '.join(NORMALIZERS)}")
    return NORMALIZERS[name]

"""Summarise a py-spy raw profile (`py-spy record --threads --format raw`) per thread: where each one spends time.

For each thread: samples (py-spy records only threads that are running, not blocked: a thread waiting for the GIL,
a lock or I/O is not sampled), the share of the recording it was active, and its top functions by self samples and
by inclusive samples. Answers "is the worker thread busy, and with what?" for the engine-turn attribution.

    python bench/spy_summary.py spy.txt --seconds 20 --rate 200 [--top 12] [--startup]

--startup first splits all threads' samples into a server start's parts (STARTUP_PARTS: the first rule a stack
matches), e.g. how much of a warm start compiles Python source because the installed packages have no bytecode.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

LINE = re.compile(r"^thread \((?P<tid>\w+)\)(?:: (?P<name>[^;]*))?;(?P<stack>.*) (?P<count>\d+)$")


# (part, a frame the stack holds): the first rule that matches names a sample's part of a server start
STARTUP_PARTS = (
    ("Python source compiled (no bytecode cached)", "SourceLoader.get_code"),
    ("imports (bytecode cached)", "_find_and_load"),
    ("Triton kernels compiled", "make_llir"),
    ("Triton kernels compiled", "make_ttgir"),
    ("Triton kernels compiled", "make_ptx"),
    ("Triton kernels compiled", "make_cubin"),
    ("dynamo guards", "CheckFunctionManager"),
    ("inductor (cache lookups, code loading)", "compile_fx"),
    ("dynamo tracing", "convert_frame"),
    ("weights loaded", "load_dual_ar"),
    ("weights loaded", "load_codec"),
    ("kernel self-check", "self_check"),
    ("warm-up (one-row vocoder graphs)", "_warm_up"),
    ("graph captures (eager warm-up runs, capture)", "capture"),
    ("start-up objects frozen", "freeze_startup_objects"),
)


def startup_parts(path: Path) -> Counter[str]:
    parts: Counter[str] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        m = LINE.match(line.strip())
        if m:
            stack = m["stack"]
            parts[next((name for name, frame in STARTUP_PARTS if frame in stack), "other")] += int(m["count"])
    return parts


def summarize(path: Path, seconds: float, rate: float, top: int) -> str:
    own: dict[str, Counter[str]] = defaultdict(Counter)
    inclusive: dict[str, Counter[str]] = defaultdict(Counter)
    totals: Counter[str] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        m = LINE.match(line.strip())
        if not m:
            continue
        thread = m["name"] or m["tid"]
        frames = m["stack"].split(";")  # "function (file:line)", outermost first
        count = int(m["count"])
        totals[thread] += count
        own[thread][frames[-1]] += count
        for f in set(frames):
            inclusive[thread][f] += count
    expected = seconds * rate
    out = []
    for thread, n in totals.most_common():
        out.append(f"== {thread}: {n} samples, active {100 * n / expected:.0f} % of the recording")
        out.append("   self:")
        out += [f"     {c:6d} {100 * c / n:5.1f} %  {f}" for f, c in own[thread].most_common(top)]
        out.append("   inclusive:")
        out += [f"     {c:6d} {100 * c / n:5.1f} %  {f}" for f, c in inclusive[thread].most_common(top)]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--seconds", type=float, required=True, help="the recording's duration")
    parser.add_argument("--rate", type=float, default=100.0, help="py-spy's --rate")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--startup", action="store_true", help="first, all threads' samples by start-up part")
    args = parser.parse_args()
    if args.startup:
        parts = startup_parts(args.profile)
        print(f"== start-up parts, all threads, {sum(parts.values()) / args.rate:.1f} s sampled:")
        for name, n in parts.most_common():
            print(f"   {n / args.rate:6.2f} s  {name}")
    print(summarize(args.profile, args.seconds, args.rate, args.top))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""A stand-in for Piper's python in the device-pipeline test (CI has no Piper): answers training.teacher's two
queries and speaks each input line as a harmonic glide whose length follows the text, written the way Piper writes
(one 22.05 kHz mono 16-bit WAV per line, named by a monotonic timestamp). Usage as `--piper-python`:

    fake_piper.py -c <code>                          → the voice path / the version
    fake_piper.py <launcher> <threads> -m M -i IN -d OUT   (or: -m piper -m M -i IN -d OUT)
"""

import math
import sys
import time
import wave
from pathlib import Path

RATE_HZ = 22050
VOICE = Path(__file__).with_name("data") / "fake-voice.onnx"


def speak(text: str, path: Path, seed: int) -> None:
    seconds = 0.3 + 0.06 * len(text)
    n = int(seconds * RATE_HZ)
    f0 = 110 + 15 * (seed % 7)
    samples = bytearray()
    phase = 0.0
    for i in range(n):
        phase += 2 * math.pi * (f0 + 40 * math.sin(2 * math.pi * 1.5 * i / RATE_HZ)) / RATE_HZ
        value = (
            0.2 * (math.sin(phase) + 0.5 * math.sin(2 * phase)) * (0.6 + 0.4 * math.sin(2 * math.pi * 3 * i / RATE_HZ))
        )
        samples += int(max(-1.0, min(1.0, value)) * 32767).to_bytes(2, "little", signed=True)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE_HZ)
        w.writeframes(bytes(samples))


def main(argv: list[str]) -> None:
    if argv[0] == "-c":
        code = argv[1]
        print(VOICE if "model_path" in code else "1.8.0")
        return
    args = argv[2:]  # after `-m piper`, or after the launcher's path and thread count
    opts = dict(zip(args[::2], args[1::2], strict=False))
    out = Path(opts["-d"])
    out.mkdir(parents=True, exist_ok=True)
    for k, line in enumerate(Path(opts["-i"]).read_text().splitlines()):
        speak(line, out / f"{time.monotonic_ns() + k}.wav", seed=k)


if __name__ == "__main__":
    main(sys.argv[1:])

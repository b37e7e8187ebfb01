"""Teacher audio → codes with a trained codec, batched, so DualAR training carries only codes (a few MB per hour).

Encodes with the inference encoder (`FireflyCodec.encode`, loaded through `model.codec_checkpoint.load_codec`), i.e.
exactly the codes the engine would compute for the same audio. Utterances are sorted by length and batched with
zero padding at the end; the encoder looks at most one mel window past a frame, so only the last frame of a padded
utterance can differ from encoding it alone (tested). Runs fine on a CPU (~1 % of real time for the small codec).
"""

from __future__ import annotations

import argparse
import math
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from model.codec_checkpoint import load_codec
from model.vocoder import FireflyCodec

from .audio_pack import Utterance, load_audio, read_manifest
from .checkpoints import load_codec_from_resume
from .dual_ar_data import CodesPack

DEFAULT_BATCH_S = 60.0  # padded audio seconds per encoder call


def frames_for(n_samples: int, codec: FireflyCodec) -> int:
    """Code frames `FireflyCodec.encode` gives for n samples: ⌈(n // hop) / downsample⌉."""
    st = codec.config.spec_transform
    return math.ceil((n_samples // st.hop_length) / codec.config.downsample_total)


@torch.inference_mode()
def encode_batch(codec: FireflyCodec, audios: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Mono float arrays at the codec rate → codes (rows, frames) int16 each (one padded encoder call)."""
    longest = max(len(a) for a in audios)
    batch = torch.zeros(len(audios), longest)
    for i, a in enumerate(audios):
        batch[i, : len(a)] = torch.from_numpy(np.asarray(a, dtype=np.float32))
    codes = codec.encode(batch).cpu().numpy()
    return [codes[i, :, : frames_for(len(a), codec)].astype(np.int16) for i, a in enumerate(audios)]


def encode_utterances(
    codec: FireflyCodec,
    utterances: Sequence[Utterance],
    *,
    text_field: str = "normalized_text",
    batch_s: float = DEFAULT_BATCH_S,
    load: Callable[[Path, int], np.ndarray] = load_audio,
    progress: Callable[[int, int], None] | None = None,
    load_workers: int = 1,
) -> CodesPack:
    """Encode every utterance (manifest order kept in the pack); `text_field` is `normalized_text` or `text`.
    `load_workers` > 1 decodes the next batch's files in threads while the encoder runs (libsndfile and soxr drop
    the GIL), which is what keeps a GPU busy."""
    rate = codec.config.sample_rate
    min_samples = codec.config.samples_per_frame
    # sort by the manifest's duration (audio is loaded batch by batch: hours of it do not fit in memory at once)
    est = [u.duration_s if u.duration_s > 0 else batch_s for u in utterances]  # unknown: encoded alone
    order = sorted(range(len(utterances)), key=lambda i: est[i])
    codes: list[np.ndarray | None] = [None] * len(utterances)
    batches: list[list[int]] = []
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and est[order[end]] * (end - start + 1) <= batch_s:
            end += 1
        batches.append(order[start:end])
        start = end

    def load_batch(members: list[int]) -> list[np.ndarray]:
        return [load(utterances[i].audio_path, rate) for i in members]

    with ThreadPoolExecutor(max_workers=max(1, load_workers)) as pool:
        # at most `load_workers` batches decoded ahead (bounded memory), taken in order
        ahead: deque[Future[list[np.ndarray]]] = deque()
        done = 0
        for n, members in enumerate(batches):
            while len(ahead) < max(1, load_workers) and n + len(ahead) < len(batches):
                ahead.append(pool.submit(load_batch, batches[n + len(ahead)]))
            audios = ahead.popleft().result()
            for i, a in zip(members, audios, strict=True):
                if len(a) < min_samples:
                    raise ValueError(f"{utterances[i].audio_path} is shorter than one code frame ({len(a)} samples)")
            for i, c in zip(members, encode_batch(codec, audios), strict=True):
                codes[i] = c
            done += len(members)
            if progress is not None:
                progress(done, len(order))
    return CodesPack(
        ids=[u.id for u in utterances],
        texts=[getattr(u, text_field) for u in utterances],
        splits=[u.split for u in utterances],
        codes=[c for c in codes if c is not None],
        samples_per_frame=codec.config.samples_per_frame,
        sample_rate_hz=rate,
    )


def merge_packs(first: CodesPack, second: CodesPack) -> CodesPack:
    """`first` then the utterances of `second` it lacks (both from the same codec)."""
    if (first.samples_per_frame, first.sample_rate_hz) != (second.samples_per_frame, second.sample_rate_hz):
        raise ValueError("packs from different codecs cannot be merged")
    seen = set(first.ids)
    new = [i for i, u in enumerate(second.ids) if u not in seen]
    return CodesPack(
        ids=first.ids + [second.ids[i] for i in new],
        texts=first.texts + [second.texts[i] for i in new],
        splits=first.splits + [second.splits[i] for i in new],
        codes=first.codes + [second.codes[i] for i in new],
        samples_per_frame=first.samples_per_frame,
        sample_rate_hz=first.sample_rate_hz,
    )


def load_encoder(source: Path, device: torch.device | str = "cpu") -> FireflyCodec:
    """A codec with its encoder from a codec resume file (`codec_resume.safetensors`) or a checkpoint folder."""
    if source.is_file():  # a resume file (any name: codec_resume…, gan_codec_resume…); folders are checkpoints
        return load_codec_from_resume(source, device=device)
    return load_codec(source, device=device, with_encoder=True)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", type=Path, required=True)
    parser.add_argument("--codec", type=Path, required=True, help="codec_resume.safetensors or a checkpoint folder")
    parser.add_argument("--out", type=Path, required=True, help="codes.npz to write")
    parser.add_argument("--text-field", choices=("normalized_text", "text"), default="normalized_text")
    parser.add_argument("--batch-s", type=float, default=DEFAULT_BATCH_S)
    parser.add_argument("--device", default="cpu", help="where the encoder runs (cuda: raise --batch-s too)")
    parser.add_argument("--load-workers", type=int, default=1, help="threads decoding audio files ahead")
    parser.add_argument("--previous", type=Path, help="a codes.npz from the same codec: its utterances are reused")
    args = parser.parse_args(argv)
    codec = load_encoder(args.codec, args.device)
    rows = read_manifest(args.manifest)
    previous = CodesPack.load(args.previous) if args.previous is not None and args.previous.exists() else None
    known = set(previous.ids) if previous is not None else set()

    def progress(done: int, total: int) -> None:
        print(f"\r{done}/{total} utterances", end="", flush=True)

    pack = encode_utterances(
        codec, [u for u in rows if u.id not in known], text_field=args.text_field, batch_s=args.batch_s,
        progress=progress, load_workers=args.load_workers,
    )  # fmt: skip
    if previous is not None:
        pack = merge_packs(previous, pack)
    pack.save(args.out)
    frames = sum(c.shape[1] for c in pack.codes)
    print(f"\n{args.out}: {len(pack.ids)} utterances, {frames} frames")


if __name__ == "__main__":
    main()

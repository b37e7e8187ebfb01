"""StandInBackend: streaming.backend.Backend's interface with the device work replaced by sleeps (bench.standin's
DeviceModel; a sleep releases the GIL, as a wait on the GPU does) and the outputs by stand-ins of the right size.

It is built on the embedded default model's folder (any checkpoint the config names): the real tokenizer, prompt
builder, text normaliser and model facts, loaded by the real Backend on a one-session, 64-position cache that nothing
then runs. A frame's main token is a semantic token, never the end token, so a segment ends at its max_new_tokens (the
model's frames-per-character cap is lifted); its codes come from a fixed random table; a chunk's PCM is a slice of
precomputed noise, as long as the chunk. It runs as a CUDA engine does: not batch-invariant (prompts prefill as one
batch), each turn's vocoder calls launched beside the step. Used by bench.standin.install; knows nothing of servers.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import cast

import numpy as np
import torch

from bench.standin import DeviceModel
from streaming.backend import HISTORY_MAX_LENGTH, VOCODER_MAX_BATCH, Backend, RowSampling
from streaming.config import BackendConfig

INIT_SEQ_LEN = 64  # the real Backend is built with this context and one session (its cache is never used)
NOISE_S = 20.0  # seconds of precomputed "speech": making a chunk's audio costs a copy
NOISE_LEVEL = 0.1  # its amplitude: s16le bytes that deflate about as little as speech does
SYLLABLE_HZ = 4.0  # its loudness envelope, roughly a syllable rate
CODE_TABLE_ROWS = 4096  # precomputed frames the step hands out in turn


class _Stepper:
    """What the worker and executor read of model.stepper.DecodeStepper: rows, buckets (exact: no graphs), counters."""

    def __init__(self, n_rows: int) -> None:
        self.n_rows = n_rows
        self.eager_prefills = 0
        self.routed_steps = 0
        self.last_bucket = (0, 0)

    def bucket_for(self, rows: int, max_pos: int) -> tuple[int, int]:
        return rows, max_pos + 1


class StandInBackend(Backend):
    def __init__(self, config: BackendConfig, device: DeviceModel | None = None) -> None:
        small = replace(config, device="cpu", max_sessions=1, max_seq_len=INIT_SEQ_LEN, cuda_graphs=False,
                        compile_max_batch=0, graph_prefill=False, length_attention=None, gemv_kernels=None,
                        vocoder_overlap=False)  # fmt: skip
        super().__init__(small)
        self.device_model = device or DeviceModel.from_env()
        self.config = config
        prefix_count = len(self.prefix_rows)
        self.session_rows = config.max_sessions + 1  # as Backend lays rows out: sessions, a scratch row, prefixes
        self.prefix_rows = list(range(self.session_rows, self.session_rows + prefix_count))
        self.stepper = _Stepper(self.session_rows + prefix_count)  # type: ignore[assignment]
        model_config = json.loads((self._encoder_folder / "config.json").read_text(encoding="utf-8"))
        model_seq_len = int(model_config["max_seq_len"])
        self.max_seq_len = min(config.max_seq_len or model_seq_len, model_seq_len)
        self.history_max_length = min(HISTORY_MAX_LENGTH, self.max_seq_len)
        self.batch_invariant = False
        self.overlap_vocoder = True
        self.vocoder_stream = None
        self.vocoder_graphs = None
        self.info = replace(self.info, name=f"{self.info.name} (stand-in: no model work)", max_frames_per_char=None,
                            max_seq_len=self.max_seq_len, device="stand-in")  # fmt: skip
        del self.model, self.codec, self.vocoder  # nothing may run them
        rng = np.random.default_rng(0)
        semantic = np.full((CODE_TABLE_ROWS, 1), self.tokenizer.semantic_begin_id)
        codes = rng.integers(0, 1000, (CODE_TABLE_ROWS, self.info.num_codebooks))
        self._codes = np.concatenate([semantic, codes], axis=1).astype(np.int64)  # (rows, 1+nc)
        self._next_code = 0
        rate = self.info.sample_rate_hz
        t = np.arange(int(NOISE_S * rate)) / rate
        envelope = 0.5 + 0.5 * np.sin(2 * np.pi * SYLLABLE_HZ * t) ** 2
        self._noise = (NOISE_LEVEL * envelope * rng.standard_normal(t.shape)).astype(np.float32)
        self._next_noise = 0
        self._vocoder_due_s = 0.0  # launched vocoder work that no step has waited for yet

    # ---- the device, as sleeps -------------------------------------------------------------------------------------
    def _count(self, part: str, seconds: float) -> None:
        """GPU seconds of `part` for /metrics (DeviceTimes' counter of float seconds)."""
        counter = cast("dict[str, float]", self.device_times.seconds)
        counter[part] = counter.get(part, 0.0) + max(seconds, 0.0)

    def _device(self, part: str, seconds: float) -> None:
        """Wait `seconds` of GPU time."""
        self._count(part, seconds)
        if seconds > 0:
            time.sleep(seconds)

    def _frames(self, rows: int) -> np.ndarray:
        start = self._next_code
        self._next_code = (start + rows) % CODE_TABLE_ROWS
        return self._codes[(start + np.arange(rows)) % CODE_TABLE_ROWS]

    def _pcm(self, samples: int) -> np.ndarray:
        start = self._next_noise if self._next_noise + samples <= len(self._noise) else 0
        self._next_noise = start + samples
        return self._noise[start : start + samples].copy()

    # ---- decoding --------------------------------------------------------------------------------------------------
    def set_sampling(self, row: int, sampling: RowSampling) -> None:
        pass

    def set_noise_step(self, row: int, step: int) -> None:
        pass

    def set_row_position(self, row: int, position: int) -> None:
        pass

    def prefill_many(
        self, rows: Sequence[int], prompts: Sequence[torch.Tensor], start_positions: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._device("prefill", self.device_model.prefill_s(sum(int(p.shape[-1]) for p in prompts)))
        return torch.zeros(len(rows), 1), torch.zeros(len(rows), 1)

    def start_segments(
        self, rows: Sequence[int], logits: torch.Tensor, hidden: torch.Tensor, next_positions: Sequence[int]
    ) -> np.ndarray:
        return self._frames(len(rows))

    def step(
        self, rows: int, commit: Sequence[bool], max_pos: int, while_running: Callable[[], None] | None = None
    ) -> np.ndarray:
        """One wait for the step's GPU time plus the vocoder work launched before it (they share the GPU); the audio
        of those launches is collected meanwhile (`while_running`), as on a GPU."""
        t0 = time.perf_counter()
        vocoder_s, self._vocoder_due_s = self._vocoder_due_s, 0.0
        self._count("vocode", vocoder_s)
        self.stepper.last_bucket = (rows, max_pos + 1)
        if while_running is not None:
            while_running()
        self._device("step", self.device_model.step_s(rows) + vocoder_s - (time.perf_counter() - t0))
        return self._frames(rows)

    def swap_rows(self, a: int, b: int, length_a: int, length_b: int) -> None:
        pass

    def permute_rows(self, dst: list[int], src: list[int], length: int) -> None:
        pass

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        pass

    # ---- vocoder ---------------------------------------------------------------------------------------------------
    def reset_vocoder(self, slot: int) -> None:
        pass

    def vocode(self, slots: Sequence[int], codes: Sequence[np.ndarray]) -> list[np.ndarray]:
        self._device("vocode", self._vocode_time(codes))
        return self._audio(codes)

    def vocode_launch(self, slots: Sequence[int], codes: Sequence[np.ndarray]) -> Callable[[], list[np.ndarray]]:
        """The audio is made now; its GPU time is waited for by the next step, or by the collect where no step runs
        before it (no rows decoding)."""
        audio = self._audio(codes)
        self._vocoder_due_s += self._vocode_time(codes)

        def collect() -> list[np.ndarray]:
            if self._vocoder_due_s > 0:
                due, self._vocoder_due_s = self._vocoder_due_s, 0.0
                self._device("vocode", due)
            return audio

        return collect

    def _vocode_time(self, codes: Sequence[np.ndarray]) -> float:
        """One call per chunk length and VOCODER_MAX_BATCH rows, as Backend makes them."""
        frames = [int(c.shape[1]) for c in codes]
        calls = sum(-(-frames.count(n) // VOCODER_MAX_BATCH) for n in set(frames))
        self.vocode_calls += calls
        self.vocode_frames_run += sum(frames)
        return self.device_model.vocode_s(calls, sum(frames))

    def _audio(self, codes: Sequence[np.ndarray]) -> list[np.ndarray]:
        spf = self.info.samples_per_frame
        return [self._pcm(int(c.shape[1]) * spf) for c in codes]

    # ---- start-up and counters ---------------------------------------------------------------------------------------
    def capture_graphs(self) -> int:
        return 0

    def capture_idle_graph(self, row_positions: Sequence[int]) -> bool:
        return False

    def graphs_captured(self) -> int:
        return 0

    def count_missing_graphs(self) -> int:
        return 0

    def encode_reference(self, audio: np.ndarray, sample_rate_hz: int) -> np.ndarray:
        raise ValueError("the stand-in backend encodes no reference audio (bench.standin_backend)")

    @property
    def clamped_codes(self) -> int:
        return 0

"""Log-mel spectrogram of the firefly encoder (upstream `LogMelSpectrogram`), written without librosa/torchaudio.

Owns the Slaney-scale, Slaney-normalised mel filterbank, the reflect-padded magnitude STFT (periodic Hann,
center=False, `sqrt(re² + im² + 1e-6)`) and the log compression `log(clamp(·, 1e-5))`. Always computes in fp32
(the STFT has no bf16 kernel); callers cast the result. It knows nothing about the codec's layers.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# Slaney mel scale (Auditory Toolbox): linear below 1 kHz at 200/3 Hz per mel, logarithmic above.
SLANEY_HZ_PER_MEL = 200.0 / 3.0
SLANEY_BREAK_HZ = 1000.0
SLANEY_LOG_STEP = math.log(6.4) / 27.0
# Added to |X|² before the square root (upstream "pow2_sqrt"), keeps the gradient and log finite.
MAGNITUDE_EPS = 1e-6
# Floor before the log (upstream compress()).
LOG_FLOOR = 1e-5


def hz_to_mel(hz: torch.Tensor) -> torch.Tensor:
    break_mel = SLANEY_BREAK_HZ / SLANEY_HZ_PER_MEL
    linear = hz / SLANEY_HZ_PER_MEL
    log_part = break_mel + torch.log(hz.clamp(min=SLANEY_BREAK_HZ) / SLANEY_BREAK_HZ) / SLANEY_LOG_STEP
    return torch.where(hz >= SLANEY_BREAK_HZ, log_part, linear)


def mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    break_mel = SLANEY_BREAK_HZ / SLANEY_HZ_PER_MEL
    linear = mel * SLANEY_HZ_PER_MEL
    log_part = SLANEY_BREAK_HZ * torch.exp(SLANEY_LOG_STEP * (mel - break_mel))
    return torch.where(mel >= break_mel, log_part, linear)


def slaney_mel_filterbank(
    n_freqs: int, n_mels: int, sample_rate: int, f_min_hz: float = 0.0, f_max_hz: float | None = None
) -> torch.Tensor:
    """Triangular filters (n_freqs, n_mels) on STFT bins 0…sample_rate/2, each scaled to unit area (2/(f₊−f₋))."""
    f_max_hz = float(sample_rate // 2) if f_max_hz is None else f_max_hz
    f64, cpu = torch.float64, torch.device("cpu")  # explicit CPU: also correct inside a meta-device build
    bin_hz = torch.linspace(0, sample_rate // 2, n_freqs, dtype=f64, device=cpu)  # (F,)
    mel_lo, mel_hi = hz_to_mel(torch.tensor([f_min_hz, f_max_hz], dtype=f64, device=cpu)).tolist()
    edges_hz = mel_to_hz(torch.linspace(mel_lo, mel_hi, n_mels + 2, dtype=f64, device=cpu))  # (M+2,)
    widths = edges_hz[1:] - edges_hz[:-1]  # (M+1,)
    offsets = edges_hz[None, :] - bin_hz[:, None]  # (F, M+2)
    rising = -offsets[:, :-2] / widths[:-1]  # (F, M)
    falling = offsets[:, 2:] / widths[1:]
    fb = torch.clamp(torch.minimum(rising, falling), min=0.0)
    fb = fb * (2.0 / (edges_hz[2:] - edges_hz[:-2]))[None, :]
    return fb.to(torch.float32)


class LogMelSpectrogram(nn.Module):
    """Audio (B, N) at `sample_rate` → log-mel (B, n_mels, N // hop_length)."""

    window: torch.Tensor  # (win_length,) periodic Hann
    fb: torch.Tensor  # (n_fft/2 + 1, n_mels)

    def __init__(self, *, sample_rate: int, n_fft: int, win_length: int, hop_length: int, n_mels: int) -> None:
        super().__init__()
        self.sample_rate = sample_rate
        self.n_fft = n_fft
        self.win_length = win_length
        self.hop_length = hop_length
        self.n_mels = n_mels
        self.init_buffers()

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)create the window and filterbank (non-persistent, like upstream) on `device` (None: CPU)."""
        window = torch.hann_window(self.win_length, periodic=True, dtype=torch.float32, device="cpu")
        fb = slaney_mel_filterbank(self.n_fft // 2 + 1, self.n_mels, self.sample_rate)
        self.register_buffer("window", window.to(device), persistent=False)
        self.register_buffer("fb", fb.to(device), persistent=False)

    @property
    def pad_samples(self) -> tuple[int, int]:
        extra = self.win_length - self.hop_length
        return (extra // 2, (extra + 1) // 2)

    def min_samples(self) -> int:
        """Shortest input: reflect padding needs more samples than the pad, and at least one frame."""
        return max(max(self.pad_samples) + 1, self.hop_length)

    def magnitude(self, audio: torch.Tensor) -> torch.Tensor:
        """Audio (B, N) → linear magnitude spectrogram (B, n_fft/2+1, frames)."""
        if audio.ndim != 2:
            raise ValueError(f"audio must be (batch, samples), got shape {tuple(audio.shape)}")
        if audio.shape[-1] < self.min_samples():
            raise ValueError(f"audio has {audio.shape[-1]} samples; the encoder needs at least {self.min_samples()}")
        x = torch.nn.functional.pad(audio.float()[:, None, :], self.pad_samples, mode="reflect")[:, 0]
        spec = torch.stft(
            x,
            self.n_fft,
            hop_length=self.hop_length,
            win_length=self.win_length,
            window=self.window,
            center=False,
            normalized=False,
            onesided=True,
            return_complex=True,
        )
        ri = torch.view_as_real(spec)  # (B, F, T, 2)
        return torch.sqrt(ri.pow(2).sum(-1) + MAGNITUDE_EPS)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:  # (B, N)
        mag = self.magnitude(audio)  # (B, F, T)
        mel = torch.matmul(mag.transpose(-1, -2), self.fb).transpose(-1, -2)  # (B, n_mels, T)
        return torch.log(torch.clamp(mel, min=LOG_FLOOR))

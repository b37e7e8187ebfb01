"""Codec training losses: multi-resolution STFT and log-mel L1, plus a light multi-period / multi-scale discriminator.

Reconstruction losses run in fp32 outside autocast (STFTs have no bf16 kernels and log-magnitudes need the range).
The discriminators follow HiFiGAN's MPD (periods 2,3,5,7,11, 2-D convs over the folded waveform) and MSD (raw, ×2 and
×4 average-pooled waveform, grouped 1-D convs) at an eighth of HiFiGAN's widths, with least-squares GAN losses and
feature matching (0.7 M + 0.3 M parameters). Knows nothing about the codec or the optimizers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from model.mel import slaney_mel_filterbank

# (n_fft, hop, window) triples: short windows resolve onsets, long ones harmonics.
STFT_RESOLUTIONS = ((512, 128, 512), (1024, 256, 1024), (2048, 512, 2048))
# Mel bands per resolution for the mel L1 (a 512-point FFT cannot fill 128 bands at 44.1 kHz).
MEL_BANDS = (64, 100, 128)
# Added under the square root of |X|² (finite gradient at silence) and the floor before log (as model.mel).
MAGNITUDE_EPS = 1e-7
LOG_FLOOR = 1e-5
# Leaky ReLU slope of HiFiGAN's discriminators.
LRELU_SLOPE = 0.1
MPD_PERIODS = (2, 3, 5, 7, 11)


class ReconstructionLoss(nn.Module):
    """mel = mean over resolutions of L1(log-mel); stft = spectral convergence + L1(log |X|), averaged."""

    def __init__(self, sample_rate: int) -> None:
        super().__init__()
        for i, (n_fft, _hop, win) in enumerate(STFT_RESOLUTIONS):
            self.register_buffer(f"window{i}", torch.hann_window(win), persistent=False)
            fb = slaney_mel_filterbank(n_fft // 2 + 1, MEL_BANDS[i], sample_rate)
            self.register_buffer(f"fb{i}", fb, persistent=False)

    def _magnitude(self, x: torch.Tensor, i: int) -> torch.Tensor:
        n_fft, hop, win = STFT_RESOLUTIONS[i]
        window = getattr(self, f"window{i}")
        spec = torch.stft(x, n_fft, hop, win, window, center=True, return_complex=True)
        ri = torch.view_as_real(spec)
        return torch.sqrt(ri.pow(2).sum(-1) + MAGNITUDE_EPS)  # (B, F, T)

    def forward(self, fake: torch.Tensor, real: torch.Tensor) -> dict[str, torch.Tensor]:
        """fake, real (B, N) → {"mel", "stft"} scalar losses."""
        with torch.autocast(fake.device.type, enabled=False):
            fake, real = fake.float(), real.float()
            mel_loss = fake.new_zeros(())
            stft_loss = fake.new_zeros(())
            for i in range(len(STFT_RESOLUTIONS)):
                mag_f, mag_r = self._magnitude(fake, i), self._magnitude(real, i)
                sc = torch.linalg.vector_norm(mag_r - mag_f) / torch.linalg.vector_norm(mag_r).clamp_min(LOG_FLOOR)
                log_mag = F.l1_loss(torch.log(mag_f), torch.log(mag_r))
                stft_loss = stft_loss + sc + log_mag
                fb = getattr(self, f"fb{i}")
                mel_f = torch.log((mag_f.transpose(1, 2) @ fb).clamp_min(LOG_FLOOR))
                mel_r = torch.log((mag_r.transpose(1, 2) @ fb).clamp_min(LOG_FLOOR))
                mel_loss = mel_loss + F.l1_loss(mel_f, mel_r)
            n = len(STFT_RESOLUTIONS)
            return {"mel": mel_loss / n, "stft": stft_loss / n}


def log_mel_distance(fake: torch.Tensor, real: torch.Tensor, sample_rate: int) -> float:
    """Mean L1 of log-mels at 2048/512 (a quick quality number for logs and tests)."""
    loss = ReconstructionLoss(sample_rate).to(fake.device)
    return float(loss(fake, real)["mel"])


# ---- discriminators ------------------------------------------------------------------------------------------------
def _score_and_features(
    convs: nn.ModuleList, post: nn.Module, x: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Leaky-ReLU conv stack then the scoring conv: (flattened score, every layer's output for feature matching)."""
    feats = []
    for conv in convs:
        x = F.leaky_relu(conv(x), LRELU_SLOPE)
        feats.append(x)
    x = post(x)
    feats.append(x)
    return x.flatten(1), feats


class PeriodDiscriminator(nn.Module):
    def __init__(self, period: int, channels: tuple[int, ...] = (16, 32, 64, 128)) -> None:
        super().__init__()
        self.period = period
        widths = (1, *channels)
        self.convs = nn.ModuleList(
            weight_norm(nn.Conv2d(widths[i], widths[i + 1], (5, 1), (3, 1), padding=(2, 0)))
            for i in range(len(channels))
        )
        self.convs.append(weight_norm(nn.Conv2d(channels[-1], channels[-1], (5, 1), 1, padding=(2, 0))))
        self.post = weight_norm(nn.Conv2d(channels[-1], 1, (3, 1), 1, padding=(1, 0)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:  # x (B, 1, N)
        bsz, ch, n = x.shape
        if n % self.period:
            x = F.pad(x, (0, self.period - n % self.period), mode="reflect")
        x = x.view(bsz, ch, -1, self.period)  # (B, 1, N/p, p)
        return _score_and_features(self.convs, self.post, x)


class ScaleDiscriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        spec = [(1, 16, 15, 1, 1), (16, 32, 41, 4, 4), (32, 64, 41, 4, 16), (64, 128, 41, 4, 16), (128, 128, 5, 1, 1)]
        self.convs = nn.ModuleList(
            weight_norm(nn.Conv1d(c_in, c_out, k, s, groups=g, padding=k // 2)) for c_in, c_out, k, s, g in spec
        )
        self.post = weight_norm(nn.Conv1d(128, 1, 3, 1, padding=1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:  # x (B, 1, N)
        return _score_and_features(self.convs, self.post, x)


class Discriminators(nn.Module):
    """MPD (5 periods) + MSD (3 scales); returns per-discriminator scores and feature maps."""

    def __init__(self) -> None:
        super().__init__()
        self.periods = nn.ModuleList(PeriodDiscriminator(p) for p in MPD_PERIODS)
        self.scales = nn.ModuleList(ScaleDiscriminator() for _ in range(3))

    def forward(self, audio: torch.Tensor) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:  # audio (B, N)
        x = audio.unsqueeze(1)
        out = [d(x) for d in self.periods]
        for i, d in enumerate(self.scales):
            out.append(d(x if i == 0 else F.avg_pool1d(x, 2**i, 2**i)))
        return out


def discriminator_loss(real: list, fake: list) -> torch.Tensor:
    """LSGAN: real scores → 1, fake scores → 0 (`fake` computed on detached audio)."""
    loss = real[0][0].new_zeros(())
    for (score_r, _), (score_f, _) in zip(real, fake, strict=True):
        loss = loss + torch.mean((1 - score_r.float()) ** 2) + torch.mean(score_f.float() ** 2)
    return loss


def generator_adversarial_loss(real: list, fake: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(LSGAN generator loss, feature-matching L1), each summed over discriminators."""
    adv = fake[0][0].new_zeros(())
    fm = fake[0][0].new_zeros(())
    for (_, feats_r), (score_f, feats_f) in zip(real, fake, strict=True):
        adv = adv + torch.mean((1 - score_f.float()) ** 2)
        for fr, ff in zip(feats_r, feats_f, strict=True):
            fm = fm + F.l1_loss(ff.float(), fr.detach().float())
    return adv, fm

"""The codec's loss terms on inputs whose values are known by hand: LSGAN targets, feature matching as L1, and the
reconstruction loss as the mean over resolutions of (spectral convergence + log-magnitude L1) and of log-mel L1."""

from __future__ import annotations

import torch

from training.codec_losses import (
    LOG_FLOOR,
    STFT_RESOLUTIONS,
    ReconstructionLoss,
    discriminator_loss,
    generator_adversarial_loss,
)


def scores(value: float, feats: list[float]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return torch.full((2, 3), value), [torch.full((2, 4), f) for f in feats]


def test_lsgan_targets_real_one_fake_zero() -> None:
    perfect = discriminator_loss([scores(1.0, [])], [scores(0.0, [])])
    assert perfect.item() == 0.0
    # two discriminators: (1 - 0.5)^2 + 0.25^2 and (1 - 1)^2 + 1^2, summed
    both = discriminator_loss([scores(0.5, []), scores(1.0, [])], [scores(0.25, []), scores(1.0, [])])
    assert abs(both.item() - (0.25 + 0.0625 + 0.0 + 1.0)) < 1e-6


def test_generator_wants_fake_scored_one_and_matches_features_by_l1() -> None:
    adv, fm = generator_adversarial_loss([scores(0.3, [1.0, 2.0])], [scores(1.0, [1.0, 2.0])])
    assert (adv.item(), fm.item()) == (0.0, 0.0)
    adv, fm = generator_adversarial_loss([scores(0.3, [1.0, -2.0])], [scores(0.5, [3.0, 0.0])])
    assert abs(adv.item() - 0.25) < 1e-6
    assert abs(fm.item() - (2.0 + 2.0)) < 1e-6  # |3 - 1| + |0 - (-2)|: L1, not squared (that would be 8)


def test_reconstruction_is_the_mean_over_resolutions_of_its_hand_computed_terms() -> None:
    torch.manual_seed(0)
    real = torch.randn(2, 8192)
    fake = real + 0.3 * torch.randn(2, 8192)
    loss = ReconstructionLoss(44100)
    got = loss(fake, real)
    assert loss(real, real)["mel"].item() == 0.0
    sc_terms, mag_terms, mel_terms = [], [], []
    for i in range(len(STFT_RESOLUTIONS)):
        mf, mr = loss._magnitude(fake, i), loss._magnitude(real, i)
        sc_terms.append(torch.linalg.vector_norm(mr - mf) / torch.linalg.vector_norm(mr))
        mag_terms.append((mf.log() - mr.log()).abs().mean())
        fb = getattr(loss, f"fb{i}")
        mel = [(m.transpose(1, 2) @ fb).clamp_min(LOG_FLOOR).log() for m in (mf, mr)]
        mel_terms.append((mel[0] - mel[1]).abs().mean())
    n = len(STFT_RESOLUTIONS)
    torch.testing.assert_close(got["stft"], (sum(sc_terms) + sum(mag_terms)) / n, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["mel"], sum(mel_terms) / n, rtol=1e-5, atol=1e-6)
    assert all(t > 0.01 for t in sc_terms)  # every term is large enough that dropping one shows

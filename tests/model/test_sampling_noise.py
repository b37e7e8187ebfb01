"""The counter-based sampling noise: each row's draws depend only on (seed, step, stream, index), so streams,
seeds and steps all draw differently, and a batch changes nothing; several streams at once equal one at a time.
And the race's argmax: chunked over long rows, it names the index torch.argmax names."""

from __future__ import annotations

import pytest
import torch

from model.sampling import exponential_noise, noise_from_keys, noise_keys

N = 4096


def draws(seed: int, step: int, stream: int, n: int = N) -> torch.Tensor:
    return exponential_noise(torch.tensor([seed]), torch.tensor([step]), stream, n)[0]


def test_streams_seeds_and_steps_draw_differently() -> None:
    base = draws(7, 3, 0)
    for other in (draws(7, 3, 1), draws(7, 3, 2), draws(8, 3, 0), draws(7, 4, 0), draws(7 + (1 << 32), 3, 0)):
        assert not torch.equal(other, base)
        assert (other - base).abs().mean() > 0.5  # unrelated draws, not a shifted copy
    assert torch.equal(draws(7, 3, 0), base)  # and the same counters draw the same


def test_a_rows_draws_do_not_depend_on_its_batch() -> None:
    seeds, steps = torch.tensor([5, 7, 9]), torch.tensor([0, 3, 11])
    batch = exponential_noise(seeds, steps, 2, N)
    for row in range(3):
        assert torch.equal(batch[row], draws(int(seeds[row]), int(steps[row]), 2))


def test_several_streams_at_once_equal_one_at_a_time() -> None:
    seeds, steps = torch.tensor([5, 7]), torch.tensor([1, 2])
    keys = noise_keys(seeds, steps, 1, 3)  # streams 1, 2, 3
    together = noise_from_keys(keys, N)  # (B, 3, N)
    for j, stream in enumerate((1, 2, 3)):
        assert torch.equal(together[:, j], exponential_noise(seeds, steps, stream, N))


def test_draws_are_exponential() -> None:
    x = exponential_noise(torch.arange(64), torch.zeros(64, dtype=torch.int64), 0, N).flatten()
    assert x.min() > 0 and abs(x.mean().item() - 1.0) < 0.02 and abs(x.var().item() - 1.0) < 0.05


@pytest.mark.parametrize("width", [1000, 8192, 8193, 102_048, 3 * 1024])
def test_first_argmax_names_the_first_maximum_as_torch_argmax_does(width: int) -> None:
    # small integers make ties common, so "first" is what is tested; exponential-race scores are >= 0, and the
    # chunked path pads with -inf, so every row's maximum is also put at the very end and at a chunk's start
    from model.sampling import ARGMAX_CHUNK, first_argmax

    gen = torch.Generator().manual_seed(width)
    x = torch.randint(0, 5, (6, width), generator=gen).float()
    x[1, -1] = 9.0  # the maximum in the last (padded) chunk
    x[2, min(ARGMAX_CHUNK, width - 10)] = 9.0  # at the start of the second chunk, and again later
    x[2, -5] = 9.0
    x[3] = 0.0  # a row of ties: index 0
    x[4, 7] = 7.0
    x[4, width // 2] = 7.0
    got = first_argmax(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.argmax(x, dim=-1))
    assert got[3] == 0 and got[4] == 7

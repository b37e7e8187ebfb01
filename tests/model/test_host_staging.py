"""model.host_staging's slices on the CPU (pinned memory and the device copies themselves are GPU-tested in
tests/model/test_gpu.py): aligned, never reused before a release, a copy that does not fit falls back."""

from __future__ import annotations

import torch

from model.host_staging import ALIGN_BYTES, PinnedStaging


def test_slices_are_aligned_kept_until_released_and_overflow_falls_back() -> None:
    staging = PinnedStaging(256, torch.device("cpu"), pin=False)
    a = staging.to_device(torch.tensor([1, 2, 3], dtype=torch.int64))  # 24 bytes at 0
    b = staging.to_device(torch.tensor([[1.5, 2.5]], dtype=torch.float32))  # 8 bytes at 64
    assert staging.used == ALIGN_BYTES + 8 and staging.fallbacks == 0
    c = staging.to_device(torch.ones(30, dtype=torch.int64))  # 240 bytes: past the end
    assert staging.fallbacks == 1 and staging.used == ALIGN_BYTES + 8
    assert a.tolist() == [1, 2, 3] and b.tolist() == [[1.5, 2.5]] and c.sum() == 30  # nothing overwrote another
    staging.release()
    d = staging.to_device(torch.tensor([7], dtype=torch.int64))
    assert staging.used == 8 and d.tolist() == [7] and a.tolist()[0] == 7  # released: the first slice is reused


def test_a_strided_tensor_is_staged_as_its_values() -> None:
    staging = PinnedStaging(1024, torch.device("cpu"), pin=False)
    t = torch.arange(12, dtype=torch.int64).view(3, 4).t()  # not contiguous
    assert torch.equal(staging.to_device(t), t)

"""streaming.profiles for a library user: the default profile is the dataclasses' defaults, every override names a
field and changes it, overrides go on top, and the module stays pure Python."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from streaming import profiles
from streaming.config import BackendConfig, WorkerLimits


def test_the_default_profile_is_the_dataclasses_defaults() -> None:
    assert profiles.backend_config() == BackendConfig() and profiles.worker_limits() == WorkerLimits()
    assert profiles.PROFILES[profiles.DEFAULT_PROFILE].backend == {}
    assert profiles.PROFILES[profiles.DEFAULT_PROFILE].limits == {}
    assert BackendConfig().compile_max_batch is None  # automatic, as `fishgate serve` has it


@pytest.mark.parametrize("name", list(profiles.PROFILES))
def test_every_override_names_a_field_and_changes_it(name: str) -> None:
    profile = profiles.PROFILES[name]
    for config, overrides in ((BackendConfig(), profile.backend), (WorkerLimits(), profile.limits)):
        names = {f.name for f in dataclasses.fields(config)}
        for key, value in overrides.items():
            assert key in names, key
            assert getattr(config, key) != value, f"{name} sets {key} to its default"
    assert profiles.backend_config(name) is not None and profiles.worker_limits(name) is not None
    assert profile.summary and len(profile.summary) < 120


def test_overrides_go_on_top_of_the_profile() -> None:
    backend = profiles.backend_config("throughput", max_sessions=64, device="cpu")
    assert (backend.max_sessions, backend.device, backend.compile_max_batch) == (64, "cpu", 512)
    assert profiles.worker_limits("throughput", admission_turn_fraction=None).admission_turn_fraction is None
    with pytest.raises(TypeError):
        profiles.backend_config("latency", no_such_field=1)


def test_an_unknown_profile_names_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown profile 'fast': choose latency or throughput"):
        profiles.backend_config("fast")


def test_profiles_and_config_import_no_torch() -> None:
    code = "import sys, streaming.profiles; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

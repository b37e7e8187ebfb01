"""`fishgate serve`'s settings: the short and the full help, profiles, flags over FISHGATE_* variables over the profile
over streaming.config's defaults, and the engine configs a server builds from them (built, not started)."""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest

from server.app import build_gateway
from server.cli import main
from server.settings import ENV_PREFIX, Settings, parse_settings
from streaming import profiles
from streaming.config import BackendConfig, WorkerLimits
from streaming.engine import EngineConfig

MAX_HELP_LINES = 140
MAX_HELP_FLAGS = 27
RESERVED_FLAGS = 2  # kept free for options of other issues (--workers took one of the three)
OPTION_LINE = re.compile(r"^  (?:-\w, )?(--[a-z][a-z-]*)")


def help_of(argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps to the terminal: a narrow one is the worst case
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    return capsys.readouterr().out


def flags_in(text: str) -> list[str]:
    return [m.group(1) for line in text.splitlines() if (m := OPTION_LINE.match(line))]


def test_serve_help_shows_only_what_an_operator_needs(capsys, monkeypatch) -> None:
    out = help_of(["serve", "--help"], capsys, monkeypatch)
    flags = flags_in(out)
    assert len(out.splitlines()) <= MAX_HELP_LINES, len(out.splitlines())
    assert len(flags) + RESERVED_FLAGS <= MAX_HELP_FLAGS, flags
    for flag in ("--help", "--help-all", "--profile", "--host", "--port", "--checkpoint", "--device", "--max-sessions",
                 "--api-key", "--allowed-origins", "--references-dir", "--admission-turn-fraction"):  # fmt: skip
        assert flag in flags, flag
    assert "FISHGATE_API_KEY" in out and "FISHGATE_MAX_SESSIONS" in out
    assert "--vocoder-overlap" not in out and "--gemv-kernels" not in out  # advanced: --help-all
    assert "latency: 8, throughput: 512" in " ".join(out.split())  # each profile's default (streaming.config)
    assert not re.search(r"\bruns? \d", out)  # facts, not benchmark-log run numbers


def test_help_all_lists_every_setting_with_its_environment_variable(capsys, monkeypatch) -> None:
    out = help_of(["serve", "--help-all"], capsys, monkeypatch)
    flags = set(flags_in(out))
    for f in dataclasses.fields(Settings):
        assert "--" + f.name.replace("_", "-") in flags, f.name
        assert ENV_PREFIX + f.name.upper() in out, f.name
    assert not re.search(r"\bruns? \d", out)


def test_serve_without_flags_builds_exactly_the_default_profile() -> None:
    settings = parse_settings([], environ={})
    config = build_gateway(settings).engine.config
    cache = settings.resolved_compile_cache_dir  # the CLI's own cache folder: the one difference from the library
    assert config.backend == dataclasses.replace(profiles.backend_config(), compile_cache_dir=cache)
    assert config.limits == profiles.worker_limits()
    assert profiles.DEFAULT_PROFILE == "latency"
    assert config.backend == BackendConfig(compile_cache_dir=cache) and config.limits == WorkerLimits()
    assert config.backend.compile_max_batch is None  # automatic in both: 8 on a GPU with CUDA graphs, off on CPU
    engine_defaults = EngineConfig()
    assert (config.max_queued_chars, config.admission_wait_s) == (
        engine_defaults.max_queued_chars, engine_defaults.admission_wait_s
    )  # fmt: skip


@pytest.mark.parametrize("name", list(profiles.PROFILES))
def test_every_profile_resolves_by_flag_and_by_environment(name: str) -> None:
    for settings in (parse_settings(["--profile", name], {}), parse_settings([], {"FISHGATE_PROFILE": name})):
        config = build_gateway(settings).engine.config
        cache = settings.resolved_compile_cache_dir
        assert config.backend == profiles.backend_config(name, compile_cache_dir=cache)
        assert config.limits == profiles.worker_limits(name)
        assert settings.resolved_max_connections == 2 * config.backend.max_sessions + 256


def test_the_throughput_profile_is_the_measured_300_stream_configuration() -> None:
    """The settings of every 300-stream figure (bench/gpu.py THROUGHPUT_SERVE_ARGS; docs/BENCHMARKS.md)."""
    settings = parse_settings(["--profile", "throughput"], {})
    backend, limits = settings.backend_config(), settings.worker_limits()
    assert (backend.max_sessions, backend.compile_max_batch, backend.tune_single_row) == (512, 512, False)
    assert backend.vocoder_half_step_buckets is True and limits.admission_turn_fraction == 0.9
    assert dataclasses.replace(backend, max_sessions=8, compile_max_batch=None,
                               vocoder_half_step_buckets=False) == settings.__class__().backend_config()  # fmt: skip


def test_flags_override_the_profile_and_the_environment() -> None:
    env = {"FISHGATE_PROFILE": "throughput", "FISHGATE_MAX_SESSIONS": "128"}
    settings = parse_settings(["--max-sessions", "64", "--admission-turn-fraction", "off"], env)
    backend, limits = settings.backend_config(), settings.worker_limits()
    assert backend.max_sessions == 64 and limits.admission_turn_fraction is None  # flag > env > profile
    assert backend.compile_max_batch == 512  # the rest of the profile stays
    assert parse_settings(["--max-sessions", "64"], env).worker_limits().admission_turn_fraction == 0.9
    assert parse_settings([], env).backend_config().max_sessions == 128
    assert parse_settings(["--compile-max-batch", "auto"], env).backend_config().compile_max_batch is None
    assert parse_settings(["--compile-max-batch", "0"], env).backend_config().compile_max_batch == 0


def test_hidden_settings_still_read_their_environment_variables() -> None:
    env = {
        "FISHGATE_VOCODER_OVERLAP": "off", "FISHGATE_LENGTH_ATTENTION": "on", "FISHGATE_GEMV_KERNELS": "off",
        "FISHGATE_PROGRAMMATIC_LAUNCH": "off", "FISHGATE_GRAPHS_UP_FRONT": "4", "FISHGATE_PREFILL_GRAPHS_UP_FRONT": "0",
        "FISHGATE_COMPILE_TUNE_SINGLE_ROW": "on", "FISHGATE_VOCODER_HALF_STEP_BUCKETS": "on",
        "FISHGATE_BATCH_INVARIANT": "off", "FISHGATE_GEMV_CONFIGS": "/tmp/sweep.json",
        "FISHGATE_PACE_LEAD_S": "off", "FISHGATE_PREFILL_HOLD_BELOW_S": "0.2", "FISHGATE_PREFILL_HOLD_MAX_S": "0.05",
        "FISHGATE_ADMISSION_CAPACITY_FRACTION": "0.67", "FISHGATE_ADMISSION_WAIT_S": "0",
        "FISHGATE_MAX_QUEUED_CHARS": "30000", "FISHGATE_WS_COMPRESSION": "on", "FISHGATE_SEND_TIMEOUT_S": "5",
    }  # fmt: skip
    settings = parse_settings([], env)
    b, limits = settings.backend_config(), settings.worker_limits()
    assert (b.vocoder_overlap, b.length_attention, b.gemv_kernels, b.programmatic_launch) == (False, True, False, False)
    assert (b.graphs_up_front, b.prefill_graphs_up_front, b.tune_single_row) == (4, 0, True)
    assert (b.vocoder_half_step_buckets, b.batch_invariant, str(b.gemv_configs)) == (True, False, "/tmp/sweep.json")
    assert (limits.pace_lead_s, limits.prefill_hold_below_s, limits.prefill_hold_max_s) == (None, 0.2, 0.05)
    assert limits.admission_capacity_fraction == 0.67
    config = build_gateway(settings).engine.config
    assert (config.admission_wait_s, config.max_queued_chars) == (0, 30_000)
    assert (settings.ws_compression, settings.send_timeout_s) == ("on", 5.0)
    assert parse_settings(["--vocoder-overlap", "on"], env).backend_config().vocoder_overlap is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-sessions", "0"], "--max-sessions must be at least 1"),
        (["--profile", "fast"], "--profile must be latency or throughput"),
        (["--vocoder-overlap", "yes"], "--vocoder-overlap must be auto, on or off"),
        (["--programmatic-launch", "on"], "--programmatic-launch must be auto or off"),
        (["--compile-after-ready", "yes"], "--compile-after-ready must be on or off"),
        (["--compile-max-batch", "-1"], "--compile-max-batch must be 0"),
        (["--compile-max-batch", "many"], "--compile-max-batch must be a whole number or auto"),
        (["--graphs-up-front", "0"], "--graphs-up-front must be at least 1"),
        (["--admission-turn-fraction", "3"], "--admission-turn-fraction must be in"),
        (["--admission-capacity-fraction", "0"], "--admission-capacity-fraction must be in"),
        (["--prefill-hold-below-s", "0"], "--prefill-hold-below-s must be in"),
        (["--prefill-hold-max-s", "-1"], "--prefill-hold-max-s must be in"),
        (["--pace-lead-s", "0.5"], "--pace-lead-s must be in"),
        (["--max-queued-chars", "100"], "--max-queued-chars must be at least --max-text-chars"),
        (["--max-connections", "0"], "--max-connections must be at least 1"),
    ],
)
def test_bad_values_are_refused_naming_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=re.escape(message)):
        parse_settings(argv, {})


@pytest.mark.parametrize(
    "flag",
    ["--vocoder-merge-padding", "--vocoder-channels-last", "--compile-vocoder", "--compile-symbolic-batch-above",
     "--prefill-max-rows", "--graph-first-frames", "--graph-prefill", "--prefill-step-share", "--admission-per-turn",
     "--prefill-hold-for"],
)  # fmt: skip
def test_removed_options_are_refused_naming_what_became_of_them(flag: str, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        parse_settings([flag, "1"], {})
    assert done.value.code == 2 and f"{flag} was removed (" in capsys.readouterr().err


def test_settings_built_directly_resolve_like_parsed_ones() -> None:
    """Tests and embedders build Settings(...) with typed values: unset engine fields still come from the profile."""
    settings = Settings(max_sessions=4, admission_turn_fraction=0.5, pace_lead_s="off", profile="throughput")
    assert settings.backend_config().max_sessions == 4 and settings.backend_config().compile_max_batch == 512
    assert settings.worker_limits().admission_turn_fraction == 0.5 and settings.worker_limits().pace_lead_s is None


def test_the_prompt_hold_and_pacing_flags_reach_the_engines_worker_limits() -> None:
    limits = build_gateway(parse_settings([], {})).engine.config.limits
    assert (limits.prefill_hold_below_s, limits.prefill_hold_max_s, limits.pace_lead_s) == (0.1, 0.25, 1.5)
    flags = ["--prefill-hold-below-s", "off", "--prefill-hold-max-s", "0.05", "--pace-lead-s", "3.5"]
    limits = build_gateway(parse_settings(flags, {})).engine.config.limits
    assert (limits.prefill_hold_below_s, limits.prefill_hold_max_s, limits.pace_lead_s) == (None, 0.05, 3.5)


def test_compile_after_ready_reaches_the_backend_config() -> None:
    assert build_gateway(parse_settings([], {})).engine.config.backend.compile_after_ready is False
    on = build_gateway(parse_settings(["--compile-after-ready", "on"], {}))
    assert on.engine.config.backend.compile_after_ready is True


def test_a_removed_setting_in_the_environment_is_only_warned_about(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="fishgate"):
        settings = parse_settings([], environ={"FISHGATE_PREFILL_MAX_ROWS": "8"})
    assert settings == parse_settings([], environ={})
    assert "FISHGATE_PREFILL_MAX_ROWS is ignored" in caplog.text

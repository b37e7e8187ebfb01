"""Saved region variants (model.saved_regions) against torch.compile's path and eager PyTorch, on CPU with inductor:
a later process decodes the same frames from the loaded files without compiling; a file that does not load, a
variant whose guards refuse its arguments and one that cannot be saved fall back to compiling; a changed switch
names a variant of its own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from model import compiled_regions, sampling, saved_regions
from model.compiled_regions import region
from model.stepper import DecodeStepper
from tests.model.test_compiled_regions import SAMPLINGS, run_script
from tests.model.test_kv_cache import make_model, random_sequence

ROOT = Path(__file__).resolve().parents[2]

# one process's decode: rows 1 and 2 (the one-row variants and the symbolic ones), eager, through torch.compile's
# path, or through saved variants (argv: mode, folder, device); prints the frames and the cache counts
DECODE = """
import json, sys, torch
from pathlib import Path
from model import compiled_regions, saved_regions
from model.stepper import DecodeStepper
from tests.model.test_compiled_regions import run_stepper
from tests.model.test_kv_cache import make_model

mode, folder, device = sys.argv[1:4]
torch.manual_seed(0)
model = make_model("gqa_fast_project").to(device)
model.freqs_cis, model.fast_freqs_cis = model.freqs_cis.float(), model.fast_freqs_cis.float()
if mode == "saved":
    saved_regions.save_in(Path(folder))
stepper = DecodeStepper(model, 2, max_seq_len=64, length_buckets=[64], use_cuda_graphs=device == "cuda",
                        compile_backend=None if mode == "eager" else "inductor", symbolic_batch_above=1)
with torch.no_grad():
    frames = run_stepper(stepper, 2, 3)
print(json.dumps({"frames": frames.tolist(), "counts": compiled_regions.cache_counts(),
                  "failed": compiled_regions.failed_regions()}))
"""


def decode(mode: str, folder: Path, cache: Path, device: str = "cpu", hash_seed: int = 0) -> dict:
    """DECODE in a new process, with inductor's caches in `cache` (and its own string hashing: set orders differ)."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton"),
           "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": str(hash_seed)}  # fmt: skip
    return run_script(DECODE, env, 600, (mode, str(folder), device))


def check_later_process_loads_every_variant(tmp_path: Path, device: str, reference: str) -> None:
    folder = tmp_path / "regions"
    expected = decode(reference, folder, tmp_path / "inductor", device)
    first = decode("saved", folder, tmp_path / "inductor", device, hash_seed=1)
    n = first["counts"]["regions_saved"]
    assert n >= 4 and first["counts"]["regions_loaded"] == 0 and first["counts"]["regions_refused"] == 0
    assert len(list(folder.glob("*.bin"))) == n
    second = decode("saved", folder, tmp_path / "inductor", device, hash_seed=2)
    assert second["counts"]["regions_loaded"] == n
    assert second["counts"]["regions_saved"] == 0 and second["counts"]["regions_refused"] == 0
    assert second["counts"]["fx_graphs_compiled"] == 0, "nothing compiled: every variant came from its file"
    assert first["failed"] == second["failed"] == []
    assert first["frames"] == expected["frames"] and second["frames"] == expected["frames"]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_later_process_loads_every_variant_and_decodes_the_same_frames(tmp_path: Path) -> None:
    check_later_process_loads_every_variant(tmp_path, "cpu", reference="eager")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_later_processes_decode_torch_compiles_frames_from_saved_variants(tmp_path: Path) -> None:
    """The same on CUDA, in CUDA graphs with the GEMV kernels (one row): the frames of torch.compile's path."""
    check_later_process_loads_every_variant(tmp_path, "cuda", reference="compiled")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_first_frames_of_a_symbolic_batch_load_every_variant(regions: Regions) -> None:
    """The engine's first frames (static buffers, CUDA graphs' shapes) of two rows, a symbolic batch, on a model with
    two fast layers: every variant saved and loaded, none refused. A symbolic variant traced where a view's storage
    offset is 2 or more guards it as such (0 and 1 specialise): the fast block's, first traced at layer 1 (a layer of
    the fast cache in), refused layer 0 (offset 0) at the next codebook, at every start."""
    model = make_model("tied_qkv_bias_mha")  # two fast layers
    rows = [0, 1]
    prompts = [random_sequence(model, 9 + 6 * row, seed=row) for row in rows]
    frames = []
    for start in ("eager", "first", "later"):
        stepper = DecodeStepper(model, 4, max_batch=3, max_seq_len=64, length_buckets=[64], first_frame_scratch_row=2,
                                compile_backend=None if start == "eager" else "inductor", symbolic_batch_above=1)  # fmt: skip
        for row in rows:
            stepper.set_sampling(row, SAMPLINGS[row])
        logits, hidden = stepper.prefill_many(rows, prompts, [0] * len(rows))
        frames.append(stepper.start_segments(rows, logits, hidden, [p.shape[1] for p in prompts]))
        if start != "eager":
            done = "regions_saved" if start == "first" else "regions_loaded"
            counts = saved_regions.counts()
            assert counts["regions_refused"] == 0 and counts[done] >= 4, (start, counts)
            regions.restart()
    assert compiled_regions.failed_regions() == []
    assert torch.equal(frames[1], frames[0]) and torch.equal(frames[2], frames[0])


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((4,), 2.0))
        self.shift = 1.0  # a plain attribute: the compiled code is specialised on it and guards it

    @region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + self.shift


class Regions:
    """Saving on in one folder, with nothing compiled or loaded in this process yet."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.restart()

    def restart(self) -> None:
        """What a new process has: no compiled or loaded variants in memory, the folder's files on disk."""
        compiled_regions.reset()
        saved_regions.save_in(self.folder)


@pytest.fixture
def regions(tmp_path: Path) -> Iterator[Regions]:
    yield Regions(tmp_path / "regions")
    saved_regions.save_in(None)
    compiled_regions.reset()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_file_that_does_not_load_falls_back_to_compiling(regions: Regions, caplog) -> None:
    module, x = Scale(), torch.arange(4.0)
    with torch.inference_mode(), compiled_regions.compiled("inductor"):
        assert torch.equal(module(x), x * 2 + 1)
    (path,) = regions.folder.glob("*.bin")
    path.write_bytes(b"not a saved function")
    regions.restart()
    with torch.inference_mode(), compiled_regions.compiled("inductor"):
        assert torch.equal(module(x), x * 2 + 1)
    assert saved_regions.counts() == {"regions_loaded": 0, "regions_saved": 0, "regions_refused": 1}
    assert "could not be loaded from" in caplog.text and "compiles as usual" in caplog.text


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_loaded_variant_whose_guards_refuse_falls_back_to_compiling(regions: Regions, caplog) -> None:
    module, x = Scale(), torch.arange(4.0)
    with torch.inference_mode(), compiled_regions.compiled("inductor"):
        assert torch.equal(module(x), x * 2 + 1)
    regions.restart()
    with torch.inference_mode(), compiled_regions.compiled("inductor"):
        assert torch.equal(module(x), x * 2 + 1)  # loaded, its guards pass
        assert saved_regions.counts()["regions_loaded"] == 1
        module.shift = 5.0  # not in the file's name: the loaded code's guard on it refuses
        assert torch.equal(module(x), x * 2 + 5)
    assert saved_regions.counts()["regions_refused"] == 1
    assert "refused its arguments" in caplog.text


def test_saving_is_off_until_a_folder_is_given() -> None:
    assert saved_regions.folder() is None and saved_regions.counts() == {}
    assert "regions_loaded" not in compiled_regions.cache_counts()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_inference_tensors_and_plain_ones_get_variants_of_their_own(regions: Regions) -> None:
    """A region called with tensors made inside and outside inference mode (different dispatch keys, which the
    compiled code's guards check) saves one variant for each, and a later start loads both without refusals."""
    module = Scale()
    with torch.no_grad():
        plain = torch.arange(4.0)
    with torch.inference_mode():
        made_inside = torch.arange(4.0)
    for start in ("first", "later"):
        with torch.no_grad(), compiled_regions.compiled("inductor"):
            assert torch.equal(module(plain), plain * 2 + 1)
            assert torch.equal(module(made_inside), made_inside * 2 + 1)
        done = "regions_saved" if start == "first" else "regions_loaded"
        assert saved_regions.counts()[done] == 2 and saved_regions.counts()["regions_refused"] == 0
        regions.restart()
    assert len(list(regions.folder.glob("*.bin"))) == 2


@region
def times_min_temperature(x: torch.Tensor) -> torch.Tensor:
    return x * sampling.MIN_TEMPERATURE  # a module-level switch of the model package, as gemv.MODE is


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_changed_module_switch_gets_a_variant_of_its_own(regions: Regions, monkeypatch) -> None:
    """The loaded code's guards do not check module globals (a loaded variant kept gemv.MODE = "auto" after the
    engine set "off"), so the switches are part of each file's name: a later start with another value compiles
    and saves anew instead of loading the old code."""
    x = torch.arange(4.0)
    for value, done in ((2.0, "regions_saved"), (2.0, "regions_loaded"), (3.0, "regions_saved")):
        monkeypatch.setattr(sampling, "MIN_TEMPERATURE", value)
        regions.restart()
        with torch.inference_mode(), compiled_regions.compiled("inductor"):
            assert torch.equal(times_min_temperature(x), x * value)
        assert saved_regions.counts()[done] == 1, (value, saved_regions.counts())
    assert len(list(regions.folder.glob("*.bin"))) == 2


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_variant_that_cannot_be_saved_is_not_tried_again_at_later_starts(regions: Regions, monkeypatch, caplog):
    """aot_compile failing for a variant: torch.compile's path, and a note beside the files so that the next start
    goes there at once instead of paying a compile that fails again."""
    real_compile = torch.compile

    def compile_without_aot(*args, **kwargs):
        compiled = real_compile(*args, **kwargs)

        def wrapper(*a, **k):  # without aot_compile, as torch 2.11 gives by default
            return compiled(*a, **k)

        return wrapper

    monkeypatch.setattr(torch, "compile", compile_without_aot)
    module, x = Scale(), torch.arange(4.0)
    for start in ("first", "later"):
        caplog.clear()
        with torch.inference_mode(), compiled_regions.compiled("inductor"):
            assert torch.equal(module(x), x * 2 + 1)
        assert saved_regions.counts() == {"regions_loaded": 0, "regions_saved": 0, "regions_refused": 1}
        assert ("could not be compiled to be saved" in caplog.text) == (start == "first")
        regions.restart()
    assert len(list(regions.folder.glob("*.unsavable"))) == 1 and not list(regions.folder.glob("*.bin"))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_folder_that_cannot_be_written_is_said_once_and_the_variants_still_run(regions: Regions, caplog) -> None:
    from torch._dynamo.aot_compile import AOTCompiledFunction

    def full_disk(self, path, *args, **kwargs):
        raise OSError(28, "No space left on device")

    module, x = Scale(), torch.arange(4.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AOTCompiledFunction, "save_compiled_function", full_disk)
        with torch.inference_mode(), compiled_regions.compiled("inductor"):
            assert torch.equal(module(x), x * 2 + 1)
            assert torch.equal(module(torch.ones(2, 4)), torch.full((2, 4), 3.0))  # a second variant
    assert saved_regions.counts() == {"regions_loaded": 0, "regions_saved": 0, "regions_refused": 2}
    assert caplog.text.count("cannot be saved in") == 1 and not list(regions.folder.iterdir())


def test_switches_name_torchs_own_flags_too(monkeypatch) -> None:
    """cuDNN autotuning decides a vocoder layout while tracing (model.codec_layers); it is part of the names."""
    before = saved_regions.switches()
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", not torch.backends.cudnn.benchmark)
    assert saved_regions.switches() != before

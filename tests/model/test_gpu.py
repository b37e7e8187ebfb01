"""GPU-only equivalence tests (skipped without CUDA): graph replay == eager for the decode stepper, bf16 logits of
the full-size model close to fp32 (tolerances from bench/gpu_model_check, see docs/BENCHMARKS.md), the streaming
vocoder's CUDA graph == eager at the official config, and the torch.compile'd step == eager."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from bench.fullsize import random_codec, random_model
from bench.gpu_model_check import compare, make_sequence
from model.dual_ar import DualARTransformer
from model.stepper import DecodeStepper, RowSampling
from model.vocoder_stream import StreamingDecoder
from tests.model.test_compiled_regions import cache_counts_of_starts
from tests.model.test_kv_cache import SEMANTIC_BEGIN, make_model, random_sequence

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# bf16 vs fp32 on the same weights, full-size model, teacher-forced forward. Measured on an H200 (1,033 tokens,
# docs/BENCHMARKS.md): ‖Δ‖/‖ref‖ 1.8e-2 (token) / 2.1e-2 (codebook), mean KL 1.8e-3 / 2.1e-3, top-1 0.95 / 0.96.
# Tolerances: ~2× the error, top-1 ten points under.
BF16_REL_ERR_MAX = 5e-2
BF16_KL_MEAN_MAX = 5e-3
BF16_TOP1_MIN = 0.85
SAMPLINGS = [RowSampling(0.0, 1.0, 1.0, seed=1), RowSampling(0.7, 0.7, 1.2, seed=2), RowSampling(0.0, 0.7, 1.2, seed=3)]


def cuda_model(name: str, dtype: torch.dtype) -> DualARTransformer:
    model = make_model(name).to("cuda", dtype)
    model.freqs_cis = model.freqs_cis.float()  # RoPE tables stay fp32, as load_dual_ar keeps them
    model.fast_freqs_cis = model.fast_freqs_cis.float()
    return model


def run_stepper(stepper: DecodeStepper, n_steps: int) -> torch.Tensor:
    """Prefill three streams (different lengths and samplings), then n_steps committed steps; frames (steps, 3, 1+nc)."""
    for row, s in enumerate(SAMPLINGS):
        stepper.set_sampling(row, s)
        stepper.set_noise_step(row, 0)
        prompt = random_sequence(stepper.model, 10 + 7 * row, seed=row)
        logits, hidden = stepper.prefill(row, prompt, 0)
        stepper.start_segment(row, logits, hidden, prompt.shape[1])
    frames = []
    for _ in range(n_steps):
        stepper.commit[:3] = True
        frames.append(stepper.step(3, int(stepper.pos[:3].max())))
    return torch.stack(frames)


@torch.no_grad()
def test_stepper_graph_replay_equals_eager() -> None:
    model = cuda_model("gqa_fast_project", torch.bfloat16)
    eager = run_stepper(DecodeStepper(model, 4, max_seq_len=128, length_buckets=[64]), 12)
    graphed_stepper = DecodeStepper(model, 4, max_seq_len=128, length_buckets=[64], use_cuda_graphs=True)
    graphed = run_stepper(graphed_stepper, 12)
    assert graphed_stepper._graphs, "no CUDA graph was captured"
    assert torch.equal(graphed, eager)
    assert (eager[:, :, 0] >= SEMANTIC_BEGIN).any(), "the check should cover semantic frames"


@torch.no_grad()
def test_a_step_routed_to_a_larger_buckets_graph_gives_its_own_buckets_frames() -> None:
    """DecodeStepper.route: steps of 3 rows replayed in the 8-row graph (5 padding rows, commit off) give the frames of
    the 4-row graph, batch-invariant bf16; the capture timed both graphs. Replay times set by hand force the plan."""
    model = cuda_model("gqa_fast_project", torch.bfloat16)
    model.set_batch_invariant(True)

    def frames(times: dict[int, float] | None) -> tuple[torch.Tensor, DecodeStepper]:
        stepper = DecodeStepper(model, 9, max_seq_len=128, max_batch=8, use_cuda_graphs=True)  # one length: the cache's
        full = stepper.cache.max_seq_len
        for bucket in (4, 8):
            stepper.capture(bucket, full)
        assert all(stepper.replay_ms[(b, full)] > 0 for b in (4, 8)), "each capture times its graph"
        if times is not None:
            stepper.replay_ms = {(b, full): ms for b, ms in times.items()}
        return run_stepper(stepper, 12), stepper

    own, own_stepper = frames({4: 1.0, 8: 5.0})
    routed, stepper = frames({4: 5.0, 8: 1.0})
    assert own_stepper.routed_steps == 0 and stepper.routed_steps == 12 and stepper.last_bucket[0] == 8
    assert torch.equal(routed, own)
    assert (own[:, :, 0] >= SEMANTIC_BEGIN).any(), "the check should cover semantic frames"


@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning")
@pytest.mark.parametrize("gemv_rows", [1, 8])
@torch.no_grad()
def test_compiled_step_equals_eager(gemv_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor-compiled step in a CUDA graph (fp32, so fusion changes only rounding): the same frames; with
    model.gemv's kernels for the 4-row bucket too (gemv.MAX_ROWS 8) or not."""
    from model import compiled_regions, gemv

    monkeypatch.setattr(gemv, "MAX_ROWS", gemv_rows)
    compiled_regions.reset()
    model = cuda_model("gqa_fast_project", torch.float32)
    model.fuse_feed_forward()
    eager = run_stepper(DecodeStepper(model, 4, max_seq_len=128, length_buckets=[64]), 8)
    compiled = DecodeStepper(
        model, 4, max_seq_len=128, length_buckets=[64], use_cuda_graphs=True, compile_backend="inductor"
    )
    got = run_stepper(compiled, 8)
    assert torch.equal(got[:, [0, 2]], eager[:, [0, 2]]), "greedy rows differ"
    assert (got == eager).float().mean() >= 0.95


@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning")
@torch.no_grad()
def test_deferred_compilation_replaces_graphs_without_changing_frames() -> None:
    """--compile-after-ready: graphs captured uncompiled at start, then replaced one by one by compiled captures
    between steps (fp32): greedy frames equal eager's before, during and after the replacements."""
    from model import compiled_regions

    compiled_regions.reset()
    model = cuda_model("gqa_fast_project", torch.float32)
    model.fuse_feed_forward()
    eager = run_stepper(DecodeStepper(model, 4, max_seq_len=128, length_buckets=[64]), 8)
    deferred = DecodeStepper(
        model, 4, max_seq_len=128, length_buckets=[64], use_cuda_graphs=True, compile_backend="inductor",
        first_frame_scratch_row=3, defer_compile=True,
    )  # fmt: skip
    deferred.capture_all()
    assert deferred.pending_upgrades(), "nothing was left to compile"
    for row, s in enumerate(SAMPLINGS):
        deferred.set_sampling(row, s)
        deferred.set_noise_step(row, 0)
        prompt = random_sequence(model, 10 + 7 * row, seed=row)
        logits, hidden = deferred.prefill(row, prompt, 0)
        deferred.start_segment(row, logits, hidden, prompt.shape[1])
    frames = []
    for _ in range(8):
        deferred.commit[:3] = True
        frames.append(deferred.step(3, int(deferred.pos[:3].max())))
        for _ in range(2):  # replacements between steps (9 graphs: decode 3 batches × 2 lengths, first frames 3)
            deferred.capture_next([int(p) for p in deferred.pos.tolist()])
    got = torch.stack(frames)
    assert deferred.pending_upgrades() == []
    assert torch.equal(got[:, [0, 2]], eager[:, [0, 2]]), "greedy rows differ"
    assert (got == eager).float().mean() >= 0.95


@pytest.mark.parametrize("gemv_mode", ["off", "auto"])
def test_tuned_one_row_step_equals_eager(gemv_mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-row bucket compiled with coordinate-descent tuning (its GEMVs as Triton reductions, or with
    model.gemv's fused kernels), in a CUDA graph, fp32: a greedy row gives the eager frames, a sampled row nearly
    all of them."""
    from model import compiled_regions, gemv

    monkeypatch.setattr(gemv, "MODE", gemv_mode)
    compiled_regions.reset()
    model = cuda_model("gqa_fast_project", torch.float32)
    model.fuse_feed_forward()
    for row in (0, 1):  # greedy, then sampled
        steppers = [
            DecodeStepper(model, 2, max_seq_len=128, length_buckets=[64]),
            DecodeStepper(
                model, 2, max_seq_len=128, length_buckets=[64], use_cuda_graphs=True, compile_backend="inductor",
                tune_single_row=True,
            ),
        ]  # fmt: skip
        frames = []
        for st in steppers:
            st.set_sampling(0, SAMPLINGS[row])
            st.set_noise_step(0, 0)
            prompt = random_sequence(model, 12, seed=row)
            logits, hidden = st.prefill(0, prompt, 0)
            st.start_segment(0, logits, hidden, prompt.shape[1])
            out = []
            for _ in range(10):
                st.commit[:1] = True
                out.append(st.step(1, int(st.pos[:1].max())))
            frames.append(torch.stack(out))
        assert steppers[1].tune_single_row and steppers[1]._graphs
        if row == 0:
            assert torch.equal(frames[1], frames[0]), "greedy frames differ"
        else:
            assert (frames[1] == frames[0]).float().mean() >= 0.9


@torch.inference_mode()
def test_full_size_bf16_logits_close_to_fp32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    model16 = random_model("cuda", torch.bfloat16, seed=0)
    model32 = copy.deepcopy(model16).float()  # the same (bf16-valued) weights in fp32
    seq = make_sequence(model16, 300).to("cuda")
    ref = model32(seq.unsqueeze(0))
    del model32
    got = model16(seq.unsqueeze(0))
    token = compare(got[0][0].float(), ref[0][0].float())
    used = ref[1][0].flatten(1).abs().amax(-1) > 0
    codebook = compare(got[1][0][used].flatten(0, 1).float(), ref[1][0][used].flatten(0, 1).float())
    for name, r in (("token", token), ("codebook", codebook)):
        assert r["rel_err"] <= BF16_REL_ERR_MAX, (name, r)
        assert r["kl_mean"] <= BF16_KL_MEAN_MAX, (name, r)
        assert r["top1_agree"] >= BF16_TOP1_MIN, (name, r)
        assert r["rel_err"] > 0, "bf16 and fp32 should not be bitwise equal: is the model really bf16?"


@torch.inference_mode()
def test_streaming_vocoder_graph_equals_eager_official_bf16() -> None:
    codec = random_codec("cuda", torch.bfloat16)
    rows = codec.config.rows
    gen = torch.Generator(device="cuda").manual_seed(5)
    chunks = [torch.randint(0, 1000, (4, rows, 8), generator=gen, device="cuda") for _ in range(3)]
    slots = torch.tensor([2, 0, 5, 3], device="cuda")
    eager_dec, graph_dec = StreamingDecoder(codec, max_slots=6), StreamingDecoder(codec, max_slots=6)
    static_codes = chunks[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph_dec.decode(static_codes, slots)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = graph_dec.decode(static_codes, slots)
    graph_dec.reset(slots)
    eager, replayed = [], []
    for chunk in chunks:
        eager.append(eager_dec.decode(chunk, slots))
        static_codes.copy_(chunk)
        graph.replay()
        replayed.append(static_out.clone())
    e, g = torch.cat(eager, -1).float(), torch.cat(replayed, -1).float()
    assert e.abs().max() > 1e-3, "the random codec should make non-trivial audio"
    assert (g - e).abs().max() <= 2e-3


@torch.inference_mode()
def test_channels_last_vocoder_graphs_equal_the_default_layout_official(monkeypatch: pytest.MonkeyPatch) -> None:
    """The channels-last streaming decoder (time-major activations, state and weights) replayed through
    GraphedVocoder against the default layout's graphs, three chunks (the carried state is compared too): fp32 to
    float rounding; in bf16 each layout is compared with the fp32 audio, since two bf16 paths that round in a
    different order differ from each other by up to twice their own error (H200: 3 % of the peak between them)."""
    from model.vocoder_graphs import GraphedVocoder

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # fp32 at 1e-4: no TF32 convs
    gen = torch.Generator(device="cuda").manual_seed(9)
    codec32 = random_codec("cuda", torch.float32)
    rows = codec32.config.rows
    chunks = [torch.randint(0, 1000, (3, rows, 8), generator=gen, device="cuda") for _ in range(3)]
    slots = torch.tensor([2, 0, 1], device="cuda")

    def audio(codec, channels_last: bool) -> torch.Tensor:
        graphed = GraphedVocoder(StreamingDecoder(codec, max_slots=8, channels_last=channels_last), 4, [4])
        return torch.cat([graphed.decode(c, slots).clone() for c in chunks], -1).float()

    reference = audio(copy.deepcopy(codec32), channels_last=False)
    assert reference.abs().max() > 1e-3
    fast = audio(copy.deepcopy(codec32), channels_last=True)
    assert (fast - reference).abs().max() <= 1e-4 * reference.abs().max()
    for channels_last in (False, True):
        got = audio(random_codec("cuda", torch.bfloat16), channels_last)
        rel = float((got - reference).norm() / reference.norm())
        assert rel <= 5e-2, (channels_last, rel)  # H200: 2.7–2.8 % in both layouts


@torch.inference_mode()
def test_rerouted_vocoder_calls_equal_their_own_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    """GraphedVocoder's timed dispatch: a call run on a larger bucket's graph (more padding rows) or split over
    several replays of a smaller one gives the audio of its own bucket's graph, three chunks (carried state too),
    fp32; padding rows leave the real slots alone. The replay times are set by hand to force each plan."""
    from model.vocoder_graphs import GraphedVocoder

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    gen = torch.Generator(device="cuda").manual_seed(11)
    codec = random_codec("cuda", torch.float32)
    chunks = [torch.randint(0, 1000, (3, codec.config.rows, 8), generator=gen, device="cuda") for _ in range(3)]
    slots = torch.tensor([5, 0, 2], device="cuda")

    def audio(times: dict[int, float] | None) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        graphed = GraphedVocoder(StreamingDecoder(copy.deepcopy(codec), max_slots=16), 8, [2, 4, 8])
        for bucket in (2, 4, 8):
            graphed.capture(bucket, 8)
        if times is not None:
            graphed.replay_ms = {(b, 8): ms for b, ms in times.items()}
        plans = [graphed.plan(3, 8) for _ in chunks]
        return torch.cat([graphed.decode(c, slots).clone() for c in chunks], -1), plans

    reference, plans = audio({2: 5.0, 4: 5.0, 8: 9.0})
    assert plans[0] == (4, 1) and reference.abs().max() > 1e-3
    for times, plan in (({2: 5.0, 4: 50.0, 8: 90.0}, (2, 2)), ({2: 40.0, 4: 50.0, 8: 9.0}, (8, 1))):
        got, plans = audio(times)
        assert plans[0] == plan
        assert (got - reference).abs().max() <= 1e-4 * reference.abs().max(), plan


@torch.no_grad()
def test_batched_prefill_on_gpu_matches_row_by_row() -> None:
    """The engine's GPU prefill path (prefill_many: one SDPA pass over right-padded prompts) against one prefill per
    row, fp32 (TF32 off) so that only summation order differs, and bf16 within the bf16 tolerance."""
    torch.backends.cuda.matmul.allow_tf32 = False
    for dtype, rel in ((torch.float32, 1e-4), (torch.bfloat16, BF16_REL_ERR_MAX)):
        model = cuda_model("gqa_fast_project", dtype)
        prompts = [random_sequence(model, n, seed=60 + n).cuda() for n in (31, 9, 20)]
        single, batched = model.make_cache(4), model.make_cache(4)
        expected = [model.prefill(p, single, row) for row, p in zip((3, 0, 1), prompts, strict=True)]
        logits, _ = model.prefill_many(prompts, batched, [3, 0, 1], [0, 0, 0])
        for b, (row, p) in enumerate(zip((3, 0, 1), prompts, strict=True)):
            ref = expected[b][0].float()
            assert (logits[b].float() - ref).norm() <= rel * ref.norm(), (dtype, row)
            k_ref = single.k[:, row, :, : p.shape[1]].float()
            assert (batched.k[:, row, :, : p.shape[1]].float() - k_ref).norm() <= rel * k_ref.norm(), (dtype, row)


@torch.no_grad()
def test_first_frame_graphs_equal_the_same_buckets_eager() -> None:
    """start_segments through a captured graph per batch bucket == the same padded buckets run eagerly (frames and
    every real row's state), in bf16 and fp32; padding writes the scratch row only."""
    from tests.model.test_stepper import first_frames

    for dtype in (torch.bfloat16, torch.float32):
        model = cuda_model("gqa_fast_project", dtype)
        for rows in ([1], [2, 0, 4], [0, 1, 2, 3, 4, 5]):
            kwargs = {"max_batch": 7, "max_seq_len": 128, "length_buckets": [64], "first_frame_scratch_row": 7}
            eager = DecodeStepper(model, 8, **kwargs)
            graphed = DecodeStepper(model, 8, use_cuda_graphs=True, **kwargs)
            assert torch.equal(first_frames(eager, rows), first_frames(graphed, rows))
            assert len(graphed._first_graphs) == 1 and not eager._first_graphs
            for t_eager, t_graphed in zip(eager._row_tensors(), graphed._row_tensors(), strict=True):
                assert torch.equal(t_eager[:7], t_graphed[:7])


@torch.no_grad()
def test_prefill_graphs_equal_the_same_buckets_eager() -> None:
    """prefill through a captured graph per (rows, chunk, attention length) bucket == the same padded passes run
    eagerly, bitwise in bf16 and fp32: logits, hidden and every row of the cache but the scratch row. A bucket's
    second call replays its graph; idle capture writes the scratch row only."""
    from tests.model.test_prefill_graphs import CASES, SCRATCH

    calls = [*CASES, ([0, 5, 1], [12, 50, 33], [64, 70, 0])]  # the last: bucket (4, 64, 128) again, new inputs
    for dtype in (torch.bfloat16, torch.float32):
        model = cuda_model("gqa_fast_project", dtype)
        kwargs = {"max_seq_len": 256, "length_buckets": [64, 128], "prefill_scratch_row": SCRATCH}
        eager = DecodeStepper(model, 8, **kwargs)
        graphed = DecodeStepper(model, 8, use_cuda_graphs=True, **kwargs)
        gen = torch.Generator(device="cuda").manual_seed(3)
        stale = torch.randn((2, *eager.cache.k.shape), generator=gen, device="cuda").to(dtype)
        for stepper in (eager, graphed):
            stepper.cache.k.copy_(stale[0])
            stepper.cache.v.copy_(stale[1])
        for rows, lengths, starts in calls:
            prompts = [random_sequence(model, n, seed=n) for n in lengths]
            expected = eager.prefill_many(rows, prompts, starts)
            got = graphed.prefill_many(rows, prompts, starts)
            assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1]), (dtype, rows)
            assert torch.equal(eager.cache.k[:, :SCRATCH], graphed.cache.k[:, :SCRATCH]), (dtype, rows)
            assert torch.equal(eager.cache.v[:, :SCRATCH], graphed.cache.v[:, :SCRATCH]), (dtype, rows)
        assert eager.static_prefill is not None and not eager.static_prefill.graphs
        assert graphed.static_prefill is not None
        assert set(graphed.static_prefill.graphs) == {
            (1, 64, 64), (4, 64, 128), (4, 64, 64), (2, 64, 128), (2, 256, 256), (1, 64, 256),
        }  # fmt: skip
        before = graphed.cache.k[:, :SCRATCH].clone()
        assert graphed.static_prefill.capture_next()
        assert torch.equal(graphed.cache.k[:, :SCRATCH], before)


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_join_silu_equals_silu_then_cat(dtype: torch.dtype) -> None:
    """model.vocoder_kernels.join_silu == cat([prev, silu(x)]) for strided views of both inputs (the state rows and a
    transposed conv's trimmed output are views), including an empty history and a block-crossing length, in both
    output layouts (contiguous; time-major for the channels-last decoder)."""
    from model import vocoder_kernels

    if not vocoder_kernels.AVAILABLE:
        pytest.skip("Triton is not installed")
    gen = torch.Generator(device="cuda").manual_seed(7)
    shapes = [(3, 8, 30, 1500), (64, 256, 12, 192), (2, 16, 0, 7), (1, 1, 5, 4100), (2, 300, 6, 50)]
    for (batch, channels, width, length), time_major in itertools.product(shapes, (False, True)):
        base = torch.randn(batch, channels * width + 9, generator=gen, device="cuda").to(dtype)
        rows = base[:, 4 : 4 + channels * width]
        prev = rows.view(batch, width, channels).transpose(1, 2) if time_major else rows.view(batch, channels, width)
        x = torch.randn(batch, channels, length + 6, generator=gen, device="cuda").to(dtype)[..., 3 : 3 + length]
        if time_major:
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
        got = vocoder_kernels.join_silu(prev, x, time_major=time_major)
        expected = torch.cat([prev, torch.nn.functional.silu(x)], -1)
        layout = got.transpose(1, 2) if time_major else got
        assert layout.is_contiguous() and torch.equal(got[..., :width], prev)
        torch.testing.assert_close(got, expected, rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-6)


@torch.inference_mode()
def test_streaming_vocoder_silu_joins_agree_official(monkeypatch: pytest.MonkeyPatch) -> None:
    """The streaming decoder's three ways of joining history and silu(x) give the same chunked audio (fp32, official
    config), equal to the offline decode, and "auto" takes Triton on CUDA when it is installed."""
    from model import vocoder_kernels, vocoder_stream

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # TF32 convs differ ~1e-3 between call shapes
    codec = random_codec("cuda", torch.float32)
    gen = torch.Generator(device="cuda").manual_seed(8)
    codes = torch.randint(0, 1000, (2, codec.config.rows, 20), generator=gen, device="cuda")
    slots = torch.tensor([1, 0], device="cuda")
    offline = codec.decode(codes)
    joins = ["cat", "out"] + (["triton"] if vocoder_kernels.AVAILABLE else [])
    audio = {}
    for join in joins:
        monkeypatch.setattr(vocoder_stream, "SILU_JOIN", join)
        decoder = StreamingDecoder(codec, max_slots=2)
        audio[join] = torch.cat([decoder.decode(codes[..., s : s + 5], slots) for s in range(0, 20, 5)], -1)
        assert (audio[join] - offline).abs().max() <= 1e-4, join
        assert (audio[join] - audio["cat"]).abs().max() <= 1e-5, join
    monkeypatch.setattr(vocoder_stream, "SILU_JOIN", "auto")
    assert vocoder_stream._silu_join(codes) == ("triton" if vocoder_kernels.supported(codes.device) else "out")


@torch.inference_mode()
def test_triton_channel_bias_equals_atens_add_and_the_decode_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """codec_layers.BIAS_ADD (the Triton kernels by default on CUDA): the in-place bias kernels equal ATen's broadcast
    add in both layouts (fp32 exactly, bf16 to one rounding), and a chunked fp32 decode with them equals ATen's."""
    from model import codec_layers, vocoder_kernels

    if not vocoder_kernels.supported(torch.device("cuda")):
        pytest.skip("Triton does not run here")
    gen = torch.Generator(device="cuda").manual_seed(9)
    for dtype in (torch.float32, torch.bfloat16):
        for shape in [(3, 16, 4100), (64, 256, 192), (1, 1, 1), (2, 3, 1025)]:
            for time_major in (False, True):
                y = torch.randn(shape, generator=gen, device="cuda").to(dtype)
                if time_major:
                    y = y.transpose(1, 2).contiguous().transpose(1, 2)
                bias = torch.randn(shape[1], generator=gen, device="cuda").to(dtype)
                expected = y + bias[:, None]
                got = vocoder_kernels.add_channel_bias_(y.clone(memory_format=torch.preserve_format), bias)
                assert got.stride() == y.stride() or y.numel() == 1
                if dtype == torch.float32:
                    assert torch.equal(got, expected), (shape, time_major)
                else:
                    torch.testing.assert_close(got, expected, rtol=8e-3, atol=1e-6)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    codec = random_codec("cuda", torch.float32)
    codes = torch.randint(0, 1000, (2, codec.config.rows, 12), generator=gen, device="cuda")
    slots = torch.tensor([1, 0], device="cuda")
    audio = {}
    for mode in ("aten", "triton"):
        for channels_last in (False, True):
            monkeypatch.setattr(codec_layers, "BIAS_ADD", mode)
            decoder = StreamingDecoder(copy.deepcopy(codec), max_slots=2, channels_last=channels_last)
            chunks = [decoder.decode(codes[..., s : s + 4], slots) for s in range(0, 12, 4)]
            audio[mode, channels_last] = torch.cat(chunks, -1)
    for channels_last in (False, True):
        assert (audio["triton", channels_last] - audio["aten", channels_last]).abs().max() <= 1e-5


@torch.inference_mode()
def test_fused_resblock_biases_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """codec_layers.FUSE_BIAS = "on": the join with a folded bias and the bias-plus-residual kernel equal their ATen
    forms (fp32 to rounding, both layouts), and a chunked fp32 decode with them equals the plain path's."""
    import torch.nn.functional as F

    from model import codec_layers, vocoder_kernels

    if not vocoder_kernels.supported(torch.device("cuda")):
        pytest.skip("Triton does not run here")
    gen = torch.Generator(device="cuda").manual_seed(4)
    for time_major in (False, True):
        prev = torch.randn(3, 64, 30, generator=gen, device="cuda")
        x = torch.randn(3, 64, 700, generator=gen, device="cuda")
        y = torch.randn(3, 64, 700, generator=gen, device="cuda")
        if time_major:
            x, y = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (x, y))
        bias = torch.randn(64, generator=gen, device="cuda")
        joined = vocoder_kernels.join_silu(prev, x, time_major=time_major, bias=bias)
        torch.testing.assert_close(joined, torch.cat([prev, F.silu(x + bias[:, None])], -1), rtol=1e-5, atol=1e-6)
        summed = vocoder_kernels.add_bias_residual(x, y, bias)
        assert summed.stride() == x.stride()
        torch.testing.assert_close(summed, x + (y + bias[:, None]), rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    codec = random_codec("cuda", torch.float32)
    codes = torch.randint(0, 1000, (2, codec.config.rows, 12), generator=gen, device="cuda")
    slots = torch.tensor([1, 0], device="cuda")
    for channels_last in (False, True):
        audio = {}
        for fuse in ("off", "on"):
            monkeypatch.setattr(codec_layers, "FUSE_BIAS", fuse)
            decoder = StreamingDecoder(copy.deepcopy(codec), max_slots=2, channels_last=channels_last)
            audio[fuse] = torch.cat([decoder.decode(codes[..., s : s + 4], slots) for s in range(0, 12, 4)], -1)
        assert (audio["on"] - audio["off"]).abs().max() <= 1e-5, channels_last


def test_pinned_staging_copies_arrive_whatever_the_caller_does_next() -> None:
    """Many small host→device copies through model.host_staging in a row, the caller overwriting its tensor after
    each, some past the buffer's end (pin_memory() fallback), one device sync: every copy arrives as it was."""
    from model.host_staging import PinnedStaging

    staging = PinnedStaging(1024, torch.device("cuda"))
    sent, arrived = [], []
    for i in range(40):
        t = torch.arange(5, dtype=torch.int64) + 10 * i if i % 2 else torch.full((3, 4), float(i))
        sent.append(t.clone())
        arrived.append(staging.to_device(t))
        t.fill_(-1)
    torch.cuda.synchronize()
    staging.release()
    assert staging.fallbacks > 0 and staging.used == 0
    for a, b in zip(sent, arrived, strict=True):
        assert torch.equal(a, b.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_length_attention_kernel_equals_masked_sdpa_at_full_size(dtype: torch.dtype, monkeypatch) -> None:
    """model.decode_attention's kernel against SDPA with the decode mask, at the slow stack's shapes (2 kv heads, 8
    query heads each, head dim 64) on strided cache views, one split and several: fp32 to rounding (no TF32), bf16
    as close to the fp32 result as SDPA's own bf16 is."""
    import torch.nn.functional as F

    from model import decode_attention

    torch.manual_seed(0)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # the fp32 reference without TF32
    for rows, bucket in [(1, 2048), (5, 1024), (384, 2048)]:
        cache_k = torch.randn(2, rows + 1, 2, 4096, 64, device="cuda").to(dtype)
        cache_v = torch.randn(2, rows + 1, 2, 4096, 64, device="cuda").to(dtype)
        keys, values = cache_k[1, :rows, :, :bucket], cache_v[1, :rows, :, :bucket]
        q = torch.randn(rows, 2, 8, 64, device="cuda").to(dtype)
        lengths = torch.randint(1, bucket + 1, (rows,), device="cuda")
        lengths[0] = bucket
        mask = (torch.arange(bucket, device="cuda") < lengths.view(-1, 1)).view(rows, 1, 1, bucket)
        exact = F.scaled_dot_product_attention(q.float(), keys.float(), values.float(), attn_mask=mask)
        got = decode_attention.length_attention(q, keys, values, lengths)
        assert got.dtype == dtype and got.shape == q.shape
        err = ((got.float() - exact).norm() / exact.norm()).item()
        if dtype == torch.float32:
            assert err < 1e-5, (rows, bucket, err)
        else:
            sdpa = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
            sdpa_err = ((sdpa.float() - exact).norm() / exact.norm()).item()
            assert err < max(2 * sdpa_err, 1e-2), (rows, bucket, err, sdpa_err)
        print(f"{dtype} rows {rows} bucket {bucket} splits {decode_attention.split_count(rows, 2, bucket)}: "
              f"rel err {err:.1e}")  # fmt: skip


@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning")
@torch.no_grad()
def test_compiled_step_with_length_attention_equals_eager() -> None:
    """The decode step with the length-aware attention kernel, compiled and in a CUDA graph, fp32: the plain eager
    step's frames (greedy rows exactly, sampled rows nearly all), as test_compiled_step_equals_eager."""
    model = cuda_model("gqa_fast_project", torch.float32)
    eager = run_stepper(DecodeStepper(model, 4, max_seq_len=128, length_buckets=[64]), 8)
    kernel_model = copy.deepcopy(model)
    kernel_model.use_length_attention(True)
    compiled = DecodeStepper(
        kernel_model, 4, max_seq_len=128, length_buckets=[64], use_cuda_graphs=True, compile_backend="inductor"
    )
    got = run_stepper(compiled, 8)
    assert torch.equal(got[:, [0, 2]], eager[:, [0, 2]]), "greedy rows differ"
    assert (got == eager).float().mean() >= 0.95


TUNED_REGION_SCRIPT = """
import json, torch
from model import compiled_regions

@compiled_regions.region
def gemv_norm(x, w):
    y = torch.nn.functional.linear(x, w)
    return y * torch.rsqrt(y.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(y.dtype)

@compiled_regions.region
def head_softmax(x, w):  # the one-row text head and the sampler's softmax over its 102,048 logits
    return torch.softmax(torch.nn.functional.linear(x, w).float() / 0.7, dim=-1)

x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
w = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
head = torch.randn(102048, 1024, device="cuda", dtype=torch.bfloat16)
with compiled_regions.compiled("inductor", tuned=True):
    gemv_norm(x, w)
    head_softmax(x, head)
torch.cuda.synchronize()
print(json.dumps(compiled_regions.cache_counts()))
"""


def test_restarted_processes_reuse_the_tuned_regions_launch_configs(tmp_path) -> None:
    """A tuned (coordinate-descent) region compiled by one process is loaded by the next ones from the on-disk caches
    without tuning again, start after start: torch 2.11's static launcher lost the tuned configs on load (H200:
    6-7 s of each warm start), which compiled_regions.tuned_options() routes around. (Engines with
    `--compile-tune-single-row on` still re-ran 90-117 tuning benchmarks at warm starts, for a reason not found:
    the option is off by default.)"""
    caches = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cc"), "TRITON_CACHE_DIR": str(tmp_path / "tc")}
    first, *restarts = cache_counts_of_starts(TUNED_REGION_SCRIPT, caches, 600, starts=3)
    assert first["fx_graphs_compiled"] >= 2 and first["tuning_benchmarks"] > 0
    for n, counts in enumerate(restarts, 2):
        assert counts["fx_graphs_from_cache"] >= 2 and counts["fx_graphs_compiled"] == 0, (n, counts)
        assert counts["tuning_benchmarks"] == 0, f"start {n} tuned again: {counts}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.inference_mode()
def test_small_sort_equals_cudas_torch_sort(dtype: torch.dtype) -> None:
    """model.small_sort's kernel against CUDA's own torch.sort (descending, the sampler's eager call) at the codebook
    width, one row to many: values bitwise, indices equal, ties (many, in bf16), -inf, +0.0 and -0.0 included;
    then the compiled sampler with its top-p sorting through the kernel, against the same through torch.sort."""
    from model import compiled_regions, small_sort
    from model.sampling import sample

    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows, width in [(1, 1024), (8, 1024), (384, 1024), (3, 1000), (2, 4096)]:
        x = (torch.randn(rows, width, device="cuda", generator=gen) * 3).to(dtype)
        x[:, ::5] = torch.round(x[:, ::5])  # more ties
        x[0, 3], x[0, 4], x[0, 7] = 0.0, -0.0, float("-inf")
        assert small_sort.applies(x)
        values, index = small_sort.sort_descending(x)
        want_values, want_index = torch.sort(x, dim=-1, descending=True)
        if not torch.equal(index, want_index):
            at = (index != want_index).nonzero()[:4].tolist()
            seen = [(r, c, int(index[r, c]), int(want_index[r, c]), float(values[r, c])) for r, c in at]
            raise AssertionError(f"{rows}x{width}: (row, place, index, torch's index, value) {seen}")
        assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8)), (rows, width)
    logits = (torch.randn(8, 1024, device="cuda", generator=gen) * 3).to(dtype)
    window = torch.randint(0, 1024, (8, 16), device="cuda", generator=gen)
    params = [torch.full((8,), v, device="cuda") for v in (0.7, 0.7, 1.2)]
    q = torch.empty(8, 1024, device="cuda").exponential_(generator=gen)
    picks = {}
    for mode in ("off", "auto"):  # both compiled (inductor's softmax rounds unlike eager's): only the sort differs
        small_sort.MODE = mode
        compiled_regions.reset()
        try:
            with compiled_regions.compiled("inductor"):
                picks[mode] = sample(logits, window, *params, q)
        finally:
            small_sort.MODE = "auto"
            compiled_regions.reset()
    assert torch.equal(picks["auto"], picks["off"])


@torch.inference_mode()
def test_one_row_gemv_kernels_at_full_size_bf16() -> None:
    """model.gemv's kernels at the DualAR's one-row products (norm, SwiGLU and residual fused as the block calls
    them) in bf16, with the rule of thumb's config and a split-K one, against the same chain in fp32 on the same
    values: as close as the eager bf16 chain (cuBLAS) is."""
    from model import gemv

    gen = torch.Generator(device="cuda").manual_seed(0)
    f = lambda t: None if t is None else t.float()  # noqa: E731
    for n, k, fused, res in [(1280, 1024, "norm", False), (1024, 1024, "plain", True), (8192, 1024, "norm", False),
                             (1024, 4096, "swiglu", True), (1024, 1024, "norm", False)]:  # fmt: skip
        w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
        x = torch.randn(2 * k if fused == "swiglu" else k, device="cuda", generator=gen).bfloat16()
        norm = (torch.rand(k, device="cuda", generator=gen) + 0.5).bfloat16() if fused == "norm" else None
        residual = torch.randn(n, device="cuda", generator=gen).bfloat16() if res else None
        swiglu = fused == "swiglu"
        exact = gemv.reference(x.float(), w.float(), f(norm), 1e-6, swiglu, f(residual))
        eager_err = ((gemv.reference(x, w, norm, 1e-6, swiglu, residual).float() - exact).norm() / exact.norm()).item()
        for config in (None, (4, 2, 4)):
            got = gemv.launch(x, w, norm, residual, 1e-6, swiglu, config=config).float()
            err = ((got - exact).norm() / exact.norm()).item()
            assert err <= max(1.5 * eager_err, 4e-3), (n, k, fused, config, err, eager_err)


def _slow_layers_chain(x, weights, k_cache, v_cache, pos, rope):
    """The one-row slow stack's kernels as the compiled step launches them (wqkv with norm, RoPE and cache writes; the
    length attention with its merge; wo + residual; w1/w3 with norm; w2 with SwiGLU + residual), layer after layer."""
    from model import decode_attention, gemv

    for wqkv, wo, w13, w2, norm1, norm2 in weights:
        qkv = gemv.launch(x, wqkv, norm1, None, 1e-6, rope=rope, rope_rows=1152, k_cache=k_cache, v_cache=v_cache,
                          cache_pos=pos)  # fmt: skip
        att = decode_attention.length_attention(qkv[:1024].view(1, 2, 8, 64), k_cache, v_cache, pos, 1)
        h = gemv.launch(att.reshape(1024), wo, residual=x)
        x = gemv.launch(gemv.launch(h, w13, norm2, None, 1e-6), w2, residual=h, swiglu=True)
    return x


@torch.inference_mode()
def test_programmatic_launch_changes_no_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """model.launch_overlap: four full-size bf16 slow layers' kernels (the length attention split and merged) launched
    with programmatic dependent launch, eagerly and replayed from a CUDA graph, give bitwise the outputs and caches
    of plain launches: only the kernels' overlap in time changes, never what they read or write."""
    from model import launch_overlap

    if not launch_overlap._supported("cuda", torch.cuda.current_device()):
        pytest.skip("programmatic dependent launch needs compute capability 9.0 (Hopper) or newer")
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()

    weights = [
        (randn(1280, 1024, scale=0.03), randn(1024, 1024, scale=0.03), randn(8192, 1024, scale=0.03),
         randn(1024, 4096, scale=0.016), randn(1024).abs() + 0.5, randn(1024).abs() + 0.5)
        for _ in range(4)
    ]  # fmt: skip
    caches = (randn(1, 2, 2048, 64), randn(1, 2, 2048, 64))
    pos = torch.tensor([1500], device="cuda")
    angles = torch.rand(32, device="cuda", generator=gen) * 6
    rope = torch.stack([angles.cos(), angles.sin()], dim=-1).reshape(-1)
    x = randn(1024)

    def run(mode: str, graphed: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(launch_overlap, "MODE", mode)
        k, v = caches[0].clone(), caches[1].clone()
        out = _slow_layers_chain(x, weights, k, v, pos, rope)  # compiles the kernels (outside any capture)
        if graphed:
            k.copy_(caches[0])
            v.copy_(caches[1])
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = _slow_layers_chain(x, weights, k, v, pos, rope)
            for _ in range(3):  # the same inputs each time: the same writes
                graph.replay()
            torch.cuda.synchronize()
        return [out.clone(), k, v]

    plain = run("off", graphed=False)
    assert launch_overlap.enabled(x.device) is False
    for graphed in (False, True):
        got = run("auto", graphed)
        for a, b in zip(got, plain, strict=True):
            assert torch.equal(a, b), f"programmatic launch changed a result (graphed: {graphed})"
    assert plain[1][0, :, 1500].abs().sum() > 0 and not torch.equal(plain[1], caches[0])

"""Streaming decoder: chunked == offline for many chunk schedules, batched slots == solo, reset, no drift over
1000+ frames (checked against the offline decode and a windowed re-decode oracle), clamping, argument errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from model import codec_layers, compiled_regions, vocoder_stream
from model.graph_timing import cheapest_plan
from model.vocoder_graphs import REROUTE_BELOW, GraphedVocoder
from model.vocoder_stream import StreamingDecoder

from .codec_testing import decode_chunked, fixture_codec, one_thread, small_codec
from .fixture_sets import firefly_sets, params

_ = one_thread
pytestmark = pytest.mark.usefixtures("one_thread")

SCHEDULES = [[1, 3, 8, 5, 7], [3], [8], [24], [2, 1, 13]]
# Past frames that fully determine a frame's audio (spec §4.3: ≤ 15, 16 with margin): the re-decode oracle.
ORACLE_CONTEXT_FRAMES = 16


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@pytest.mark.parametrize("fs", params(firefly_sets()))
def test_chunked_equals_upstream_offline(fs):
    codec, t = fixture_codec(fs.path), fs.tensors()
    spf = codec.config.samples_per_frame
    codes = t["codes_long"][..., :24]
    reference = t["audio_long"][:, 0, : 24 * spf]  # upstream offline decode of all frames
    ours_offline = codec.decode(codes)
    stream = StreamingDecoder(codec, max_slots=3)
    slot = torch.tensor([1])
    for schedule in SCHEDULES:
        stream.reset(slot)
        chunked = decode_chunked(stream, codes, slot, schedule)
        assert _max_diff(chunked, reference) <= 1e-4, schedule
        assert _max_diff(chunked, ours_offline) <= 1e-5, schedule


@pytest.mark.parametrize("fs", params(firefly_sets()))
def test_fused_silu_context_equals_upstream_and_the_plain_join(fs, monkeypatch):
    """The one-pass join of history and silu(x) by `silu.out` (CUDA's path without Triton, forced on CPU here) gives upstream's offline audio for
    every schedule and the plain silu-then-cat join's audio to rounding (the CPU's strided silu rounds differently),
    and it really ran: every silu-first layer wrote its input through `silu.out`."""
    codec, t = fixture_codec(fs.path), fs.tensors()
    spf = codec.config.samples_per_frame
    codes = t["codes_long"][..., :24]
    reference = t["audio_long"][:, 0, : 24 * spf]
    slot = torch.tensor([1])
    plain = [decode_chunked(StreamingDecoder(codec, max_slots=2), codes, slot, s) for s in SCHEDULES]
    monkeypatch.setattr(vocoder_stream, "SILU_JOIN", "out")
    fused_calls = []
    real_out = torch.ops.aten.silu.out
    monkeypatch.setattr(torch.ops.aten.silu, "out", lambda *a, **k: fused_calls.append(1) or real_out(*a, **k))
    for schedule, expected in zip(SCHEDULES, plain, strict=True):
        fused_calls.clear()
        got = decode_chunked(StreamingDecoder(codec, max_slots=2), codes, slot, schedule)
        assert _max_diff(got, reference) <= 1e-4, schedule
        assert _max_diff(got, expected) <= 1e-5, schedule
        assert fused_calls, schedule


def test_batched_slots_equal_solo_and_reset():
    codec = small_codec()
    rows, cs = codec.config.rows, codec.config.codebook_size
    torch.manual_seed(1)
    codes = torch.randint(0, cs, (3, rows, 40))
    stream = StreamingDecoder(codec, max_slots=6)
    solo = StreamingDecoder(codec, max_slots=1)
    only = torch.tensor([0])
    # Give slots 4 and 1 different histories (20 and 7 frames), slot 2 none.
    stream.decode(codes[0:1, :, :20], torch.tensor([4]))
    stream.decode(codes[1:2, :, :7], torch.tensor([1]))
    slots = torch.tensor([4, 1, 2])
    starts = [20, 7, 0]
    new = torch.stack([codes[i, :, s : s + 9] for i, s in enumerate(starts)])  # (3, rows, 9)
    batched = stream.decode(new, slots)
    for i, s in enumerate(starts):
        solo.reset(only)
        expected = decode_chunked(solo, codes[i : i + 1, :, : s + 9], only, [s + 9])[:, s * 128 :]
        assert _max_diff(batched[i : i + 1], expected) <= 1e-5, i
    # After a reset, a slot decodes like a fresh stream regardless of what it held.
    stream.reset(torch.tensor([4]))
    fresh = stream.decode(codes[2:3, :, :5], torch.tensor([4]))
    assert _max_diff(fresh, codec.decode(codes[2:3, :, :5])) <= 1e-5
    # A slot untouched by the reset keeps its history.
    cont = stream.decode(codes[1:2, :, 16:18], torch.tensor([1]))
    assert _max_diff(cont, codec.decode(codes[1:2, :, :18])[:, 16 * 128 :]) <= 1e-5


def test_no_drift_over_1000_frames():
    codec = small_codec()
    spf = codec.config.samples_per_frame
    torch.manual_seed(2)
    n_frames = 1200
    codes = torch.randint(0, codec.config.codebook_size, (2, codec.config.rows, n_frames))
    stream = StreamingDecoder(codec, max_slots=4)
    audio = decode_chunked(stream, codes, torch.tensor([3, 0]), [1, 3, 8, 24, 40, 7, 64, 2])
    offline = codec.decode(codes)
    assert offline.abs().max() > 0.05
    errors = (audio - offline).abs().view(2, n_frames, spf).amax(dim=(0, 2))  # per frame
    assert errors.max().item() <= 1e-5
    assert errors[-100:].max().item() <= 1e-5
    # Independent oracle: re-decode the last frames from 16 frames of left context only.
    start = n_frames - 10
    window = codec.decode(codes[..., start - ORACLE_CONTEXT_FRAMES :])[:, ORACLE_CONTEXT_FRAMES * spf :]
    assert _max_diff(audio[:, start * spf :], window) <= 1e-5


def test_stream_clamps_and_counts():
    codec = small_codec()
    stream = StreamingDecoder(codec, max_slots=2)
    codes = torch.full((1, codec.config.rows, 2), 1010)
    before = codec.clamped_codes.item()
    audio = stream.decode(codes, torch.tensor([0]))
    assert torch.isfinite(audio).all()
    assert codec.clamped_codes.item() - before == codes.numel()


def test_state_layout_and_errors():
    codec = small_codec()
    stream = StreamingDecoder(codec, max_slots=2)
    assert stream.state.shape == (2, stream.state_numel)
    # 2 upsample dwconvs + conv_pre + conv_post + per stage (1 transposed conv + 3 kernels × 3 dilations × 2 convs)
    assert len(codec.causal_layers()) == 2 + 1 + 1 + 5 * (1 + 18)
    with pytest.raises(ValueError, match="slots"):
        stream.decode(torch.zeros(2, codec.config.rows, 1, dtype=torch.long), torch.tensor([0]))
    with pytest.raises(ValueError, match="max_slots"):
        StreamingDecoder(codec, max_slots=0)
    with pytest.raises(ValueError, match="must match the codec"):
        StreamingDecoder(codec, max_slots=1, dtype=torch.float64)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode:UserWarning")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_equals_eager_without_syncs():
    codec = copy.deepcopy(small_codec()).to("cuda")
    rows, cs = codec.config.rows, codec.config.codebook_size
    torch.manual_seed(3)
    codes = torch.randint(0, cs + 24, (2, rows, 12), device="cuda")  # includes out-of-range codes
    slots = torch.tensor([3, 1], device="cuda")
    eager, graphed = StreamingDecoder(codec, max_slots=4), StreamingDecoder(codec, max_slots=4)
    static_codes = codes[..., :3].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture (cuDNN/cuBLAS handles, allocator)
        graphed.decode(static_codes, slots)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = graphed.decode(static_codes, slots)
    graphed.reset(slots)
    eager_chunks, graph_chunks = [], []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for start in range(0, 12, 3):
            eager_chunks.append(eager.decode(codes[..., start : start + 3], slots))  # raises on a host sync
            static_codes.copy_(codes[..., start : start + 3])
            graph.replay()
            graph_chunks.append(static_out.clone())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    offline = codec.decode(codes)
    assert _max_diff(torch.cat(eager_chunks, -1), offline) <= 1e-5
    assert _max_diff(torch.cat(graph_chunks, -1), offline) <= 1e-5


def test_channels_last_decoder_keeps_its_layout_when_conv_kernels_return_the_default_layout(monkeypatch):
    """On CUDA (and under torch.compile) a conv given a time-major input may return (B, C, T) contiguous output; the
    H200 then ran the ConvNeXt depthwise convs through cuDNN's grouped kernel (183 ms at 64 × 24 frames). Simulate
    such kernels: every layer's output must still be time-major, no depthwise conv may reach F.conv1d, and the
    audio must equal the default layout's."""
    import model.codec_layers as codec_layers

    fs = firefly_sets()[0]
    codec = fixture_codec(fs.path)
    plain, fast = StreamingDecoder(codec, max_slots=2), StreamingDecoder(copy.deepcopy(codec), 2, channels_last=True)
    codes = fs.tensors()["codes_long"][..., :12].repeat(2, 1, 1)
    slots = torch.tensor([1, 0])
    expected = torch.cat([plain.decode(codes[..., s : s + 4], slots) for s in (0, 4, 8)], -1)
    grouped_calls, single_channel_inputs = [], []
    real_conv1d, real_transpose = F.conv1d, F.conv_transpose1d

    def conv1d(x, w, b=None, stride=1, padding=0, dilation=1, groups=1):
        grouped_calls.append(groups > 1)
        if w.shape[0] == 1:  # one output channel: cuDNN's channels-last kernel is slow, so channels-first input
            single_channel_inputs.append(x.is_contiguous() and w.is_contiguous())
        return real_conv1d(x, w, b, stride=stride, padding=padding, dilation=dilation, groups=groups).contiguous()

    transposed_calls = []

    def conv_transpose1d(x, w, b=None, stride=1):
        transposed_calls.append((w.shape[-1], stride))
        return real_transpose(x, w, b, stride=stride).contiguous()

    monkeypatch.setattr(codec_layers.F, "conv1d", conv1d)
    monkeypatch.setattr(codec_layers.F, "conv_transpose1d", conv_transpose1d)
    outputs: list[bool] = []
    for layer in fast.codec.decode_path_layers():
        layer.register_forward_hook(lambda _m, _a, y: outputs.append(codec_layers.is_time_minor(y) or y.shape[1] == 1))
    got = torch.cat([fast.decode(codes[..., s : s + 4], slots) for s in (0, 4, 8)], -1)
    assert _max_diff(got, expected) <= 1e-5
    assert outputs and all(outputs)
    assert grouped_calls and not any(grouped_calls)
    assert single_channel_inputs and all(single_channel_inputs)
    # transposed convs with kernel = m·stride (all of the firefly decoder's) run as matmuls, not through cuDNN
    assert transposed_calls == []


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_compiled_chunk_decode_equals_eager(backend):
    """The chunk decode as a compiled region (what GraphedVocoder captures with a compile backend): dynamo's fullgraph
    trace ("eager") is bitwise the plain decode; inductor's CPU kernels agree to fp32 rounding, chunk after chunk."""
    codec = small_codec()
    torch.manual_seed(4)
    codes = torch.randint(0, codec.config.codebook_size, (2, codec.config.rows, 12))
    slots = torch.tensor([2, 0])
    plain, traced = StreamingDecoder(codec, max_slots=3), StreamingDecoder(codec, max_slots=3)
    expected = decode_chunked(plain, codes, slots, [3])
    compiled_regions.reset()
    with compiled_regions.compiled(backend):
        got = decode_chunked(traced, codes, slots, [3])
    assert compiled_regions.failed_regions() == []
    if backend == "eager":
        assert torch.equal(got, expected)
    else:
        assert _max_diff(got, expected) <= 1e-5
    assert _max_diff(traced.state, plain.state) <= 1e-5  # the slots' history continues the same


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphed_vocoder_compiled_equals_plain_graphs(monkeypatch: pytest.MonkeyPatch):
    # fp32 comparisons at 1e-5: cuDNN's default TF32 convs would differ by ~1e-3 between call shapes
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    codec = copy.deepcopy(small_codec()).to("cuda")
    torch.manual_seed(5)
    codes = torch.randint(0, codec.config.codebook_size, (3, codec.config.rows, 16), device="cuda")
    slots = torch.tensor([0, 2, 1], device="cuda")
    outs = []
    for backend in (None, "inductor"):
        graphed = GraphedVocoder(StreamingDecoder(codec, max_slots=8), 4, [1, 2, 4], compile_backend=backend)
        # decode returns a view of the graph's output buffer, valid until its next replay: keep copies
        outs.append(torch.cat([graphed.decode(codes[..., s : s + 4], slots).clone() for s in range(0, 16, 4)], -1))
    assert compiled_regions.failed_regions() == []
    assert _max_diff(outs[1], outs[0]) <= 1e-5
    assert _max_diff(outs[0], codec.decode(codes)) <= 1e-5


@pytest.mark.parametrize("fs", params(firefly_sets()))
def test_channels_last_decoder_equals_the_default_layout_and_keeps_its_layout(fs):
    """The GPU fast path (`channels_last=True`: activations, state and conv weights time-major) against the default
    layout: same audio chunk by chunk over a seam-crossing schedule and after a reset, and every decode-path conv
    really receives a channel-stride-1 input (else cuDNN would transpose and the layout would buy nothing)."""
    codec = fixture_codec(fs.path)
    fast_codec = copy.deepcopy(codec)
    plain, fast = StreamingDecoder(codec, max_slots=3), StreamingDecoder(fast_codec, max_slots=3, channels_last=True)
    codes = fs.tensors()["codes_long"][..., :24].repeat(2, 1, 1)
    codes[1] = codes[1].flip(-1)
    slots = torch.tensor([2, 0])
    for round_ in range(2):
        start = 0
        for f in [1, 3, 8, 5, 7]:
            a = plain.decode(codes[..., start : start + f], slots)
            b = fast.decode(codes[..., start : start + f], slots)
            assert _max_diff(a, b) <= 1e-5, (round_, start)
            start += f
        plain.reset(slots)
        fast.reset(slots)
    # the codec's own offline decode still works on the converted codec (layers without a context)
    assert _max_diff(fast_codec.decode(codes), codec.decode(codes)) <= 1e-5
    # the layers call F.conv1d themselves, so their own forward (not nn.Conv1d's) sees the input
    seen: list[bool] = []
    for layer in fast_codec.causal_layers():
        layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0].stride(1) == 1 or args[0].shape[1] == 1))
    fast.decode(codes[..., :4], slots)
    assert len(seen) == len(fast_codec.causal_layers()) and all(seen)
    assert all(c.weight.stride(1) == 1 for c in fast_codec.decode_path_convs() if c.weight.shape[1] > 1)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_compiled_chunk_decode_traces_once_for_every_batch_and_chunk_size():
    """The vocoder region compiles batch and frames symbolically: the engine's batch buckets × chunk sizes (here
    2-5 rows × 2-24 frames, both layouts) reuse one traced graph instead of one ~35 s compile each on the H200;
    the traced decode equals the plain one."""
    from torch._dynamo.utils import counters

    codec = small_codec()
    for channels_last in (False, True):
        compiled_regions.reset()
        counters.clear()
        plain = StreamingDecoder(codec, max_slots=6)
        traced = StreamingDecoder(copy.deepcopy(codec), max_slots=6, channels_last=channels_last)
        torch.manual_seed(3)
        for b, f in [(2, 4), (3, 8), (5, 2), (2, 24), (4, 3)]:
            codes = torch.randint(0, codec.config.codebook_size, (b, codec.config.rows, f))
            slots = torch.randperm(6)[:b]
            with compiled_regions.compiled("eager"):
                got = traced.decode(codes, slots)
            assert _max_diff(got, plain.decode(codes, slots)) <= 1e-5
        assert counters["stats"]["unique_graphs"] == 1, channels_last
    assert compiled_regions.failed_regions() == []
    compiled_regions.reset()


def test_auto_join_on_cpu_is_silu_then_cat() -> None:
    """ "auto" keeps the plain join on a CPU (no Triton path there; a strided `silu.out` rounds differently)."""
    from model import vocoder_kernels

    assert vocoder_stream.SILU_JOIN == "auto"
    assert codec_layers.BIAS_ADD == "auto" and not codec_layers._triton_bias(torch.zeros(1, 2, 3))
    assert vocoder_stream._silu_join(torch.zeros(1, 2, 3)) == "cat"
    assert vocoder_kernels.supported(torch.device("cpu")) is False


def test_triton_bias_runs_only_for_inference(monkeypatch) -> None:
    """codec_layers.BIAS_ADD ("auto": the Triton kernel where it runs) hands each conv's bias to the kernel only where
    it can run and nothing needs gradients: with autograd on (codec training) the convs keep ATen's add; on a CPU
    (no Triton) "auto" is ATen's add. The kernel is stood in for by the same add on CPU, so the audio must not
    change, in the default layout and the channels-last streaming one; the GPU test compares the real kernel."""
    from model import vocoder_kernels

    codec = small_codec()
    torch.manual_seed(6)
    codes = torch.randint(0, codec.config.codebook_size, (1, codec.config.rows, 8))
    with torch.no_grad():
        expected = codec.decode(codes)
    calls = []

    def stand_in(y, bias):
        calls.append(y.shape)
        return y.add_(bias[:, None])

    monkeypatch.setattr(codec_layers, "BIAS_ADD", "triton")
    monkeypatch.setattr(codec_layers, "FUSE_BIAS", "off")  # the folded biases: test_fused_resblock_biases_...
    monkeypatch.setattr(vocoder_kernels, "supported", lambda device: True)
    monkeypatch.setattr(vocoder_kernels, "add_channel_bias_", stand_in)
    with torch.no_grad():
        got = codec.decode(codes)
        assert calls and _max_diff(got, expected) <= 1e-6
        calls.clear()
        streamed = StreamingDecoder(copy.deepcopy(codec), max_slots=1, channels_last=True)
        chunks = [streamed.decode(codes[..., s : s + 4], torch.tensor([0])) for s in (0, 4)]
        assert calls and _max_diff(torch.cat(chunks, -1), expected) <= 1e-5
    calls.clear()
    codec.requires_grad_(True)  # as codec training has it: autograd on, no in-place kernel
    trained = codec.decode_with_context(codes, None)
    assert calls == [] and trained.requires_grad
    assert _max_diff(trained.detach(), expected) <= 1e-6


def test_fused_resblock_biases_equal_the_plain_path(monkeypatch) -> None:
    """codec_layers.FUSE_BIAS = "on" (the default; it applies where the Triton bias kernel runs): each resblock's first conv bias is folded into
    the second conv's silu join and the second's into the residual add. With the kernels stood in for by the same
    arithmetic on CPU, streamed audio in both layouts and the offline decode equal the plain path; the folded path
    really ran (the GPU test compares the real kernels)."""
    from model import codec_layers, vocoder_kernels

    codec = small_codec()
    torch.manual_seed(6)
    codes = torch.randint(0, codec.config.codebook_size, (2, codec.config.rows, 12))
    slots = torch.tensor([1, 0])

    def streamed(channels_last: bool) -> torch.Tensor:
        dec = StreamingDecoder(copy.deepcopy(codec), max_slots=2, channels_last=channels_last)
        return torch.cat([dec.decode(codes[..., s : s + 4], slots) for s in range(0, 12, 4)], -1)

    with torch.no_grad():
        expected = {False: streamed(False), True: streamed(True)}
        offline = codec.decode(codes)
    residuals = []

    def residual_stand_in(x, y, bias):
        residuals.append(x.shape)
        return x + (y + bias[:, None])

    monkeypatch.setattr(codec_layers, "FUSE_BIAS", "on")
    monkeypatch.setattr(vocoder_kernels, "supported", lambda device: True)
    monkeypatch.setattr(vocoder_kernels, "add_channel_bias_", lambda y, bias: y.add_(bias[:, None]))
    monkeypatch.setattr(vocoder_kernels, "add_bias_residual", residual_stand_in)
    with torch.no_grad():
        for channels_last in (False, True):
            assert _max_diff(streamed(channels_last), expected[channels_last]) <= 1e-5, channels_last
        assert _max_diff(codec.decode(codes), offline) <= 1e-5
    assert residuals  # the folded path ran
    with pytest.raises(ValueError, match="in_bias"):
        codec.head.conv_pre(torch.zeros(1, codec.config.head.num_mels, 4), in_bias=torch.zeros(1))


def test_channels_last_decoder_may_run_chosen_convs_channels_first(monkeypatch) -> None:
    """codec_layers.CHANNELS_FIRST_CONVS ({(256, 7, 5)} by default): a channels-last decoder runs the listed convs through
    channels-first copies and returns to time-major after them; the audio is the same (here every conv is listed)."""
    from model import codec_layers

    codec = small_codec()
    torch.manual_seed(8)
    codes = torch.randint(0, codec.config.codebook_size, (2, codec.config.rows, 12))
    slots = torch.tensor([0, 1])

    def streamed() -> torch.Tensor:
        dec = StreamingDecoder(copy.deepcopy(codec), max_slots=2, channels_last=True)
        return torch.cat([dec.decode(codes[..., s : s + 4], slots) for s in range(0, 12, 4)], -1)

    with torch.no_grad():
        expected = streamed()
        listed = {
            (m.conv.in_channels, m.conv.kernel_size[0], m.dilation)
            for m in codec.modules()
            if isinstance(m, codec_layers.CausalConv1d)
        }
        monkeypatch.setattr(codec_layers, "CHANNELS_FIRST_CONVS", frozenset(listed))
        got = streamed()
    assert len(listed) > 3 and _max_diff(got, expected) <= 1e-5


def test_cheapest_plan_reroutes_only_pathological_graphs() -> None:
    """A call runs its own bucket's graph unless another captured graph of its chunk size is clearly cheaper: a larger
    bucket once, or a smaller one several times (H200, untuned channels-last layout, ms per replay)."""

    def plan(batch: int, own: int, replay_ms: dict[int, float]) -> tuple[int, int]:
        return cheapest_plan(batch, own, replay_ms, REROUTE_BELOW)

    at_24_frames = {8: 4.47, 12: 6.48, 16: 7.58, 24: 80.5, 32: 107.1, 48: 22.7, 64: 29.5}
    assert plan(24, 24, at_24_frames) == (12, 2)  # 13.0 ms instead of 80.5 (two 16-row replays: 15.2)
    assert plan(30, 32, at_24_frames) == (16, 2)  # 15.2 ms; the 48-row graph 22.7, three 12-row 19.4
    assert plan(40, 48, at_24_frames) == (48, 1)  # its own graph is fine
    at_8_frames = {16: 3.4, 24: 4.48, 32: 5.54, 48: 7.64, 64: 73.3}
    assert plan(64, 64, at_8_frames) == (32, 2)  # 11.1 ms instead of 73.3
    assert plan(50, 64, at_8_frames) == (32, 2)
    healthy = {16: 5.5, 24: 7.6, 32: 7.1}  # timing noise: the larger graph measured a little faster
    assert plan(20, 24, healthy) == (24, 1)
    assert plan(20, 24, {16: 5.5}) == (24, 1)  # own graph not timed yet: it runs (and is captured)
    assert plan(3, 4, {2: 1.0, 4: 10.0, 8: 2.0}) == (8, 1)  # a tie with (2, 2) keeps one replay

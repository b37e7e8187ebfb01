"""The batched stepper (fast path) produces exactly the frames of the single-stream reference loop (slow path)."""

from __future__ import annotations

import types

import torch

from model.frame import SamplingTensors
from model.generate import generate, seeded_noise
from model.stepper import (
    DecodeStepper,
    RowSampling,
    capturable_buckets,
    decode_batch_buckets,
    fastest_bucket,
    half_step_buckets,
    power_of_two_buckets,
)
from tests.model.test_kv_cache import make_model, random_sequence

IM_END = 260


def reference(model, prompt, n, s: RowSampling) -> torch.Tensor:
    params = SamplingTensors.fill(1, s.temperature, s.top_p, s.repetition_penalty)
    return generate(model, prompt, n, params, seeded_noise(s.seed, "cpu"), IM_END + 10_000).frames


def start_stream(stepper: DecodeStepper, row: int, s: RowSampling, prompt: torch.Tensor) -> torch.Tensor:
    """Prefill `prompt` into `row` from position 0 with sampling `s`; returns the segment's first frame."""
    stepper.set_sampling(row, s)
    logits, hidden = stepper.prefill(row, prompt, 0)
    return stepper.start_segment(row, logits, hidden, prompt.shape[1]).cpu()


def test_decode_buckets_add_half_steps_above_128_rows() -> None:
    assert decode_batch_buckets(64) == power_of_two_buckets(64)
    assert decode_batch_buckets(513) == [1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512, 513]
    assert decode_batch_buckets(1024)[-4:] == [384, 512, 768, 1024]


def test_half_step_buckets_pad_under_a_third() -> None:
    assert half_step_buckets(64) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    assert half_step_buckets(1) == [1] and half_step_buckets(10) == [1, 2, 3, 4, 6, 8, 10]
    for rule, worst in ((half_step_buckets, 1 / 3), (power_of_two_buckets, 0.5)):
        buckets = rule(64)
        padding = max(1 - n / min(b for b in buckets if b >= n) for n in range(1, 65))
        assert padding < worst, (rule.__name__, padding)


def test_power_of_two_buckets() -> None:
    assert power_of_two_buckets(1) == [1]
    assert power_of_two_buckets(8) == [1, 2, 4, 8]
    assert power_of_two_buckets(12) == [1, 2, 4, 8, 12]


@torch.no_grad()
def test_batched_steps_equal_single_stream_generation() -> None:
    """Streams join late, stall, and run beside others at several batch buckets: frames are bitwise the solo ones."""
    model = make_model("gqa_fast_project")
    model.set_batch_invariant(True)
    samplings = [
        RowSampling(0.7, 0.7, 1.2, seed=11),
        RowSampling(1.0, 0.9, 1.5, seed=12),
        RowSampling(0.0, 1.0, 1.0, seed=13),  # greedy
    ]
    prompts = [random_sequence(model, n, seed=n) for n in (12, 25, 7)]
    n_frames = 14
    expected = [reference(model, p, n_frames, s) for p, s in zip(prompts, samplings, strict=True)]

    stepper = DecodeStepper(model, n_rows=4, max_seq_len=128)
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    rows_started: list[int] = []

    def admit(i: int) -> None:
        row = i
        stepper.set_sampling(row, samplings[i])
        stepper.set_noise_step(row, 0)
        logits, hidden = stepper.prefill(row, prompts[i], 0)
        got[i].append(stepper.start_segment(row, logits, hidden, prompts[i].shape[1]).cpu())
        rows_started.append(i)

    admit(0)
    for t in range(40):
        if t == 3:
            admit(1)
        if t == 6:
            admit(2)
        active = [i for i in rows_started if len(got[i]) < n_frames]
        if not active:
            break
        stepper.commit.zero_()
        stalled = {1} if 8 <= t < 11 else set()  # stream 1 is back-pressured for three steps
        for i in active:
            stepper.commit[i] = i not in stalled
        rows = max(active) + 1
        frames = stepper.step(rows, int(stepper.pos[:rows].max()))
        for i in active:
            if i not in stalled:
                got[i].append(frames[i])
    for i, exp in enumerate(expected):
        assert torch.equal(torch.stack(got[i], dim=1), exp), f"stream {i} differs from its solo run"


@torch.no_grad()
def test_move_and_swap_rows_carry_the_whole_stream() -> None:
    model = make_model("gqa_fast_project")
    model.set_batch_invariant(True)
    s = RowSampling(0.8, 0.8, 1.3, seed=5)
    prompt = random_sequence(model, 15, seed=3)
    expected = reference(model, prompt, 8, s)

    stepper = DecodeStepper(model, n_rows=4, max_seq_len=64)
    frames = [start_stream(stepper, 2, s, prompt)]
    for k in range(7):
        if k == 3:  # move mid-stream: row 2 → row 0 through swap with an occupied row 0
            stepper.swap_rows(2, 0, int(stepper.pos[2]), 0, spare=3)
            assert int(stepper.pos[3]) == 0  # the spare may pad a later step: left where its mirror says
        row = 0 if k >= 3 else 2
        stepper.commit.zero_()
        stepper.commit[row] = True
        frames.append(stepper.step(row + 1, int(stepper.pos[: row + 1].max()))[row])
    assert torch.equal(torch.stack(frames, 1), expected)


@torch.no_grad()
def test_rows_past_the_callers_count_never_advance() -> None:
    """A step runs a whole batch bucket: rows beyond those the caller passed must not advance, whatever earlier
    steps set (a stale flag once advanced an idle row past its attention bucket on the GPU: index out of bounds)."""
    model = make_model("gqa_fast_project")
    stepper = DecodeStepper(model, n_rows=4, max_seq_len=64)
    for row in range(4):
        stepper.set_sampling(row, RowSampling(0.7, 0.7, 1.2, seed=row))
        logits, hidden = stepper.prefill(row, random_sequence(model, 10, seed=row), 0)
        stepper.start_segment(row, logits, hidden, 10)
    stepper.set_commit([True, True, True, True])
    stepper.step(4, 11)
    assert stepper.pos.tolist() == [11, 11, 11, 11]
    stepper.set_commit([True, False, True])  # 3 rows run in the bucket of 4: row 3 must stay put
    stepper.step(3, 12)
    assert stepper.pos.tolist() == [12, 11, 12, 11]


def test_a_step_records_no_autograd_history() -> None:
    """Decoding must never build autograd graphs (they grow with every KV write: memory and time leak)."""
    model = make_model("gqa_fast_project")  # parameters require grad here, as a freshly built module's do
    stepper = DecodeStepper(model, n_rows=2, max_seq_len=32)
    stepper.set_sampling(0, RowSampling(0.7, 0.7, 1.2, seed=1))
    logits, hidden = stepper.prefill(0, random_sequence(model, 8, seed=1), 0)
    stepper.start_segment(0, logits, hidden, 8)
    stepper.set_commit([True])
    stepper.step(1, 9)
    for t in (stepper.cache.k, stepper.cache.v, stepper.frame, stepper.out):
        assert t.grad_fn is None and not t.requires_grad


def test_graph_bookkeeping_without_cuda_is_empty() -> None:
    """On CPU there are no graphs: nothing is missing, idle capture has nothing to do, capture_all reports 0."""
    model = make_model("gqa_fast_project")
    stepper = DecodeStepper(model, n_rows=4, max_seq_len=64, use_cuda_graphs=True)  # ignored off CUDA
    assert stepper.missing_graphs() == [] and stepper.capture_next([0] * 4) is False and stepper.capture_all(1) == 0


def test_idle_capture_skips_buckets_shorter_than_an_open_row() -> None:
    """Capturing a (batch, length) graph steps rows [0, batch) in place: a row already past the length (an open
    session between utterances) would be written out of range, so such buckets wait until they are safe."""
    missing = [(1, 512), (1, 1024), (2, 512), (2, 1024), (4, 512)]
    assert capturable_buckets(missing, [0, 0, 0, 0, 0]) == missing
    assert capturable_buckets(missing, [700, 0, 0, 0, 0]) == [(1, 1024), (2, 1024)]
    assert capturable_buckets(missing, [0, 0, 600, 0, 0]) == [(1, 512), (1, 1024), (2, 512), (2, 1024)]
    assert capturable_buckets(missing, [511, 0, 0, 0]) == missing  # position 511 is the last inside 512
    assert capturable_buckets(missing, [512, 0, 0, 0]) == [(1, 1024), (2, 1024)]  # 512 itself is outside
    assert capturable_buckets(missing, [2000, 0]) == []


def test_batch_invariant_stepper_has_one_fixed_batch() -> None:
    """fixed_batch (batch-invariant GPU engines): one batch bucket, the largest, so every step runs the same
    kernels whatever the load; without graphs (CPU) a step still runs exactly the active rows."""
    model = make_model("gqa_fast_project")
    stepper = DecodeStepper(model, n_rows=12, max_seq_len=64, max_batch=9, fixed_batch=True)
    assert stepper.batch_buckets == [9] and stepper.bucket_for(3, 5)[0] == 3
    assert DecodeStepper(model, n_rows=12, max_seq_len=64, max_batch=9).batch_buckets == [1, 2, 4, 8, 9]


def test_a_position_equal_to_a_length_bucket_needs_the_next_bucket() -> None:
    """A step writes K/V at each row's position and attends over [0, length): the length must exceed it."""
    stepper = DecodeStepper(make_model("gqa_fast_project"), n_rows=4, max_seq_len=256, length_buckets=[64, 128])
    assert [stepper.bucket_for(1, p)[1] for p in (0, 63, 64, 127, 128)] == [64, 64, 128, 128, 256]


def test_prefill_keeps_its_length_buckets_when_decode_has_one() -> None:
    """With the length-aware decode attention the engine gives the step one length (the cache's) while prefill
    passes keep their buckets: SDPA there reads the whole bucket, so a short prompt should not pay for the cache."""
    stepper = DecodeStepper(
        make_model("gqa_fast_project"), n_rows=4, max_seq_len=256, prefill_length_buckets=[64, 128],
        prefill_scratch_row=3,
    )  # fmt: skip
    assert stepper.length_buckets == [256] and [stepper.bucket_for(1, p)[1] for p in (0, 63, 200)] == [256] * 3
    assert stepper.static_prefill is not None and stepper.static_prefill.length_buckets == [64, 128, 256]
    both = DecodeStepper(make_model("gqa_fast_project"), n_rows=4, max_seq_len=256, length_buckets=[64, 128])
    assert both.prefill_length_buckets == both.length_buckets == [64, 128, 256]


def test_graphs_up_front_leaves_larger_buckets_and_first_frames_to_idle_capture() -> None:
    """`capture_all(max_batch=1)` (--graphs-up-front 1): the one-row decode and first-frame graphs before ready, every
    other decode and first-frame bucket one at a time by `capture_next` (idle time), decode buckets first. The
    bookkeeping only: here a stand-in recorder runs each call once instead of capturing it (no CUDA)."""
    stepper = DecodeStepper(make_model("gqa_fast_project"), 9, max_seq_len=64, max_batch=8, first_frame_scratch_row=8)
    stepper.use_cuda_graphs = True

    def record(run):  # what `_record` returns: something with replay()
        run()
        return types.SimpleNamespace(replay=run)

    stepper._record = record  # type: ignore[method-assign]
    after: list[tuple[int, int]] = []  # graphs of each kind when `after_each` ran (the engine freezes GC objects)
    assert (
        stepper.capture_all(
            max_batch=1, after_each=lambda: after.append((len(stepper._graphs), len(stepper._first_graphs)))
        )
        == 1
    )
    assert list(stepper._graphs) == [(1, 64)] and list(stepper._first_graphs) == [1]
    assert after == [(1, 0), (1, 1)]  # once after each capture, right after it
    assert stepper.missing_graphs() == [(2, 64), (4, 64), (8, 64)]
    assert stepper.missing_first_frame_graphs() == [2, 4, 8]
    captured = []
    while stepper.capture_next([0] * 9):
        captured.append((list(stepper._graphs), list(stepper._first_graphs)))
    assert len(captured) == 6 and stepper.missing_graphs() == [] and stepper.missing_first_frame_graphs() == []
    assert captured[2] == ([(1, 64), (2, 64), (4, 64), (8, 64)], [1])  # decode buckets first, then first frames
    assert stepper.capture_all(after_each=lambda: after.append((-1, -1))) == 4  # nothing left to capture
    assert after == [(1, 0), (1, 1)]


def test_a_first_frame_capture_in_idle_time_runs_the_scratch_row_at_position_zero() -> None:
    """First-frame graphs left to idle time (--graphs-up-front) are captured after real first frames went through
    the static buffers, which still hold those rows' positions. The capture's runs must put the scratch row at
    position 0 in every padded slot, not at a stale position past the shortest attention length: there the next decode
    capture over the scratch row wrote out of range (a CUDA index assert on the H200; on a GPU which of the
    duplicate writes lands is not defined). Stand-in recorder (no CUDA) noting the positions each capture runs with."""
    model = make_model("gqa_fast_project")
    stepper = DecodeStepper(model, 9, max_seq_len=64, max_batch=8, length_buckets=[16, 32], first_frame_scratch_row=8)
    stepper.use_cuda_graphs = True
    seen: list[list[int]] = []

    def record(run):
        if int(stepper._ff_rows[0]) == 8:  # a first-frame capture (its rows all the scratch row)
            seen.append(stepper._ff_positions.tolist())
        run()
        return types.SimpleNamespace(replay=run)

    stepper._record = record  # type: ignore[method-assign]
    stepper.capture_all(max_batch=1)
    prompts = [random_sequence(model, n, seed=n) for n in (40, 41)]
    outs = [stepper.prefill(row, p, 0) for row, p in enumerate(prompts)]
    logits, hidden = torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])
    stepper.start_segments([0, 1], logits, hidden, [40, 41])  # bucket 2, captured on this first use
    assert seen[-1][:2] == [0, 0] and [int(p) for p in stepper.pos[:2]] == [40, 41]
    seen.clear()
    while stepper.capture_next([41, 42] + [0] * 7):  # the decode buckets of length 16 and 32 must wait for rows 0, 1
        pass
    assert stepper.missing_first_frame_graphs() == [] and len(seen) == 2  # buckets 4 and 8
    assert all(p == 0 for positions in seen for p in positions) and int(stepper.pos[8]) == 0
    assert stepper._ff_positions[:2].tolist() == [40, 41]  # the buffers hold what the last real call put there


def test_first_frames_sampled_together_equal_one_at_a_time() -> None:
    """start_segments draws each row's first frame exactly as start_segment would (batch-invariant layers, per-row
    parameters and noise), and leaves each row ready to decode."""
    model = make_model("gqa_fast_project")
    model.set_batch_invariant(True)
    prompts = [random_sequence(model, n, seed=40 + n) for n in (11, 17, 8)]
    settings = [RowSampling(0.7, 0.7, 1.2, 5), RowSampling(1.0, 0.9, 1.0, 6), RowSampling(0.0, 0.5, 1.1, 7)]
    one, together = DecodeStepper(model, 4), DecodeStepper(model, 4)
    rows = [2, 0, 3]
    outputs = []
    for stepper in (one, together):
        for row, s, prompt in zip(rows, settings, prompts, strict=True):
            stepper.set_sampling(row, s)
            stepper.set_noise_step(row, 3)
        outputs.append([stepper.prefill(row, p, 0) for row, p in zip(rows, prompts, strict=True)])
    ends = [p.shape[1] for p in prompts]
    expected = [one.start_segment(r, lg, h, e) for r, (lg, h), e in zip(rows, outputs[0], ends, strict=True)]
    logits = torch.stack([lg for lg, _ in outputs[1]])
    hidden = torch.stack([h for _, h in outputs[1]])
    frames = together.start_segments(rows, logits, hidden, ends)
    assert torch.equal(frames, torch.stack(expected))
    for t_one, t_together in zip(one._row_tensors(), together._row_tensors(), strict=True):
        assert torch.equal(t_one, t_together)


def first_frames(stepper: DecodeStepper, rows: list[int]) -> torch.Tensor:
    """Prefill `rows` with different prompts and samplings, then sample their first frames in one call."""
    settings = [RowSampling(0.7, 0.7, 1.2, 5), RowSampling(1.0, 0.9, 1.0, 6), RowSampling(0.0, 0.5, 1.1, 7)]
    outputs, ends = [], []
    for k, row in enumerate(rows):
        stepper.set_sampling(row, settings[k % 3])
        stepper.set_noise_step(row, 3 + k)
        prompt = random_sequence(stepper.model, 8 + 5 * k, seed=60 + k)
        outputs.append(stepper.prefill(row, prompt, 0))
        ends.append(prompt.shape[1])
    logits = torch.stack([lg for lg, _ in outputs])
    hidden = torch.stack([h for _, h in outputs])
    return stepper.start_segments(rows, logits, hidden, ends)


def test_first_frames_through_padded_static_buffers_equal_the_plain_call() -> None:
    """first_frame_scratch_row: start_segments runs through fixed buffers padded to a batch bucket (what the GPU
    captures as a graph); the frames and every real row's state equal the plain call's, padding touches only the
    scratch row, and a batch beyond the largest bucket falls back to the plain call."""
    model = make_model("gqa_fast_project")
    model.set_batch_invariant(True)
    for rows in ([1], [2, 0, 4], [0, 1, 2, 3, 4, 5]):
        plain = DecodeStepper(model, 8, max_batch=7)
        static = DecodeStepper(model, 8, max_batch=7, first_frame_scratch_row=7)
        assert static.first_frame_buckets == [1, 2, 4, 7]
        expected, got = first_frames(plain, rows), first_frames(static, rows)
        assert torch.equal(expected, got)
        for t_plain, t_static in zip(plain._row_tensors(), static._row_tensors(), strict=True):
            assert torch.equal(t_plain[:7], t_static[:7])  # row 7 is the scratch row
    big = DecodeStepper(model, 24, max_batch=23, first_frame_scratch_row=23)
    assert big.first_frame_buckets[-1] == 16
    assert torch.equal(first_frames(big, list(range(17))), first_frames(DecodeStepper(model, 24), list(range(17))))


def test_without_static_shapes_a_step_runs_exactly_the_rows_asked_for() -> None:
    """Graph buckets pad the batch to a captured size; an eager stepper (CPU) has no reason to."""
    model = make_model("gqa_fast_project")
    assert DecodeStepper(model, 8).bucket_for(5, 0)[0] == 5
    assert DecodeStepper(model, 8, compile_backend="eager").bucket_for(5, 0)[0] == 8


def test_an_end_token_as_the_very_first_frame_stops_generation() -> None:
    """Unlike upstream, generate() stops when frame 0 is <|im_end|> (model/generate.py): the greedy first token of a
    free run, declared the end token, must end the next run after one frame."""
    model = make_model("gqa_fast_project")
    prompt = random_sequence(model, 9, seed=1)
    greedy = SamplingTensors.fill(1, 0.0, 1.0, 1.0)
    free = generate(model, prompt, 5, greedy, seeded_noise(1, "cpu"), IM_END + 10_000)
    assert free.frames.shape[1] == 5 and not free.ended
    first = int(free.frames[0, 0])
    stopped = generate(model, prompt, 5, greedy, seeded_noise(1, "cpu"), first)
    assert stopped.ended and stopped.frames.shape[1] == 1 and torch.equal(stopped.frames[:, 0], free.frames[:, 0])


def test_a_second_segment_in_a_used_row_equals_a_fresh_generation() -> None:
    """A row is reused for the next segment (and the next session): its repetition window, loop step and noise
    counter start afresh, so the second segment's frames equal a fresh generate() of its prompt."""
    model = make_model("gqa_fast_project")
    model.set_batch_invariant(True)
    sampling = RowSampling(0.7, 0.7, 1.5, seed=21)  # a strong penalty: a stale window would change the draws
    first, second = random_sequence(model, 12, seed=5), random_sequence(model, 10, seed=6)
    n_frames = 12
    expected = reference(model, second, n_frames, sampling)
    stepper = DecodeStepper(model, n_rows=2, max_seq_len=128)
    for prompt in (first, second):
        stepper.set_sampling(0, sampling)
        stepper.set_noise_step(0, 0)
        logits, hidden = stepper.prefill(0, prompt, 0)
        frames = [stepper.start_segment(0, logits, hidden, prompt.shape[1]).cpu()]
        for _ in range(n_frames - 1):
            stepper.commit[:1] = True
            frames.append(stepper.step(1, int(stepper.pos[0]))[0].cpu())
    assert torch.equal(torch.stack(frames, 1), expected)


@torch.no_grad()
def test_permute_rows_equals_the_swaps_it_composes() -> None:
    """The worker's batched row moves (DecodeStepper.permute_rows, one permutation for a turn's swaps) leave every
    row's KV positions and per-row state exactly where the same swaps one by one through a spare row leave them."""
    import random
    from types import SimpleNamespace

    from streaming.executor import Executor

    model = make_model("gqa_fast_project")
    slow, fast = (DecodeStepper(model, n_rows=8, max_seq_len=64) for _ in range(2))
    lengths = [5, 17, 9, 30, 0, 12, 22, 0]
    for stepper in (slow, fast):
        torch.manual_seed(0)
        stepper.cache.k.normal_()
        stepper.cache.v.normal_()
        for row in range(7):
            stepper.set_sampling(row, RowSampling(0.5 + row / 10, 0.7, 1.1, seed=row))
            stepper.pos[row] = lengths[row]
    rng = random.Random(3)
    swaps = [tuple(rng.sample(range(7), 2)) for _ in range(12)]
    pos = list(lengths)
    for a, b in swaps:  # the slow path: one swap at a time through the spare row 7
        slow.swap_rows(a, b, pos[a], pos[b], spare=7)
        pos[a], pos[b] = pos[b], pos[a]

    # the executor's composition, on a stand-in with just what flush_swaps reads
    def permute_rows(dst: list[int], src: list[int], length: int) -> None:  # as Backend.permute_rows, on CPU
        fast.permute_rows(torch.tensor(dst), torch.tensor(src), length)

    rows = SimpleNamespace(row_pos=pos, _pending_swaps=list(swaps), b=SimpleNamespace(permute_rows=permute_rows))
    Executor.flush_swaps(rows)  # type: ignore[arg-type]
    for row in range(7):
        n = pos[row]
        assert torch.equal(fast.cache.k[:, row, :, :n], slow.cache.k[:, row, :, :n]), row
        assert torch.equal(fast.cache.v[:, row, :, :n], slow.cache.v[:, row, :, :n]), row
    for got, want in zip(fast._row_tensors(), slow._row_tensors(), strict=True):
        assert torch.equal(got[:7], want[:7])


def test_deferred_compilation_captures_uncompiled_first_and_compiles_one_graph_at_a_time(monkeypatch) -> None:
    """defer_compile (--compile-after-ready): start-up captures every bucket with its regions uncompiled, so it waits
    for no compilation; `capture_next` then replaces one uncompiled graph at a time by its compiled capture (decode
    buckets first, each only once the rows' positions allow, then first frames), and a step meanwhile replays the
    uncompiled graph instead of compiling in the middle of a turn. Stand-in recorder (no CUDA) noting, for each
    capture, the compile backend its regions ran under (model.compiled_regions.compiled, patched)."""
    import model.stepper as stepper_module

    backends: list[str | None] = []
    real = stepper_module.compiled

    def noting(backend, *args, **kwargs):
        backends.append(backend)
        return real(None, *args, **kwargs)  # nothing really compiles here: only which backend was asked for

    monkeypatch.setattr(stepper_module, "compiled", noting)
    model = make_model("gqa_fast_project")
    stepper = DecodeStepper(
        model, 9, max_seq_len=64, max_batch=8, length_buckets=[32], first_frame_scratch_row=8,
        compile_backend="inductor", compile_max_batch=2, defer_compile=True,
    )  # fmt: skip
    stepper.use_cuda_graphs = True
    seen: list[tuple[str, int, int, str | None]] = []  # (kind, batch, length, backend) per capture

    def record(run):
        backends.clear()
        run()
        kind = "first" if stepper._capturing_first else "decode"
        seen.append((kind, *stepper._capturing_key, backends[-1]))
        return types.SimpleNamespace(replay=run)

    stepper._record = record  # type: ignore[method-assign]
    stepper._capturing_first = False
    stepper._capturing_key = (0, 0)
    real_capture, real_first = stepper.capture, stepper._capture_first_frames

    def capture(bucket, attn_len, **kw):
        stepper._capturing_first, stepper._capturing_key = False, (bucket, attn_len)
        return real_capture(bucket, attn_len, **kw)

    def capture_first(bucket, **kw):
        stepper._capturing_first, stepper._capturing_key = True, (bucket, 0)
        try:
            return real_first(bucket, **kw)
        finally:
            stepper._capturing_first = False

    stepper.capture, stepper._capture_first_frames = capture, capture_first  # type: ignore[method-assign]
    stepper.capture_all()
    assert all(backend is None for *_, backend in seen), seen  # nothing compiled before ready
    assert len(seen) == 2 * 4 * 1 + 4  # decode: 4 batch buckets × lengths 32, 64; first frames: 4 buckets
    assert stepper.pending_upgrades() == [("decode", 1, 32), ("decode", 1, 64), ("decode", 2, 32), ("decode", 2, 64),
                                          ("first", 1, 0), ("first", 2, 0)]  # fmt: skip
    seen.clear()
    stepper.step(1, 0)  # a step on an uncompiled bucket replays it: no capture, no compile mid-turn
    assert seen == []
    assert stepper.capture_next([40] + [0] * 8)  # row 0 at 40: length-32 decode graphs must wait
    assert seen == [("decode", 1, 64, "inductor")]
    while stepper.capture_next([40] + [0] * 8):
        pass
    assert [s[:3] for s in seen] == [("decode", 1, 64), ("decode", 2, 64), ("first", 1, 0), ("first", 2, 0)]
    assert all(backend == "inductor" for *_, backend in seen)
    assert stepper.pending_upgrades() == [("decode", 1, 32), ("decode", 2, 32)]
    while stepper.capture_next([0] * 9):
        pass
    assert stepper.pending_upgrades() == []


def test_without_deferral_start_up_compiles_the_buckets_it_captures() -> None:
    """The default: a compiled bucket's graph is captured compiled at once; nothing is left to upgrade."""
    stepper = DecodeStepper(
        make_model("gqa_fast_project"), 9, max_seq_len=64, max_batch=8, length_buckets=[32],
        compile_backend="inductor", compile_max_batch=2,
    )  # fmt: skip
    stepper.use_cuda_graphs = True
    stepper._record = lambda run: types.SimpleNamespace(replay=run)  # type: ignore[method-assign]
    stepper.capture_all()
    assert stepper.pending_upgrades() == [] and stepper._defers(1) is False
    assert stepper.capture_seconds.keys() >= {"decode_static", "decode_eager"}


def test_a_step_routes_to_a_larger_bucket_only_when_it_replayed_clearly_faster() -> None:
    # H200 replay times: 64 rows 5.46 ms, 96 rows 6.68 ms, 128 rows 4.94 ms
    times = {32: 4.92, 48: 5.19, 64: 5.46, 96: 6.68, 128: 4.94, 192: 6.0}
    assert fastest_bucket(64, times) == 128
    assert fastest_bucket(96, times) == 128
    assert fastest_bucket(32, times) == 32  # 128 is not under 0.95 of 4.92 ms
    assert fastest_bucket(128, times) == 128  # never a smaller bucket: it would not hold the rows
    assert fastest_bucket(48, {48: 5.0, 64: 4.9}) == 48  # within the noise margin: stays
    assert fastest_bucket(24, times) == 24  # own not timed (not captured): stays


@torch.no_grad()
def test_a_routed_step_gives_the_frames_of_its_own_bucket_and_leaves_padding_rows_alone() -> None:
    """Rows [1, 4) ride along with commit off (one holds an idle stream far along): the stream in row 0 gets exactly
    its solo frames, and the other rows' state does not move."""
    model = make_model("gqa_fast_project")
    model.set_batch_invariant(True)
    s = RowSampling(0.8, 0.8, 1.3, seed=7)
    prompt = random_sequence(model, 11, seed=4)
    expected = reference(model, prompt, 6, s)

    stepper = DecodeStepper(model, n_rows=4, max_seq_len=64)
    full = stepper.cache.max_seq_len
    idle = random_sequence(model, 40, seed=9)  # an idle session in row 2, its position past the prompt's
    start_stream(stepper, 2, RowSampling(0.7, 0.7, 1.2, seed=3), idle)
    frames = [start_stream(stepper, 0, s, prompt)]
    stepper.replay_ms = {(1, full): 10.0, (4, full): 5.0}  # as if captured and timed: the 4-row graph is faster
    before = [t[1:].clone() for t in (stepper.pos, stepper.frame, stepper.window, stepper.loop_step)]
    for _ in range(5):
        stepper.set_commit([True])
        frames.append(stepper.step(1, int(stepper.pos[:1].max()))[0])
        assert stepper.last_bucket == (4, full)
    assert stepper.routed_steps == 5
    assert torch.equal(torch.stack(frames, 1), expected)
    after = [t[1:] for t in (stepper.pos, stepper.frame, stepper.window, stepper.loop_step)]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_no_routing_below_the_full_attention_length() -> None:
    """A larger bucket would step rows whose positions a shorter attention length may not hold."""
    model = make_model("gqa_fast_project")
    stepper = DecodeStepper(model, n_rows=4, max_seq_len=128, length_buckets=[32])
    full = stepper.cache.max_seq_len
    stepper.replay_ms = {(1, 32): 10.0, (4, 32): 1.0, (1, full): 10.0, (4, full): 1.0}
    assert stepper.route(1, 32) == 1
    assert stepper.route(1, full) == 4

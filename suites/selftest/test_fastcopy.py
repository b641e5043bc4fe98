"""``copy_pairs`` writes exactly the bits ``dst.copy_(src)`` writes, on every backend.

Shapes cover what the sender paths hand it: whole per-expert tensors, row slices of fc1
halves, column slices of fc2 (strided, MoE-TP > 1), 1-D runs of any length, transposed and
3-D views; values are random bit patterns, NaN payloads included.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from pytest_weightsync.reference_impl.kernels import fastcopy  # noqa: E402
from pytest_weightsync.reference_impl.kernels.fastcopy import (  # noqa: E402
    PairMismatchError,
    PairTypeError,
    choose_backend,
    copy_pairs,
    plan_copies,
)

from .expert_layers import receiver_buffers, receiver_pairs, trainer_experts  # noqa: E402

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8, torch.bool)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def random_bits(shape, dtype, device="cpu", seed=0):
    """A tensor of ``dtype`` holding random bit patterns (NaNs with payloads, -0.0, ...)."""
    where = torch.device(device)
    if where.type != "cuda":
        where = torch.device("cpu")  # the interpreter test passes device="cpu"
    g = torch.Generator(where).manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, device=where).bool().to(device)
    width = torch.empty((), dtype=dtype).element_size()
    bits = torch.randint(-(2**31), 2**31 - 1, shape, generator=g, dtype=torch.int64, device=where)
    return bits.to(_BITS[width]).view(dtype).to(device)


def assert_same_bits(got, want, where):
    g = got.reshape(-1).view(_BITS[got.element_size()]) if got.dtype != torch.bool else got.reshape(-1)
    w = want.reshape(-1).view(_BITS[want.element_size()]) if want.dtype != torch.bool else want.reshape(-1)
    diff = (g != w).nonzero()
    if diff.numel():
        i = int(diff[0])
        idx = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), got.shape))
        raise AssertionError(
            f"{where}: first differing element at {idx}: got bits {int(g[i])}, want {int(w[i])}"
        )


def strided_cases(dtype, device="cpu"):
    """(name, dst, src) triples shaped like the sender paths' copies, plus awkward views."""
    fc1 = random_bits((2 * 10, 12), dtype, device, seed=1)  # [2I, H], I=10, H=12
    fc2 = random_bits((12, 10), dtype, device, seed=2)  # [H, I]
    w13 = torch.zeros(3, 10, 12, dtype=dtype, device=device)  # receiver MoE-TP 2: [E, 2I/2, H]
    w2 = torch.zeros(3, 12, 5, dtype=dtype, device=device)
    wide = random_bits((5, 2500), dtype, device, seed=3)
    flat = random_bits((3001,), dtype, device, seed=4)
    cube = random_bits((4, 3, 5), dtype, device, seed=5)
    return [
        ("fc1 gate rows -> w13 first half", w13[1, :5], fc1[5:10]),
        ("fc1 up rows -> w13 second half", w13[1, 5:], fc1[15:20]),
        ("fc2 column slice (strided)", w2[2], fc2[:, 5:]),
        ("whole expert", torch.empty_like(fc1), fc1),
        ("transposed destination", torch.zeros(12, 20, dtype=dtype, device=device).t(), fc1),
        ("wide rows, strided rows", torch.zeros(5, 1250, dtype=dtype, device=device), wide[:, ::2]),
        ("1-D of odd length", torch.zeros(3001, dtype=dtype, device=device), flat),
        ("1-D strided", torch.zeros(1501, dtype=dtype, device=device), flat[::2]),
        ("3-D permuted (not 2-D)", torch.zeros(5, 3, 4, dtype=dtype, device=device).permute(2, 1, 0), cube),
        ("scalar", torch.zeros((), dtype=dtype, device=device), flat[7]),
        ("empty", torch.zeros(0, 4, dtype=dtype, device=device), fc1[:0, :4]),
        ("offset view of a shared buffer", w13.view(-1)[7:7 + 100], flat[11:111]),
    ]


def check_backend(backend, device="cpu", dtypes=DTYPES):
    for dtype in dtypes:
        cases = strided_cases(dtype, device)
        expected = []
        for _, dst, src in cases:
            ref = dst.clone()
            ref.copy_(src)
            expected.append(ref)
        used = copy_pairs([(dst, src) for _, dst, src in cases], backend=backend)
        assert used == backend
        for (name, dst, _), want in zip(cases, expected):
            assert_same_bits(dst, want, f"{backend} {dtype} {name}")


@pytest.mark.parametrize("backend", ["loop", "foreach"])
def test_backend_is_bit_identical_to_copy_(backend):
    check_backend(backend)


def test_auto_on_cpu_is_the_single_threaded_loop():
    dst, src = torch.zeros(4, 4), torch.ones(4, 4)
    assert copy_pairs([(dst, src)]) == "loop"
    assert torch.equal(dst, src)


def test_choose_backend_falls_back_without_triton_or_cuda():
    assert choose_backend("cuda", has_triton=True) == "triton"
    assert choose_backend("cuda", has_triton=False) == "foreach"
    assert choose_backend("cpu", has_triton=True) == "loop"


def test_triton_unavailable_when_its_import_fails(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delitem(sys.modules, "pytest_weightsync.reference_impl.kernels.triton_copy", raising=False)
    assert fastcopy.triton_available() is False


def test_shape_mismatch_names_the_pair():
    good = (torch.zeros(2, 3), torch.ones(2, 3))
    with pytest.raises(PairMismatchError, match=r"pair 1: shape mismatch: dst \(2, 3\) vs src \(3, 2\)"):
        copy_pairs([good, (torch.zeros(2, 3), torch.ones(3, 2))])


def test_dtype_mismatch_names_the_pair_and_leaves_destinations_untouched():
    dst0 = torch.zeros(2, 3)
    with pytest.raises(PairMismatchError, match=r"pair 1: dtype mismatch: dst torch.float32 vs src torch.bfloat16"):
        copy_pairs([(dst0, torch.ones(2, 3)), (torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bfloat16))])
    assert torch.count_nonzero(dst0) == 0, "validation must run before any copy"


def test_non_tensor_entries_are_rejected_by_index():
    with pytest.raises(PairTypeError, match=r"pair 0: src is list, expected torch.Tensor"):
        copy_pairs([(torch.zeros(1), [1.0])])
    with pytest.raises(PairTypeError, match=r"pair 0: expected a \(dst, src\) pair"):
        copy_pairs([torch.zeros(2)[:1]])


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="backend must be one of"):
        copy_pairs([], backend="memcpy")


def test_plan_is_reusable_and_copies_current_values():
    dst, src = torch.zeros(3, 5), random_bits((3, 5), torch.float32)
    plan = plan_copies([(dst, src)])
    plan.run()
    src.add_(1)
    plan.run()
    assert_same_bits(dst, src, "second run of the same plan")


_INTERPRETED_KERNEL_CHECK = textwrap.dedent(
    """
    import torch
    from pytest_weightsync.suites.selftest.test_fastcopy import check_backend
    check_backend("triton", dtypes=(torch.bfloat16, torch.float64, torch.bool))  # widths 2, 8, 1
    from pytest_weightsync.suites.selftest.test_fastcopy import check_even_and_32bit_launches
    check_even_and_32bit_launches()
    print("triton kernel bit-identical under the interpreter")
    """
)


def check_even_and_32bit_launches(device="cpu"):
    """Launches cut so that every copy is whole tiles (no masks) and, separately, ones that
    are not, with 32-bit and 64-bit indexing: all bit-identical to ``copy_``."""
    src = random_bits((8, 64), torch.bfloat16, device, seed=7)
    flat = random_bits((3 * 1024,), torch.bfloat16, device, seed=8)
    dst_cols = torch.zeros(8, 32, dtype=torch.bfloat16, device=device)
    dst_flat = torch.zeros(3 * 1024, dtype=torch.bfloat16, device=device)
    odd = torch.zeros(7, 30, dtype=torch.bfloat16, device=device)
    pairs = [(dst_cols, src[:, 32:]), (dst_flat, flat), (odd, src[:7, 1:31])]
    plan = plan_copies(pairs, backend="triton", graph=False, triton_options=dict(tile=64, tiles_per_program=1))
    launches = plan.launches
    assert {launch.even for launch in launches} == {True, False}, [vars(x) for x in launches]
    assert all(launch.offset32 for launch in launches)
    plan.run()
    for i, (d, s) in enumerate(pairs):
        assert_same_bits(d, s, f"shaped launch pair {i}")


def test_launch_evenness_and_offset_width_are_decided_per_copy():
    pytest.importorskip("triton")
    from pytest_weightsync.reference_impl.kernels.triton_copy import LaunchShape

    shape = LaunchShape(tile=64, tiles_per_program=2)
    # 2-D copy tuples: (src, dst, rows, cols, ss0, ss1, ds0, ds1)
    assert shape.even((0, 0, 8, 32, 64, 1, 32, 1), 32)  # 2 rows/tile: 4 tiles, 2 programs
    assert not shape.even((0, 0, 6, 32, 64, 1, 32, 1), 32)  # 3 tiles: half a program
    assert not shape.even((0, 0, 8, 30, 64, 1, 30, 1), 32)  # partial rows
    assert shape.key((0, 0, 8, 30, 64, 1, 30, 1)) == (32, False)


def test_triton_kernel_is_bit_identical_under_the_interpreter(tmp_path):
    """The GPU kernel's indexing, run on CPU by Triton's interpreter (TRITON_INTERPRET=1)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRETED_KERNEL_CHECK],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bit-identical" in proc.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "foreach", "loop"])
def test_gpu_backend_is_bit_identical_to_copy_(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    check_backend(backend, device="cuda")


@pytest.mark.gpu
def test_gpu_auto_uses_triton_when_it_imports():
    pytest.importorskip("triton")
    dst, src = torch.zeros(4, 4, device="cuda"), torch.ones(4, 4, device="cuda")
    assert copy_pairs([(dst, src)]) == "triton"
    assert torch.equal(dst, src)


@pytest.mark.gpu
def test_gpu_auto_falls_back_to_foreach_without_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delitem(sys.modules, "pytest_weightsync.reference_impl.kernels.triton_copy", raising=False)
    cases = strided_cases(torch.bfloat16, "cuda")
    want = [d.clone().copy_(s) for _, d, s in cases]
    assert copy_pairs([(d, s) for _, d, s in cases]) == "foreach"
    for (name, dst, _), w in zip(cases, want):
        assert_same_bits(dst, w, f"foreach fallback {name}")


@pytest.mark.gpu
def test_gpu_full_layer_direct_tp2_slices_are_bit_identical():
    """The Qwen3.5-35B-A3B layer shape at receiver MoE-TP 2 (strided fc2 columns)."""
    pytest.importorskip("triton")
    E, H, inter, part = 256, 2048, 512, 256
    fc1 = [random_bits((2 * inter, H), torch.bfloat16, "cuda", seed=e) for e in range(E)]
    fc2 = [random_bits((H, inter), torch.bfloat16, "cuda", seed=E + e) for e in range(E)]
    for rank in range(2):
        w13 = torch.zeros(E, 2 * part, H, dtype=torch.bfloat16, device="cuda")
        w2 = torch.zeros(E, H, part, dtype=torch.bfloat16, device="cuda")
        lo = rank * part
        pairs = []
        for e in range(E):
            pairs.append((w13[e, :part], fc1[e][lo : lo + part]))
            pairs.append((w13[e, part:], fc1[e][inter + lo : inter + lo + part]))
            pairs.append((w2[e], fc2[e][:, lo : lo + part]))
        assert copy_pairs(pairs) == "triton"
        for i, (d, s) in enumerate(pairs):
            assert_same_bits(d, s, f"rank {rank} expert {i // 3} pair {i % 3}")


@pytest.mark.gpu
def test_gpu_planning_a_copy_does_not_wait_for_the_device():
    """A receiver plans bucket ``b + 1`` while its stream still copies bucket ``b``: building
    the plan (the Triton launch tables) must queue behind that copy, not wait for it on the
    host (a blocking copy of a pageable table synchronizes the stream, which serialized the
    buckets of every freshly planned update)."""
    pytest.importorskip("triton")
    dst = torch.zeros(64, 32, dtype=torch.bfloat16, device="cuda")
    src = random_bits((64, 64), torch.bfloat16, "cuda")[:, :32]  # strided: the Triton kernel
    stream = torch.cuda.current_stream()
    fastcopy.plan_copies([(dst, src)], graph=False)  # host allocations warm (pinned blocks)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of device time queued on the stream
    plan = fastcopy.plan_copies([(dst, src)], graph=False)
    still_busy = not stream.query()
    plan.run()
    torch.cuda.synchronize()
    assert plan.backend == "triton" and [s.kind for s in plan.steps] == ["triton"]
    assert still_busy, "planning waited for the work queued before it"
    assert_same_bits(dst, src, "copy planned while the device was busy")


@pytest.mark.gpu
def test_gpu_the_same_copies_planned_again_reuse_their_tables_also_from_another_stream():
    """A stateless sender plans the same strided copies every update: the second plan takes
    the launch tables the first uploaded (no host work, no upload), a plan of other copies
    gets its own, and a plan made on another stream while the first upload still waits
    behind queued work waits for it on the device before its kernel reads the table."""
    pytest.importorskip("triton")
    from pytest_weightsync.reference_impl.kernels import triton_copy

    triton_copy._LAUNCH_TABLES.clear()
    src = random_bits((64, 64), torch.bfloat16, "cuda")[:, :32]  # strided: the Triton kernel
    dst, other = (torch.zeros(64, 32, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    first = fastcopy.plan_copies([(dst, src)], graph=False)
    again = fastcopy.plan_copies([(dst, src)], graph=False)
    assert again.launches[0].meta is first.launches[0].meta
    assert len(triton_copy._LAUNCH_TABLES) == 1
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the next upload queues behind this on the current stream
    elsewhere = fastcopy.plan_copies([(other, src)], graph=False)
    assert elsewhere.launches[0].meta is not first.launches[0].meta
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        reused = fastcopy.plan_copies([(other, src)], graph=False)
        assert reused.launches[0].meta is elsewhere.launches[0].meta
        reused.run()
    torch.cuda.synchronize()
    assert_same_bits(other, src, "a table reused on another stream before its upload ran")
    small = triton_copy._LaunchTables(capacity=2)
    tables = [small.put(("cuda", i), "cuda", (torch.zeros(1, device="cuda"),)) for i in range(3)]
    assert len(small) == 2 and small.get(("cuda", 0)) is None
    assert small.get(("cuda", 2)) is tables[2]


# --------------------------------------------------------------------------- plan choice


def sender_pairs(experts=4, hidden=16, inter=8, moe_tp=1, device="cpu", order=None):
    """Receiver rank 0's pairs of one layer from separate per-expert tensors (fc1 = [gate; up],
    fc2), in ``order`` (default expert by expert)."""
    fc1, fc2 = trainer_experts(experts, hidden, inter, device)
    pairs = receiver_pairs(fc1, fc2, *receiver_buffers(experts, hidden, inter, moe_tp, device), moe_tp)
    return pairs if order is None else [pairs[i] for i in order]


def test_runs_are_whole_contiguous_tensors_tiling_one_span_in_any_list_order():
    pairs = sender_pairs(order=list(range(12))[::-1])  # reversed: runs are found by address
    runs, rest = fastcopy.find_runs(pairs)
    by_len = sorted(len(r) for r in runs)
    assert by_len == [4, 8], runs  # w2 (4 experts), w13 (gate + up of 4 experts)
    assert rest == []
    strided = sender_pairs(moe_tp=2)
    runs, rest = fastcopy.find_runs(strided)
    assert [len(r) for r in runs] == [8] and len(rest) == 4  # fc2 column slices stay out


def test_gaps_and_lone_pairs_are_not_runs():
    buf = torch.zeros(10)
    a, b = random_bits((3,), torch.float32, seed=1), random_bits((3,), torch.float32, seed=2)
    runs, rest = fastcopy.find_runs([(buf[0:3], a), (buf[4:7], b)])  # one element apart
    assert runs == [] and rest == [0, 1]
    runs, rest = fastcopy.find_runs([(buf[0:3], a), (torch.zeros(0), torch.zeros(0)), (buf[3:6], b)])
    assert runs == [[0, 2]] and rest == []  # empty pairs copy nothing and break nothing
    other = torch.zeros(10)
    runs, rest = fastcopy.find_runs([(buf[0:3], a), (other[0:3], b)])
    assert runs == [] and rest == [0, 1]


@pytest.mark.parametrize("moe_tp", [1, 2])
@pytest.mark.parametrize("shuffle", [False, True])
def test_auto_plan_with_runs_is_bit_identical(moe_tp, shuffle):
    order = [5, 0, 11, 3, 8, 1, 10, 2, 7, 4, 9, 6] if shuffle else None
    pairs = sender_pairs(moe_tp=moe_tp, order=order)
    plan = plan_copies(pairs)
    plan.run()
    for i, (d, s) in enumerate(pairs):
        assert_same_bits(d, s, f"pair {i}")
    assert plan.counts() == ({"cat": 2} if moe_tp == 1 else {"cat": 1, "copy": 4})
    assert not plan.captured  # CPU plans never capture


def test_named_backend_takes_every_pair_unless_runs_are_asked_for():
    pairs = sender_pairs()
    assert plan_copies(pairs, backend="loop").counts() == {"copy": 12}
    assert plan_copies(pairs, backend="loop", runs=True).counts() == {"cat": 2}
    with pytest.raises(ValueError, match="graph must be"):
        plan_copies(pairs, graph="sometimes")


# --------------------------------------------------------------------------- CUDA graphs


def assert_pairs_copied(pairs, where):
    """Every destination holds its source's bits (after the device finished writing)."""
    torch.cuda.synchronize()
    for i, (d, s) in enumerate(pairs):
        assert_same_bits(d, s, f"{where}, pair {i}")


def _renew(pairs, seed):
    for i, (_, s) in enumerate(pairs):
        s.copy_(random_bits(tuple(s.shape), s.dtype, s.device, seed=seed + i))


@pytest.mark.gpu
@pytest.mark.parametrize("moe_tp", [1, 2])
def test_gpu_reused_plan_is_captured_at_its_second_run_and_copies_current_values(moe_tp):
    pytest.importorskip("triton")
    pairs = sender_pairs(experts=8, hidden=256, inter=128, moe_tp=moe_tp, device="cuda")
    plan = plan_copies(pairs)
    plan.run()
    assert not plan.captured
    for update in range(3):
        _renew(pairs, seed=1000 * (update + 1))
        plan.run()
        assert plan.captured, plan.graph_error
        assert_pairs_copied(pairs, f"update {update}")


@pytest.mark.gpu
def test_gpu_graph_false_never_captures_and_true_captures_at_once():
    pytest.importorskip("triton")
    pairs = sender_pairs(moe_tp=2, device="cuda")
    never = plan_copies(pairs, graph=False)
    never.run()
    never.run()
    assert not never.captured
    at_once = plan_copies(pairs, graph=True)
    _renew(pairs, seed=77)
    at_once.run()
    assert at_once.captured, at_once.graph_error
    assert_pairs_copied(pairs, "graph=True")


@pytest.mark.gpu
def test_gpu_plan_run_inside_a_callers_capture_is_recorded_into_that_graph():
    pytest.importorskip("triton")
    pairs = sender_pairs(moe_tp=2, device="cuda")
    plan = plan_copies(pairs)
    plan.run()  # compiles the kernel outside the capture
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        plan.run()
    assert not plan.captured  # it issued its steps into the caller's graph instead
    _renew(pairs, seed=5)
    outer.replay()
    assert_pairs_copied(pairs, "replayed caller graph")


@pytest.mark.gpu
def test_gpu_failed_capture_keeps_copying_eagerly_and_says_why(monkeypatch):
    pytest.importorskip("triton")

    class Refusing:
        def capture_begin(self, *args, **kwargs):
            raise RuntimeError("capture refused for the test")

        def capture_end(self):
            pass

    pairs = sender_pairs(moe_tp=2, device="cuda")
    plan = plan_copies(pairs)
    plan.run()
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Refusing)
    _renew(pairs, seed=9)
    plan.run()
    assert not plan.captured and "capture refused for the test" in plan.graph_error
    assert_pairs_copied(pairs, "eager after a failed capture")


@pytest.mark.gpu
@pytest.mark.parametrize("moe_tp,counts", [(1, {"cat": 2}), (2, {"cat": 1, "triton": 1})])
def test_gpu_auto_plan_of_a_full_layer_is_batched_copies_and_one_launch(moe_tp, counts):
    """The Qwen3.5-35B-A3B layer: whole tensors go to torch.cat, the strided rest to one
    Triton launch (whole tiles: no masks)."""
    pytest.importorskip("triton")
    pairs = sender_pairs(experts=256, hidden=2048, inter=512, moe_tp=moe_tp, device="cuda")
    plan = plan_copies(pairs)
    assert plan.counts() == counts
    launches = plan.launches
    assert len(launches) == counts.get("triton", 0)
    assert all(launch.even and launch.offset32 for launch in launches)
    plan.run()
    plan.run()
    assert_pairs_copied(pairs, f"full layer MoE-TP {moe_tp}")

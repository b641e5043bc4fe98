"""The CPU-checkable parts of the GPU suites, run here on CPU.

The GPU suites (suites/selftest/test_gpu_*.py) are written device-generic: their scenario steps
(suites/selftest/gpu_harness.py), their rank bodies and their checks take a device. This file runs that
same code with ``device="cpu"`` (gloo instead of NCCL, shared memory instead of CUDA IPC, no
graphs), checks the reference MoE forward they rely on against a naive loop, and checks that
the GPU suites themselves skip cleanly without a GPU.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from zygote import run_pytest

from pytest_weightsync.reference_impl.oracle import moe_forward as mf
from pytest_weightsync.reference_impl.oracle import synth
from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology, fused_name

ROOT = Path(__file__).resolve().parents[1]
SUITES = ROOT / "suites" / "selftest"

# The suites are a package (relative imports inside): import them as the installed plugin
# names them, as `pytest --pyargs pytest_weightsync.suites` does.
h = importlib.import_module("pytest_weightsync.suites.selftest.gpu_harness")


def _suite(name: str):
    return importlib.import_module(f"pytest_weightsync.suites.selftest.{name}")


#: The suites' own autouse fixture: one intra-op thread, as the suites run.
_one_torch_thread = importlib.import_module("pytest_weightsync.suites.conftest")._one_torch_thread


# --------------------------------------------------------------------------------------------
# The reference MoE forward
# --------------------------------------------------------------------------------------------


def _random_layer(experts=6, hidden=16, inter=10, tokens=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate = torch.randn(experts, inter, hidden, generator=gen) * 0.3
    up = torch.randn(experts, inter, hidden, generator=gen) * 0.3
    down = torch.randn(experts, hidden, inter, generator=gen) * 0.3
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    return gate, up, down, x, logits


def _naive(gate, up, down, x, logits, top_k):
    """Token by token, expert by expert, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    probs = torch.softmax(logits.double(), dim=-1)
    for t in range(x.shape[0]):
        weights, ids = torch.topk(probs[t], top_k)
        weights = weights / weights.sum()
        for w, e in zip(weights.tolist(), ids.tolist()):
            xt = x[t].double()
            act = torch.nn.functional.silu(gate[e].double() @ xt) * (up[e].double() @ xt)
            out[t] += w * (down[e].double() @ act)
    return out


@pytest.mark.parametrize("top_k", [1, 2, 6])
def test_moe_forward_matches_a_naive_token_loop(top_k):
    gate, up, down, x, logits = _random_layer()
    w13 = torch.cat([gate, up], dim=1)
    got = mf.moe_forward(x, logits, w13, down, top_k=top_k, out_dtype=torch.float64)
    torch.testing.assert_close(got, _naive(gate, up, down, x, logits, top_k), rtol=1e-5, atol=1e-5)


def test_moe_forward_reads_the_gate_half_the_order_names():
    gate, up, down, x, logits = _random_layer()
    gate_up = mf.moe_forward(x, logits, torch.cat([gate, up], 1), down, top_k=2)
    up_gate = mf.moe_forward(x, logits, torch.cat([up, gate], 1), down, top_k=2, order="up_gate")
    assert torch.equal(gate_up, up_gate)
    wrong = mf.moe_forward(x, logits, torch.cat([up, gate], 1), down, top_k=2)
    assert not torch.allclose(gate_up, wrong), "swapping gate and up must change the output"


def test_partial_outputs_of_moe_tp_and_ep_ranks_sum_to_the_full_output():
    gate, up, down, x, logits = _random_layer(experts=6, inter=10)
    full = mf.moe_forward(x, logits, torch.cat([gate, up], 1), down, top_k=3, out_dtype=torch.float64)
    tp = sum(mf.moe_forward(x, logits, torch.cat([gate[:, s], up[:, s]], 1), down[:, :, s], top_k=3,
                            out_dtype=torch.float64) for s in (slice(0, 5), slice(5, 10)))
    ep = sum(mf.moe_forward(x, logits, torch.cat([gate[e], up[e]], 1), down[e], top_k=3, expert_start=e.start,
                            out_dtype=torch.float64) for e in (range(0, 2), range(2, 6)))
    torch.testing.assert_close(tp, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ep, full, rtol=1e-5, atol=1e-5)


def test_zero_padding_of_the_receiver_buffers_changes_nothing():
    gate, up, down, x, logits = _random_layer(inter=10)
    pad = lambda t, dim: torch.cat([t, torch.zeros_like(t.narrow(dim, 0, 3))], dim)  # noqa: E731
    plain = mf.moe_forward(x, logits, torch.cat([gate, up], 1), down, top_k=2, out_dtype=torch.float64)
    padded = mf.moe_forward(x, logits, torch.cat([pad(gate, 1), pad(up, 1)], 1), pad(down, 2), top_k=2,
                            out_dtype=torch.float64)
    torch.testing.assert_close(padded, plain, rtol=1e-6, atol=1e-6)


def test_moe_forward_is_shape_static_and_never_reads_values_on_the_host():
    """On ``meta`` tensors any host read (.item(), nonzero, data-dependent shapes) raises: a
    forward that runs there can be captured in a CUDA graph."""
    w13 = torch.empty(4, 2 * 8, 16, dtype=torch.bfloat16, device="meta")
    w2 = torch.empty(4, 16, 8, dtype=torch.bfloat16, device="meta")
    x = torch.empty(5, 16, dtype=torch.bfloat16, device="meta")
    logits = torch.empty(5, 12, device="meta")
    out = mf.moe_forward(x, logits, w13, w2, top_k=3, expert_start=4, out_dtype=torch.float32)
    assert out.shape == (5, 16) and out.device.type == "meta" and out.dtype == torch.float32


@pytest.mark.parametrize("change, match", [
    (dict(w2=torch.zeros(4, 16, 7)), "w2 shape"),
    (dict(x=torch.zeros(5, 15)), "hidden size 15"),
    (dict(logits=torch.zeros(4, 12)), "router_logits must be"),
    (dict(top_k=13), "top_k must be"),
    (dict(expert_start=9), "do not fit"),
    (dict(order="gate-up"), "order must be"),
])
def test_moe_forward_names_bad_inputs(change, match):
    args = dict(x=torch.zeros(5, 16), logits=torch.zeros(5, 12), w13=torch.zeros(4, 16, 16),
                w2=torch.zeros(4, 16, 8), top_k=2, expert_start=0, order="gate_up")
    args.update(change)
    with pytest.raises(mf.MoEForwardError, match=match):
        mf.moe_forward(args["x"], args["logits"], args["w13"], args["w2"], top_k=args["top_k"],
                       expert_start=args["expert_start"], order=args["order"])


def test_capture_refuses_cpu_tensors_by_name():
    with pytest.raises(mf.MoEForwardError, match="CUDA graph capture needs CUDA tensors"):
        mf.capture_forward(torch.zeros(2, 4), torch.zeros(2, 3), torch.zeros(3, 4, 4), torch.zeros(3, 4, 2), top_k=1)


# --------------------------------------------------------------------------------------------
# The scenario steps of the GPU suites, on CPU
# --------------------------------------------------------------------------------------------

SPEC = MoESpec(num_layers=2, num_experts=6, hidden=16, intermediate=12)
TOPOS = [
    pytest.param(ReceiverTopology(tp=1), id="moe_tp1"),
    pytest.param(ReceiverTopology(tp=2), id="moe_tp2"),
    pytest.param(ReceiverTopology(tp=2, moe_ep=2, order="up_gate"), id="moe_ep2-up_gate"),
    pytest.param(ReceiverTopology(tp=2, intermediate_padded=8), id="moe_tp2-padded"),
    pytest.param(ReceiverTopology(tp=3, intermediate_padded=5, pad_mode="blocked"), id="moe_tp3-blocked"),
]


@pytest.mark.parametrize("finite", [False, True], ids=["full-spread", "finite"])
@pytest.mark.parametrize("topo", TOPOS)
def test_device_path_of_the_oracle_gives_the_cpu_bits(topo, finite):
    """``device=`` only moves where the integer hash runs: the harness (which always passes a
    device) gets bit for bit what the default CPU call gives. The GPU suite checks the same
    on CUDA (test_gpu_repeated.py)."""
    spec = MoESpec(1, 6, 16, 13) if topo.pad_mode == "blocked" else SPEC
    for rank in range(topo.world_size):
        got = h.expected_params(spec, topo, rank, 7, "cpu", seed=3, finite=finite)
        want = synth.expected_receiver_params(spec, topo, rank, 7, seed=3, finite=finite)
        assert sorted(got) == sorted(want)
        for name in want:
            h.assert_bits_equal(got[name], want[name], name)
    full, want = h.full_weights(spec, 2, "cpu", 1, finite=finite), synth.full_weights(spec, 2, 1, finite=finite)
    for layer in want:
        for e, w in enumerate(want[layer]):
            for p in ("gate", "up", "down"):
                h.assert_bits_equal(full[layer][e][p], w[p], f"layer {layer} expert {e} {p}")


def test_weights_oracle_and_poison_at_qwen35_sizes_are_built_on_the_target_device(monkeypatch):
    """No per-element work on the CPU for a GPU-sized tensor: on the ``meta`` device (shapes
    only, no data) every call of the value function gets its coordinates on that device, and
    every result lives there. Experts of the Qwen3.5 layer's size (8 of its 256; the whole
    layer and model: tests/test_oracle_device_path.py) and a poisoned receiver buffer of the
    whole layer."""
    seen = []
    real = synth._bits_at

    signature = inspect.signature(real)

    def recording(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        seen.append((bound["r"].device.type, bound["c"].device.type))
        return real(*args, **kwargs)

    monkeypatch.setattr(synth, "_bits_at", recording)
    qwen, topo = h.QWEN35_LAYER, ReceiverTopology(tp=2)
    spec = MoESpec(num_layers=1, num_experts=8, hidden=qwen.hidden, intermediate=qwen.intermediate)
    full = synth.full_weights(spec, 1, device="meta")
    assert {t.device.type for w in full[0] for t in (w.gate, w.up, w.down)} == {"meta"}
    expected = synth.expected_receiver_params(spec, topo, 1, 1, device="meta", finite=True)
    assert {t.device.type for t in expected.values()} == {"meta"}
    buffer = torch.empty(qwen.num_experts, 2 * qwen.intermediate, qwen.hidden, dtype=qwen.dtype, device="meta")
    assert synth.poison_(buffer) is buffer
    assert seen and set(seen) == {("meta", "meta")}, sorted(set(seen))
    # off the CPU the oracle hashes a batch of experts at once: full weights 3 per batch,
    # MoE-TP rank 1 (every expert, half the rows) 3 per batch; poison: one tile per (dtype,
    # device), hashed once and then copied (none when this process made it before)
    batches = sum(-(-spec.num_experts // synth.experts_per_batch(rows * spec.hidden))
                  for rows in (spec.intermediate, spec.intermediate // 2))
    assert len(seen) - 3 * batches in (0, 1), len(seen)


def test_poison_is_the_pattern_of_each_flat_index(monkeypatch):
    """The poison is one hashed tile repeated: it must depend on the flat index alone - not
    on where a tile boundary falls in the buffer (the GPU suite compares GPU slices against
    ``poison_values``), nor on the tensor's strides or dtype."""
    whole = synth.poison_(torch.empty(5, 7, 11, dtype=torch.bfloat16))
    assert torch.equal(whole.view(torch.int16).reshape(-1),
                       synth.poison_values(0, 385, torch.bfloat16).view(torch.int16))
    assert not (whole == 0).any(), "the poison must never equal zero padding"
    monkeypatch.setattr(synth, "POISON_TILE", 16)  # many tiles, and a partial one at the end
    tiled = synth.poison_(torch.empty(5, 7, 11, dtype=torch.bfloat16))
    h.assert_bits_equal(tiled.reshape(-1), synth.poison_values(0, 385, torch.bfloat16),
                        "poison across 16-element tiles")
    h.assert_bits_equal(tiled.reshape(-1)[21:40], synth.poison_values(21, 40, torch.bfloat16),
                        "a slice straddling a tile boundary")
    assert len(set(tiled.reshape(-1)[:16].view(torch.int16).tolist())) > 8, "a varied tile"
    monkeypatch.undo()
    strided = torch.empty(11, 7, 5, dtype=torch.bfloat16).permute(2, 1, 0)
    synth.poison_(strided)
    h.assert_bits_equal(strided.contiguous(), whole, "poison of a non-contiguous view")
    as_float = synth.poison_(torch.empty(5, 7, 11, dtype=torch.float32))
    h.assert_bits_equal(as_float.to(torch.bfloat16), whole, "poison of an FP32 buffer")


def test_qwen35_shape_constant_is_one_real_layer():
    spec = h.QWEN35_LAYER
    assert (spec.num_experts, spec.hidden, spec.intermediate, spec.num_layers) == (256, 2048, 512, 1)
    assert 3 * spec.num_experts * spec.hidden * spec.intermediate * 2 == 3 << 29  # 1.5 GiB


@pytest.mark.parametrize("path", h.PATHS)
@pytest.mark.parametrize("topo", TOPOS[:4])
def test_update_scenario_on_cpu(topo, path):
    log = h.run_updates(h.Scenario(SPEC, topo, tokens=8, top_k=2), path, range(3), "cpu")
    assert log.outputs_checked == 3 * topo.world_size * SPEC.num_layers
    assert log.graph_checks == 0


def test_twenty_repeated_updates_on_cpu_are_exact_every_time():
    scenario = h.Scenario(SPEC, ReceiverTopology(tp=2, moe_ep=2), tokens=8, top_k=3)
    log = h.run_updates(scenario, "direct", range(21), "cpu")
    assert log.outputs_checked == 21 * 2 * SPEC.num_layers
    assert len(log.changed_elements) == 21 and all(c > 0 for c in log.changed_elements[1:])


def test_update_scenario_catches_a_reallocating_loader(monkeypatch):
    real = h.update

    def reallocating(receivers, path, full):
        real(receivers, path, full)
        name = fused_name(0, "w2")
        receivers[0].params[name] = receivers[0].params[name].clone()

    monkeypatch.setattr(h, "update", reallocating)
    with pytest.raises(AssertionError, match="reallocated"):
        h.run_updates(h.Scenario(SPEC, ReceiverTopology(tp=1)), "packed", range(2), "cpu")


def test_update_scenario_catches_a_stale_layer_with_its_location(monkeypatch):
    real = h.update

    def skips_layer_1_after_first(receivers, path, full):
        for receiver in receivers:
            receiver.begin_update()
            layers = range(receiver.spec.num_layers) if not skips_layer_1_after_first.done else [0]
            for layer in layers:
                receiver.load(h.payload(path, receiver.spec, receiver.topo, receiver.rank, full, [layer]),
                              load_format=h.LOAD_FORMAT[path])
        skips_layer_1_after_first.done = True

    skips_layer_1_after_first.done = False
    monkeypatch.setattr(h, "update", skips_layer_1_after_first)
    with pytest.raises(AssertionError, match=r"layer=1 expert=0 projection=\w+ row=0 col=0"):
        h.run_updates(h.Scenario(SPEC, ReceiverTopology(tp=1)), "direct", range(2), "cpu")
    del real


# --------------------------------------------------------------------------------------------
# The IPC path, through shared memory on CPU
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_receivers():
    from pytest_weightsync.reference_impl.engine.process import ReceiverProcess

    processes = [ReceiverProcess("cpu"), ReceiverProcess("cpu")]
    yield processes
    for process in processes:
        process.close()
    assert all(p.pid is None for p in processes)


@pytest.mark.parametrize("path, topo", [("direct", ReceiverTopology(tp=2)),
                                        ("packed", ReceiverTopology(tp=2, moe_ep=2, order="up_gate"))],
                         ids=["direct-moe_tp2", "packed-moe_ep2"])
def test_ipc_updates_on_cpu_are_exact_in_place_and_leak_no_handles(cpu_receivers, path, topo):
    log = h.run_ipc_updates(cpu_receivers, SPEC, topo, path, range(10), "cpu")
    for rank in range(2):
        fds = [reports[rank].memory.open_fds for reports in log.receivers]
        assert fds[-1] <= fds[1], f"receiver rank {rank} open descriptors grew: {fds}"
    shared = [m.shared_fds for m in log.trainer]
    # One handle may be in flight: multiprocessing's resource sharer closes its copy of a
    # descriptor after the receiver fetched it, on its own thread. A leak keeps one handle per
    # update (8 here), so more than one more than after the first updates is one.
    assert shared[-1] <= shared[1] + 1, f"the trainer's shared-memory handles grew: {shared}"
    assert all(r.nbytes > 0 for reports in log.receivers for r in reports)


def test_ipc_receiver_refuses_a_bad_payload_and_keeps_its_parameters(cpu_receivers):
    from pytest_weightsync.reference_impl.engine import process as engine_process
    from pytest_weightsync.reference_impl.sharing import ipc

    topo = ReceiverTopology(tp=1)
    process = cpu_receivers[0]
    h.run_ipc_updates([process], SPEC, topo, "direct", [4], "cpu")
    bad = [(n, t.float()) for n, t in h.payload("direct", SPEC, topo, 0, h.full_weights(SPEC, 5, "cpu"))]
    with pytest.raises(engine_process.ReceiverProcessError, match="dtype torch.float32"):
        process.update(ipc.serialize(bad), "direct")
    h.assert_params_exact(process.params(), SPEC, topo, 0, 4)
    with pytest.raises(engine_process.ReceiverProcessError, match="failed in 'update'"):
        process.update(b"not a payload", "direct")
    with pytest.raises(ipc.IpcError, match="not a \\(name, tensor\\) pair"):
        ipc.serialize([("x", [1, 2])])


def test_ipc_receiver_that_dies_is_reported_and_reaped():
    from pytest_weightsync.reference_impl.engine.process import ReceiverProcess, ReceiverProcessError

    process = ReceiverProcess("cpu", timeout=60)
    process.configure(SPEC, ReceiverTopology(tp=1), 0)
    pid = process.pid
    os.kill(pid, 9)
    with pytest.raises(ReceiverProcessError, match="died during 'memory'|lost the connection|cannot send"):
        process.memory()
    assert process.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


# --------------------------------------------------------------------------------------------
# The NCCL suite's rank bodies, over gloo
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gloo_pool():
    from pytest_weightsync.ranks import RankPool

    with RankPool(world_size=2, backend="gloo") as pool:
        yield pool


def test_nccl_suite_bodies_run_over_gloo(gloo_pool):
    nccl = _suite("test_gpu_nccl")
    case = nccl.ExpertCase(ep=2, etp=1, experts=4, hidden=24, ffn=16, budget=4096)
    nccl.check_expert_gather(case, gloo_pool.run(nccl.gather_experts, case), "cpu")
    case = nccl.ExpertCase(ep=1, etp=2, experts=3, hidden=16, ffn=12, budget=2048)
    nccl.check_expert_gather(case, gloo_pool.run(nccl.gather_experts, case), "cpu")
    for spec, topo in nccl.trainer_cases():
        nccl.check_trainer_gather(spec, 5, gloo_pool.run(nccl.gather_trainer_weights, spec, topo, 5))


def test_nccl_suite_component_gathers_run_over_gloo(gloo_pool):
    nccl = _suite("test_gpu_nccl")
    nccl.check_component_gather(7, gloo_pool.run(nccl.gather_components, 7))


def test_nccl_suite_checks_can_fail():
    nccl = _suite("test_gpu_nccl")
    case = nccl.ExpertCase(ep=2, etp=1, experts=2, hidden=8, ffn=4, budget=1024)
    results = [{"device": "cpu", "peak": 0, "plan": None,
                "experts": {(e, p): case.full(e, p).clone() for e in range(2) for p in ("fc1", "fc2")}}]
    results[0]["experts"][(1, "fc2")].view(torch.int16)[2, 3] ^= 1
    with pytest.raises(AssertionError, match=r"expert 1 fc2.*\[2, 3\]"):
        nccl.check_expert_gather(case, results, "cpu")


# --------------------------------------------------------------------------------------------
# The GPU suites and the CI script, as files
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip behaviour without CUDA")
def test_gpu_suites_collect_and_skip_cleanly_without_cuda(zygote):
    files = sorted(str(p) for p in SUITES.glob("test_gpu_*.py"))
    assert len(files) == 6, files
    args = ["-p", "weightsync", "-q", "-rs", "-p", "no:cacheprovider", *files]
    run = run_pytest(zygote, args, cwd=ROOT, env=dict(os.environ), timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    last = run.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ skipped in [\d.]+s( \([\d:]+\))?", last), out  # no pass, no error
    assert "CUDA is not available" in out, out


def test_ci_gpu_script_is_valid_bash_and_keeps_nvlink_multicast_off():
    script = ROOT / "ci" / "gpu.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "unset NCCL" not in text and "NCCL_NVLS_ENABLE=1" not in text
    assert 'NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"' in text
    assert "CUDA_VISIBLE_DEVICES=$devices timeout" in text and "-m gpu" in text
    assert "--timeout=" in text and "-n 2 tests/test_ranks_gpu.py" in text
    assert "PYTHONPATH=\"$PWD" not in text, "a bare checkout on PYTHONPATH lacks the mapped subpackages"


def test_ci_gpu_script_runs_every_gpu_suite_file():
    """Each file with GPU tests has its own bounded pytest run in the one-GPU stage."""
    text = (ROOT / "ci" / "gpu.sh").read_text()
    listed = set(re.findall(r'^\s+"((?:suites/selftest|tests)/test_\w+\.py) \d+"$', text, re.M))
    with_gpu = {f"suites/selftest/{p.name}" for p in SUITES.glob("test_*.py") if "pytest.mark.gpu" in p.read_text()}
    assert with_gpu <= listed, with_gpu - listed
    assert "tests/test_ranks_gpu.py" in listed


def test_ci_gpu_summary_counts_a_killed_run_from_its_log_and_names_two_gpu_tests(tmp_path):
    """The summary line of a file comes from junit XML, or from the -v log of a run that the
    file's time limit killed; two-GPU skips are "not run", not failures."""
    text = (ROOT / "ci" / "gpu.sh").read_text()
    code = text.split("""cat >"$RESULTS/summarize.py" <<'PY'\n""", 1)[1].split("\nPY\n", 1)[0]
    (tmp_path / "summarize.py").write_text(code)
    log = tmp_path / "run.log"
    log.write_text("suites/selftest/test_gpu_ipc.py::test_a[x] PASSED [ 10%]\n"
                   "suites/selftest/test_gpu_ipc.py::test_b FAILED [ 20%]\n"
                   "[gw1] [ 30%] PASSED tests/test_ranks_gpu.py::test_c\n"
                   "suites/selftest/test_gpu_ipc.py::test_d \n")
    run = subprocess.run([sys.executable, str(tmp_path / "summarize.py"), str(tmp_path / "none.xml"),
                          str(log), "124", "240.0", "suites/selftest/test_gpu_ipc.py"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert re.search(r"passed +2 +failed +1 .* TIMED OUT +\(counts from the log\)", run.stdout), run.stdout
    assert "FAILED suites/selftest/test_gpu_ipc.py::test_b" in run.stdout
    xml = tmp_path / "run.xml"
    xml.write_text('<testsuites><testsuite>'
                   '<testcase classname="suites.test_gpu_ipc" name="test_a"/>'
                   '<testcase classname="suites.test_gpu_ipc" name="test_two">'
                   '<skipped message="needs 2 CUDA GPUs, 1 visible"/></testcase>'
                   '<testcase classname="suites.test_gpu_ipc" name="test_bridge">'
                   '<skipped message="megatron-bridge is not installed"/></testcase>'
                   '</testsuite></testsuites>')
    run = subprocess.run([sys.executable, str(tmp_path / "summarize.py"), str(xml), str(log), "0", "3.0",
                          "suites/selftest/test_gpu_ipc.py"], capture_output=True, text=True)
    assert re.search(r"passed +1 +failed +0 +skipped +1 +not run \(needs 2 GPUs\) +1 .* ok$",
                     run.stdout.splitlines()[0]), run.stdout
    assert "not run, needs 2 GPUs: suites.test_gpu_ipc::test_two" in run.stdout
    assert "skipped 1: megatron-bridge is not installed" in run.stdout


# --------------------------------------------------------------------------------------------
# Engine layouts (suites/selftest/test_gpu_engine_layouts.py), same steps on CPU
# --------------------------------------------------------------------------------------------

_engine_cases = importlib.import_module("pytest_weightsync.suites.harness.cases").ENGINE_CASES


@pytest.mark.parametrize("case", _engine_cases, ids=lambda c: c.id)
def test_engine_layout_update_steps_on_cpu(case):
    log = h.run_engine_updates(case, "compat", "cpu", updates=3)
    assert log.updates == 3 and log.outputs_checked >= 3 * case.spec.num_layers


# --------------------------------------------------------------------------------------------
# Whole models (suites/selftest/test_gpu_model.py), same steps on CPU at small sizes
# --------------------------------------------------------------------------------------------

_model_spec = importlib.import_module("pytest_weightsync.reference_impl.model.model_spec")
_layout = importlib.import_module("pytest_weightsync.reference_impl.model.layout")


@pytest.mark.parametrize("fmt", ["compat", "hf_fused", "direct"])
@pytest.mark.parametrize("receiver", [_layout.ReceiverTopology(tp=1),
                                      _layout.ReceiverTopology(tp=4, order="up_gate")],
                         ids=["tp1", "tp4-ug"])
def test_whole_model_update_steps_on_cpu(receiver, fmt):
    spec = _model_spec.qwen3_5_moe(linear_k_heads=4, linear_v_heads=8)
    log = h.run_model_updates(spec, receiver, fmt, "cpu", updates=2)
    layout = importlib.import_module("pytest_weightsync.reference_impl.model.model_layout")
    ranks = sorted({0, receiver.world_size - 1})
    assert log.updates == 2
    assert log.params_checked == 2 * sum(len(layout.engine_params(spec, receiver, r))
                                         for r in ranks)


def test_whole_model_update_steps_catch_a_wrong_tensor_and_locate_it(monkeypatch):
    import torch

    from pytest_weightsync.reference_impl.senders import model_senders

    spec = _model_spec.qwen3_5_moe()
    real = model_senders.export

    def zero_gate(fmt, *args, **kwargs):  # the shared expert's gate sent as zeros
        return [(n, torch.zeros_like(t) if "shared_expert_gate" in n else t)
                for n, t in real(fmt, *args, **kwargs)]

    monkeypatch.setattr(model_senders, "export", zero_gate)
    with pytest.raises(AssertionError) as info:
        h.run_model_updates(spec, _layout.ReceiverTopology(tp=2), "compat", "cpu", updates=1)
    message = str(info.value)
    assert "compat whole-model update 0 (version 1), engine rank 0" in message, message
    assert "shared_expert_gate" in message and "row=" in message, message


def test_ci_gpu_script_names_each_gpu_kind_and_its_baseline_records_that_kind():
    """The guard compares a run only with ci/baselines/KIND.json, KIND from the GPU's name;
    every committed GPU baseline is named after the kind of the GPU it records."""
    text = (ROOT / "ci" / "gpu.sh").read_text()
    code = text.split("""GPU_KIND=$("$PYTHON" - <<'PY'\n""", 1)[1].split("\nPY\n", 1)[0]
    namespace: dict = {}
    exec(code.rsplit("\nprint(", 1)[0], namespace)
    kind = namespace["gpu_kind"]
    assert kind("NVIDIA H100 80GB HBM3") == "h100"
    assert kind("NVIDIA H200") == "h200"
    assert kind("NVIDIA A100-SXM4-80GB") == "a100"
    assert kind("NVIDIA GeForce RTX 4090") == "nvidia-geforce-rtx-4090"
    assert kind("") == "gpu"
    gpu_baselines = [p for p in (ROOT / "ci" / "baselines").glob("*.json") if p.stem != "cpu"]
    assert gpu_baselines
    for path in gpu_baselines:
        recorded = json.loads(path.read_text())["machine"]["gpu"]
        assert kind(recorded) == path.stem, (path.name, recorded)

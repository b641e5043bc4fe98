"""Where a stateless exporter's update goes: gather, payload, load, against one plain copy.

The exporter speed column (``suites/conformance/test_speed.py``) times the reference's
single-process ``export_weights`` end to end on one real Qwen3.5-35B-A3B layer (engine MoE-TP
rank 1 of 2, trainer TP 2 x EP 4). This splits one such update into its three steps - the
gather of the full weights from every trainer rank's shards, the building of the format's
payload, the reference receiver's load of it (fresh tensors every update: no plan reused) -
each timed alone (mean of 5 after a warm-up), beside a plain device copy of the bytes the engine
rank holds. CUDA only.

    python benchmarks/profile_stateless_export.py
"""

from __future__ import annotations

import time


def _timed(fn, repeats: int = 5):
    import torch

    out = fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3, out


def main() -> None:
    import torch

    from pytest_weightsync.reference_impl.engine.receiver import ReferenceReceiver
    from pytest_weightsync.reference_impl.model.layout import (
        MoESpec,
        ReceiverTopology,
        TrainerTopology,
    )
    from pytest_weightsync.reference_impl.oracle import synth
    from pytest_weightsync.reference_impl.senders import formats as senders
    from pytest_weightsync.reference_impl.trainer import trainer as trainer_side
    from pytest_weightsync.suites.harness import inputs, reference
    from pytest_weightsync.suites.harness.cases import Case

    spec = MoESpec(num_layers=1, num_experts=256, hidden=2048, intermediate=512)
    case = Case(spec, TrainerTopology(tp=2, ep=4), ReceiverTopology(tp=2))
    states = trainer_side.trainer_states(spec, case.trainer,
                                         synth.full_weights(spec, 1, device="cuda"))
    params = inputs.receiver_params(case, 1, device="cuda")
    receiver = ReferenceReceiver(spec, case.receiver, 1, params=params)
    nbytes = sum(t.numel() * t.element_size() for t in params.values())
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_ms, _ = _timed(lambda: dst.copy_(src))
    gather_ms, full = _timed(lambda: trainer_side.gather_full_weights(spec, case.trainer, states))
    print(f"{torch.cuda.get_device_name(0)}; {nbytes / 2**20:.0f} MiB per engine rank; plain "
          f"copy {copy_ms:.2f} ms; gather {gather_ms:.2f} ms")
    for fmt in ("direct", "packed", "hf_fused", "compat"):
        export_ms, payload = _timed(lambda: senders.export(fmt, spec, case.receiver, 1, full))
        load_ms, _ = _timed(lambda: reference.load_update(receiver, [payload], fmt))
        total = gather_ms + export_ms + load_ms
        print(f"{fmt:9} payload {export_ms:7.2f} ms ({len(payload)} entries), load "
              f"{load_ms:7.2f} ms; whole {total:7.2f} ms = {copy_ms / total:.3f} of the copy")


if __name__ == "__main__":
    main()

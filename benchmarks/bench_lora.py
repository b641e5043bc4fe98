"""An adapter sync against a plain copy of the adapter's bytes: the reference adapter loader.

One load of a whole adapter into one engine slot (checked whole, then every piece copied into
the slot's buffers, the scaling folded into a copy of B where the layout folds it) timed against
one plain copy of the same number of bytes, in the same run, interleaved
(``pytest_weightsync.timing.measure``): the ratio is copy time / load time (1.0: as fast as a
plain copy). A Qwen3.5-35B-A3B-shaped layer adapter by default (hidden 2048, 256 experts,
expert LoRA), on CPU or the given device.

    python benchmarks/bench_lora.py [--device cuda] [--rank 16] [--layers 1] [--repeats 7]
"""

from __future__ import annotations

import argparse

from pytest_weightsync.timing import machine_info, measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    from pytest_weightsync.reference_impl.engine.adapter_receiver import (
        allocate_slots,
        load_adapter,
    )
    from pytest_weightsync.reference_impl.model.adapter_spec import AdapterSpec
    from pytest_weightsync.reference_impl.model.layout import ReceiverTopology
    from pytest_weightsync.reference_impl.model.model_spec import qwen3_5_35b_a3b
    from pytest_weightsync.reference_impl.oracle import adapter_synth

    spec = qwen3_5_35b_a3b(num_layers=max(args.layers, 4), num_experts=args.experts,
                           mtp_layers=0)
    topo = ReceiverTopology(tp=1)
    print(machine_info())
    print(f"{'layout':7} {'MiB':>8} {'load ms':>9} {'copy ms':>9} {'ratio':>6}")
    for layout in ("sglang", "vllm"):
        adapter = AdapterSpec(spec, args.rank, 2 * args.rank)
        payload = list(adapter_synth.adapter_tensors(adapter, 1, device=args.device).items())
        slots = allocate_slots(adapter, topo, 0, layout, 2, device=args.device)
        nbytes = sum(t.numel() * t.element_size() for _, t in payload)
        m = measure(f"lora/{layout}", lambda: load_adapter(
            None, slots, payload, adapter=adapter, topology=topo, rank=0, slot=1, layout=layout),
            nbytes, device=args.device, repeats=args.repeats, warmup=1, best_of=1)
        print(f"{layout:7} {nbytes / 2**20:>8.1f} {m.path_seconds * 1e3:>9.2f} "
              f"{m.copy_seconds * 1e3:>9.2f} {m.ratio:>6.3f}")


if __name__ == "__main__":
    main()

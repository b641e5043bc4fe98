"""End to end: a whole colocated weight update, trainer process to engine processes, against
one plain device copy of the same bytes measured in the same run.

What runs is what a user of the reference runs (docs/performance.md, "End to end"): the
trainer holds the model's expert weights on the device (a grouped-GEMM layout: one buffer
per layer and projection, ``synth.grouped_full_weights``), one engine process per receiver
rank (``engine.process.ReceiverProcess``: CUDA IPC on a GPU, shared memory on a CPU) holds SGLang's
``w13``/``w2`` parameters, and every update goes

    export (refill staging tensors; nothing where payloads are views of the trainer's memory)
    -> serialize (the update messages)
    -> receive (the engine rebuilds the payload, or finds its registered one)
    -> load (begin / load / end: the plan cache recognises the bucket, replays its copy plan)
    -> synchronize (the engine waits for the device),

timed per stage, per format (direct, packed, hf_fused, compat) and receiver MoE-TP (1, 2),
along two protocols:

* ``registered``: payloads shared once per model (``ColocatedSync.register``), each update a
  message of a few bytes;
* ``per_update`` (``--per-update``): SGLang's ``update_weights_from_tensor`` protocol - every
  update serializes every bucket for every rank again (each storage shared anew: a new IPC
  handle, reference-counter slot and CUDA event; the bucket's table pickled once per model),
  and the engine rebuilds, recognises (table and addresses), loads and drops it.

Between updates the trainer changes every weight in place (each 16-bit pattern XORed with a
new mask, untimed), so every update moves new bits. After every update (untimed) the engine
ranks' digests of their parameters (``process.bits_digest``: exact sums of the bits and their
squares) must add up to the trainer's digest of its weights - an element an update missed
holds an older mask and changes them; after the timed updates each engine checks every
parameter bit for bit against the synthetic oracle (``oracle_check``) and reports the first
wrong element, and parameter addresses must never change.

The ratio is, per round, the time of one plain copy of the bytes the update writes into the
engines (``limit``: a contiguous device copy, in chunks of ``--chunk-mib`` when the model is
larger than memory allows twice) over the time of the whole update; the median over rounds
is reported, with its spread. ``--per-tensor`` also times SGLang's per-tensor wire format (a
stateless sender: ``senders.export`` + ``ipc.serialize``, one IPC share per tensor, every
update) on a model of the first ``--per-tensor-layers`` layers, the engines with their plan
cache off (validation and planning of every entry every update: what the reference did before
the per-update protocol reached the limit) and on (lists recognised by their signature), and
the same stateless sender with one share per storage (``shared_payload.serialize_storages``).

    python benchmarks/bench_e2e.py --device cpu --json e2e-cpu.json          # tiny, seconds
    python benchmarks/bench_e2e.py --device cuda --json e2e-h200.json --per-update [--per-tensor]
    python benchmarks/plot_e2e.py e2e-h200.json --out docs/e2e-cuda.png

Model parts: the expert weights are one part (``ExpertsPart``); a part builds its trainer
tensors, changes them in place, makes its sender for a format and topology, and checks the
engines. Parts for the rest of the model join the same loop (``PARTS``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from pytest_weightsync.reference_impl.senders.timeline import bucket_timeline, format_timeline
from pytest_weightsync.timing import ProcessesCopy, machine_info
from pytest_weightsync.timing import plain_copy as queued_plain_copy

#: Qwen3.5-35B-A3B's routed experts: 40 MoE layers x 256 experts, hidden 2048, moe_ffn 512
#: (60 GiB of bf16).
QWEN35 = dict(layers=40, experts=256, hidden=2048, moe_ffn=512)
#: CPU default: a tiny model of the same structure (runs in seconds on one thread).
TINY = dict(layers=2, experts=8, hidden=256, moe_ffn=128)
FORMATS = ("direct", "packed", "hf_fused", "compat")
#: Goals on one H200 for the whole model (docs/performance.md).
GOALS = {("direct", 1): 0.8, ("packed", 1): 0.8, ("direct", 2): 0.7, ("packed", 2): 0.7,
         ("hf_fused", 2): 0.7, ("compat", 1): 0.3, ("compat", 2): 0.3}


def signed16(pattern: int) -> int:
    pattern &= 0xFFFF
    return pattern - 0x10000 if pattern >= 0x8000 else pattern


class Masks:
    """Distinct 15-bit XOR masks, one per update of the whole run: an element an update did
    not write still holds an earlier mask and fails the check."""

    def __init__(self):
        self.current, self._next = 0, 0

    def next(self) -> int:
        self._next += 1
        self.current = (self._next * 0x2F1B) & 0x7FFF or 0x7FFF
        return self.current


class ExpertsPart:
    """The routed experts: trainer tensors, their in-place change, their sender, their check."""

    name = "experts"

    def __init__(self, spec, device, seed: int = 0, etp: int = 1):
        from pytest_weightsync.reference_impl.oracle import synth

        self.spec, self.seed, self.etp = spec, seed, etp
        if etp > 1:  # the trainer's ETP shards, not gathered (direct reads them as they are)
            self.full = synth.etp_grouped_weights(spec, 0, seed, etp=etp, device=device)
        else:
            self.full = synth.grouped_full_weights(spec, 0, seed, device=device)
        self.buffers = synth.storage_words(self.full)
        self.mask = 0

    def set_mask(self, mask: int) -> None:
        """Every trainer element becomes ``synth bits ^ mask`` (in place)."""
        delta = signed16(self.mask ^ mask)
        for flat in self.buffers:
            flat.bitwise_xor_(delta)
        if self.buffers and self.buffers[0].device.type == "cuda":
            torch.cuda.synchronize(self.buffers[0].device)  # not part of the next update's time
        self.mask = mask

    def written_bytes(self, topo) -> int:
        """Bytes the engines' parameters receive per update (all ranks; no padding here)."""
        spec = self.spec
        per_layer = spec.num_experts * 3 * spec.intermediate * spec.hidden * spec.dtype.itemsize
        return per_layer * spec.num_layers * topo.moe_dp

    def sender(self, fmt, topo, staging_bytes, layers=None, bucket_bytes=None, bucket_ramp=False,
               receivers=None):
        from pytest_weightsync.reference_impl.senders.colocated import ColocatedSender

        return ColocatedSender(fmt, self.spec, topo, self.full, layers=layers,
                               staging_bytes=staging_bytes, bucket_bytes=bucket_bytes,
                               bucket_ramp=bucket_ramp, receivers=receivers)

    def check(self, engines) -> list:
        return [engine.check(0, self.seed, self.mask) for engine in engines]

    def digest(self) -> tuple[int, int]:
        """The trainer's :func:`process.bits_digest` of every expert weight (what the engines'
        digests add up to after a complete update)."""
        from pytest_weightsync.reference_impl.engine.process import bits_digest

        return bits_digest(self.buffers)

    def digest_problem(self, engines, expected) -> str:
        """``""`` when the engine ranks' digests add up to ``expected``, else what differs."""
        got = [engine.digest() for engine in engines]
        total = (sum(g[0] for g in got), sum(g[1] for g in got))
        return "" if total == tuple(expected) else f"digest {total} != trainer's {tuple(expected)}"


PARTS = (ExpertsPart,)


class PlainCopy:
    """One contiguous device copy of ``nbytes`` bytes (in chunks of at most ``chunk`` bytes,
    back to back, when two full-size buffers would not fit next to the model).

    ``split``: where several engine ranks share one GPU, the same bytes copied by as many
    processes at once (``timing.ProcessesCopy``: one CUDA context each, as the engines have),
    timed in every round beside the plain copy - the limit of that topology, which a row
    reports as a second ratio (``ratio_split``); None elsewhere."""

    def __init__(self, nbytes: int, device, chunk: int):
        self.split = None
        self._copy = queued_plain_copy(nbytes, str(device), chunk)
        self.cuda = torch.device(device).type == "cuda"

    def seconds(self) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._copy()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        self._copy()
        return time.perf_counter() - t0


def median(xs):
    return statistics.median(xs) if xs else None


def save(args, rows, failures, **extra) -> None:
    """Write what has been measured so far (a run stopped at its time limit keeps it)."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(extra, results=rows, failures=failures), f, indent=2)


def registered_rows(part, engines, topo, tp, args, masks, limit, ptrs, failures) -> list:
    """Payloads registered once per model (see :func:`sync_rows`)."""
    return sync_rows(part, engines, topo, tp, args, masks, limit, ptrs, failures, per_update=False)


def per_update_rows(part, engines, topo, tp, args, masks, limit, ptrs, failures) -> list:
    """SGLang's per-update protocol over the whole model (see :func:`sync_rows`)."""
    return sync_rows(part, engines, topo, tp, args, masks, limit, ptrs, failures, per_update=True)


def sync_rows(part, engines, topo, tp, args, masks, limit, ptrs, failures, *,
              per_update: bool) -> list:
    """Per format: build the sender (and register, unless ``per_update``), warm up, time
    ``repeats`` updates against the plain copy; after every update the engines' digests, after
    the last every bit.

    One trainer rank of several (``bench_e2e_ranks.py``) sets ``args.receivers`` (the receiver
    ranks its sender feeds: ``engines`` are theirs), ``args.barrier`` (called before every
    update and every plain copy, so all ranks start each together) and ``args.digest_log``:
    its engines' digests after every update go there, with the trainer's, for the caller to
    add up over the ranks, instead of being compared here."""
    from pytest_weightsync.reference_impl.senders.colocated import ColocatedSync

    rows = []
    nbytes = part.written_bytes(topo)
    digest = getattr(args, "digest", True)
    receivers = getattr(args, "receivers", None)
    barrier = getattr(args, "barrier", None) or (lambda: None)
    digest_log = getattr(args, "digest_log", None)
    for fmt in args.formats:
        for engine in engines:
            engine.reset(plan_cache=True)
        t0 = time.perf_counter()
        bucket_mib = getattr(args, "bucket_mib", None)
        sender = part.sender(fmt, topo, args.staging_mib << 20,
                             bucket_bytes=None if not bucket_mib else bucket_mib << 20,
                             bucket_ramp=getattr(args, "bucket_ramp", False), receivers=receivers)
        build = time.perf_counter() - t0
        sync = ColocatedSync(sender, engines, per_update=per_update,
                             ranks_in_turn=getattr(args, "ranks_in_turn", None),
                             end_on_device=getattr(args, "end_on_device", True),
                             serialize_ahead=getattr(args, "serialize_ahead", True))
        register = sync.register()
        problems, digests = [], 0

        logged: list = []

        def update():
            nonlocal digests
            part.set_mask(masks.next())
            barrier()
            timing = sync.update()
            if digest:
                digests += 1
                if digest_log is not None:  # one rank of several: added up by the caller
                    logged.append(([engine.digest() for engine in engines], part.digest()))
                else:
                    problem = part.digest_problem(engines, part.digest())
                    if problem and len(problems) < 3:
                        problems.append(f"update {digests}: {problem}")
            return timing

        def plain_copy():
            barrier()
            return limit.seconds()

        first = update()
        for _ in range(args.warmup - 1):
            update()
        rounds, split = [], []
        for _ in range(args.repeats):
            timing = update()
            rounds.append((timing, plain_copy()))
            if limit.split is not None:
                barrier()
                split.append(limit.split.seconds())
        if digest_log is not None:
            digest_log.append(logged)
        t1 = time.perf_counter()
        problems += [p for p in part.check(engines) if p]
        check_s = time.perf_counter() - t1
        moved = [r for reports in first.reports for r in reports]
        for report in [r for timing, _ in rounds for reports in timing.reports for r in reports] + moved:
            if dict(report.param_ptrs) != ptrs[report.rank]:
                problems.append(f"rank {report.rank} parameters moved")
        bits = "exact" if not problems else "; ".join(problems)
        if bits != "exact":
            failures.append(f"{'per-update' if per_update else 'registered'} {fmt} MoE-TP {tp}"
                            f"{_etp_label(part.etp)}: {bits}")
        in_turn = sync.ranks_in_turn
        sync.close()
        ratios = [plain / timing.wall for timing, plain in rounds]
        split_ratios = [s / timing.wall for (timing, _), s in zip(rounds, split)]
        cache = [c for timing, _ in rounds for c in timing.cache]
        row = dict(
            path="per_update" if per_update else "registered", format=fmt, moe_tp=tp,
            trainer_etp=part.etp, ranks_in_turn=in_turn,
            bucket_ramp=getattr(args, "bucket_ramp", False),
            end_on_device=sync.end_on_device, serialize_ahead=sync.serialize_ahead,
            engine_poll_ms=engines[0].poll_s * 1e3,
            device_wait_s=median([t.device_wait for t, _ in rounds]),
            layers=part.spec.num_layers,
            entries=sender.entries, buckets=len(sender.buckets), nbytes=nbytes,
            staged_bytes=sender.staged_bytes, storages=sum(len(b.shared[r].wholes)
                                                           for b in sender.buckets for r in b.shared),
            build_s=build, register_s=register, first_update_s=first.wall,
            export_s=median([t.export for t, _ in rounds]),
            serialize_s=median([t.serialize for t, _ in rounds]),
            receive_s=median([t.stage("receive") for t, _ in rounds]),
            load_s=median([t.stage("load") for t, _ in rounds]),
            synchronize_s=median([t.stage("synchronize") for t, _ in rounds]),
            wall_s=median([t.wall for t, _ in rounds]),
            plain_copy_s=median([p for _, p in rounds]),
            ratio=median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
            walls_s=[t.wall for t, _ in rounds], plain_copies_s=[p for _, p in rounds],
            # the same bytes copied by one process per engine rank at once (PlainCopy.split)
            split_processes=len(engines) if split else None, split_copy_s=median(split),
            ratio_split=median(split_ratios),
            ratio_split_min=min(split_ratios, default=None),
            ratio_split_max=max(split_ratios, default=None), split_copies_s=split,
            cache_hits=cache.count("hit"), cache_other=len(cache) - cache.count("hit"),
            goal=GOALS.get((fmt, tp)), bits=bits, check_s=check_s, digests=digests,
        )
        if getattr(args, "timeline", False):  # the round of the median update, bucket by bucket
            timing, plain = sorted(rounds, key=lambda r: r[0].wall)[len(rounds) // 2]
            row["timeline"] = bucket_timeline(timing, plain)
        rows.append(row)
        print_row(row)
        if "timeline" in row:
            print(format_timeline(row["timeline"]), flush=True)
        if args.progress is not None:
            args.progress(row)
        del sender, sync
        release(engines[0].device)
    return rows


def shard_rows_args(args, tp):
    """The run's arguments for the rows from the trainer's ETP shards (``--trainer-etp``: the
    direct format only, at MoE-TP > 1), or ``None`` where there are none."""
    if not (getattr(args, "trainer_etp", False) and tp > 1 and "direct" in args.formats):
        return None
    return argparse.Namespace(**{**vars(args), "formats": ["direct"]})


def trainer_etp_rows(spec, engines, topo, tp, sub, masks, limit, ptrs, failures) -> list:
    """The direct rows again with the trainer holding its experts as an ETP group of
    ``tp`` ranks (``EtpGroupedExperts``: Megatron's ``[gate_r; up_r]`` shards, not gathered):
    every engine rank's ``w13`` / ``w2`` is then one ETP rank's buffer, a view, so nothing is
    staged. Both protocols the run times (registered, ``--per-update``); ``sub``: the run's
    arguments from :func:`shard_rows_args`."""
    device = engines[0].device
    part = ExpertsPart(spec, torch.device(device), etp=tp)
    rows = []
    try:
        if sub.registered:
            rows += registered_rows(part, engines, topo, tp, sub, masks, limit, ptrs, failures)
        if sub.per_update:
            rows += per_update_rows(part, engines, topo, tp, sub, masks, limit, ptrs, failures)
    finally:
        del part
        release(device)
    return rows


def release(device) -> None:
    """Give staging memory back between formats (IPC blocks the engines let go, then the
    allocator's cache)."""
    from pytest_weightsync.reference_impl.sharing import ipc

    if torch.device(device).type == "cuda":
        ipc.collect(device)
        torch.cuda.empty_cache()


#: The stateless senders of :func:`per_tensor_rows`: (row label, wire, engine plan cache).
STATELESS = (("per_tensor", "tensors", False), ("per_tensor_cached", "tensors", True),
             ("per_storage", "storages", True))


def per_tensor_rows(part, engines, topo, tp, args, masks, ptrs, failures) -> list:
    """A stateless sender every update (``senders.stateless.StatelessSync``): per bucket of
    ``--stateless-bucket-layers`` layers ``senders.export`` for every rank, serialized on
    SGLang's per-tensor wire (``ipc.serialize``) with the engines' plan cache off and on, or
    with one share per storage (``shared_payload.serialize_storages``), and sent while the
    engines copy the previous bucket. Digests after every update, every bit after the last."""
    from pytest_weightsync.reference_impl.sharing import ipc
    from pytest_weightsync.reference_impl.senders.stateless import StatelessSync

    rows = []
    device = part.buffers[0].device
    nbytes = part.written_bytes(topo)
    limit = PlainCopy(nbytes, device, args.chunk_mib << 20)
    chosen = [s for s in STATELESS if s[0] in args.stateless]
    for fmt in args.formats:
        for label, wire, cached in chosen:
            for engine in engines:
                engine.reset(plan_cache=cached)
            sync = StatelessSync(fmt, part.spec, topo, engines, wire=wire,
                                 bucket_layers=args.stateless_bucket_layers,
                                 end_on_device=getattr(args, "end_on_device", True))
            rounds, problems = [], []
            for step in range(args.warmup + args.per_tensor_repeats):
                part.set_mask(masks.next())
                timing = sync.update(part.full)
                ipc.collect(device)
                problem = part.digest_problem(engines, part.digest())
                if problem and len(problems) < 3:
                    problems.append(f"update {step + 1}: {problem}")
                for report in [r for bucket in timing.reports for r in bucket]:
                    if dict(report.param_ptrs) != ptrs[report.rank]:
                        problems.append(f"rank {report.rank} parameters moved")
                if step >= args.warmup:
                    rounds.append((timing, limit.seconds()))
            problems += [p for p in part.check(engines) if p]
            bits = "exact" if not problems else "; ".join(problems)
            if bits != "exact":
                failures.append(f"{label} {fmt} MoE-TP {tp}{_etp_label(part.etp)}: {bits}")
            last = rounds[-1][0]
            entries = sum(r.entries for bucket in last.reports for r in bucket)
            ratios = [plain / t.wall for t, plain in rounds]
            stage = lambda name: median([t.stage(name) for t, _ in rounds])  # noqa: E731
            host = median([t.export + t.serialize for t, _ in rounds]) + stage("receive") + stage("load")
            cache = [c for t, _ in rounds for bucket in t.reports for r in bucket for c in r.cache]
            row = dict(
                path=label, wire=wire, plan_cache=cached, format=fmt, moe_tp=tp,
                trainer_etp=part.etp,
                layers=part.spec.num_layers, entries=entries, buckets=len(last.reports),
                nbytes=nbytes, export_s=median([t.export for t, _ in rounds]),
                serialize_s=median([t.serialize for t, _ in rounds]), receive_s=stage("receive"),
                load_s=stage("load"), synchronize_s=stage("synchronize"),
                wall_s=median([t.wall for t, _ in rounds]), plain_copy_s=median([p for _, p in rounds]),
                ratio=median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
                host_us_per_entry=1e6 * host / max(1, entries // topo.world_size),
                cache_hits=cache.count("hit"), cache_other=len(cache) - cache.count("hit"),
                bits=bits,
            )
            rows.append(row)
            print_row(row)
            if args.progress is not None:
                args.progress(row)
            del sync
            release(device)
    del limit
    return rows


def _etp_label(etp: int) -> str:
    """How a row's trainer holds its experts, where it is not one gathered buffer."""
    return f" (trainer ETP {etp} shards)" if etp > 1 else ""


def print_row(r) -> None:
    ms = lambda k: f"{1e3 * r[k]:8.2f}" if r.get(k) is not None else "       -"  # noqa: E731
    fmt = r["format"] + (f"/etp{r['trainer_etp']}" if r.get("trainer_etp", 1) > 1 else "")
    print(f"{r['path']:<17} {fmt:<8} tp{r['moe_tp']} L{r['layers']:<3} "
          f"{r['entries']:>6} entries {r['nbytes'] / 2**30:7.2f} GiB | export {ms('export_s')} "
          f"serialize {ms('serialize_s')} receive {ms('receive_s')} load {ms('load_s')} "
          f"sync {ms('synchronize_s')} | update {ms('wall_s')} ms  plain copy {ms('plain_copy_s')} ms "
          f"ratio {r['ratio']:.3f} [{r['ratio_min']:.3f}, {r['ratio_max']:.3f}]"
          + (f"  bits {r['bits']}" if "bits" in r else "")
          + (f"\n{'':<17} {r['split_processes']} processes copying their shares at once "
             f"{ms('split_copy_s')} ms: ratio {r['ratio_split']:.3f} [{r['ratio_split_min']:.3f}, "
             f"{r['ratio_split_max']:.3f}]" if r.get("ratio_split") is not None else "")
          + (f"  host {r['host_us_per_entry']:.1f} us/entry" if "host_us_per_entry" in r else ""),
          flush=True)


def run(args) -> dict:
    from pytest_weightsync.reference_impl.engine import process as engine_process
    from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology
    from pytest_weightsync.reference_impl.sharing import share_chain

    torch.set_num_threads(1)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
        device = torch.device("cuda", torch.cuda.current_device())
    spec = MoESpec(num_layers=args.layers, num_experts=args.experts, hidden=args.hidden,
                   intermediate=args.moe_ffn)
    t0 = time.perf_counter()
    part = ExpertsPart(spec, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    print(f"trainer weights: {spec.num_layers} layers x {spec.num_experts} experts, "
          f"{sum(b.numel() * 2 for b in part.buffers) / 2**30:.2f} GiB on {device}, built in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    masks = Masks()
    rows, failures, timings = [], [], {}
    header = dict(device=str(device), machine=machine_info(), timings=timings)
    if getattr(args, "progress", None) is None:
        collected: list = []

        def progress(row):
            collected.append(row)
            save(args, collected, failures, **header)
        args.progress = progress
    small = None  # the model of the per-tensor rows, built on first use
    for tp in args.tp:
        topo = ReceiverTopology(tp=tp)
        poll_s = getattr(args, "engine_poll_ms", 0.0) / 1e3 if args.device == "cuda" else 0.0
        engines = [engine_process.ReceiverProcess(str(device), timeout=args.timeout, poll_s=poll_s)
                   for _ in range(tp)]
        split = None  # the split copy's processes (PlainCopy.split), ended in any case
        try:
            t0 = time.perf_counter()
            for engine in engines:
                engine.start()  # the processes start side by side
            ptrs = [engine.configure(spec, topo, rank) for rank, engine in enumerate(engines)]
            timings[f"configure_tp{tp}_s"] = time.perf_counter() - t0
            limit = PlainCopy(part.written_bytes(topo), device, args.chunk_mib << 20)
            if device.type == "cuda" and tp > 1 and args.split_copy:
                # chunks of at most 512 MiB: two buffers per process beside a model that may
                # fill the GPU (40 layers at MoE-TP 2 on an H200); as fast as larger ones
                limit.split = split = ProcessesCopy(part.written_bytes(topo), str(device), tp,
                                                    min(args.chunk_mib, 512) << 20,
                                                    timeout=args.timeout)
            if args.registered:
                rows += registered_rows(part, engines, topo, tp, args, masks, limit, ptrs, failures)
            if args.per_update:
                rows += per_update_rows(part, engines, topo, tp, args, masks, limit, ptrs, failures)
            sub = shard_rows_args(args, tp)
            if sub is not None:
                rows += trainer_etp_rows(spec, engines, topo, tp, sub, masks, limit, ptrs,
                                         failures)
            del limit
            if split is not None:  # its processes' memory back before the per-tensor rows
                split.close()
            release(device)
            if args.per_tensor:
                if small is None:
                    small = ExpertsPart(MoESpec(num_layers=min(args.per_tensor_layers, spec.num_layers),
                                                num_experts=spec.num_experts, hidden=spec.hidden,
                                                intermediate=spec.intermediate), device)
                small_ptrs = [engine.configure(small.spec, topo, rank)
                              for rank, engine in enumerate(engines)]
                rows += per_tensor_rows(small, engines, topo, tp, args, masks, small_ptrs, failures)
                if sub is not None:
                    sharded = ExpertsPart(small.spec, device, etp=tp)
                    rows += per_tensor_rows(sharded, engines, topo, tp, sub, masks, small_ptrs,
                                            failures)
                    holder = [sharded]
                    del sharded
                    share_chain.release(holder)
        finally:
            for engine in engines:
                engine.close()
            if split is not None:  # closing twice is harmless
                split.close()
    # The trainer's buffers, shared once per tensor and update by the per-tensor rows, are
    # freed on a large stack (share_chain): unwinding one deleter per share overflowed the
    # main thread's stack at exit.
    trainer = [part] + ([small] if small is not None else [])
    del part, small
    share_chain.release(trainer)
    return dict(
        model=dict(layers=spec.num_layers, experts=spec.num_experts, hidden=spec.hidden,
                   moe_ffn=spec.intermediate, dtype=str(spec.dtype), parts=[p.name for p in PARTS]),
        device=str(device), repeats=args.repeats, warmup=args.warmup,
        per_tensor_layers=args.per_tensor_layers if args.per_tensor else None,
        per_tensor_repeats=args.per_tensor_repeats if args.per_tensor else None,
        staging_mib=args.staging_mib, bucket_mib=args.bucket_mib, chunk_mib=args.chunk_mib,
        machine=machine_info(),
        timings=timings, results=rows, failures=failures,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """This benchmark's options (``bench_e2e_ranks.py`` takes the same)."""
    p.add_argument("--device", choices=("cpu", "cuda"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    for key in ("layers", "experts", "hidden", "moe_ffn"):
        p.add_argument(f"--{key.replace('_', '-')}", type=int)
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="receiver MoE-TP sizes")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2, help="updates before timing (>= 2: the "
                   "first plans, the second captures the CUDA graphs)")
    p.add_argument("--staging-mib", type=int, default=6144,
                   help="most staging memory the sender holds at once (direct at MoE-TP > 1)")
    p.add_argument("--chunk-mib", type=int, default=1024, help="plain copy chunk")
    p.add_argument("--bucket-mib", type=int, default=8192,
                   help="most payload one engine rank gets per bucket (0: one bucket); a "
                   "bucket of views is copied while the next one is sent")
    p.add_argument("--no-bucket-ramp", dest="bucket_ramp", action="store_false",
                   help="buckets of --bucket-mib from the first on, instead of the default "
                   "ramp (the first bucket one layer, each next at most twice the previous: "
                   "the device starts copying after one layer's host work)")
    p.add_argument("--per-update", action="store_true",
                   help="also time SGLang's per-update protocol over the whole model (every "
                   "bucket serialized and rebuilt every update, one share per storage)")
    p.add_argument("--no-registered", dest="registered", action="store_false",
                   help="skip the rows of payloads registered once")
    p.add_argument("--per-tensor", action="store_true",
                   help="also time stateless senders (export every update) with SGLang's "
                   "per-tensor wire (plan cache off / on) and one share per storage")
    p.add_argument("--per-tensor-layers", type=int, default=4)
    p.add_argument("--per-tensor-repeats", type=int, default=5)
    p.add_argument("--stateless", nargs="+", choices=[s[0] for s in STATELESS],
                   default=["per_tensor_cached", "per_storage"],
                   help="which stateless rows --per-tensor times")
    p.add_argument("--stateless-bucket-layers", type=int, default=1,
                   help="layers per bucket of the stateless sender (sent while the engines "
                   "copy the previous bucket)")
    p.add_argument("--ranks-in-turn", dest="ranks_in_turn", action="store_const", const=True,
                   help="engine rank r gets the update's buckets once rank r - 1 has queued its "
                        "own, its copies after rank r - 1's on the device "
                        "(ColocatedSync(ranks_in_turn=True)): one context switch per rank and "
                        "update on a shared GPU; buckets of views only. The default where every "
                        "engine rank shares the trainer's GPU; with this flag also on CPU")
    p.add_argument("--ranks-side-by-side", dest="ranks_in_turn", action="store_const",
                   const=False, help="every bucket to every engine rank at once, also on a "
                   "shared GPU (ColocatedSync(ranks_in_turn=False))")
    p.add_argument("--no-end-on-device", dest="end_on_device", action="store_false",
                   help="the engines wait for their last copies and then answer, instead of the "
                        "trainer waiting for their IPC events (ColocatedSync(end_on_device=False))")
    p.add_argument("--no-serialize-ahead", dest="serialize_ahead", action="store_false",
                   help="per-update: make each later bucket's bytes while the engines copy the "
                        "bucket before it (ColocatedSync(serialize_ahead=False)), instead of "
                        "all of them right after posting the first")
    p.add_argument("--timeline", action="store_true",
                   help="after each row of ColocatedSync, its median update bucket by bucket: "
                        "the trainer's and the engines' host marks and the device's estimated "
                        "copies and idle time (reference_impl/senders/timeline.py)")
    p.add_argument("--engine-poll-ms", type=float, default=float("inf"),
                   help="milliseconds each engine (and the trainer, for answers) polls its pipe "
                        "before blocking (ReceiverProcess(poll_s=...)); default inf: never "
                        "blocks, as SGLang's scheduler polls by default; 0: block at once")
    p.add_argument("--trainer-etp", action="store_true",
                   help="at each MoE-TP > 1 also time direct with the trainer holding its "
                   "experts as ETP shards of that size, not gathered (Megatron's [gate_r; up_r] "
                   "fc1: every engine rank's w13 is one shard, sent as a view)")
    p.add_argument("--no-digest", dest="digest", action="store_false",
                   help="skip the digest check after every update of the whole-model rows")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per engine request")
    p.add_argument("--no-split-copy", dest="split_copy", action="store_false",
                   help="at MoE-TP > 1 with every engine rank on one GPU, skip the second "
                        "limit: the same bytes copied by one process per engine rank at once "
                        "(PlainCopy.split; bench_e2e_ranks.py has a GPU per rank: no split)")
    p.add_argument("--json", metavar="PATH")


def check_arguments(p: argparse.ArgumentParser, args) -> None:
    """Refuse what cannot be measured; fill in the model's defaults for the device."""
    if args.repeats < 3:
        p.error("--repeats must be at least 3")
    if args.warmup < 2:
        p.error("--warmup must be at least 2")
    if args.per_tensor_repeats < 3:
        p.error("--per-tensor-repeats must be at least 3")
    default = QWEN35 if args.device == "cuda" else TINY
    for key, value in default.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    check_arguments(p, args)
    args.progress = None
    result = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    if result["failures"]:
        print("BIT CHECK FAILED:\n  " + "\n  ".join(result["failures"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

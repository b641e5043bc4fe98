"""One update's timeline, bucket by bucket: where the host work around the copy went
(``benchmarks/bench_e2e.py --timeline``).

An update's ratio to the copy limit says how much host time stood beside the copy, not
where. This lays the trainer's marks (``SyncTiming.clock``: each bucket staged, posted,
answered, the update done) beside the engines' (``UpdateReport.clock``: each bucket's message
taken, rebuilt, its copies queued) - one monotonic clock for every process of the machine -
and estimates the device's side: bucket ``b``'s copy starts when its slowest rank has queued
it and bucket ``b - 1``'s copy is done, and takes its share of the plain copy of the update's
bytes in the same run (its share of the bytes the engines received). ``idle`` is then the
time the device waited for the host before bucket ``b``, and ``tail`` what the update took
after the last estimated copy (the answer and the trainer's wait). An estimate: copies of two engine contexts on one GPU interleave, and a copy that
started late may run faster than the plain copy's rate; the host marks themselves are
measured.
"""

from __future__ import annotations


def bucket_timeline(timing, copy_s: float) -> dict:
    """``timing``: a ``SyncTiming`` of one update; ``copy_s``: seconds of a plain copy of the
    bytes the update writes. Returns ``{"buckets": [...], "done_ms", "tail_ms", "idle_ms"}``,
    times in ms from the update's start; every bucket ``{"bucket", "bytes", "staged", "posted", "answered",
    "taken", "rebuilt", "queued", "copy_from", "copy_to", "idle"}`` (the engines' marks are
    the slowest rank's)."""
    marks: dict = {}
    start = done = None
    for what, bucket, t in timing.clock:
        if what == "start":
            start = t
        elif what == "done":
            done = t
        else:
            marks.setdefault(bucket, {})[what] = t
    if start is None or done is None or not timing.reports:
        raise ValueError("an update's timeline needs its clock and reports "
                         "(ColocatedSync.update's SyncTiming)")
    if not copy_s > 0:
        raise ValueError(f"copy_s must be > 0 seconds, got {copy_s!r}")
    ms = lambda t: None if t is None else (t - start) * 1e3  # noqa: E731
    received = sum(r.nbytes for reports in timing.reports for r in reports) or 1
    rows, copy_to = [], 0.0
    for index, reports in enumerate(timing.reports):
        trainer = marks.get(index, {})
        clocks = [r.clock for r in reports if r.clock]
        taken, rebuilt, queued = ((max(c[i] for c in clocks) if clocks else None)
                                  for i in range(3))
        nbytes = sum(r.nbytes for r in reports)
        ready = ms(queued) if queued is not None else ms(trainer.get("answered"))
        copy_from = max(ready or 0.0, copy_to)
        idle = copy_from - copy_to
        copy_to = copy_from + copy_s * 1e3 * nbytes / received
        rows.append(dict(bucket=index, bytes=nbytes, staged=ms(trainer.get("staged")),
                         posted=ms(trainer.get("posted")), answered=ms(trainer.get("answered")),
                         taken=ms(taken), rebuilt=ms(rebuilt), queued=ms(queued),
                         copy_from=copy_from, copy_to=copy_to, idle=idle))
    done_ms = ms(done)
    return dict(buckets=rows, done_ms=done_ms, tail_ms=done_ms - copy_to,
                idle_ms=sum(row["idle"] for row in rows))


def format_timeline(line: dict) -> str:
    """The timeline as a table, one bucket a line. ``recv GiB`` is what the bucket's engine
    ranks received together: every rank of a rank-independent format (all but direct) gets the
    whole layer and copies its slice, so at MoE-TP > 1 it exceeds the bytes written."""
    cell = lambda v: "      -" if v is None else f"{v:7.2f}"  # noqa: E731
    out = ["  bucket recv GiB |  staged  posted answered |   taken rebuilt  queued |"
           "   copy from      to    idle"]
    for b in line["buckets"]:
        out.append(f"  {b['bucket']:>6} {b['bytes'] / 2**30:8.2f} | {cell(b['staged'])} "
                   f"{cell(b['posted'])}  {cell(b['answered'])} | {cell(b['taken'])} "
                   f"{cell(b['rebuilt'])} {cell(b['queued'])} |     {cell(b['copy_from'])} "
                   f"{cell(b['copy_to'])} {cell(b['idle'])}")
    out.append(f"  done at {line['done_ms']:.2f} ms: the device idle {line['idle_ms']:.2f} ms "
               f"before copies (estimated), {line['tail_ms']:.2f} ms after the last")
    return "\n".join(out)

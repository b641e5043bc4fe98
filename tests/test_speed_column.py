"""The speed column: cells relative to the reference, figures with their spread beside the
reference's for the same format, and the plot beside the JSON report (well-formed SVG, one
bar per implementation, format and device)."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from pytest_weightsync import speed_column


def _cpu(ops, us, ratio):
    return {"ops": ops, "bytes_written": 1000, "host_us_per_entry": us,
            "host_us_per_entry_min": us * 0.9, "host_us_per_entry_max": us * 1.5,
            "cpu_ratio": ratio, "cpu_ratio_min": ratio * 0.8, "cpu_ratio_max": ratio * 1.1}


SPEED = {
    "reference": {"compat": _cpu(24, 10.0, 0.5), "direct": {**_cpu(4, 2.0, 0.9),
                                                           "gpu_ratio": 0.81,
                                                           "gpu_ratio_min": 0.8,
                                                           "gpu_ratio_max": 0.83}},
    "mine": {"compat": _cpu(48, 30.0, 0.1)},
}


def test_cells_set_an_implementation_beside_the_reference():
    assert speed_column.cell("mine", SPEED) == "2x ops, 1x bytes, 3x time of ref"
    assert speed_column.cell("reference", SPEED) == "28 ops / 2 fmt, gpu 0.81-0.81"
    assert speed_column.cell("other", SPEED) == "not run"


def test_lines_give_median_and_spread_with_the_reference_figure_in_120_columns():
    lines = speed_column.lines(SPEED)
    text = "\n".join(lines)
    assert all(len(line) <= 120 for line in lines), lines
    assert "mine / compat: 48 ops, 1000 B written; 30.0 [27.0, 45.0] us/entry; ratio " \
           "0.100 [0.080, 0.110]" in text.replace("\n      ", " ")
    assert "reference 24 ops, 10.0 us/entry, ratio 0.500" in text.replace("\n      ", " ")
    assert "reference / direct on GPU: ratio 0.810 [0.800, 0.830]" in text
    assert speed_column.lines({}) == []


def test_the_plot_is_an_svg_bar_per_implementation_format_and_device(tmp_path):
    target = speed_column.write_plot(SPEED, str(tmp_path / "out.json"))
    assert target == tmp_path / "out.speed.svg"
    root = ET.fromstring(target.read_text())
    labels = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    bars = [label for label in labels if label and " / " in label]
    assert bars == ["reference / compat (cpu)", "reference / direct (cpu)",
                    "reference / direct (gpu)", "mine / compat (cpu)"]
    assert len(list(root.iter("{http://www.w3.org/2000/svg}rect"))) == 4
    # nothing timed: no plot
    assert speed_column.write_plot({"x": {"compat": {"ops": 1}}}, str(tmp_path / "b.json")) is None
    assert not (tmp_path / "b.speed.svg").exists()


def test_the_gpu_column_times_the_loaders_own_calls_in_stream_order():
    from pytest_weightsync.suites.conformance import test_speed

    calls = []

    class Loader:
        name = "fake"

        def begin_update(self, params, **kw):
            calls.append(("begin", sorted(kw)))

        def load_weights(self, params, payload, **kw):
            calls.append(("load", [n for n, _ in payload]))

        def end_update(self, params, **kw):
            calls.append(("end", sorted(kw)))

    class NoHooks:
        def load_weights(self, params, payload, **kw):
            calls.append(("load", len(payload)))

    case = test_speed.PROFILE_CASE
    stream = [[("a", None)], [("b", None), ("c", None)]]
    test_speed.unguarded_update(Loader(), {}, stream, "packed", case, 0)()
    keys = ["format", "rank", "spec", "topology"]
    assert calls == [("begin", keys), ("load", ["a"]), ("load", ["b", "c"]), ("end", keys)]
    calls.clear()
    test_speed.unguarded_update(NoHooks(), {}, stream, "packed", case, 0)()
    assert calls == [("load", 1), ("load", 2)]


def test_an_exporters_end_to_end_gpu_ratio_has_its_cell_line_and_bar():
    speed = {"reference": {"direct": {"gpu_ratio": 0.81}},
             "exporter-x": {"packed": {"export_gpu_ratio": 0.42, "export_gpu_ratio_min": 0.4,
                                       "export_gpu_ratio_max": 0.45}},
             "both": {"compat": {"gpu_ratio": 0.7, "export_gpu_ratio": 0.3}}}
    assert speed_column.cell("exporter-x", speed) == "export gpu 0.42-0.42"
    assert speed_column.cell("both", speed) == "gpu 0.70-0.70, export gpu 0.30-0.30"
    text = "\n".join(speed_column.lines(speed))
    assert "exporter-x / packed exported on GPU, end to end: ratio 0.420 [0.400, 0.450]" in text
    labels = [bar[0] for bar in speed_column.bars(speed)]
    assert "exporter-x / packed (export, gpu)" in labels and "both / compat (gpu)" in labels

"""Third-party implementations reach the conformance suites every way they can be registered,
and the matrix tells a correct loader from a broken one.

The example package (``examples/weightsync-example-loader``) is installed into a temporary
``--target`` directory and found through its ``weightsync.loaders`` entry points; its correct
loader must pass, its gate/up-swapped loader must fail with the swap named. Each run selects a
handful of conformance tests on one topology to stay fast.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "weightsync-example-loader"
#: The shipped suites (conformance modules and their harness), without the self-tests.
SHIPPED = shutil.ignore_patterns("selftest", "__pycache__")
#: One unpadded, gate_up, two-receiver-rank topology of the matrix (its first anchor).
TOPOLOGY = "L4E8H8I2-T.tp2ep4etp1pp2seq-R.tp1ep2dp1gu"

MY_LOADER = '''
from pytest_weightsync.reference_impl.impl import ReferenceImplementation


class MyLoader(ReferenceImplementation):
    name = "mine"


class Impostor(ReferenceImplementation):
    name = "reference"


class NotALoader:
    name = "broken"
'''


@pytest.fixture(scope="session")
def example_site(tmp_path_factory) -> Path:
    """The example package installed (no deps, no network) into a fresh target directory."""
    pytest.importorskip("setuptools", reason="building the example needs setuptools")
    work = tmp_path_factory.mktemp("example")
    source = work / "src"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    target = work / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), str(source)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"installing the example failed:\n{proc.stdout}\n{proc.stderr}"
    return target


@pytest.fixture
def suites(pytester: pytest.Pytester) -> pytest.Pytester:
    """A copy of the loader conformance suite in the pytester directory (so a conftest there
    can override fixtures), plus a module of small registrations."""
    shutil.copytree(REPO / "suites", pytester.path / "suites", ignore=SHIPPED)
    pytester.makepyfile(myloader=MY_LOADER)
    pytester.makeini("[pytest]\nmarkers =\n    weightsync_backend(name): backend\n")
    return pytester


def _outcomes(report: dict) -> dict:
    out: dict = {}
    for test in report["tests"]:
        out.setdefault(test["implementation"], {}).setdefault(test["outcome"], []).append(test)
    return out


def test_example_loaders_found_by_entry_point_good_passes_swapped_fails(
        suites: pytest.Pytester, example_site: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PYTHONPATH", str(example_site))
    result = suites.runpytest_subprocess(
        "-p", "weightsync", "suites/conformance/test_loader.py",
        "-k", f"on_every_rank and {TOPOLOGY}", "--weightsync-report", "report.json")
    result.stdout.re_match_lines([
        r"implementation\s+bit_exact\s+verdict",
        r"example\s+1/0/0\s+PARTIAL",  # -k: not a PASS
        r"example-swapped\s+0/1/0\s+FAIL",
        r"reference\s+1/0/0\s+PARTIAL",
        r"verdicts:",
        r"  example: PARTIAL \(4/\d+ ran; \d+ deselected; .*",
        r".*example-swapped / bit_exact / .*gate/up halves swapped: the gate rows of w13 hold "
        r"up_proj values",
    ], consecutive=False)
    report = json.loads((suites.path / "report.json").read_text())
    sources = {i["name"]: i["source"] for i in report["implementations"]}
    assert sources["example"].startswith("entry point 'example'")
    assert sources["example-swapped"].startswith("entry point 'example-swapped'")
    outcomes = _outcomes(report)
    assert len(outcomes["example"]["passed"]) == 3 and set(outcomes["example"]) == {"passed",
                                                                                    "skipped"}
    assert [t["format"] for t in outcomes["example"]["skipped"]] == ["hf_fused"]  # not claimed
    assert len(outcomes["reference"]["passed"]) == 4 and set(outcomes["reference"]) == {"passed"}
    failed = outcomes["example-swapped"]["failed"]
    # direct payloads are plain copies, so the swap only shows where the loader places halves
    assert sorted(t["format"] for t in failed) == ["compat", "packed"]
    assert [t["format"] for t in outcomes["example-swapped"]["passed"]] == ["direct"]
    for test in failed:
        assert "gate/up halves swapped" in test["message"]
        assert "layer=0 expert=0 projection=gate row=0 col=0" in test["message"]
    cell = next(c for c in report["cells"] if c["implementation"] == "example-swapped")
    assert cell["outcome"] == "failed" and cell["topology"] == TOPOLOGY


def test_example_loader_passes_every_property_and_skips_what_it_does_not_claim(
        suites: pytest.Pytester, example_site: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PYTHONPATH", str(example_site))
    result = suites.runpytest_subprocess(
        "-p", "weightsync", "suites/conformance/test_loader.py", "--weightsync-only", "example",
        "-k", "L4E8H8I2-T.tp2ep4etp1pp2seq or (bit_exact and pad4e) or "
              "(hardening and unsharded and compat)",
        "--weightsync-report", "report.json")
    report = json.loads((suites.path / "report.json").read_text())
    assert [i["name"] for i in report["implementations"]] == ["example"]
    assert set(report["summary"]["example"]) == {"bit_exact", "in_place", "no_stale_values",
                                                 "hardening", "fallback_routing"}
    # a -k selection of one module certifies nothing: every claimed case that ran passed,
    # and the verdict says what did not run
    assert report["implementations"][0]["verdict_word"] == "PARTIAL", result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert "not collected: test_distributed_exporter, test_random" in \
        report["implementations"][0]["verdict"]
    # the hardening report lists a finding for every bad kind it was fed
    kinds = {h["kind"] for h in report["hardening"]["example"] if h["format"] == "compat"}
    assert len(kinds) == 7, report["hardening"]
    outcomes = _outcomes(report)["example"]
    assert "failed" not in outcomes, result.stdout.str()
    # the example does not claim padded buffers: skipped with the reason, never passed
    padded = [t for t in outcomes["skipped"] if "pad4e" in t["topology"]]
    assert padded and all("does not claim padded buffers" in t["message"] for t in padded)
    assert not [t for t in outcomes["passed"] if "pad" in t["topology"]]


def test_loader_registered_by_option(suites: pytest.Pytester):
    result = suites.runpytest_subprocess(
        "-p", "weightsync", "suites/conformance/test_loader.py", "--weightsync-loader",
        "myloader:MyLoader", "--weightsync-only", "mine", "-k", f"in_place and {TOPOLOGY}", "-v",
        "--weightsync-allow-partial")
    result.assert_outcomes(passed=4)  # one per format
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines([f"*test_loader_writes_in_place_and_only_the_payload[[]mine-*"])
    assert "[reference-" not in result.stdout.str()


def test_loader_registered_by_conftest_fixture(suites: pytest.Pytester):
    suites.makeconftest('''
import pytest

@pytest.fixture
def weightsync_implementations():
    return ["myloader:MyLoader"]
''')
    result = suites.runpytest_subprocess(
        "-p", "weightsync", "suites/conformance/test_loader.py", "-k", f"in_place and {TOPOLOGY}", "-v")
    result.assert_outcomes(passed=8)  # two loaders x four formats
    result.stdout.fnmatch_lines(["*[[]reference-*PASSED*", "*[[]mine-*PASSED*"])


@pytest.mark.parametrize("target,message", [
    ("nosuchmodule_xyz:Loader", "cannot import module 'nosuchmodule_xyz'"),
    ("myloader:Missing", "module 'myloader' has no attribute 'Missing'"),
    ("myloader", "is not of the form 'module:attr'"),
    ("myloader:NotALoader", "is not a weightsync implementation: 'capabilities' must be"),
    ("myloader:Impostor", "duplicate implementation name 'reference'"),
])
def test_bad_registration_is_a_usage_error(pytester: pytest.Pytester, target, message):
    pytester.makepyfile(myloader=MY_LOADER)
    pytester.syspathinsert()
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    result = pytester.runpytest("-p", "weightsync", "--weightsync-loader", target)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    error = result.stderr.str()
    assert f"--weightsync-loader {target}" in error and message in error, error


def test_unknown_only_name_is_a_usage_error(pytester: pytest.Pytester):
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    result = pytester.runpytest("-p", "weightsync", "--weightsync-only", "nobody")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert ("--weightsync-only: no implementation named ['nobody']; registered: ['reference']"
            in result.stderr.str())


def test_same_implementation_twice_is_registered_once(pytester: pytest.Pytester):
    pytester.makepyfile(test_impls='''
def test_impl(weightsync_impl):
    pass
''')
    result = pytester.runpytest("-p", "weightsync", "-v", "--weightsync-loader",
                                "pytest_weightsync.reference_impl.impl:ReferenceImplementation")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_impl[[]reference[]] PASSED*"])


# --- stock SGLang rows: present when SGLang imports, absent (not failing) when it does not -----

HIDE_SGLANG = '''
import importlib.abc
import sys


class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "sglang" or name.startswith("sglang."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden for this run)", name=name)
        return None


sys.modules["sglang"] = None
sys.meta_path.insert(0, _Hide())
'''

LOADER_IDS = "def test_ids(weightsync_loader):\n    pass\n"


def test_sglang_rows_absent_when_sglang_does_not_import(pytester: pytest.Pytester,
                                                        monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("WEIGHTSYNC_OPTIONAL_BUILTINS", raising=False)
    pytester.makepyfile(weightsync_hide_sglang=HIDE_SGLANG, test_ids=LOADER_IDS)
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    result = pytester.runpytest_subprocess("-p", "weightsync_hide_sglang", "-p", "weightsync",
                                           "-p", "no:cacheprovider", "-p", "no:xdist", "-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_ids[[]reference[]] PASSED*"])
    assert "sglang-" not in result.stdout.str()


def test_sglang_rows_registered_when_sglang_imports(monkeypatch: pytest.MonkeyPatch):
    from pytest_weightsync import registry
    from pytest_weightsync.reference_impl.backends import probe

    status = probe("sglang")
    if not status.available:
        pytest.skip(status.reason)
    monkeypatch.delenv(registry.OPTIONAL_BUILTINS_ENV, raising=False)
    rows = {registry.as_implementation(t, s).name: s for t, s in registry.optional_targets()}
    assert set(rows) == {"sglang-qwen3-moe", "sglang-qwen3.5-moe"}
    assert all(s.startswith("built-in default (stock sglang: sglang ") for s in rows.values())
    monkeypatch.setenv(registry.OPTIONAL_BUILTINS_ENV, "none")
    assert registry.optional_targets() == []

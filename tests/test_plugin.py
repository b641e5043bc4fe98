"""The plugin's surface: options, markers, GPU gating, and that loading it stays cheap and
changes nothing in a session that does not ask for it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

OPTIONS = (
    "--weightsync-backend",
    "--weightsync-rank-timeout",
    "--weightsync-threads",
    "--weightsync-no-pool",
)


def test_options_are_listed_under_the_weightsync_group(pytester):
    result = pytester.runpytest_subprocess("-p", "weightsync", "--help")
    assert result.ret == 0
    out = result.stdout.str()
    header = out.index("weight synchronization conformance (pytest-weightsync)")
    for option in OPTIONS:
        assert out.index(option) > header, f"{option} is not in the weightsync group"
    assert "weightsync_rank_timeout" in out  # the ini key is documented too


def test_markers_are_registered(pytester):
    result = pytester.runpytest_subprocess("-p", "weightsync", "--markers")
    out = result.stdout.str()
    assert "@pytest.mark.gpu(n=1)" in out
    assert "@pytest.mark.ranks(n, backend=None, timeout=None)" in out
    assert "@pytest.mark.weightsync_property(name)" in out


def test_gpu_tests_skip_with_a_reason_on_cpu_and_deselect_with_not_gpu(pytester):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: gpu-marked tests run instead of skipping")
    pytester.makepyfile(
        test_g=textwrap.dedent(
            """
            import pytest

            pytestmark = pytest.mark.weightsync

            @pytest.mark.gpu
            def test_one_gpu():
                raise AssertionError("must not run on CPU")

            @pytest.mark.gpu(n=2)
            @pytest.mark.ranks(2)
            def test_two_gpu_ranks():
                raise AssertionError("must not run on CPU")

            def test_cpu():
                pass
            """
        )
    )
    result = pytester.runpytest_subprocess("-p", "weightsync", "-p", "no:cacheprovider", "-rs", "--strict-markers")
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines(["*needs 1 CUDA GPU(s): *", "*needs 2 CUDA GPU(s): *"])

    result = pytester.runpytest_subprocess("-p", "weightsync", "-p", "no:cacheprovider", "-m", "not gpu")
    result.assert_outcomes(passed=1, deselected=2)


def test_importing_the_plugin_does_not_import_torch():
    code = (
        "import sys, pytest_weightsync.plugin, pytest_weightsync.ranks, "
        "pytest_weightsync.ranks.dispatch\n"
        "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.cold_interpreter
def test_plugin_loads_with_autoload_disabled_and_a_plain_session_never_imports_torch(pytester, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makepyfile(
        test_plain=textwrap.dedent(
            """
            import sys

            def test_weightsync_is_active(pytestconfig):
                assert pytestconfig.pluginmanager.has_plugin("pytest_weightsync.ranks.dispatch")

            def test_torch_was_not_imported():
                assert "torch" not in sys.modules
            """
        )
    )
    result = pytester.runpytest_subprocess("-p", "weightsync", "-p", "no:cacheprovider", "--strict-markers")
    result.assert_outcomes(passed=2)


FOREIGN = textwrap.dedent(
    """
    import sys
    import pytest

    @pytest.mark.gpu
    def test_their_gpu_marker_is_theirs():
        pass

    def test_no_sub_plugin_was_switched_on(pytestconfig):
        active = [name for name in ("pytest_weightsync.gpu_gate", "pytest_weightsync.report",
                                    "pytest_weightsync.session_guard")
                  if pytestconfig.pluginmanager.has_plugin(name)]
        assert active == WANT_ACTIVE, active
        assert "torch" not in sys.modules
    """
)


@pytest.mark.cold_interpreter
@pytest.mark.weightsync_not_asked
@pytest.mark.parametrize("asked", [False, True], ids=["not-asked", "named"])
def test_a_foreign_gpu_test_is_never_gated(pytester, asked):
    """A project's own ``gpu`` marker keeps its meaning: without ``-p weightsync`` nothing of
    the plugin is switched on; with it, only weightsync tests are gated."""
    want = ["pytest_weightsync.gpu_gate", "pytest_weightsync.report",
            "pytest_weightsync.session_guard"] if asked else []
    pytester.makeini("[pytest]\nmarkers =\n    gpu: the project's own GPU tests\n")
    pytester.makepyfile(test_foreign=f"WANT_ACTIVE = {want!r}\n" + FOREIGN)
    args = ("-p", "weightsync") if asked else ()
    result = pytester.runpytest_subprocess(*args, "-p", "no:cacheprovider", "--strict-markers",
                                           "-rA")
    result.assert_outcomes(passed=2)
    if not asked:  # pytest's own "plugins:" header lists every installed plugin
        said = [line for line in result.outlines
                if "weightsync" in line and not line.startswith("plugins:")]
        assert not said, said


@pytest.mark.cold_interpreter
@pytest.mark.weightsync_not_asked
def test_a_session_that_does_not_ask_registers_no_marker_and_no_sub_plugin(pytester):
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--markers")
    assert result.ret == 0
    out = result.stdout.str()
    assert "@pytest.mark.ranks" not in out and "@pytest.mark.weightsync_property" not in out
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--markers",
                                           "--weightsync-threads", "1")
    assert "@pytest.mark.ranks(n, backend=None, timeout=None)" in result.stdout.str()

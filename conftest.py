"""Root conftest of the repository: settings for the plugin's own tests and the reference's
self-tests (not shipped: the installed conformance suites carry their own settings)."""

import os

import pytest

pytest_plugins = ["pytester"]

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # pragma: no cover - hypothesis is a dependency
    pass
else:
    settings.register_profile(
        "ci",
        deadline=None,
        max_examples=25,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    settings.register_profile("dev", deadline=None, max_examples=10)
    settings.load_profile("ci")


# --------------------------------------------------------------------------------------------
# Tiers: the main job (`pytest -p weightsync suites/`) runs the shipped conformance suites; the
# reference's self-tests (suites/selftest/, several times longer) run when asked for - by
# --weightsync-selftests (CI: ci/test-all.sh) or by naming them on the command line.
# --------------------------------------------------------------------------------------------


SELFTEST_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "suites", "selftest")
_SELFTESTS_LEFT = pytest.StashKey[int]()


def pytest_addoption(parser):
    parser.getgroup("weightsync").addoption(
        "--weightsync-selftests", action="store_true", default=False,
        help="also run the reference's self-tests (suites/selftest/) where they were not named "
             "on the command line; without it `pytest -p weightsync suites/` runs the shipped "
             "conformance suites alone")


def pytest_configure(config):
    if config.getoption("weightsync_selftests"):
        from pytest_weightsync import activation

        activation.activate(config)


def _named_selftests(config) -> bool:
    """Whether a command-line path points into suites/selftest/ (then its tests were asked for)."""
    for arg in config.args:
        path = os.path.abspath(os.path.join(str(config.invocation_params.dir),
                                            str(arg).split("::")[0]))
        if path == SELFTEST_DIR or path.startswith(SELFTEST_DIR + os.sep):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    if config.getoption("weightsync_selftests") or _named_selftests(config):
        return
    inside = SELFTEST_DIR + os.sep
    skipped = [item for item in items if str(item.path).startswith(inside)]
    if not skipped:
        return
    config.hook.pytest_deselected(items=skipped)
    items[:] = [item for item in items if not str(item.path).startswith(inside)]
    config.stash[_SELFTESTS_LEFT] = len(skipped)


def pytest_terminal_summary(terminalreporter, config):
    left = config.stash.get(_SELFTESTS_LEFT, 0)
    if left:
        terminalreporter.write_line(
            f"weightsync: {left} self-tests of suites/selftest/ not run (the main job runs the "
            f"shipped conformance suites); --weightsync-selftests runs them too")


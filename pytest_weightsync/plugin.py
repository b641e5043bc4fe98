"""The pytest entry point (``pytest -p weightsync``): options, markers and sub-plugins.

This module only declares things. Each concern lives in its own module and registers its
own hooks as a sub-plugin, the way pytest-xdist splits its session logic - but only in a
session that asks for the plugin (:mod:`pytest_weightsync.activation`): the wheel's entry
point loads this module into every pytest run of an environment where it is installed, and a
session that selects nothing of weightsync must run exactly as without it. Nothing imported
here may import torch.
"""

from __future__ import annotations

import pytest

from pytest_weightsync import activation

#: ``{dest: default}`` of every option below: one given with another value asks for the plugin.
OPTION_DEFAULTS: dict = {}


class _Group:
    """The option group, remembering each option's default (:data:`OPTION_DEFAULTS`)."""

    def __init__(self, group) -> None:
        self._group = group

    def addoption(self, *names, **attrs) -> None:
        self._group.addoption(*names, **attrs)
        dest = attrs.get("dest") or names[0].lstrip("-").replace("-", "_")
        OPTION_DEFAULTS[dest] = attrs.get("default")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = _Group(parser.getgroup("weightsync",
                                   "weight synchronization conformance (pytest-weightsync)"))
    group.addoption(
        "--weightsync-backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="torch.distributed backend for multi-rank tests: auto picks nccl for gpu-marked "
        "tests when CUDA is available, gloo otherwise (default: auto).",
    )
    group.addoption(
        "--weightsync-rank-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="fail a multi-rank test whose ranks have not all finished its body after this many "
        "seconds, dumping the Python stack of every hung rank (default: 180, or the ini value "
        "weightsync_rank_timeout). Starting the ranks is bounded separately "
        "(--weightsync-startup-timeout).",
    )
    group.addoption(
        "--weightsync-startup-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="fail a multi-rank test whose rank processes have not all started and joined the "
        "process group after this many seconds (an interpreter importing torch on a loaded "
        "machine can take minutes; default: 300, or the ini value weightsync_startup_timeout).",
    )
    group.addoption(
        "--weightsync-call-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="fail a conformance test whose call into the implementation in the pytest process "
        "(load_weights, begin/end_update, export_weights) has not returned after this many "
        "seconds, showing the call's Python stack; also bounds importing and instantiating a "
        "registered implementation; 0 for no limit (default: 300, or the ini value "
        "weightsync_call_timeout).",
    )
    group.addoption(
        "--weightsync-max-call-timeouts",
        type=int,
        default=None,
        metavar="N",
        help="cut an implementation off after N of its in-process calls timed out: its "
        "remaining tests are skipped as not run (never counted as passed); 0 never cuts off "
        "(default: 2, or the ini value weightsync_max_call_timeouts).",
    )
    group.addoption(
        "--weightsync-allow-partial",
        action="store_true",
        default=False,
        help="exit 0 when no test failed even if a verdict is PARTIAL or NOT RUN (a -k or "
        "single-file run while developing); without it such a run exits 1, since it "
        "certifies nothing.",
    )
    group.addoption(
        "--weightsync-threads",
        type=int,
        default=None,
        metavar="N",
        help="torch.set_num_threads(N) in every rank; 0 leaves torch's default (default: 1).",
    )
    group.addoption(
        "--weightsync-no-pool",
        action="store_true",
        default=False,
        help="spawn fresh rank processes for every multi-rank test instead of reusing a warm "
        "pool per world size (slower; isolates global state).",
    )
    group.addoption(
        "--weightsync-loader",
        action="append",
        default=[],
        metavar="MODULE:ATTR",
        help="register a third-party loader/exporter implementation to run the conformance "
        "suites against (repeatable).",
    )
    group.addoption(
        "--weightsync-only",
        action="append",
        default=[],
        metavar="NAME",
        help="run the conformance suites only against the named implementations (repeatable; "
        "default: every registered implementation).",
    )
    group.addoption(
        "--weightsync-eligibility",
        action="append",
        default=[],
        metavar="MODULE:ATTR",
        help="an inline-logprob eligibility function to check against the reference decision "
        "table (repeatable).",
    )
    group.addoption(
        "--weightsync-property",
        action="append",
        default=[],
        metavar="NAME",
        help="run only the conformance tests of this property (exact name, repeatable; -k "
        "matches property names too, as substrings); a narrower run is PARTIAL.",
    )
    group.addoption(
        "--weightsync-format",
        action="append",
        default=[],
        metavar="NAME",
        help="run only the tests of this payload format (compat, hf_fused, packed, direct; "
        "repeatable); tests with no format still run; a narrower run is PARTIAL.",
    )
    group.addoption(
        "--weightsync-list",
        action="store_true",
        default=False,
        help="collect only and list, per selected implementation and property, how many cases "
        "(topology x format) the run would check, and every topology spelled out (layers, "
        "experts, heads, KV heads, trainer TP/EP/ETP/PP, engine TP/EP/DP, order); runs nothing.",
    )
    group.addoption(
        "--weightsync-report",
        default=None,
        metavar="PATH",
        help="write the conformance matrix and per-backend pass/skip counts as JSON to PATH.",
    )
    group.addoption(
        "--weightsync-waivers",
        default=None,
        metavar="FILE",
        help="known, accepted deviations: a file of node id patterns, one per line, each with "
        "'# reason'; a listed test that fails is reported xfailed and WAIVED (never PASS), and "
        "the run exits 0 for it; unused waivers are listed (default: the ini value "
        "weightsync_waivers).",
    )
    group.addoption(
        "--weightsync-baseline",
        default=None,
        metavar="FILE",
        help="compare measured throughput ratios with this stored baseline; fail the run with "
        "a table when one drops by more than the tolerance.",
    )
    group.addoption(
        "--weightsync-save-baseline",
        default=None,
        metavar="FILE",
        help="write the throughput ratios measured in this run as a JSON baseline.",
    )
    group.addoption(
        "--weightsync-tolerance",
        type=float,
        default=None,
        metavar="FRACTION",
        help="allowed relative drop of a throughput ratio against the baseline (default: 0.10).",
    )
    parser.addini(
        "weightsync_rank_timeout",
        "default per-test timeout in seconds for multi-rank tests",
        default="180",
    )
    parser.addini(
        "weightsync_startup_timeout",
        "seconds allowed for starting a pool's rank processes (default 300)",
        default="",
    )
    parser.addini(
        "weightsync_call_timeout",
        "seconds an in-process implementation call may take; 0 for no limit (default 300)",
        default="300",
    )
    parser.addini(
        "weightsync_max_call_timeouts",
        "in-process call time-outs after which an implementation is cut off; 0 never (default 2)",
        default="2",
    )
    parser.addini(
        "weightsync_waivers",
        "a waiver file (see --weightsync-waivers), relative to the directory pytest starts in",
        default="",
    )
    parser.addini(
        "weightsync_tolerance",
        "default allowed relative drop of a throughput ratio against the baseline",
        default="0.10",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Switch the machinery on only where the session asked for it (named with ``-p``, or a
    weightsync option given); the shipped suites' conftest asks for it when collected."""
    if activation.named(config) or activation.options_given(config, OPTION_DEFAULTS):
        activation.activate(config)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from pytest_weightsync import hookspecs

    pluginmanager.add_hookspecs(hookspecs)

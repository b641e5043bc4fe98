"""A verdict certifies only what ran: the shipped conformance suites, run against small
implementations, in every way a run can fall short of running them.

Each run is a real ``pytest -p weightsync suites/`` subprocess over a copy of the shipped
suites (conformance modules and harness, no self-tests), with ``--weightsync-only`` naming an
implementation of ``toyimpls.py`` that claims one tiny topology, so a full conformance run
takes seconds:

- the full run is PASS and exits 0; a loader whose topologies no case of a property it has
  fits is PARTIAL, naming the property NOT RUN; ``-k`` and ``--lf`` runs are PARTIAL and exit
  1 (0 with ``--weightsync-allow-partial``); ``-x`` stopping at a failure leaves the other
  implementation INTERRUPTED; Ctrl-C (SIGINT) during a hung loader is INTERRUPTED, in the
  terminal and the JSON;
- a loader that hangs in the pytest process fails within ``--weightsync-call-timeout`` with
  the stack of the call; a wrong method signature is one usage error naming the method;
- ``--weightsync-only`` deselects the tests of roles the implementation does not play (no
  "got empty parameter set" skips); a 2 MB exception message is cut everywhere the plugin
  writes it; a failing cell's rerun command reruns exactly it; a usage error is in the JSON.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest
from toy_sources import TINY_LOADER


TOY_IMPLS = '''
import os
import time

''' + TINY_LOADER + '''

class Broken(Tiny):
    """Writes nothing: every update fails bit_exact."""

    name = "broken"

    def load_weights(self, params, payload, **kw):
        if os.environ.get("TOY_BROKEN", "1") == "1":
            return
        super().load_weights(params, payload, **kw)


class Hang(Tiny):
    """Sleeps in load_weights (after saying so in a file)."""

    name = "hang"

    def load_weights(self, params, payload, **kw):
        open(os.environ["TOY_HANG_FILE"], "w").write("hanging")
        time.sleep(600)


class Loud(Tiny):
    """Refuses every bucket with a 2 MB message."""

    name = "loud"

    def load_weights(self, params, payload, **kw):
        raise ValueError("x" * 2_000_000)


class OneExpert(Tiny):
    """Tiny restricted to the one-expert matrix topologies: no engine the lifecycle suite
    drives fits it."""

    name = "one-expert"
    capabilities = Capabilities(formats={"compat"},
                                topology=lambda spec, receiver: spec.num_experts == 1)


class WrongSignature(Tiny):
    name = "wrong-signature"

    def load_weights(self, params, payload, fmt, spec, topology, rank):
        pass
'''


@pytest.fixture
def suites(shipped):
    """The shipped suites plus ``toyimpls.py`` in a fresh directory (tests/conftest.py)."""
    (shipped.path / "toyimpls.py").write_text(TOY_IMPLS)
    return shipped


def _args(*names: str) -> list[str]:
    out = []
    for name in names:
        cls = {"tiny": "Tiny", "broken": "Broken", "hang": "Hang", "loud": "Loud",
               "wrong-signature": "WrongSignature", "one-expert": "OneExpert"}[name]
        out += ["--weightsync-loader", f"toyimpls:{cls}", "--weightsync-only", name]
    return out


def run(suites, *args: str, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    return suites.run("-p", "no:randomly", *args, timeout=timeout, **env)


def verdicts(suites) -> dict:
    return suites.verdicts()


def test_full_run_passes_and_exits_zero(suites):
    proc = run(suites, "suites/", *_args("tiny"), "-p", "no:cacheprovider")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    tiny = verdicts(suites)["tiny"]
    assert tiny["verdict_word"] == "PASS", out
    assert "tiny" in out and "PASS" in out
    # no "got empty parameter set" skips for the roles tiny does not play: deselected
    assert "got empty parameter set" not in out
    data = json.loads((suites.path / "report.json").read_text())
    assert data["selection"]["deselected"] > 0 and data["selection"]["keyword"] is None


def test_a_claimed_property_that_no_case_fits_is_named_not_run(suites):
    """Every loader has identity and coverage_by_rank; a loader whose topology predicate
    refuses every engine of the lifecycle suite never ran them: not a PASS, and the verdict,
    the matrix and the JSON name them. The lifecycle parts it does not claim (atomic_update,
    lifecycle, version), refused by the same predicate first, are not named."""
    proc = run(suites, "suites/", *_args("one-expert"), "-p", "no:cacheprovider")
    out = proc.stdout + proc.stderr
    row = verdicts(suites)["one-expert"]
    assert row["verdict_word"] == "PARTIAL", out
    assert set(row["claims_not_run"]) == {"identity", "coverage_by_rank"}, row
    assert re.search(r"identity: NOT RUN - no case fits this implementation's topologies "
                     r"\(\d+ case\(s\) refused: one-expert its topology predicate refuses this "
                     r"receiver\)", row["verdict"]), row["verdict"]
    assert proc.returncode == 1, out
    matrix = [line for line in out.splitlines() if line.startswith("one-expert ")]
    assert any("NOT RUN" in line for line in matrix), out  # the cells of the two properties
    assert "coverage_by_rank: NOT RUN" in out


def test_a_narrower_selection_is_partial_and_exits_one(suites):
    """-k leaves tests deselected; one path leaves conformance modules uncollected."""
    proc = run(suites, "suites/conformance/test_loader.py", "-k", "compat", *_args("tiny"),
               "-p", "no:cacheprovider")
    out = proc.stdout + proc.stderr
    tiny = verdicts(suites)["tiny"]
    assert tiny["verdict_word"] == "PARTIAL", out
    assert "deselected" in tiny["verdict"] and "not collected: test_random" in tiny["verdict"]
    assert proc.returncode == 1, out
    assert "tiny" in out and "PARTIAL (" in out and "--weightsync-allow-partial" in out
    # accepted when asked for, and still said
    proc = run(suites, "suites/conformance/test_loader.py", "-k", "compat", *_args("tiny"),
               "-p", "no:cacheprovider", "--weightsync-allow-partial")
    assert proc.returncode == 0, proc.stdout
    assert verdicts(suites)["tiny"]["verdict_word"] == "PARTIAL"


def test_last_failed_rerun_is_partial(suites):
    first = run(suites, "suites/", *_args("broken"), TOY_BROKEN="1")
    assert first.returncode == 1 and verdicts(suites)["broken"]["verdict_word"] == "FAIL"
    again = run(suites, "suites/", "--lf", *_args("broken"), TOY_BROKEN="0")
    out = again.stdout + again.stderr
    broken = verdicts(suites)["broken"]
    assert broken["verdict_word"] == "PARTIAL", out  # the failures pass now; the rest never ran
    assert again.returncode == 1, out
    assert json.loads((suites.path / "report.json").read_text())["selection"]["last_failed"] is True


def test_stopping_early_leaves_the_other_implementation_interrupted(suites):
    proc = run(suites, "suites/conformance/", "-x", *_args("broken", "tiny"),
               "-p", "no:cacheprovider")
    out = proc.stdout + proc.stderr
    judged = verdicts(suites)
    assert judged["broken"]["verdict_word"] == "FAIL", out
    assert judged["tiny"]["verdict_word"] in ("INTERRUPTED", "PARTIAL"), out
    assert judged["tiny"]["verdict_word"] != "PASS"
    data = json.loads((suites.path / "report.json").read_text())
    assert data["interrupted"] and data["interrupted"].startswith("stopped early"), data
    assert proc.returncode == 1


def test_sigint_during_a_hung_loader_is_interrupted(suites, tmp_path):
    marker = tmp_path / "hanging"
    cmd = [sys.executable, "-m", "pytest", "-p", "weightsync", "-q", "-p", "no:cacheprovider",
           "--weightsync-report", "report.json", "suites/", *_args("hang")]
    proc = subprocess.Popen(cmd, cwd=suites.path, env=suites.env(TOY_HANG_FILE=str(marker)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert marker.exists(), "the hanging loader was never called"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, out
    hang = verdicts(suites)["hang"]
    assert hang["verdict_word"] == "INTERRUPTED", out
    assert "INTERRUPTED (" in out and not re.search(r"^hang\s.*\bPASS$", out, re.M)


def test_a_hung_in_process_loader_fails_within_the_call_limit_with_its_stack(suites):
    started = time.monotonic()
    # -x: the first hung call is the whole point (each further one is 2 s more of the same)
    proc = run(suites, "suites/conformance/test_loader.py", "-x", "-k",
               "test_loader_lands_bit_exact_on_every_rank", "--weightsync-call-timeout", "2",
               *_args("hang"), "-p", "no:cacheprovider",
               TOY_HANG_FILE=str(suites.path / "hanging"))
    elapsed = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "hang.load_weights did not return within 2 s (--weightsync-call-timeout)" in out, out
    assert "time.sleep(600)" in out, out  # the call's own stack, down to where it hangs
    assert elapsed < 120, elapsed
    assert verdicts(suites)["hang"]["verdict_word"] == "FAIL"


def test_a_wrong_method_signature_is_one_usage_error_naming_the_method(suites):
    proc = run(suites, "suites/", *_args("wrong-signature"))
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    err = proc.stderr
    assert "load_weights" in err and "cannot be called as load_weights(params, payload, *, " \
        "format, spec, topology, rank)" in err, err
    assert err.count("cannot be called") == 1
    data = json.loads((suites.path / "report.json").read_text())
    assert "cannot be called as load_weights" in data["usage_error"]


def test_a_huge_message_is_cut_and_the_failing_cell_reruns_from_its_command(suites):
    proc = run(suites, "suites/conformance/test_loader.py", "-k", "in_place", *_args("loud"),
               "--junitxml", "junit.xml", "-p", "no:cacheprovider")
    assert proc.returncode == 1
    # a 2 MB exception message is cut in the terminal, the junit file and the JSON report
    assert len(proc.stdout) < 2_000_000, len(proc.stdout)
    assert "characters cut" in proc.stdout
    assert (suites.path / "junit.xml").stat().st_size < 2_000_000
    assert (suites.path / "report.json").stat().st_size < 2_000_000
    # the failing cell's command (also shown in the terminal) reruns exactly it
    failure = json.loads((suites.path / "report.json").read_text())["failures"][0]
    assert failure["rerun"] in proc.stdout
    again = subprocess.run(failure["rerun"], shell=True, env=suites.env(), capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 1, again.stdout + again.stderr
    assert "1 failed" in again.stdout and failure["nodeid"].split("::")[1] in again.stdout

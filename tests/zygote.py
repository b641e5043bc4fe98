"""Inner pytest sessions forked from a warm interpreter instead of started cold.

The plugin's own tests run real ``pytest -p weightsync`` sessions over a copy of the shipped
suites (``conftest.ShippedSuites``) - dozens per run. Each cold start pays the interpreter,
torch and hypothesis before collecting anything (about 5 s on a busy two-core machine), most
of the CPU these tests cost. A zygote process imports those once; every inner session is a
fork of it that sets its own working directory, environment and ``sys.path`` (as
``python -m pytest`` would from there), sends stdout and stderr to files, runs ``pytest.main``
and exits with its status. The child is a real process of its own (a process group of its
own: a time-out kills it with everything it started); nothing of the suites is imported in
the zygote, so every session collects its own copy from scratch.

Only sessions that need nothing but a status and the output go through here; a test that
signals its inner session (Ctrl-C, SIGTERM) starts it with ``subprocess`` itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

#: Imported once in the zygote: what every inner session imports before collecting.
PRELOAD = ("torch", "hypothesis", "hypothesis.strategies", "pytest", "_pytest.pytester",
           "pytest_weightsync.plugin", "pytest_weightsync.reference_impl.model.layout",
           "pytest_weightsync.reference_impl.oracle.synth")

_ZYGOTE = r'''
import importlib, json, os, signal, sys, time
for name in sys.argv[1:]:
    importlib.import_module(name)
# pytest warns that it cannot rewrite the asserts of a plugin module imported before it
# started (hypothesis here) - in a cold session it would have; the marker says not to try
for module in list(sys.modules.values()):
    try:
        module.__doc__ = (module.__doc__ or "") + "\nPYTEST_DONT_REWRITE"
    except (AttributeError, TypeError):
        pass
requests, replies = sys.stdin.buffer, sys.stdout
print(json.dumps({"ready": os.getpid()}), file=replies, flush=True)
for line in requests:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            os.setpgid(0, 0)
            os.chdir(job["cwd"])
            os.environ.clear()
            os.environ.update(job["env"])
            import tempfile
            tempfile.tempdir = None  # read TMPDIR again: the session's, not the zygote's
            extra = [p for p in job["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
            sys.path[:] = [job["cwd"], *extra, *[p for p in sys.path[1:] if p not in extra]]
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            for fd, path in ((1, job["out"]), (2, job["err"])):
                target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(target, fd)
                os.close(target)
            sys.stdin = open(0, closefd=False)
            sys.stdout = open(1, "w", buffering=1, closefd=False)
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            import pytest
            code = int(pytest.main(job["argv"]))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 3
        sys.stdout.flush()
        sys.stderr.flush()
        sys.exit(code)
    deadline = time.monotonic() + job["timeout"]
    status = None
    while status is None:
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(raw)
        elif time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            status = "timeout"
        else:
            time.sleep(0.02)
    print(json.dumps({"status": status}), file=replies, flush=True)
'''


class Zygote:
    """One warm interpreter; :meth:`run` is ``subprocess.run([python, "-m", "pytest", ...])``
    with ``capture_output=True, text=True``, forked from it."""

    def __init__(self, preload=PRELOAD) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE, *preload],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True, env={k: v for k, v in os.environ.items()
                                                      if k != "PYTEST_XDIST_WORKER"})
        self._lock = threading.Lock()
        ready = self._proc.stdout.readline()
        if not ready:
            raise RuntimeError("the zygote did not start")

    def run(self, argv: list, *, cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
        with self._lock, tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "out", Path(tmp) / "err"
            self._proc.stdin.write(json.dumps({
                "argv": [str(a) for a in argv], "cwd": str(cwd), "env": dict(env),
                "out": str(out), "err": str(err), "timeout": timeout}) + "\n")
            self._proc.stdin.flush()
            reply = self._proc.stdout.readline()
            if not reply:
                raise RuntimeError("the zygote died")
            status = json.loads(reply)["status"]
            stdout = out.read_text(errors="replace") if out.exists() else ""
            stderr = err.read_text(errors="replace") if err.exists() else ""
        command = [sys.executable, "-m", "pytest", *argv]
        if status == "timeout":
            raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
        return subprocess.CompletedProcess(command, status, stdout, stderr)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def run_pytest(zygote, argv: list, *, cwd, env: dict, timeout: float
               ) -> subprocess.CompletedProcess:
    """``python -m pytest ARGV`` in ``cwd`` with ``env``, output captured as text: forked from
    ``zygote`` when there is one (``None``: started cold, as ``WEIGHTSYNC_TESTS_COLD=1`` asks)."""
    if zygote is not None:
        return zygote.run(argv, cwd=cwd, env=env, timeout=timeout)
    return subprocess.run([sys.executable, "-m", "pytest", *map(str, argv)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)

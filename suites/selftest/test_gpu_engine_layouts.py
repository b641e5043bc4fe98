"""Engines that do not keep the checkpoint layout, updated repeatedly on the GPU.

Every engine case of the matrix (``cases.ENGINE_CASES``: the TRT-LLM BF16 block layout
re-applied after every update, triton_kernels' transposed parameters, redundant experts under
a placement that changes between updates) receives updates on the GPU through the reference
receiver; after each one the parameters are checked bit for bit in the engine's layout and
every local slot's expert output, read from the engine buffer, against the expected weights
(``gpu_harness.run_engine_updates``). The CPU run of the same steps is in
tests/test_gpu_suites_cpu.py.
"""

from __future__ import annotations

import pytest

from ..harness import cases
from . import gpu_harness as h

pytestmark = [pytest.mark.gpu, pytest.mark.weightsync_property("repeated-updates")]

ENGINES = [pytest.param(c, id=c.id) for c in cases.ENGINE_CASES]


@pytest.mark.parametrize("path", h.PATHS)
@pytest.mark.parametrize("case", ENGINES)
def test_engine_layout_updates_on_the_gpu_exact_in_params_and_outputs(case, path):
    log = h.run_engine_updates(case, path, "cuda", updates=6)
    assert log.updates == 6 and log.outputs_checked > 0

"""Receivers as SGLang builds them, and what they copy with.

The checkpoint-layout expert receiver (:mod:`.receiver`: SGLang ``FusedMoE`` placement,
stricter on bad input), the entry checks and payload errors every receiver shares
(:mod:`.payload_checks`), the records of a planned bucket and an open update
(:mod:`.load_plan`), its engine-layout and EPLB variants (:mod:`.engine_receivers`), the FP8
block receiver (:mod:`.fp8_receiver`), the whole-model receiver (:mod:`.model_receiver`), the
checks that decide whether a tensor can be read at all (:mod:`.tensor_checks`), the plan cache
that replays a validated bucket (:mod:`.plan_cache`), the memo that checks a receiver's
parameters once while they stay as they were (:mod:`.checked_memo`; both trust tensor objects
through the native passes of ``sharing.tensor_guard``), and one receiver rank in its own process
(:mod:`.process`). Receivers never read the oracle; only :mod:`.process` calls it, to poison
fresh parameters and check them where they live when a test asks.
"""

#: Rooms of ``reference_impl`` this one may import (checked by the repository's tests;
#: ``oracle`` by :mod:`.process` alone).
MAY_IMPORT = ("errors", "model", "kernels", "sharing", "oracle")

"""Wire formats and exporters: what the reference sends an engine rank, and how it gets there.

The four expert formats (:mod:`.compat`, :mod:`.hf_fused`, :mod:`.packed`, :mod:`.direct`,
picked by name in :mod:`.formats`, chosen for a receiver in :mod:`.select`), whole-model
streams (:mod:`.model_senders`), FP8 payloads (:mod:`.fp8`), byte-limited buckets
(:mod:`.buckets`), payloads that are views of trainer memory (:mod:`.zerocopy`), the
exporters that run in trainer ranks (:mod:`.distributed_export`,
:mod:`.distributed_model_export`) and the colocated sync that builds everything once
(:mod:`.colocated`). Senders read trainer state and move it over a transport; they never
import the oracle (the values they send are the trainer's) nor a receiver.
"""

#: Rooms of ``reference_impl`` this one may import (checked by the repository's tests).
MAY_IMPORT = ("errors", "model", "trainer", "sharing", "kernels")

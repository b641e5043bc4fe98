"""Expected values: what every trainer and engine tensor must hold, computed independently.

Synthetic weights are a function of their coordinates (:mod:`.synth` for experts,
:mod:`.model_synth` for whole models, :mod:`.fp8` for FP8 blocks), evaluated at the places the
layout model names, never sliced from what a sender produced. :mod:`.oracle_check` compares an
engine's parameters with them where they live; :mod:`.moe_forward` is the MoE forward over
expected weights. The oracle judges senders and receivers, so it never imports them: only
``model/`` and the errors.
"""

#: Rooms of ``reference_impl`` this one may import (checked by the repository's tests).
MAY_IMPORT = ("errors", "model")

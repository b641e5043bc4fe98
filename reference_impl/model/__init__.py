"""What a model is: the facts every other room reads and none may change.

The expert layout and its ownership math (:mod:`.layout`: which trainer and engine rank holds
which rows of which expert; one import point over the model shape :mod:`.moe_spec`, the weight
names :mod:`.expert_names`, the trainer's sharding :mod:`.trainer_layout` and the engine's
:mod:`.receiver_layout`), whole-model specs (:mod:`.model_spec`) and their engine parameter
trees (:mod:`.model_layout`), one record per model family that they all read
(:mod:`.families`), the engine-specific expert layouts (:mod:`.engine_layout`), the FP8 block
layout with its quantizer (:mod:`.fp8`) and vLLM's parameter layouts (:mod:`.vllm_layout`).
Plain functions of shapes and coordinates:
they import nothing of the reference but its errors, so the oracle can build on them without
sharing code with a sender or a receiver.
"""

#: Rooms of ``reference_impl`` this one may import (checked by the repository's tests).
MAY_IMPORT = ("errors",)

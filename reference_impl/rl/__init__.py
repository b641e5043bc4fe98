"""The RL side of a refit: whether inline log-probs may be used, and the loss inputs they feed.

:mod:`.inline_logprob` decides eligibility (the engine's log-probs stand for the trainer's only
when the weights they were computed with are the trainer's, bit for bit); :mod:`.loss_inputs`
builds what the loss reads. Torch-free where it can be; independent of the sync itself.
"""

#: Rooms of ``reference_impl`` this one may import (checked by the repository's tests).
MAY_IMPORT = ("errors",)

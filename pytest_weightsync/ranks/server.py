"""Imported first in the fork server that gloo ranks are forked from (never in pytest).

The server imports what every rank would import (:mod:`pytest_weightsync.ranks.launch`);
what those imports say about the machine (no Transformer Engine, Apex or CUDA runtime) would
land once in the output of whichever test started the server, so it is quieted here as each
rank quiets it.
"""

from pytest_weightsync.ranks.worker import _quiet_what_the_machine_lacks

_quiet_what_the_machine_lacks()

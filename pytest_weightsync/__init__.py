"""pytest-weightsync: prove that trainer-to-inference weight synchronization is bit-exact and fast.

Importing this package (or its pytest plugin module) must stay cheap: it never imports torch.
Heavy modules (the multi-rank launcher, comparison, throughput) are imported by the fixtures
that use them.
"""

__version__ = "0.1.0"

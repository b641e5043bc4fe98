"""Copy machinery every room may use: planned ``(dst, src)`` copies and their Triton kernels.

:mod:`.fastcopy` plans a list of copies into runs and runs them as few launches as it can;
:mod:`.triton_copy` holds the kernels it launches on a GPU. They know tensors, not models.
"""

#: Rooms of ``reference_impl`` this one may import (checked by the repository's tests).
MAY_IMPORT = ("errors",)

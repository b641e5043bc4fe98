"""Located raw-bit checks shared by the gather suites.

Both wrap :func:`pytest_weightsync.compare.assert_bitwise_equal` (raw bits, shape and dtype
checked, mismatch count in the message) and only add a locator that names the first differing
element in the suite's own terms: (layer, expert, projection, row, col) for expert weights,
(component, source TP rank, row, col) for component-ordered tensors.
"""

from __future__ import annotations

from pytest_weightsync.compare import assert_bitwise_equal


def _col(index: tuple):
    """The column part of an element index: one int for 2-D tensors, the rest otherwise."""
    return index[1] if len(index) == 2 else list(index[1:])


def assert_expert_bits(actual, expected, *, layer: int, expert: int, projection: str,
                       where: str, row_blocks: tuple = ()) -> None:
    """``actual`` has the bits of ``expected``, one expert's ``projection`` of ``layer``.

    ``row_blocks`` (``(name, rows), ...``) splits a stacked tensor such as fc1 ``[gate; up]``
    so the message names the sub-projection and the row within it.
    """

    def locate(_name, index):
        row, name = index[0], projection
        for block, rows in row_blocks:
            if row < rows:
                name = f"{projection}.{block}"
                break
            row -= rows
        return f"layer={layer} expert={expert} projection={name} row={row} col={_col(index)}"

    assert_bitwise_equal(actual, expected, name=where, locate=locate)


def assert_component_bits(actual, expected, layout, tp: int) -> None:
    """``actual`` has the bits of ``expected``, an unsharded ``layout`` tensor gathered from
    ``tp`` ranks; the first wrong row is named by component and the TP rank it came from."""

    def locate(_name, index):
        component, source_rank, local_row = layout.locate(index[0], tp)
        return (f"row {index[0]} (component {component!r}, row {local_row} of TP rank "
                f"{source_rank}'s block), col {_col(index)}")

    assert_bitwise_equal(actual, expected, name=f"{layout.name} at TP {tp}", locate=locate)

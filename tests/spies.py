"""What the interpreter's load spies (test_kernels, test_block_split,
test_position_skipping) need to name the block a program owns: kernels
whose later blocks carry more work take them heaviest first
(masks.program_order), so program i owns block n - 1 - i there."""
from __future__ import annotations

from napkin import masks


def heaviest_first(bounds) -> tuple[bool, bool]:
    """Whether the row-block kernels (forward, dQ) and the key-block kernel
    (dK/dV) of a mask with these bounds take their blocks in reverse."""
    return masks.work_grows(bounds, "row"), masks.work_grows(bounds, "col")


def program_block(builder, reversed_: bool) -> int:
    """The block along grid axis 0 that the interpreter's current program owns."""
    return builder.grid_dim[0] - 1 - builder.grid_idx[0] if reversed_ else builder.grid_idx[0]

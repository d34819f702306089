"""How L decoder layers are cut into n consecutive pieces (weight-pipeline shards, pipeline stages).

Pure arithmetic, no torch: the planners, the simulator, the flag checks and the runtime share it.

* :func:`default_layer_split` -- when n does not divide L, the first ``L mod n`` pieces take one
  layer more than the others (``[2, 2, 1, 1]`` for 6 layers in 4 pieces). The larger pieces are
  consecutive, so with groups running a few visits apart only a few slots see a large piece.
* :func:`first_last_layer_split` -- Megatron-LM's ``--decoder-first-pipeline-num-layers`` /
  ``--decoder-last-pipeline-num-layers``: the first and/or last piece fixed, the rest split as above.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple


def default_layer_split(num_layers: int, pieces: int) -> Tuple[int, ...]:
    """``pieces`` counts summing to ``num_layers``, as equal as possible, the larger ones first."""
    if pieces < 1:
        raise ValueError(f"cannot cut {num_layers} layers into {pieces} pieces")
    if num_layers < pieces:
        raise ValueError(f"{num_layers} layers cannot be cut into {pieces} pieces of one layer or more")
    base, extra = divmod(num_layers, pieces)
    return tuple(base + 1 if i < extra else base for i in range(pieces))


def is_even(split: Sequence[int]) -> bool:
    return len(set(split)) <= 1


def first_last_layer_split(num_layers: int, pieces: int, first: Optional[int] = None,
                           last: Optional[int] = None, even_middle: bool = False) -> Tuple[int, ...]:
    """The split with the first and/or last piece fixed; the middle pieces share the rest
    (``even_middle``: they must share it equally, as megatron-core's own pipeline requires)."""
    fixed = [x for x in (first, last) if x is not None]
    if any(x < 1 for x in fixed):
        raise ValueError("the first and last pieces need at least one layer")
    if pieces == 1 and fixed:
        if any(x != num_layers for x in fixed):
            raise ValueError(f"a single piece holds all {num_layers} layers")
        return (num_layers,)
    if first is not None and last is not None and pieces == 2:
        if first + last != num_layers:
            raise ValueError(f"the first ({first}) and last ({last}) pieces must hold all {num_layers} layers")
        return (first, last)
    middle_pieces = pieces - len(fixed)
    middle_layers = num_layers - sum(fixed)
    if middle_layers < middle_pieces:
        raise ValueError(f"{middle_layers} layers are left for {middle_pieces} middle pieces (one layer or more each)")
    if even_middle and middle_layers % middle_pieces:
        raise ValueError(f"the {middle_layers} layers left must divide evenly over the {middle_pieces} middle pieces")
    middle = default_layer_split(middle_layers, middle_pieces)
    return (() if first is None else (first,)) + middle + (() if last is None else (last,))


def check_layer_split(split: Sequence[int], num_layers: int, pieces: int) -> Tuple[int, ...]:
    """``split`` as a tuple after checking it: ``pieces`` counts of one layer or more summing to ``num_layers``."""
    split = tuple(int(x) for x in split)
    if len(split) != pieces:
        raise ValueError(f"a split into {pieces} pieces needs {pieces} counts, got {len(split)}: {list(split)}")
    if any(x < 1 for x in split):
        raise ValueError(f"every piece needs at least one layer: {list(split)}")
    if sum(split) != num_layers:
        raise ValueError(f"the pieces hold {sum(split)} layers, not {num_layers}: {list(split)}")
    return split


def layer_offsets(split: Sequence[int]) -> Tuple[int, ...]:
    """The first layer of each piece."""
    out, at = [], 0
    for n in split:
        out.append(at)
        at += n
    return tuple(out)

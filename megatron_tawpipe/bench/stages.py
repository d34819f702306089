"""How the benchmark's strategies cut the decoder layers, also where the ranks do not divide them.

The weight-passing schedules cut the layers by the default split (the first ``L mod P`` shards one layer
more). Native pipelines get the same split of their stages: megatron-core's layout string
(``--pipeline-model-parallel-layout``) where the stages do not divide the layers. A split given in the model
flags (Megatron-LM's ``--decoder-first/last-pipeline-num-layers``, ``--pipeline-model-parallel-layout``) has
one piece per rank: the weight-passing schedules and 1F1B over all ranks take it as it is, the strategies
without stages leave it out, and the others (interleaved, one stage per node) are refused in one line.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from megatron_tawpipe.common.errors import BenchmarkError
from megatron_tawpipe.common.layer_split import default_layer_split


def flag_value(argv: Sequence[str], flag: str) -> Optional[str]:
    argv = list(argv)
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def interleaved_layers_per_virtual_stage(layers: int, ranks: int) -> int:
    """The benchmark's interleaved 1F1B where the ranks divide the layers: two virtual stages per rank where a
    rank's layers split evenly, else one layer per virtual stage."""
    per_stage = layers // ranks
    if per_stage < 2:
        raise BenchmarkError(f"interleaved needs at least 2 layers per stage ({layers} layers on {ranks} ranks)")
    return per_stage // 2 if per_stage % 2 == 0 else 1


def interleaved_virtual_stages(layers: int, ranks: int) -> int:
    """Model chunks per rank of the benchmark's interleaved 1F1B (see :func:`native_stage_flags` where the
    ranks do not divide the layers: two)."""
    if layers % ranks:
        if layers < 2 * ranks:
            raise BenchmarkError(f"interleaved needs at least 2 layers per stage ({layers} layers on {ranks} ranks)")
        return 2
    return layers // ranks // interleaved_layers_per_virtual_stage(layers, ranks)


# Megatron-LM's flags that cut the layers into stages (shards): in the model flags they give one piece per rank.
SPLIT_FLAGS = ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
               "--pipeline-model-parallel-layout")
# Strategies that take a split of one piece per rank as it is given (a shard or a pipeline stage per rank).
_ONE_PIECE_PER_RANK = ("tawpipe", "tawpipe-owner", "tawpipe-rep", "tawpipe-nocache", "tawpipe-spread", "weipipe",
                       "1f1b")
# Strategies without stages: the split flags mean nothing to them and are left out.
_NO_STAGES = ("distopt-node", "distopt", "fsdp", "hsdp", "hfsdp")


def native_stage_flags(layers: int, stages: int, virtual: int = 1) -> List[str]:
    """Flags that give a native pipeline of ``stages`` ranks x ``virtual`` chunks its layers: none where the
    pieces divide the layers, else megatron-core's layout string of the default split (the first ``L mod n``
    pieces one layer more, as the weight pipeline's shards and the simulator's stages are cut)."""
    pieces = stages * virtual
    if layers % pieces == 0:
        return []
    if layers < pieces:
        raise BenchmarkError(f"{layers} layers cannot fill {pieces} pipeline stages of one layer or more")
    text = ["t" * n for n in default_layer_split(layers, pieces)]
    text[0], text[-1] = "E" + text[0], text[-1] + "L"
    return ["--pipeline-model-parallel-layout", "|".join(text)]


def without_flags(argv: Sequence[str], flags: Sequence[str]) -> List[str]:
    """``argv`` less every one of ``flags`` with its value (``--flag value`` or ``--flag=value``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not arg.startswith(tuple(flag + "=" for flag in flags)):
            out.append(arg)
    return out


def model_args_for(schedule: str, model_args: Sequence[str]) -> List[str]:
    """The model flags for ``schedule``: a split given in them is one piece per rank, which the weight-passing
    schedules and 1F1B over all ranks take as it is; strategies without stages drop it."""
    given = [flag for flag in SPLIT_FLAGS if flag_value(model_args, flag) is not None]
    if not given or schedule in _ONE_PIECE_PER_RANK:
        return list(model_args)
    if schedule in _NO_STAGES:
        return without_flags(model_args, SPLIT_FLAGS)
    raise BenchmarkError(f"{schedule}: the model flags' {' / '.join(given)} give one piece per rank, which "
                         f"{schedule} does not have (its stages or shards are not one per rank); leave the flags out (every "
                         f"strategy then gets the default split) or leave {schedule} out")


def variant_layout_flags(schedule: str, config) -> List[str]:
    """A named TawPipe variant's whole layout, pinned (``tawpipe`` itself runs the layout the run decides): its own
    flag, ``--tawpipe-microbatches-per-visit`` and ``--tawpipe-shards-per-rank`` as the benchmark gives them (1 by
    default), the cache on over several groups (off for tawpipe-nocache), the hierarchical replicated reduction."""
    several = config.num_groups() >= 2
    flags = ["--tawpipe-microbatches-per-visit", str(config.tawpipe_microbatches_per_visit or 1),
             "--tawpipe-shards-per-rank", str(config.tawpipe_shards_per_rank or 1),
             "--tawpipe-replicated-reduce", "hierarchical",
             "--tawpipe-ownership", "spread" if schedule == "tawpipe-spread" else "owner",
             "--tawpipe-cache", "on" if several and schedule != "tawpipe-nocache" else "off"]
    return flags + (["--tawpipe-replicate-first-shard"] if schedule == "tawpipe-rep"
                    else ["--no-tawpipe-replicate-first-shard"])

"""Benchmarks and measurements: everything that times a run rather than trains one.

Cluster benchmarks on CPU (``tools/benchmark.py``):

* :mod:`.emulated_cluster` — nodes as network namespaces joined by shaped links (built on
  :mod:`.node_network`, :mod:`.netns` for ``ip``/``tc``, :mod:`.subprocesses`, and :mod:`.link_probe`
  which measures a link);
* :mod:`.calibrate` — measures the per-layer times that emulated compute
  (:mod:`megatron_tawpipe.emulation`) sleeps (``tools/calibrate.py``);
* :mod:`.benchmark` — every strategy on the emulated cluster, table and chart; :mod:`.matrix` — the
  simulator against measurements over a matrix of configurations;
* :mod:`.link_duplex`, :mod:`.collective_speed`, :mod:`.fsdp_overhead` — measurements of the links,
  collectives and FSDP2's own CPU work that the simulator's parameters come from.

One-GPU checks and measurements of one rank (``tools/gpu_check.py``).

NCCL refuses two ranks on one GPU, so a single GPU can check what one rank
does — kernels, numerics, memory, timings — and nothing about multi-rank NCCL
ordering (that is modelled on CPU by the plan validator and the executor's
NCCL-faithful mode). The pieces:

* :mod:`.layer_specs` — Transformer Engine's decoder-layer spec against the
  local spec on the same weights;
* :mod:`.one_rank` — one-rank training runs in this process through the
  project's own ``pretrain``;
* :mod:`.waits` — host time of the executor's plan ``Wait``;
* :mod:`.shard_timing` — per-shard forward/backward/recompute times, written
  as the calibration JSON;
* :mod:`.memory` — one rank's memory against the simulator's prediction;
* :mod:`.gpu_check` — the command: flags, the checks in order, table, JSON.
"""

"""The measurement lab: what measures the product rather than being it. Not installed (``setup.py`` packages
``megatron_tawpipe`` only); it imports ``megatron_tawpipe`` and is never imported by it (``.importlinter``).
Scripts under ``tools/`` find it beside them.

Network emulation and link probes:

* :mod:`.emulated_cluster` — nodes as network namespaces joined by shaped links (built on
  :mod:`.node_network` and :mod:`.netns` for ``ip``/``tc``; ``tools/emulated_cluster.py``);
  :mod:`.benchmark_cluster` — that cluster as ``run_benchmark`` takes it (``tools/benchmark.py --nodes``);
* :mod:`.link_probe` (one TCP stream between nodes, timed), :mod:`.link_burst` (htb's burst swept),
  :mod:`.link_duplex`, :mod:`.collective_speed` — the links and collectives the simulator's
  parameters come from.

Simulator validation:

* :mod:`.matrix` — the simulator against measurements over a matrix of emulated configurations
  (``tools/simulator_matrix.py``);
* :mod:`.idle_breakdown` — a measured iteration split into categories beside the simulator's
  (``tools/idle_breakdown.py``);
* :mod:`.fsdp_overhead` — FSDP2's own CPU work around its collectives.

One-GPU checks and measurements of one rank (``tools/gpu_check.py``). NCCL refuses two ranks on one
GPU, so a single GPU can check what one rank does — kernels, numerics, memory, timings — and nothing
about multi-rank NCCL ordering (that is modelled on CPU by the plan validator and the executor's
NCCL-faithful mode):

* :mod:`.layer_specs` — Transformer Engine's decoder-layer spec against the local spec on the same
  weights;
* :mod:`.compute_check` — the weight-passing shard's compute against native megatron-core's;
* :mod:`.one_rank` — one-rank training runs in this process through the project's own ``pretrain``;
* :mod:`.waits` — host time of the executor's plan ``Wait``;
* :mod:`.shard_timing` — per-shard forward/backward/recompute times, written as the calibration JSON;
* :mod:`.gpu_check` — the command: flags, the checks in order, table, JSON (one rank's memory
  against the simulator's prediction is ``megatron_tawpipe.bench.memory``).
"""

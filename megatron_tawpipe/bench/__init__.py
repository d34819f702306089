"""Benchmarks a user runs: every strategy against native megatron on one model, batch and data.

* :mod:`.benchmark` — every strategy side by side, table and chart (``tools/benchmark.py``), with
  :mod:`.bench_runs` (one strategy's run, its logs and failures), :mod:`.subprocesses` (processes
  stopped and waited for), :mod:`.stages` (native pipelines' stages), :mod:`.benchmark_report`
  (table, chart, measured against simulated);
* :mod:`.collective_bytes` and :mod:`.counted_pretrain` — every collective's bytes per link class;
* :mod:`.equal_memory` — each strategy's micro-batch size under one memory budget;
* :mod:`.calibrate` — the per-layer times that emulated compute (:mod:`megatron_tawpipe.emulation`)
  sleeps (``tools/calibrate.py``), with :mod:`.activation_bytes`;
* :mod:`.memory` — one rank's memory against the simulator's prediction.

The emulated cluster a benchmark can run on, the link probes, the simulator's validation and the
one-GPU checks are the measurement lab, ``tools/tawpipe_lab/``: it imports this package, never the
other way round.
"""

"""What TawPipe is compared with, trained through the same loop (data, loss, metrics, checkpoints).

* :mod:`.native` — megatron-core's own schedules (no pipelining, 1F1B,
  interleaved) with its DDP or distributed optimizer;
* :mod:`.fsdp` — torch FSDP2 over all ranks (ZeRO-3) or on a
  (nodes, ranks per node) mesh (HSDP).
"""

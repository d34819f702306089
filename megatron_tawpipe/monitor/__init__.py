"""What a run reports: metrics and the log line (:mod:`.metrics`), the progress board and hang watchdog
(:mod:`.progress`), Megatron-LM's exit conditions (:mod:`.exits`), TensorBoard and W&B (:mod:`.tensorboard_log`)."""

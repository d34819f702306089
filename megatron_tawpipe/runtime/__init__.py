"""The weight-passing runtime: the plan executor (:mod:`.executor`) and its transports, the weight-pipeline model
(:mod:`.weight_pipe_model`) with its compute (:mod:`.layer_compute`) and micro-batches (:mod:`.microbatches`), the
trainer (:mod:`.trainer`) and megatron's schedule-function convention (:mod:`.schedules`)."""

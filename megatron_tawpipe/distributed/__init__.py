"""Process groups: torch.distributed and megatron-core's parallel state (:mod:`.initialize`), the weight
pipeline's topology (:mod:`.parallel_state`), megatron-core's schedule function for a layout
(:mod:`.megatron_schedules`)."""

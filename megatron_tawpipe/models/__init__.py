"""The model: megatron-core's GPTModel built from Megatron-LM's flags (:mod:`.llama`), its deterministic
initialisation (:mod:`.initialization`), global parameter names and tensor-parallel slices (:mod:`.parameters`),
core attention on SDPA (:mod:`.attention`)."""

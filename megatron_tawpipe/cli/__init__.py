"""Command lines: the entry of ``pretrain_llama.py`` (:mod:`.pretrain`) and the simulator/advisor tools' shared flags
(:mod:`.plan_args`)."""

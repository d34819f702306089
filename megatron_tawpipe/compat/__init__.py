"""Fitting megatron-core and Megatron-LM: the supported releases (``versions``), every run-time patch of
megatron-core, torch or Python (``patches``), the CPU layer, and Megatron-LM's flags this project answers
without implementing."""

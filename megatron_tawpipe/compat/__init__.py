"""Fitting Megatron-LM users' habits: its flags that this project answers without implementing."""

"""Emulated compute: calibrated sleeps instead of compute, an object given to the model (:mod:`.compute`,
:mod:`.gpt`)."""

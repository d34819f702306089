"""The bottom layer: errors, the device, a training step's result, atomic files, units, the checkpoint interface.

Imports nothing else of the package (see docs/architecture.md)."""

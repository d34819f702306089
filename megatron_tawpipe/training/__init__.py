"""Training: the pre-training loop (:mod:`.loop`), the GPT forward step it is given (:mod:`.forward_step`) and
the validation of the flags (:mod:`.validate_args`).

The loop's names (``pretrain``, ``build_trainer``, ``evaluate``, ``TrainingError``) are loaded on first
use, so that validating flags does not import megatron-core's training parts.
"""

_LOOP_NAMES = ("TrainingError", "build_scheduler", "build_trainer", "evaluate", "pretrain")


def __getattr__(name):
    if name in _LOOP_NAMES:
        from megatron_tawpipe.training import loop

        return getattr(loop, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_LOOP_NAMES)

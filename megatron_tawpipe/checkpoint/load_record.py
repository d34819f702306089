"""What a load restored: the one line a run prints after loading a checkpoint (path, format, iteration, what
was and was not restored), filled by each format's loader."""

from __future__ import annotations

from typing import List, Optional, Tuple


class LoadRecord:
    """What one load restored and what it did not (with why), in the order the line names them."""

    def __init__(self, directory: str = "", kind: str = "", release: bool = False, iteration: int = 0):
        self.directory, self.kind, self.release, self.iteration = directory, kind, release, iteration
        self.restored: List[str] = []
        self.not_restored: List[Tuple[str, Optional[str]]] = []

    def note(self, what: str, done: bool, why: Optional[str] = None) -> None:
        if done:
            self.restored.append(what)
        else:
            self.not_restored.append((what, why))

    def line(self, root: str) -> str:
        text = (f" loaded checkpoint from {root} at iteration {self.iteration}: {self.directory} (--ckpt-format "
                f"{self.kind}{', release' if self.release else ''}); restored: {', '.join(self.restored) or 'nothing'}")
        if self.not_restored:     # grouped by why: "optimizer state, LR schedule (--finetune)"
            reasons = list(dict.fromkeys(why for _what, why in self.not_restored))
            text += "; not restored: " + ", ".join(
                ", ".join(what for what, why in self.not_restored if why == reason) + (f" ({reason})" if reason else "")
                for reason in reasons)
        return text


def fresh_start_reason(args, release: bool = False) -> Optional[str]:
    """Why the optimizer, LR schedule and data position start afresh (None when they are restored)."""
    if args.finetune:
        return "--finetune"
    if release:
        return "a release checkpoint holds weights only"
    if args.no_load_optim:
        return "--no-load-optim"
    return None


def note_training_state(record: Optional[LoadRecord], args, *, optimizer: bool, scheduler: bool,
                        rng: bool, rng_why: Optional[str], iteration: int, consumed: int,
                        release: bool = False, optimizer_why: Optional[str] = None) -> None:
    """Record the weights and the training state a loader restored (or why not)."""
    if record is None:
        return
    fresh = fresh_start_reason(args, release)
    record.note("weights", True)
    record.note("optimizer state", optimizer, optimizer_why or fresh)
    record.note("LR schedule", scheduler, fresh or ("not in the checkpoint" if not scheduler else None))
    position = not (args.finetune or release)
    record.note(f"iteration {iteration} and data position ({consumed} samples)" if position else
                "iteration and data position", position, fresh)
    if not rng and rng_why is None:
        rng_why = ("--no-load-rng" if args.no_load_rng else "--finetune" if args.finetune else "not saved for this layout and schedule")
    record.note("RNG states", rng, rng_why)

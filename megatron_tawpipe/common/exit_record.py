"""Why a rank ended, written where the launch scripts read it after torchrun returns.

torchrun reports any failed worker as exit status 1, so a launch script cannot tell from the status
alone whether restarting from the latest checkpoint can help. Each rank therefore records its reason,
when the environment names a directory for it (``TAWPIPE_EXIT_DIR``, set by ``examples/restarts.sh``
for every attempt): one file ``rank<R>.<kind>`` holding the error line, written atomically. Kinds:

* ``refused`` (exit status 2): the flags, data, tokenizer or checkpoint were refused before training;
  the same command fails the same way;
* ``repeatable`` (exit status 3): training failed in a way that recurs from the same checkpoint with the
  same data (a NaN or Inf loss or gradient, a checkpoint that does not load, a plan action that cannot
  run);
* ``stopped`` (exit status 0, as Megatron-LM's): the run stopped on request before ``--train-iters``
  (``--exit-signal-handler`` after its signal, ``--exit-interval``, ``--exit-duration-in-mins``), with a
  checkpoint saved when ``--save`` is given; the launch scripts do not restart it, a later launch resumes;
* a rank that lost a peer, timed out or was killed records nothing: a restart can fix that.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

from megatron_tawpipe.common.atomic import atomic_write_text

ENV = "TAWPIPE_EXIT_DIR"
REFUSED, REPEATABLE, STOPPED = "refused", "repeatable", "stopped"
EXIT_STATUS = {REFUSED: 2, REPEATABLE: 3, STOPPED: 0}


def record_exit(kind: str, line: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Record that this rank ends for ``kind`` with the line ``line`` when ``TAWPIPE_EXIT_DIR`` is set;
    returns whether it was recorded (the launch script then prints the line, once for all ranks)."""
    if kind not in EXIT_STATUS:
        raise ValueError(f"unknown exit kind {kind!r}; known: {', '.join(EXIT_STATUS)}")
    environ = os.environ if environ is None else environ
    directory = environ.get(ENV)
    if not directory:
        return False
    try:
        os.makedirs(directory, exist_ok=True)
        atomic_write_text(os.path.join(directory, f"rank{environ.get('RANK', '0')}.{kind}"),
                          line.rstrip("\n") + "\n")
    except OSError:
        return False
    return True

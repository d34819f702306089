"""Files written whole or not at all: write a temporary file beside the target, then rename it over the target.

A reader never sees half a file, and a crash leaves the previous version. ``durable=True`` also flushes the
file and its directory to disk before and after the rename (checkpoints, whose loss would cost training).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import IO, Iterator


def fsync_file(path: str) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_path(path: str) -> str:
    """The temporary name a write to ``path`` goes to first (unique per process)."""
    return f"{path}.tmp{os.getpid()}"


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "w", durable: bool = False, **open_kwargs) -> Iterator[IO]:
    """``with atomic_write(path) as f: ...``: ``f`` is the temporary file; on leaving the block without an
    error it replaces ``path``, on an error it is removed and ``path`` is left as it was."""
    if "b" not in mode:
        open_kwargs.setdefault("encoding", "utf-8")
    tmp = temporary_path(path)
    try:
        with open(tmp, mode, **open_kwargs) as handle:
            yield handle
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write_text(path: str, text: str, durable: bool = False) -> None:
    with atomic_write(path, "w", durable=durable) as handle:
        handle.write(text)


def atomic_write_bytes(path: str, payload: bytes, durable: bool = False) -> None:
    with atomic_write(path, "wb", durable=durable) as handle:
        handle.write(payload)


def atomic_write_json(path: str, obj, indent=None, sort_keys: bool = False, newline: bool = False,
                      durable: bool = False) -> None:
    """``obj`` as JSON (``newline``: with a final newline)."""
    with atomic_write(path, "w", durable=durable) as handle:
        json.dump(obj, handle, indent=indent, sort_keys=sort_keys)
        if newline:
            handle.write("\n")


def atomic_torch_save(obj, path: str) -> None:
    """``torch.save`` of ``obj``, flushed to disk before the rename (checkpoint files; the checkpoint's
    directory is flushed when it is promoted)."""
    import torch

    tmp = temporary_path(path)
    try:
        torch.save(obj, tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise

#!/usr/bin/env python
"""What a checkpoint save costs the training loop, with and without --async-save.

Trains one rank of a small Llama on mock data three times (no checkpoints; --save every --save-interval
iterations, synchronous; the same with --async-save) and times every iteration from the start of one
training step to the start of the next, so an iteration's time includes whatever the loop did after the
step: the save (synchronous), or planning it and handing the write to a background process (--async-save).

    python tools/measure_async_save.py --train-iters 26 --save-interval 4 --repetitions 3

Prints, per mode (medians over the repetitions): the median time of the iterations without a save (with
--async-save these include the ones a background write overlaps), the mean time of the iterations that
saved, the median time the loop spent in the save call (what the loop waits for), and the checkpoint
size. Flags after ``--`` replace the model flags (pretrain_llama.py's). The figures in docs/checkpoints.md
come from ``--repetitions 3``.
"""

import argparse
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = ["--num-layers", "8", "--hidden-size", "512", "--ffn-hidden-size", "1408", "--num-attention-heads", "8",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
         "--global-batch-size", "1", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "8000",
         "--untie-embeddings-and-output-weights", "--lr", "1e-4", "--lr-warmup-iters", "1", "--eval-iters", "0",
         "--log-interval", "1000", "--num-workers", "0", "--seed", "1"]


def _run(mode: str, argv, port: int, results) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.distributed.initialize import destroy
    from megatron_tawpipe.training import pretrain
    from megatron_tawpipe.training.forward_step import gpt_forward_step
    from megatron_tawpipe.training.loop import build_trainer
    from megatron_tawpipe.training.validate_args import validate_args

    starts = []

    def timed_trainer(args, forward_step, run):
        trainer = build_trainer(args, forward_step, run)
        step = trainer.train_step

        def train_step(iterators, num_microbatches):
            starts.append(time.perf_counter())
            return step(iterators, num_microbatches)

        trainer.train_step = train_step
        return trainer

    from megatron_tawpipe.training import loop

    saves = []
    save = loop.save_checkpoint

    def timed_save(*save_args, **save_kwargs):
        began = time.perf_counter()
        try:
            return save(*save_args, **save_kwargs)
        finally:
            saves.append(time.perf_counter() - began)

    loop.save_checkpoint = timed_save
    args = validate_args(parse_args(argv))
    try:
        pretrain(args, gpt_forward_step, trainer_factory=timed_trainer)
    finally:
        destroy()
    # (The last save, after the last iteration, is left out: the run ends with it.)
    results.put((mode, ([b - a for a, b in zip(starts, starts[1:])], saves[:-1])))


def _size(path: str) -> int:
    return int(subprocess.run(["du", "-sb", path], capture_output=True, text=True, check=True).stdout.split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-iters", type=int, default=26)
    parser.add_argument("--save-interval", type=int, default=4)
    parser.add_argument("--repetitions", type=int, default=2, help="runs of each mode, alternating")
    parser.add_argument("--dir", default="/tmp/async_save_measure", help="checkpoints go here (removed after)")
    parser.add_argument("model", nargs="*", help="after --: model flags replacing the default small Llama")
    options = parser.parse_args()
    from megatron_tawpipe.arguments import LLAMA_FLAGS

    model = list(LLAMA_FLAGS) + (options.model or MODEL)
    base = model + ["--train-iters", str(options.train_iters)]
    modes = {"no checkpoints": [], "--save (synchronous)": ["--save", os.path.join(options.dir, "sync")],
             "--save --async-save": ["--save", os.path.join(options.dir, "async"), "--async-save"]}
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    timings, calls, sizes = {name: [] for name in modes}, {name: [] for name in modes}, {}
    for _repetition, (mode, extra) in ((r, item) for r in range(options.repetitions) for item in modes.items()):
        shutil.rmtree(options.dir, ignore_errors=True)
        flags = extra + (["--save-interval", str(options.save_interval)] if extra else [])
        proc = ctx.Process(target=_run, args=(mode, base + flags, _port(), results))
        proc.start()
        while True:
            try:
                name, (gaps, save_calls) = results.get(timeout=5)
                break
            except queue.Empty:
                if not proc.is_alive():
                    raise SystemExit(f"the {mode} run failed (exit code {proc.exitcode}); its error is above")
        proc.join()
        timings[name].append(gaps)
        calls[name].extend(save_calls)
        if extra:
            latest = open(os.path.join(extra[1], "latest_checkpointed_iteration.txt")).read().strip()
            sizes[name] = _size(os.path.join(extra[1], f"iter_{int(latest):07d}"))
    shutil.rmtree(options.dir, ignore_errors=True)
    saving = [i for i in range(len(timings["no checkpoints"][0])) if (i + 1) % options.save_interval == 0]
    print(f"{len(saving)} saves (after iterations {', '.join(str(i + 1) for i in saving)}), "
          f"{options.train_iters} iterations, 1 rank; median over {options.repetitions} alternating repetitions")
    print(f"{'mode':<24}{'iteration, no save':>20}{'iteration with a save':>24}{'save call':>12}{'checkpoint':>12}")
    for name, runs in timings.items():
        plain = statistics.median(statistics.median(g for i, g in enumerate(gaps) if i not in saving and i > 0)
                                  for gaps in runs)
        with_save = statistics.median(statistics.mean(gaps[i] for i in saving) for gaps in runs)
        size = f"{sizes[name] / 2**20:.0f} MiB" if name in sizes else "-"
        call = f"{statistics.median(calls[name]):.3f}s" if calls[name] else "-"
        print(f"{name:<24}{plain:>19.3f}s{with_save:>23.3f}s{call:>12}{size:>12}")


def _port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    main()

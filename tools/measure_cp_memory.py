#!/usr/bin/env python
"""What one micro-batch's forward keeps for its backward on each rank, with and without context parallelism.

Runs ``pretrain_llama.py``'s training (the flags given, a native schedule) for the iterations they give,
counting, in every forward of a micro-batch, the distinct storages autograd saves (parameters and their
gradients excluded): the activations a rank holds for one micro-batch until its backward. On a GPU it also
reads ``torch.cuda.max_memory_allocated``. Rank 0 prints one JSON line: the context-parallel size, the largest
count over micro-batches per rank, and the memory model's figure for the same run (the cost model's activation
bytes of one layer x layers, / C). Run it with torchrun, e.g. one node of 2 CPU ranks:

    torchrun --nproc-per-node 2 tools/measure_cp_memory.py <model flags> --context-parallel-size 2

``examples/measure_context_parallel_memory.sh`` runs it at C = 1 and 2 on the same model and sequence.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="append the JSON line to this file too")
    args, flags = p.parse_known_args()   # the rest: pretrain_llama.py's flags
    flags = [f for f in flags if f != "--"]

    import torch
    import torch.distributed as dist

    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.arguments.run_config import ModelConfig, PrecisionConfig
    from megatron_tawpipe.bench.activation_bytes import saved_storages
    from megatron_tawpipe.distributed.initialize import destroy
    from megatron_tawpipe.sim.run_cost import cost_model_for_run
    from megatron_tawpipe.training import pretrain
    from megatron_tawpipe.training.forward_step import gpt_forward_step
    from megatron_tawpipe.training.validate_args import validate_args

    run_args = validate_args(parse_args(flags))
    counts = []

    def counting_forward_step(data_iterator, model):
        params = {t.untyped_storage().data_ptr() for t in model.parameters()}
        with saved_storages(params) as saved:
            output, loss_func = gpt_forward_step(data_iterator, model)
        if torch.is_grad_enabled():
            counts.append(sum(saved.values()))
        return output, loss_func

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        pretrain(run_args, counting_forward_step)
        mine = torch.tensor([max(counts, default=0)], dtype=torch.float64)
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        cp = run_args.context_parallel_size
        cost = cost_model_for_run(ModelConfig.from_args(run_args), PrecisionConfig.from_args(run_args),
                                  run_args.micro_batch_size, recompute=False)
        line = {"context_parallel_size": cp, "seq_length": run_args.seq_length, "num_layers": run_args.num_layers,
                "hidden_size": run_args.hidden_size, "micro_batch_size": run_args.micro_batch_size,
                "world_size": dist.get_world_size(),
                "saved_bytes_per_microbatch": [float(t) for t in everyone],
                "model_activation_bytes": cost.layer_activation_bytes * run_args.num_layers / cp,
                "cuda_max_allocated": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None}
        if dist.get_rank() == 0:
            print(json.dumps(line), flush=True)
            if args.out:
                with open(args.out, "a", encoding="utf-8") as f:
                    f.write(json.dumps(line) + "\n")
    finally:
        destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How this project answers the Megatron-LM flags its parser does not define: the rules behind the flag
table (:mod:`megatron_tawpipe.compat.flag_table`).

A flag is ``no-effect`` (accepted; one notice per job with the reason) only where it cannot change the
math, the data order or what is saved: a GPU kernel or memory-placement choice, a logging or profiling
switch with no target here, a fault-tolerance service that is not used. Everything else is ``refused``
in one line saying what it needs or what to use instead; the values of a refused flag that ask for what
this project does (``--rerun-mode disabled``) are accepted by the rules of
:mod:`megatron_tawpipe.compat.flag_values`, and Megatron-LM's own default of one by the rule of
:mod:`megatron_tawpipe.compat.flag_defaults`. :data:`EXPLICIT` names single flags;
:data:`FAMILIES` whole families by prefix (first match wins; explicit entries are looked up first).
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

NO_EFFECT = "no-effect"
REFUSED = "refused"

# ---- reasons shared by several flags --------------------------------------------------------------
_MOE = "mixture-of-experts models are not supported (dense decoder layers only)"
_FP8 = "fp8 training is not supported yet; train in fp32 (default), --bf16 or --fp16"
_FP4 = "fp4 training is not supported yet; train in fp32 (default), --bf16 or --fp16"
_TP_OVERLAP = "needs tensor parallelism with Transformer Engine's userbuffers on GPUs (not supported here)"
_PROFILER = "no profiler hooks here: run under nsys, or --timeline-file for the weight-passing schedules"
_TENSORBOARD = ("not written to TensorBoard (--metrics-file has the memory fields); the loss, learning rate, "
                "gradient norm, loss scale, timings and validation are")
_DEEPSPEED = ("DeepSpeed is not used: training runs on megatron-core, with batch sizes and precision from "
              "the flags (no DeepSpeed config file is read)")
_DEEPSPEED_ONLY = ("a Megatron-DeepSpeed flag this project does not implement (DeepSpeed is not used; "
                   "docs/pretrain-llama-and-megatron-lm.md, 'Coming from Megatron-LM', lists what carries over)")
_INFERENCE = "inference / text-generation settings: pretrain_llama.py runs no inference engine"
_RL = "reinforcement learning (GRPO rollouts) is not supported: pretrain_llama.py pre-trains on token data"
_RETRO = "retrieval models (RETRO, ICT, REALM) are not supported: GPT/Llama decoders only"
_ENCODER = "encoder models (BERT, T5) are not supported: GPT/Llama decoders only"
_VISION = "vision models are not supported: GPT/Llama decoders only"
_DISTILL = "knowledge distillation is not supported: pre-training from --data-path or --mock-data only"
_CUDA_GRAPH = "CUDA graphs are not captured here: the same kernels run eagerly"
_ONE_LOGGER = ("NVIDIA's one-logger / telemetry services are not used (the log line, --metrics-file, TensorBoard "
               "and W&B are)")
_FT = ("NVIDIA's fault-tolerance / in-process restart services are not used: a failed run exits with status 1 and "
       "the launch scripts relaunch it from the latest checkpoint (MAX_RESTARTS)")
_FLIGHT_RECORDER = ("torch's NCCL flight recorder is configured by its environment variables here "
                    "(TORCH_NCCL_TRACE_BUFFER_SIZE, TORCH_NCCL_DUMP_ON_TIMEOUT, TORCH_FR_DUMP_TEMP_FILE)")
_ARCH = "not supported: the model is a GPT/Llama decoder (docs/pretrain-llama-and-megatron-lm.md, 'The model')"
_OFFLOAD = "CPU offloading is not supported: weights, activations and optimizer state stay on the device"
_OPTIMIZER_ONLY = ("applies to an --optimizer this project refuses (adam only); with adam Megatron-LM ignores it "
                   "too")
_NON_PERSISTENT = "non-persistent (local) checkpoints are not written: use --save with --save-interval"
_KERNEL = "a GPU kernel choice: it changes which kernel runs, not the result; none of these kernels is used here"
_FAULT_INJECTION = "Megatron-LM's fault injection is not available (tests/test_faults.py injects faults here)"
_DUMPS = ("debug dumps of tensors to disk are not written; --metrics-file records per-iteration scalars")
_GRADIENT_TRACKING = "gradient / loss checks beyond NaN detection are not made (--check-for-nan-in-loss-and-grad is)"
_MSC = "the multi-storage client is not used: checkpoints and data are read from local paths"
_MUP = "maximal-update parametrisation (muP) is not supported: Megatron-LM's standard parametrisation only"
_MTP = "multi-token prediction is not supported: one next-token loss"
_MLA = "multi-latent attention is not supported: standard (grouped-query) attention"
_HYBRID = "hybrid Mamba / linear-attention models are not supported: attention decoder layers only"
_HETERO = "heterogeneous layer configurations are not supported: every decoder layer has the same shape"
_SFT = "supervised fine-tuning data are not supported: pre-training data (--data-path or --mock-data)"
_FIM = "the fill-in-the-middle data transformation is not supported"
_EXPERIMENTAL = "an experimental Megatron-LM feature that is not supported here"


_SPLIT = ("give the stages' layers with --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers "
          "or --pipeline-model-parallel-layout")
_DDP = "not passed to megatron-core's DDP here (--ddp-bucket-size sets the gradient buckets)"
_CP = ("context parallelism here is megatron-core's p2p ring over --context-parallel-size ranks: the other "
       "communication types (a2a, allgather, a2a+p2p), hierarchical and hybrid context parallelism are not supported")
_NCCL = "NCCL tuning: collectives run with NCCL's defaults here, with the same results"
_INIT = "initialisation is this project's own (deterministic and the same for every parallel layout)"
_CKPT_IO = "how megatron-core spreads checkpoint I/O over the ranks; the checkpoint is the same"
_CONVERT = ("checkpoints are not converted by pretrain_llama.py: --load reads torch_dist, torch and tawpipe checkpoints; "
            "tools/hf_checkpoint.py converts Hugging Face weights both ways")
_VOCAB = "the vocabulary is padded to --make-vocab-size-divisible-by x tensor-parallel size, as Megatron-LM's default"
_EVAL = "validation runs --eval-iters global batches of the training batch size every --eval-interval iterations"
_HF_TOKENIZER = ("Megatron-LM 0.16's spelling: special tokens are included and the fast tokenizer used unless "
                 "--tokenizer-hf-no-include-special-tokens / --tokenizer-hf-no-use-fast")
_TOKENIZER = "a tokenizer option this project does not implement (docs/pretrain-llama-and-megatron-lm.md, 'Flags')"


# ---- single flags -------------------------------------------------------------------------------------
EXPLICIT: Dict[str, Tuple[str, str]] = {
    # Earlier accepted-with-a-notice flags.
    "--use-mcore-models": (NO_EFFECT, "megatron-core models are the only kind (Megatron-LM ignores this flag too)"),
    "--use-flash-attn": (NO_EFFECT, "Megatron-LM no longer reads it; the attention kernel follows --attention-backend"),
    "--no-async-tensor-model-parallel-allreduce": (NO_EFFECT, "Megatron-LM removed it; it never changed results"),
    "--disable-async-tensor-model-parallel-allreduce": (NO_EFFECT, "Megatron-LM removed it; it never changed results"),
    "--no-contiguous-buffers-in-local-ddp": (NO_EFFECT, "megatron-core's DDP always keeps gradients in contiguous "
                                                        "buffers"),
    "--manual-gc": (NO_EFFECT, "Python's garbage collector stays automatic"),
    "--manual-gc-interval": (NO_EFFECT, "Python's garbage collector stays automatic"),
    "--no-manual-gc-eval": (NO_EFFECT, "Python's garbage collector stays automatic"),
    "--disable-manual-gc-eval": (NO_EFFECT, "Python's garbage collector stays automatic"),
    "--empty-unused-memory-level": (NO_EFFECT, "the CUDA caching allocator is not flushed between steps"),
    "--timing-log-level": (NO_EFFECT, "no per-phase timers: the log line has the iteration time, --timeline-file "
                                      "the weight-passing schedules' phases"),
    "--timing-log-option": (NO_EFFECT, "no per-phase timers: the log line has the iteration time"),
    "--no-barrier-with-level-1-timing": (NO_EFFECT, "no per-phase timers, so no barriers for them"),
    "--log-params-norm": (NO_EFFECT, "the parameter norm is not computed (the gradient norm is logged)"),
    "--log-num-zeros-in-grad": (NO_EFFECT, "zeros in the gradient are not counted"),
    "--ckpt-fully-parallel-save": (NO_EFFECT, "deprecated in Megatron-LM; checkpoints are written by every rank in "
                                              "parallel anyway"),
    "--dist-ckpt-strictness": (NO_EFFECT, "loading asks for exactly the tensors the model needs and names any that "
                                          "is missing; other entries of a checkpoint are ignored"),
    "--auto-detect-ckpt-format": (NO_EFFECT, "the format of a checkpoint is always detected when loading"),
    "--deterministic-mode": (NO_EFFECT, "CPU kernels are deterministic; on GPUs non-deterministic kernels are not "
                                        "forbidden"),
    "--data-impl": (NO_EFFECT, "Megatron-LM removed it: .bin/.idx data are memory-mapped (--no-mmap-bin-files "
                               "reads them instead)"),
    "--no-query-key-layer-scaling": (NO_EFFECT, "query-key layer scaling is off unless "
                                                "--apply-query-key-layer-scaling, as in Megatron-LM"),
    "--zero-stage": (NO_EFFECT, "DeepSpeed's ZeRO is not used; for sharded optimizer state use "
                                "--use-distributed-optimizer (stages 1-2), --use-torch-fsdp2 or --pipeline-schedule "
                                "tawpipe (stage 3): the arithmetic is the same"),
    "--rampup-batch-size": (NO_EFFECT, "deprecated, and ignored by Megatron-LM since megatron-core 0.18 as it is here: "
                                       "the global batch is --global-batch-size throughout (--step-batch-size-schedule "
                                       "ramps it)"),
    "--deepspeed": (NO_EFFECT, _DEEPSPEED),
    "--deepspeed_config": (NO_EFFECT, _DEEPSPEED),
    "--deepspeed-activation-checkpointing": (NO_EFFECT, "DeepSpeed is not used; --recompute-granularity full "
                                                        "recomputes activations"),
    # Logging with no target here (they change nothing that is computed or saved).
    "--log-device-memory-used": (NO_EFFECT, "device memory is not logged per iteration (--log-memory-to-tensorboard "
                                            "writes the allocator's figures)"),
    "--log-memory-interval": (NO_EFFECT, "memory scalars follow --tensorboard-log-interval here"),
    "--log-max-attention-logit": (NO_EFFECT, "the largest attention logit is not computed or logged"),
    "--log-energy": (NO_EFFECT, "needs NVML's GPU energy counters: energy is not logged here"),
    "--log-straggler": (NO_EFFECT, "straggler detection (nvidia-resiliency-ext) is not used"),
    "--log-batch-size-to-tensorboard": (NO_EFFECT, "batch-size is always written to TensorBoard (Megatron-LM removed "
                                                   "this switch for the same reason)"),
    "--exit-signal-handler-for-training": (NO_EFFECT, "a signal without --exit-signal-handler stops the run as it "
                                                      "would anyway; --exit-signal-handler saves a checkpoint first"),
    "--use-same-sampling-seed-across-dp-ranks": (NO_EFFECT, _INFERENCE),
    "--fsdp-manual-registration": (NO_EFFECT, _NCCL),
    "--suggested-communication-unit-size": (NO_EFFECT, "how many elements Megatron-FSDP moves per collective; "
                                                       "the values are the same"),
    "--fsdp-db-use-persist-buf-on-alloc-fail": (NO_EFFECT, "applies to Megatron-FSDP's double buffer, which is not "
                                                           "used here"),
    # Data, checkpoint and precision options that change what is computed or saved, not built here.
    "--allow-ambiguous-pad-tokens": (REFUSED, "changes which tokens the loss masks; not supported (megatron-core's "
                                              "default masking applies)"),
    "--mid-level-dataset-surplus": (REFUSED, "blended datasets are built with megatron-core's default surplus "
                                             "(leave it out)"),
    "--multiple-validation-sets": (REFUSED, "one validation set: --valid-data-path (several prefixes, optionally "
                                            "weighted, blend into it)"),
    "--validation-set-names": (REFUSED, "one validation set: --valid-data-path (several prefixes, optionally "
                                        "weighted, blend into it)"),
    "--per-dataset-sequences-path": (REFUSED, "not read: megatron-core builds the dataset indices from the .idx files "
                                              "(leave it out)"),
    "--phase-transition-iterations": (REFUSED, "phased training is not supported; --step-batch-size-schedule steps "
                                               "the batch up"),
    "--sample-rate": (REFUSED, "sub-sampling the training data is not supported: every sample of the blend is used"),
    "--load-main-params-from-ckpt": (REFUSED, "the fp32 main weights are always rebuilt from the loaded weights "
                                              "when the optimizer state is not loaded (--no-load-optim)"),
    "--verify-integrity": (REFUSED, "checkpoint files are not hashed; writes are atomic and loading names any "
                                    "missing tensor"),
    "--test-mode": (REFUSED, "Megatron-LM's internal test mode is not available"),
    "--tensor-parallel-num-weight-shards": (REFUSED, "tensor-parallel weights are sharded --tensor-model-parallel-size "
                                                     "ways, not otherwise"),
    "--no-use-layer-wise-param-layout": (REFUSED, _OPTIMIZER_ONLY),
    "--megatron-fsdp-enable-fine-grained-param-gather": (REFUSED, "not supported yet: --use-megatron-fsdp gathers "
                                                                  "whole layers' weights"),
    "--megatron-fsdp-grad-comm-dtype": (REFUSED, "Megatron-FSDP's dtypes follow --bf16 here; its own dtype flags are "
                                                 "not supported yet"),
    "--megatron-fsdp-main-grads-dtype": (REFUSED, "Megatron-FSDP's dtypes follow --bf16 here; its own dtype flags are "
                                                  "not supported yet"),
    "--megatron-fsdp-main-params-dtype": (REFUSED, "Megatron-FSDP's dtypes follow --bf16 here; its own dtype flags "
                                                   "are not supported yet"),
    "--megatron-fsdp-max-pool-double-buffer": (REFUSED, "Megatron-FSDP's fp8 / double-buffer options are not "
                                                        "supported; --use-megatron-fsdp runs without them"),
    # Flags of Megatron-LM's development branch that no megatron-core release (0.16-0.19) has.
    **{flag: (REFUSED, "a flag of Megatron-LM's development branch that no megatron-core release 0.16-0.19 has: "
                       "not supported yet")
       for flag in ("--ckpt-drop-redundant-extra-state", "--ckpt-pg-tensors-cache-create",
                    "--ckpt-pg-tensors-cache-path", "--gtp-remat-nccl-ub", "--gtp-remat-opt-in-modules",
                    "--gtp-remat-reduce-scatter-with-fp32-accumulation", "--megatron-fsdp-version",
                    "--output-logit-dtype", "--use-gigatoken")},
    "--no-scatter-gather-tensors-in-pipeline": (REFUSED, "pipeline stages send whole activations here (megatron-core's "
                                                         "default)"),
    # Earlier refusals.
    "--use-legacy-models": (REFUSED, "legacy models are gone from Megatron-LM; this project trains megatron-core's "
                                     "GPTModel"),
    "--fsdp-double-buffer": (REFUSED, "Megatron-FSDP's fp8 / double-buffer options are not supported; "
                                      "--use-megatron-fsdp runs without them"),
    "--keep-fp8-transpose-cache": (REFUSED, "Megatron-FSDP's fp8 / double-buffer options are not supported; "
                                            "--use-megatron-fsdp runs without them"),
    "--num-experts": (REFUSED, _MOE),
    "--tp-comm-overlap": (REFUSED, _TP_OVERLAP),
    # Native pipeline layout and DDP knobs megatron-core has that are not passed to it here.
    "--account-for-embedding-in-pipeline-split": (REFUSED, _SPLIT),
    "--account-for-loss-in-pipeline-split": (REFUSED, _SPLIT),
    "--num-virtual-stages-per-pipeline-rank": (REFUSED, "give --num-layers-per-virtual-pipeline-stage or "
                                                        "--pipeline-model-parallel-layout"),
    "--use-ring-exchange-p2p": (REFUSED, "needs a PyTorch build with torch.distributed.ring_exchange"),
    "--pipeline-model-parallel-comm-backend": (REFUSED, "pipeline stages communicate over --distributed-backend"),
    "--overlap-param-gather-with-optimizer-step": (REFUSED, "not supported: --overlap-param-gather overlaps the "
                                                            "weight all-gather with the next forward"),
    "--ddp-num-buckets": (REFUSED, _DDP),
    "--ddp-pad-buckets-for-high-nccl-busbw": (REFUSED, _DDP),
    "--ddp-average-in-collective": (REFUSED, _DDP),
    "--ddp-reduce-scatter-with-fp32-accumulation": (REFUSED, _DDP),
    "--ddp-param-name-patterns-for-fp32-local-accumulation": (REFUSED, _DDP),
    "--use-tp-pp-dp-mapping": (REFUSED, "ranks are ordered tensor, data, pipeline (megatron-core's default order)"),
    "--cp-comm-type": (REFUSED, _CP),
    "--hierarchical-context-parallel-sizes": (REFUSED, _CP),
    "--max-seqlen-per-dp-cp-rank": (REFUSED, _CP),
    "--enable-full-sharding-in-hsdp": (REFUSED, "HSDP here shards inside groups and replicates across them "
                                                "(--use-torch-fsdp2 --num-distributed-optimizer-instances N)"),
    "--torch-fsdp2-no-reshard-after-forward": (REFUSED, "FSDP2 here reshards the weights after every forward"),
    "--model-parallel-size": (REFUSED, "Megatron-LM's old name: use --tensor-model-parallel-size"),
    "--batch-size": (REFUSED, "Megatron-LM's old name: use --micro-batch-size"),
    "--warmup": (REFUSED, "Megatron-LM's old name: use --lr-warmup-fraction"),
    "--checkpoint-activations": (REFUSED, "Megatron-LM's old name: use --recompute-granularity full (or "
                                          "--recompute-activations for selective recompute)"),
    # Kernel choices, memory placement and communication tuning: the same values either way.
    "--cross-entropy-fusion-impl": (NO_EFFECT, _KERNEL),
    "--flash-attention-version": (NO_EFFECT, _KERNEL),
    "--fused-residual-rmsnorm": (NO_EFFECT, _KERNEL),
    "--disable-jit-fuser": (NO_EFFECT, _KERNEL),
    "--no-gradient-reduce-div-fusion": (NO_EFFECT, _KERNEL),
    "--use-grouped-gemm-for-dense-mlp": (NO_EFFECT, _KERNEL),
    "--use-transformer-engine-op-fuser": (NO_EFFECT, _KERNEL),
    "--disable-symmetric-registration": (NO_EFFECT, _NCCL),
    "--symmetric-ar-type": (NO_EFFECT, _NCCL),
    "--use-nccl-ub": (NO_EFFECT, _NCCL),
    "--use-sharp": (NO_EFFECT, _NCCL),
    "--sharp-enabled-group": (NO_EFFECT, _NCCL),
    "--nccl-communicator-config-path": (NO_EFFECT, _NCCL),
    "--high-priority-stream-groups": (NO_EFFECT, _NCCL),
    "--create-all-gather-group": (NO_EFFECT, _NCCL),
    "--disable-gloo-process-groups": (NO_EFFECT, "only decides which helper process groups megatron-core creates"),
    "--distribute-saved-activations": (NO_EFFECT, "memory placement of recomputed layers' inputs; the values are "
                                                  "the same"),
    "--disable-clone-scatter-output-in-embedding": (NO_EFFECT, "a memory detail of the sequence-parallel embedding; "
                                                               "the values are the same"),
    "--no-clone-scatter-output-in-embedding": (NO_EFFECT, "a memory detail of the sequence-parallel embedding; the "
                                                          "values are the same"),
    "--init-model-with-meta-device": (NO_EFFECT, _INIT),
    "--use-cpu-initialization": (NO_EFFECT, _INIT),
    "--local-rank": (NO_EFFECT, "the local rank comes from torchrun's LOCAL_RANK"),
    "--train-sync-interval": (NO_EFFECT, "every iteration synchronises with the device for its log line anyway"),
    "--distributed-timeout-seconds-after-init": (NO_EFFECT, "--distributed-timeout-minutes applies to the whole run"),
    "--onnx-safe": (NO_EFFECT, "no ONNX export here"),
    "--disable-msc": (NO_EFFECT, _MSC),
    "--exit-signal-handler-for-dataloader": (NO_EFFECT, "the data-loader workers ignore the exit signal; "
                                                        "--exit-signal-handler handles it in training"),
    # Checkpoint I/O details: the checkpoint written is the same.
    "--ckpt-assume-constant-structure": (NO_EFFECT, _CKPT_IO),
    "--ckpt-fully-parallel-load": (NO_EFFECT, _CKPT_IO),
    "--ckpt-fully-parallel-load-exchange-algo": (NO_EFFECT, _CKPT_IO),
    "--ckpt-fully-parallel-load-process-group": (NO_EFFECT, _CKPT_IO),
    "--ckpt-fully-parallel-load-per-rank-objects": (NO_EFFECT, _CKPT_IO),
    "--ckpt-fully-parallel-save-process-group": (NO_EFFECT, _CKPT_IO),
    "--no-ckpt-fully-parallel-save": (NO_EFFECT, _CKPT_IO),
    "--disable-ckpt-fully-parallel-save": (NO_EFFECT, _CKPT_IO),
    "--dist-ckpt-workers": (NO_EFFECT, _CKPT_IO),
    "--disable-ckpt-load-validate-sharding-integrity": (NO_EFFECT, "loading names any tensor it needs and misses "
                                                                   "either way"),
    "--no-ckpt-load-validate-sharding-integrity": (NO_EFFECT, "loading names any tensor it needs and misses "
                                                              "either way"),
    "--no-save-tokenizer-assets": (NO_EFFECT, "tokenizer files are not copied into checkpoints here"),
    "--disable-save-tokenizer-assets": (NO_EFFECT, "tokenizer files are not copied into checkpoints here"),
    "--dataloader-defer-npy-index-mmap": (NO_EFFECT, "how megatron-core's dataset index files are opened; the "
                                                     "samples are the same"),
    "--dataloader-fast-cache-load": (NO_EFFECT, "how megatron-core's dataset index files are opened; the samples "
                                                "are the same"),
    # Refused: they change the math, the data, the model or what is saved.
    "--ckpt-convert-format": (REFUSED, _CONVERT),
    "--ckpt-convert-save": (REFUSED, _CONVERT),
    "--ckpt-convert-update-legacy-dist-opt-format": (REFUSED, _CONVERT),
    "--dist-ckpt-save-pre-mcore-014": (REFUSED, "checkpoints are written in megatron-core's current torch_dist layout"),
    "--disable-strict-fsdp-dtensor-load": (REFUSED, "--ckpt-format fsdp_dtensor is not supported"),
    "--no-strict-fsdp-dtensor-load": (REFUSED, "--ckpt-format fsdp_dtensor is not supported"),
    "--disable-stream-ckpt-dequant": (REFUSED, _FP8),
    "--no-stream-ckpt-dequant": (REFUSED, _FP8),
    "--ckpt-step": (REFUSED, "--load resumes from the latest checkpoint (latest_checkpointed_iteration.txt)"),
    "--override-ckpt-iteration": (REFUSED, "--load resumes at the checkpoint's own iteration"),
    "--pretrained-checkpoint": (REFUSED, "use --load with --finetune"),
    "--use-mp-args-from-checkpoint-args": (REFUSED, "use --use-checkpoint-args"),
    "--replication": (REFUSED, _NON_PERSISTENT),
    "--replication-factor": (REFUSED, _NON_PERSISTENT),
    "--replication-jump": (REFUSED, _NON_PERSISTENT),
    "--object-storage-cache-path": (REFUSED, _MSC),
    "--batch-invariant-mode": (REFUSED, "batch-invariant kernels are not available here"),
    "--batch-invariant-backend": (REFUSED, "batch-invariant kernels are not available here"),
    "--disable-bf16-reduced-precision-matmul": (REFUSED, "bf16 matmuls use torch's default reduction precision"),
    "--fp16-lm-cross-entropy": (REFUSED, "the loss is computed in fp32"),
    "--te-rng-tracker": (REFUSED, "Transformer Engine's RNG tracker is not used: megatron-core's draws the dropout "
                                  "masks"),
    "--data-parallel-random-init": (REFUSED, _INIT),
    "--no-initialization": (REFUSED, _INIT),
    "--lazy-mpu-init": (REFUSED, "process groups are initialised by pretrain_llama.py before the model is built"),
    "--fake-process-group": (REFUSED, "training needs real process groups"),
    "--freeze-all-layers": (REFUSED, "every parameter is trained"),
    "--head-lr-mult": (REFUSED, "--decoupled-lr sets the learning rate of the embeddings and the output layer"),
    "--no-weight-decay-cond-type": (REFUSED, "weight decay applies to every weight but biases and norms, as "
                                             "Megatron-LM's default"),
    "--disable-pad-vocab-size": (REFUSED, _VOCAB),
    "--no-pad-vocab-size": (REFUSED, _VOCAB),
    "--padded-vocab-size": (REFUSED, _VOCAB),
    "--decrease-batch-size-if-needed": (REFUSED, "the global batch is --global-batch-size (or "
                                                 "--step-batch-size-schedule)"),
    "--eval-global-batch-size": (REFUSED, _EVAL),
    "--eval-micro-batch-size": (REFUSED, _EVAL),
    "--full-validation": (REFUSED, _EVAL),
    "--start-eval-at-iter": (REFUSED, _EVAL),
    "--skip-train": (REFUSED, "pretrain_llama.py trains; --eval-iters sets the validation batches"),
    "--no-data-sharding": (REFUSED, "every data-parallel rank reads its own share of each global batch"),
    "--dataloader-inter-document-masking": (REFUSED, "--reset-attention-mask masks attention across documents"),
    "--recompute-modules": (REFUSED, "selective recompute here is megatron-core's default (core attention); "
                                     "--recompute-granularity full recomputes whole layers"),
    "--mlp-chunks-for-training": (REFUSED, "MLP chunking is not supported"),
    "--tiktoken-special-tokens": (REFUSED, "Megatron-LM 0.16's name: use --tokenizer-special-tokens"),
    "--tokenizer-hf-include-special-tokens": (REFUSED, _HF_TOKENIZER),
    "--tokenizer-hf-use-fast": (REFUSED, _HF_TOKENIZER),
    "--legacy-tokenizer": (REFUSED, _TOKENIZER),
    "--tokenizer-sentencepiece-legacy": (REFUSED, _TOKENIZER),
    "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces": (REFUSED, _TOKENIZER),
    "--no-tokenizer-sentencepiece-ignore-extra-whitespaces": (REFUSED, _TOKENIZER),
    "--tokenizer-metadata": (REFUSED, _TOKENIZER),
    "--trust-remote-code": (REFUSED, _TOKENIZER),
    "--null-tokenizer-eod-id": (REFUSED, _TOKENIZER),
    "--null-tokenizer-pad-id": (REFUSED, _TOKENIZER),
    "--disable-use-tokenizer-model-from-checkpoint-args": (REFUSED, _TOKENIZER),
    "--no-use-tokenizer-model-from-checkpoint-args": (REFUSED, _TOKENIZER),
    "--yaml-cfg": (REFUSED, "YAML configurations are not read: give the flags"),
    "--config-logger-dir": (REFUSED, _DUMPS),
}


# ---- families (prefixes; first match wins) --------------------------------------------------------------
FAMILIES: Sequence[Tuple[Tuple[str, ...], str, str]] = (
    (("--fp4-",), REFUSED, _FP4),
    (("--fp8-", "--no-fp8-", "--disable-fp8-", "--keep-fp8-", "--first-last-layers-bf16",
      "--num-layers-at-start-in-bf16",
      "--num-layers-at-end-in-bf16", "--reuse-grad-buf-for-mxfp8-param-ag", "--te-precision-config-file"),
     REFUSED, _FP8),
    (("--moe-", "--num-experts", "--expert-", "--enable-expert-tensor-parallelism", "--create-moe-param-group",
      "--disable-moe-", "--overlap-moe-expert-parallel-comm", "--overlap-dispatch-backward-with-experts-wgrad",
      "--ep-overlap-", "--use-tutel", "--topk", "--gtp-expert-", "--delay-wgrad-compute",
      "--use-grouped-gemm-for-shared-expert", "--high-priority-a2a-comm-stream"), REFUSED, _MOE),
    (("--tp-comm-", "--no-tp-comm-", "--disable-tp-comm-"), REFUSED, _TP_OVERLAP),
    (("--rl-", "--no-rl-", "--grpo-", "--langrl-", "--no-langrl-", "--perform-rl-step", "--refit-method"),
     REFUSED, _RL),
    (("--inference-", "--no-inference-", "--enable-chunked-prefill", "--disable-chunked-prefill", "--flash-decode",
      "--decode-only-cuda-graphs", "--mlp-chunks-for-prefill", "--nccl-all-reduce-for-prefill",
      "--num-speculative-tokens", "--use-legacy-static-engine", "--max-tokens-to-oom", "--ds-inference",
      "--mamba-inference-"), NO_EFFECT, _INFERENCE),
    (("--retro-", "--retriever-", "--block-data-path", "--evidence-data-path", "--ict-", "--biencoder-",
      "--titles-data-path", "--query-in-block-prob", "--use-one-sent-docs", "--embedding-path", "--indexer-",
      "--bert-embedder-type", "--output-bert-embeddings"), REFUSED, _RETRO),
    (("--bert-", "--encoder-num-layers", "--encoder-seq-length", "--decoder-num-layers", "--decoder-seq-length",
      "--mask-prob", "--short-seq-prob", "--vocab-extra-ids"), REFUSED, _ENCODER),
    (("--img-", "--patch-dim", "--num-channels", "--num-classes", "--vision-", "--dino-", "--swin-backbone-type",
      "--classes-fraction", "--data-per-class-fraction", "--mask-factor", "--mask-type", "--iter-per-epoch"),
     REFUSED, _VISION),
    (("--kd", "--load-teacher", "--hidden-size-teacher", "--num-attention-heads-teacher", "--num-layers-teacher",
      "--num-experts-teacher", "--logits-"), REFUSED, _DISTILL),
    (("--cuda-graph-", "--enable-cuda-graph", "--external-cuda-graph", "--optimizer-cuda-graph",
      "--delay-offload-until-cuda-graph"), NO_EFFECT, _CUDA_GRAPH),
    (("--one-logger-", "--no-one-logger", "--app-tag-", "--otel-", "--run-workload-inspector-server"),
     NO_EFFECT, _ONE_LOGGER),
    (("--ft-", "--enable-ft-package", "--calc-ft-timeouts", "--inprocess-", "--kill-switch-file",
      "--straggler-", "--disable-straggler-on-startup", "--gpu-sniff-test-interval", "--adlr-autoresume"),
     NO_EFFECT, _FT),
    (("--flight-recorder-", "--no-flight-recorder-", "--disable-flight-recorder-"), NO_EFFECT, _FLIGHT_RECORDER),
    (("--fault-injector-", "--error-injection-"), REFUSED, _FAULT_INJECTION),
    (("--profile", "--use-pytorch-profiler", "--pytorch-profiler-", "--record-memory-history",
      "--memory-snapshot-path", "--nvtx-ranges", "--record-shapes"), NO_EFFECT, _PROFILER),
    (("--save-activations-interval", "--save-dgrads-interval", "--save-wgrads-interval", "--save-params-interval",
      "--save-tokens-per-expert-interval", "--dump-param-to-param-group-map", "--result-rejected-tracker-filename"),
     REFUSED, _DUMPS),
    (("--non-persistent-", "--persistent-save-interval"), REFUSED, _NON_PERSISTENT),
    (("--muon-", "--lion-", "--sgd-momentum"), NO_EFFECT, _OPTIMIZER_ONLY),
    (("--mup-", "--use-mup"), REFUSED, _MUP),
    (("--mtp-",), REFUSED, _MTP),
    (("--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
      "--v-head-dim", "--mla-", "--cache-mla-latents"), REFUSED, _MLA),
    (("--mamba-", "--hybrid-", "--is-hybrid-model", "--linear-", "--gdp-", "--mhc-", "--enable-mhc-connections",
      "--disable-mamba-mem-eff-path"), REFUSED, _HYBRID),
    (("--heterogeneous-",), REFUSED, _HETERO),
    (("--dsa-", "--no-dsa-", "--disable-dsa-", "--experimental-attention-variant", "--enable-experimental",
      "--window-", "--softmax-type", "--attention-output-gate", "--qk-l2-norm", "--qk-clip", "--mrope-section",
      "--rotary-interleaved", "--relative-attention-", "--yarn-", "--no-yarn-", "--mscale", "--no-rope-freq",
      "--rotary-scaling-factor", "--glu-linear-offset", "--activation-func-clamp-value", "--quick-geglu",
      "--openai-gelu", "--use-fused-weighted-squared-relu", "--apply-residual-connection-post-layernorm",
      "--fp32-residual-connection", "--init-method-xavier-uniform", "--embedding-init-method-std",
      "--apply-wd-to-qk-layernorm", "--spec", "--rope-type", "--use-te-activation-func", "--mlp-type",
      "--use-kitchen-attention", "--kitchen-attention-backend"), REFUSED, _ARCH),
    (("--sft", "--chat-template"), REFUSED, _SFT),
    (("--fim-",), REFUSED, _FIM),
    (("--cpu-offloading", "--optimizer-cpu-offload", "--optimizer-offload-fraction", "--overlap-cpu-optimizer-d2h-h2d",
      "--use-torch-optimizer-for-cpu-offload", "--fine-grained-activation-offloading", "--fine-grained-offloading-",
      "--offload-modules", "--min-offloaded-tensor-size", "--activation-offload-fraction", "--delta-offload-bytes-",
      "--no-pin-cpu-", "--cpu-optimizer", "--cpu_torch_adam", "--checkpoint-in-cpu", "--remote-device",
      "--memory-centric-tiled-linear", "--tile-factor"), REFUSED, _OFFLOAD),
    (("--check-for-large-grads", "--check-for-spiky-loss", "--check-weight-hash-across-dp-replicas-interval",
      "--rerun-mode", "--error-injection", "--iterations-to-skip"), REFUSED, _GRADIENT_TRACKING),
    (("--enable-msc", "--msc-"), REFUSED, _MSC),
    (("--zero-", "--ds-", "--deepscale", "--ds_", "--force-ds-sequence-parallel", "--partition-activations",
      "--contigious-checkpointing", "--synchronize-each-layer", "--profile-backward", "--scattered-embeddings",
      "--split-transformers", "--random-ltd", "--data-efficiency-curriculum-learning"), REFUSED, _DEEPSPEED_ONLY),
)

# Implemented flags whose default here is not Megatron-LM's, and why.
DEFAULT_EXCEPTIONS: Dict[str, str] = {
    "--num-layers": "Megatron-LM has no default (a model must be given); a tiny model (4) runs a smoke test here",
    "--hidden-size": "Megatron-LM has no default; a tiny model (128) runs a smoke test here",
    "--num-attention-heads": "Megatron-LM has no default; a tiny model (4) runs a smoke test here",
    "--seq-length": "Megatron-LM has no default; 128 tokens run a smoke test here",
    "--micro-batch-size": "Megatron-LM has no default; 2 runs a smoke test here",
    "--distributed-backend": "None: nccl with CUDA, gloo without (Megatron-LM's nccl needs GPUs)",
    "--transformer-impl": "None: transformer_engine where it is installed with a GPU, else local (Megatron-LM's "
                          "transformer_engine needs both)",
    "--num-query-groups": "None, filled in as Megatron-LM's 1 with --group-query-attention (and the head count "
                          "without, which is what Megatron-LM's 1 means there)",
    "--no-persist-layer-norm": "stored as persist_layer_norm (True unless given) where Megatron-LM stores "
                               "no_persist_layer_norm (False unless given): the same switch",
    "--no-save-optim": "False where Megatron-LM's is None: both mean not given",
    "--no-save-rng": "False where Megatron-LM's is None: both mean not given",
    "--no-load-optim": "False where Megatron-LM's is None: both mean not given",
    "--no-load-rng": "False where Megatron-LM's is None: both mean not given",
}


def family_of(flag: str):
    for prefixes, cls, reason in FAMILIES:
        if flag.startswith(prefixes):
            return cls, reason
    return None


def classify(flag: str, deepspeed_only: bool = False) -> Tuple[str, str]:
    """(class, reason) of a Megatron-LM flag this project's parser does not define."""
    if flag in EXPLICIT:
        return EXPLICIT[flag]
    found = family_of(flag)
    if found is not None:
        return found
    if deepspeed_only:
        return REFUSED, _DEEPSPEED_ONLY
    return REFUSED, ("a Megatron-LM flag this project does not implement (docs/pretrain-llama-and-megatron-lm.md, "
                     "'Coming from Megatron-LM', lists what carries over)")

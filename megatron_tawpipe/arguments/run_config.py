"""The run's configuration as typed, frozen records: what the rest of the package reads instead of the
parsed flags. :meth:`RunConfig.from_args` is the boundary: it reads every flag once, with the parser's
default (``args.flag``), and computes the values that follow from them in one place (:func:`derive`).

Read after :func:`~megatron_tawpipe.training.validate_args.validate_args` (which settles the flags) and,
for ``ModelConfig.padded_vocab_size``, after the tokenizer is built (it sets ``args.padded_vocab_size``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Optional, Tuple

from megatron_tawpipe.arguments.weight_passing import is_weight_passing, plan_file_of

# Bytes per element of a dtype flag's value.
_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


def _read_flags(cls, args: argparse.Namespace, **given):
    """A record of ``cls`` whose every field is the flag of its name (``given``: fields not read off the flags)."""
    return cls(**{f.name: given[f.name] if f.name in given else getattr(args, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class ModelConfig:
    """The architecture: sizes, attention, MLP, norms, embeddings."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int          # the heads without --group-query-attention (fill_defaults)
    group_query_attention: bool
    kv_channels: Optional[int]
    seq_length: int
    max_position_embeddings: int
    vocab_size: Optional[int]
    padded_vocab_size: Optional[int]   # the output layer's rows, once the tokenizer is built
    untie_embeddings_and_output_weights: bool
    normalization: str
    swiglu: bool
    squared_relu: bool
    add_bias_linear: bool
    position_embedding_type: str
    qk_layernorm: bool

    @property
    def tie_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    @property
    def output_vocab_size(self) -> int:
        """The output layer's size: the padded vocabulary, or ``--vocab-size`` before the tokenizer sets it."""
        return self.padded_vocab_size or self.vocab_size

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ModelConfig":
        # padded_vocab_size: set by the tokenizer (data.tokenizers.build_tokenizer), None before
        return _read_flags(cls, args)


@dataclass(frozen=True)
class LayerOptions:
    """What the decoder layer's spec and its fused kernels follow from (``models.llama``). The defaults are
    Llama's, for a model built without flags (:meth:`of` None); the ``*_fusion`` fields are on unless a
    ``--no-*-fusion`` flag turns them off."""

    normalization: str = "RMSNorm"
    qk_layernorm: bool = False
    apply_layernorm_1p: bool = False
    swiglu: bool = True
    squared_relu: bool = False
    add_bias_linear: bool = False
    position_embedding_type: str = "rope"
    transformer_impl: Optional[str] = None
    apply_query_key_layer_scaling: bool = False
    sequence_parallel: bool = False
    bias_swiglu_fusion: bool = True
    bias_gelu_fusion: bool = True
    apply_rope_fusion: bool = True
    masked_softmax_fusion: bool = True
    gradient_accumulation_fusion: bool = True

    @classmethod
    def of(cls, args) -> "LayerOptions":
        """The options of the parsed flags ``args``; ``args`` itself if it is a record; Llama's for None."""
        if args is None:
            return cls()
        return args if isinstance(args, cls) else _read_flags(cls, args)


@dataclass(frozen=True)
class PrecisionConfig:
    """The compute dtype and the optimizer's (``--use-precision-aware-optimizer``) dtypes."""

    bf16: bool
    fp16: bool
    use_precision_aware_optimizer: bool
    main_grads_dtype: str
    main_params_dtype: str
    exp_avg_dtype: str
    exp_avg_sq_dtype: str

    @property
    def compute_bytes(self) -> int:
        """Bytes per weight and activation element in the compute dtype."""
        return 2 if self.bf16 or self.fp16 else 4

    @property
    def grad_bytes(self) -> int:
        """Bytes per element of the main gradients (and the weight pipeline's travelling gradients): fp32
        unless the precision-aware optimizer keeps them in ``--main-grads-dtype``."""
        return _DTYPE_BYTES[self.main_grads_dtype] if self.use_precision_aware_optimizer else 4

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "PrecisionConfig":
        return _read_flags(cls, args)


@dataclass(frozen=True)
class ParallelLayout:
    """How the ranks are laid out: tensor, pipeline and data parallelism, and the weight pipeline's groups."""

    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    sequence_parallel: bool
    context_parallel_size: int           # ranks sharing each sequence (megatron-core's context parallelism)
    tawpipe_num_groups: Optional[int]    # the weight pipeline's groups; None: one per node
    ranks_per_node: int                  # LOCAL_WORLD_SIZE (common.launcher)
    use_torch_fsdp2: bool                # data parallelism by FSDP2 ...
    use_megatron_fsdp: bool              # ... or by Megatron-FSDP, sharding as these two say
    data_parallel_sharding_strategy: str
    outer_dp_sharding_strategy: str
    decoder_layer_split: Optional[Tuple[int, ...]]   # validate_args': layers per stage or shard, None: even

    @classmethod
    def from_args(cls, args: argparse.Namespace, world_size: int, ranks_per_node: int) -> "ParallelLayout":
        tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
        return cls(world_size=world_size, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                   data_parallel_size=derive_data_parallel_size(args.pipeline_schedule, world_size, tp, pp, cp),
                   sequence_parallel=args.sequence_parallel, context_parallel_size=cp, tawpipe_num_groups=args.tawpipe_num_groups,
                   ranks_per_node=ranks_per_node, use_torch_fsdp2=args.use_torch_fsdp2,
                   use_megatron_fsdp=args.use_megatron_fsdp,
                   data_parallel_sharding_strategy=args.data_parallel_sharding_strategy,
                   outer_dp_sharding_strategy=args.outer_dp_sharding_strategy,
                   decoder_layer_split=_tuple(args.decoder_layer_split))


@dataclass(frozen=True)
class ScheduleConfig:
    """The pipeline schedule and the weight-passing runtime's knobs (tawpipe / weipipe)."""

    pipeline_schedule: str
    micro_batch_size: int
    tawpipe_no_overlap: bool
    tawpipe_no_recompute: bool
    tawpipe_microbatches_per_visit: int
    tawpipe_replicate_first_shard: bool
    tawpipe_cache: str
    tawpipe_ownership: str
    tawpipe_shards_per_rank: int
    tawpipe_replicated_reduce: str
    tawpipe_nccl_faithful: bool
    weipipe_zero_bubble: int

    @property
    def weight_passing(self) -> bool:
        return is_weight_passing(self.pipeline_schedule)

    @property
    def plan_file(self) -> Optional[str]:
        return plan_file_of(self.pipeline_schedule)

    @property
    def recompute(self) -> bool:
        """Whether the weight-passing runtime recomputes a shard's forward in its backward."""
        return not self.tawpipe_no_recompute

    @property
    def plan_name(self) -> str:
        """The planner's name for a weight-passing schedule (``plan.build_plan``)."""
        if self.pipeline_schedule == "weipipe":
            return f"weipipe-zb{self.weipipe_zero_bubble}" if self.weipipe_zero_bubble else "weipipe"
        return "tawpipe-nooverlap" if self.tawpipe_no_overlap else "tawpipe"

    def ownership(self, groups: int) -> str:
        """The layout a TawPipe run over ``groups`` groups uses: ``--tawpipe-ownership`` owner or spread, as the
        run settled it at start-up (``training.tawpipe_layout``: auto is decided before this record is made)."""
        if self.pipeline_schedule == "tawpipe" and "auto" in (self.tawpipe_ownership, self.tawpipe_shards_per_rank,
                                                              self.tawpipe_microbatches_per_visit,
                                                              self.tawpipe_replicated_reduce):
            raise ValueError("the TawPipe layout flags are still auto: the run settles them at start-up "
                             "(training.tawpipe_layout.settle_tawpipe_layout) before its records are made")
        return self.tawpipe_ownership

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ScheduleConfig":
        return _read_flags(cls, args)


@dataclass(frozen=True)
class DataConfig:
    """The data, the tokenizer and the samples each split is built with (``data``'s functions take it)."""

    tokenizer_type: Optional[str]
    tokenizer_model: Optional[str]
    vocab_file: Optional[str]
    merge_file: Optional[str]
    tiktoken_pattern: Optional[str]
    tiktoken_num_special_tokens: int
    tokenizer_special_tokens: Optional[Tuple[str, ...]]
    tokenizer_hf_no_include_special_tokens: bool
    tokenizer_hf_no_use_fast: bool
    vocab_size: Optional[int]
    make_vocab_size_divisible_by: int
    tensor_model_parallel_size: int      # the padded vocabulary is a multiple of this times the above
    mock_data: bool
    data_path: Optional[Tuple[str, ...]]
    data_args_path: Optional[str]
    train_data_path: Optional[Tuple[str, ...]]
    valid_data_path: Optional[Tuple[str, ...]]
    test_data_path: Optional[Tuple[str, ...]]
    per_split_data_args_path: Optional[str]
    split: Optional[str]                 # None: DEFAULT_SPLIT where --data-path is cut (split_or_default)
    data_cache_path: Optional[str]
    mmap_bin_files: bool
    num_dataset_builder_threads: int
    seq_length: int
    seed: int
    reset_position_ids: bool
    reset_attention_mask: bool
    eod_mask_loss: bool
    create_attention_mask_in_dataloader: bool
    dataloader_type: Optional[str]
    num_workers: int
    # What the splits' sample counts follow from (data.dataset_builder.dataset_sizes).
    batch_schedule: Optional[Tuple[Tuple[int, int], ...]]   # validate_args'; None: --global-batch-size throughout
    global_batch_size: Optional[int]
    train_iters: Optional[int]
    train_samples: Optional[int]
    eval_iters: int
    eval_interval: Optional[int]

    DEFAULT_SPLIT = "969,30,1"           # Megatron-LM's --split

    @property
    def split_or_default(self) -> str:
        return self.DEFAULT_SPLIT if self.split is None else self.split

    @property
    def schedule(self) -> Tuple[Tuple[int, int], ...]:
        """The global batch schedule: ``(consumed samples, batch)`` steps."""
        return self.batch_schedule or ((0, int(self.global_batch_size)),)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "DataConfig":
        schedule = args.batch_schedule
        return _read_flags(cls, args, tokenizer_special_tokens=_tuple(args.tokenizer_special_tokens),
                           data_path=_tuple(args.data_path), train_data_path=_tuple(args.train_data_path),
                           valid_data_path=_tuple(args.valid_data_path), test_data_path=_tuple(args.test_data_path),
                           batch_schedule=None if schedule is None else tuple(tuple(step) for step in schedule))

    @classmethod
    def of(cls, data) -> "DataConfig":
        """``data`` itself, or the record of a namespace of flags (a partial one completed with the parser's
        defaults: :func:`~megatron_tawpipe.arguments.defaults.complete_args`)."""
        if isinstance(data, cls):
            return data
        from megatron_tawpipe.arguments.defaults import complete_args

        return cls.from_args(complete_args(data))


def _tuple(value):
    """A list flag as a tuple (None stays None; a single string, as a tool may give it, is one item)."""
    if value is None or isinstance(value, tuple):
        return value
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving and loading."""

    save: Optional[str]
    load: Optional[str]
    save_interval: Optional[int]
    ckpt_format: str
    finetune: bool
    no_save_optim: bool
    no_save_rng: bool
    no_load_optim: bool
    no_load_rng: bool
    save_retain_interval: Optional[int]
    async_save: bool
    use_persistent_ckpt_worker: bool
    async_ckpt_cpu_priority: int
    async_ckpt_io_priority: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "CheckpointConfig":
        return _read_flags(cls, args)


@dataclass(frozen=True)
class LoggingConfig:
    """The log line, TensorBoard / W&B and the run's metric files."""

    log_interval: int
    log_throughput: bool
    log_progress: bool
    logging_level: Optional[int]
    tensorboard_dir: Optional[str]
    tensorboard_log_interval: int
    tensorboard_queue_size: int
    log_timers_to_tensorboard: bool
    log_memory_to_tensorboard: bool
    log_world_size_to_tensorboard: bool
    log_learning_rate_to_tensorboard: bool
    log_loss_scale_to_tensorboard: bool
    log_validation_ppl_to_tensorboard: bool
    wandb_project: Optional[str]
    wandb_entity: Optional[str]
    wandb_exp_name: Optional[str]
    wandb_save_dir: Optional[str]
    metrics_file: Optional[str]
    timeline_file: Optional[str]
    record_plan_memory: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "LoggingConfig":
        return _read_flags(cls, args)


@dataclass(frozen=True)
class OptimizerSettings:
    """Adam, gradient clipping, loss scaling and how gradients are reduced (megatron's DDP and distributed
    optimizer); the learning rates the schedule starts from."""

    lr: Optional[float]
    min_lr: float
    decoupled_lr: Optional[float]
    decoupled_min_lr: Optional[float]
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float
    loss_scale: Optional[float]
    initial_loss_scale: float
    min_loss_scale: float
    loss_scale_window: float
    hysteresis: int
    check_for_nan_in_loss_and_grad: bool
    use_distributed_optimizer: bool
    num_distributed_optimizer_instances: int
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    align_grad_reduce: bool
    align_param_gather: bool
    ddp_bucket_size: Optional[int]
    accumulate_allreduce_grads_in_fp32: bool
    grad_reduce_in_bf16: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "OptimizerSettings":
        return _read_flags(cls, args)


@dataclass(frozen=True)
class LrSchedule:
    """Megatron's learning-rate and weight-decay schedule, in samples (the steps are validate_args')."""

    lr_warmup_init: float
    lr_warmup_steps: int
    lr_decay_steps: int
    lr_decay_style: str
    lr_wsd_decay_style: str
    wsd_decay_steps: Optional[int]
    start_weight_decay: float
    end_weight_decay: float
    wd_incr_steps: int
    weight_decay_incr_style: str
    use_checkpoint_opt_param_scheduler: bool
    override_opt_param_scheduler: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "LrSchedule":
        return _read_flags(cls, args)


@dataclass(frozen=True)
class TrainingConfig:
    """The iterations: how many, recomputation, evaluation, and what ends a run early."""

    train_iters: int
    recompute_granularity: Optional[str]
    eval_iters: int
    eval_interval: Optional[int]
    exit_signal_handler: bool
    exit_signal: str
    exit_interval: Optional[int]
    exit_duration_in_mins: Optional[float]
    exit_on_missing_checkpoint: bool
    distributed_timeout_minutes: float
    lr_schedule: LrSchedule

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TrainingConfig":
        return _read_flags(cls, args, lr_schedule=LrSchedule.from_args(args))


def derive_data_parallel_size(schedule: str, world_size: int, tensor_parallel: int, pipeline_parallel: int,
                              context_parallel: int = 1) -> int:
    """Data-parallel ranks: every tensor x context-parallel group with weight passing (it has no pipeline
    stages), else world / (tensor x context x pipeline), as Megatron-LM (the context-parallel ranks of a
    sequence read the same samples)."""
    if is_weight_passing(schedule):
        return world_size // (tensor_parallel * context_parallel)
    return world_size // (pipeline_parallel * tensor_parallel * context_parallel)


@dataclass(frozen=True)
class RunConfig:
    """One run's configuration, read from the flags once (:meth:`from_args`)."""

    model: ModelConfig
    precision: PrecisionConfig
    layout: ParallelLayout
    schedule: ScheduleConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    optimizer: OptimizerSettings
    training: TrainingConfig

    @classmethod
    def from_args(cls, args: argparse.Namespace, world_size: Optional[int] = None,
                  ranks_per_node: Optional[int] = None) -> "RunConfig":
        """``world_size`` / ``ranks_per_node``: the launcher's (:mod:`megatron_tawpipe.common.launcher`) unless given."""
        from megatron_tawpipe.common import launcher

        world = launcher.world_size() if world_size is None else world_size
        per_node = launcher.local_world_size(world) if ranks_per_node is None else ranks_per_node
        return cls(model=ModelConfig.from_args(args), precision=PrecisionConfig.from_args(args),
                   layout=ParallelLayout.from_args(args, world, per_node), schedule=ScheduleConfig.from_args(args),
                   data=DataConfig.from_args(args), checkpoint=CheckpointConfig.from_args(args),
                   logging=LoggingConfig.from_args(args), optimizer=OptimizerSettings.from_args(args),
                   training=TrainingConfig.from_args(args))

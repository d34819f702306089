"""Flags answered by their value: the values of refused Megatron-LM flags that ask for what this project
does, and the flags none of whose values does.

A refused flag that takes a value is refused for what its value asks. Where a value asks for exactly what
``pretrain_llama.py`` does -- a feature switched off, a count of zero, a mode it implements -- that value is
accepted with one notice (the ``no-effect`` class) and :data:`VALUE_RULES` lists it; every other value is
refused as the flag is, with the refusal naming the accepted values. Every refused flag of the table that
takes a value is decided here: it has a rule, or :data:`WITHOUT_OFF_VALUE` says why no value of it asks
for what this project does (``tools/megatron_lm_flags.py table --check`` fails while one is undecided).
Megatron-LM's own default of such a flag is accepted by the rule of
:mod:`megatron_tawpipe.compat.flag_defaults`; a rule here answers first where it accepts the same value.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, List, Sequence, Tuple


@dataclasses.dataclass(frozen=True)
class ValueRule:
    values: Tuple[str, ...]     # accepted values as written on a command line (numbers compare as numbers)
    reason: str                 # the notice: why this value is what pretrain_llama.py does
    on: str                     # a value that asks for what is not done here (refused; the tests use it)


_NO_OFFLOAD = "nothing is offloaded to the CPU: weights, activations and optimizer state stay on the device"
_DENSE = "the model is dense (no experts), which is what this value describes"

VALUE_RULES = {
    "--rerun-mode": ValueRule(("disabled",), "each iteration runs once (megatron-core's rerun state machine, where "
                              "a schedule uses it, stays in its disabled mode); a NaN loss or gradient stops the "
                              "run (--check-for-nan-in-loss-and-grad), as in Megatron-LM's disabled mode",
                              "validate_results"),
    "--error-injection-rate": ValueRule(("0",), "no errors are injected", "1000"),
    "--num-experts": ValueRule(("0",), "0 experts is a dense model, as Megatron-LM reads it (no mixture of "
                               "experts)", "8"),
    "--expert-model-parallel-size": ValueRule(("1",), _DENSE + ": expert parallelism 1 splits nothing", "2"),
    "--expert-tensor-parallel-size": ValueRule(("1",), _DENSE + ": expert tensor parallelism 1 splits nothing",
                                               "2"),
    "--moe-expert-parallel-size": ValueRule(("1",), _DENSE + ": expert parallelism 1 splits nothing", "2"),
    "--ds-sequence-parallel-size": ValueRule(("1",), "DeepSpeed's sequence parallelism of 1 splits nothing "
                                             "(DeepSpeed is not used)", "2"),
    "--mlp-type": ValueRule(("standard",), "every layer has the standard dense MLP", "residual"),
    "--cpu-offloading-num-layers": ValueRule(("0",), _NO_OFFLOAD, "2"),
    "--activation-offload-fraction": ValueRule(("0.0",), _NO_OFFLOAD, "0.5"),
    "--optimizer-offload-fraction": ValueRule(("0.0",), _NO_OFFLOAD, "0.5"),
    "--delta-offload-bytes-across-pp-ranks": ValueRule(("0",), _NO_OFFLOAD, "1048576"),
    "--remote-device": ValueRule(("none",), _NO_OFFLOAD, "cpu"),
    "--config-logger-dir": ValueRule(("",), "an empty directory writes no configuration dumps, as here", "configs"),
    "--glu-linear-offset": ValueRule(("0.0",), "the gated linear unit adds no offset (act(x0) * x1, as --swiglu "
                                     "computes here)", "1.0"),
    "--head-lr-mult": ValueRule(("1.0",), "the output layer trains at the learning rate of the other weights "
                                "(--decoupled-lr sets its own)", "2.0"),
    "--mlp-chunks-for-training": ValueRule(("1",), "the MLP runs on the whole sequence at once", "4"),
    "--sample-rate": ValueRule(("1.0",), "every sample of the blend is used", "0.5"),
    "--mid-level-dataset-surplus": ValueRule(("0.005",), "megatron-core's default surplus, with which blended "
                                             "datasets are built here", "0.01"),
    "--softmax-type": ValueRule(("vanilla",), "attention uses the standard softmax", "off-by-one"),
    "--rope-type": ValueRule(("rope",), "standard rotary embeddings, as --position-embedding-type rope uses here",
                             "yarn"),
    "--recompute-modules": ValueRule(("core_attn",), "selective recompute here recomputes core attention "
                                     "(megatron-core's default); --recompute-granularity full recomputes whole "
                                     "layers", "mlp"),
    "--num-virtual-stages-per-pipeline-rank": ValueRule(("1",), "one stage per pipeline rank is no virtual "
                                                        "pipeline, as Megatron-LM reads 1", "2"),
    "--start-eval-at-iter": ValueRule(("0",), "validation runs from the start, every --eval-interval iterations",
                                      "1000"),
    "--vocab-extra-ids": ValueRule(("0",), "no extra vocabulary ids are added (T5's span-masking ids)", "100"),
    "--fim-rate": ValueRule(("0.0",), "no sample is turned into fill-in-the-middle form", "0.9"),
    "--dsa-indexer-loss-coeff": ValueRule(("0.0",), "no DSA indexer loss is added (DeepSeek sparse attention is "
                                          "not used)", "0.01"),
    "--dsa-kernel-backend": ValueRule(("none",), "no fused DSA kernel runs (DeepSeek sparse attention is not "
                                      "used)", "tilelang"),
    "--null-tokenizer-pad-id": ValueRule(("-1",), "NullTokenizer has no pad token here: no token is masked from "
                                         "the loss as padding", "0"),
}


# ---- refused value-taking flags none of whose values asks for what this project does -------------------
_PARAMETER = ("sets a parameter of a feature this project does not have (another flag switches it on): no "
              "value of it switches the feature off")
_NAMES = "names a file, directory, module, token or template that this project does not read or write"
_SETTING = ("every value asks for something this project does not do or does another way (the refusal says "
            "what to use)")

WITHOUT_OFF_VALUE: Sequence[Tuple[Tuple[str, ...], str]] = (
    (("--fp8-", "--fp4-", "--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16", "--moe-", "--expert-",
      "--num-experts-", "--topk", "--tp-comm-", "--rl-", "--grpo-", "--langrl-", "--refit-method", "--retro-",
      "--retriever-", "--ict-", "--biencoder-", "--indexer-", "--query-in-block-prob", "--bert-", "--encoder-",
      "--decoder-", "--mask-", "--short-seq-prob", "--img-", "--patch-dim", "--num-channels", "--num-classes",
      "--vision-", "--dino-", "--swin-", "--classes-fraction", "--data-per-class-fraction", "--iter-per-epoch",
      "--kd-", "--hidden-size-teacher", "--num-attention-heads-teacher", "--num-layers-teacher", "--logits-",
      "--mup-", "--mtp-", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
      "--v-head-dim", "--mscale", "--rotary-scaling-factor", "--yarn-", "--qk-clip-", "--mamba-", "--hybrid-",
      "--linear-", "--gdp-", "--mhc-", "--dsa-", "--experimental-attention-variant", "--window-",
      "--relative-attention-", "--activation-func-clamp-value", "--kitchen-attention-backend", "--fim-",
      "--non-persistent-", "--persistent-save-interval", "--replication-", "--fault-injector-",
      "--error-injection-type", "--min-offloaded-tensor-size", "--fine-grained-offloading-",
      "--offload-modules", "--tile-factor", "--checkpoint-num-layers", "--expert-interval", "--zero-",
      "--ds-sequence-parallel-fpdt-chunk-size", "--megatron-fsdp-", "--gtp-remat-", "--batch-invariant-backend",
      "--te-precision-config-file"), _PARAMETER),
    (("--bert-load", "--block-data-path", "--embedding-path", "--evidence-data-path", "--titles-data-path",
      "--ckpt-convert-save", "--ckpt-pg-tensors-cache-path", "--dump-param-to-param-group-map", "--yaml-cfg",
      "--per-dataset-sequences-path", "--object-storage-cache-path", "--result-rejected-tracker-filename",
      "--pretrained-checkpoint", "--load-teacher", "--load-tag", "--tokenizer-metadata", "--chat-template",
      "--sft-tokenizer-prompt-format", "--tiktoken-special-tokens", "--spec", "--heterogeneous-",
      "--deepscale_config", "--aml-data-download-path", "--train-desc-path", "--train-doc-idx-path",
      "--train-idx-path", "--train-sample-idx-path", "--train-shuffle-idx-path", "--validation-set-names"), _NAMES),
    (("--batch-size", "--model-parallel-size", "--warmup", "--ckpt-convert-format", "--ckpt-step",
      "--override-ckpt-iteration", "--check-weight-hash-across-dp-replicas-interval", "--iterations-to-skip",
      "--save-activations-interval", "--save-dgrads-interval", "--save-params-interval",
      "--save-tokens-per-expert-interval", "--save-wgrads-interval", "--ddp-num-buckets",
      "--ddp-param-name-patterns-for-fp32-local-accumulation", "--eval-global-batch-size", "--eval-micro-batch-size",
      "--embedding-init-method-std", "--no-rope-freq", "--no-weight-decay-cond-type", "--mrope-section",
      "--padded-vocab-size", "--tensor-parallel-num-weight-shards", "--pipeline-model-parallel-comm-backend",
      "--pipeline-model-parallel-split-rank", "--phase-transition-iterations", "--null-tokenizer-eod-id",
      "--output-logit-dtype", "--DDP-impl", "--local_rank", "--lr-decay-tokens", "--lr-warmup-tokens",
      "--train-tokens", "--train-data-exact-num-epochs", "--use-dataset-only", "--retriever-seq-length",
      "--rotary-position-embeddings-theta", "--cp-comm-type", "--hierarchical-context-parallel-sizes",
      "--max-seqlen-per-dp-cp-rank"), _SETTING),
)


# ---- matching ------------------------------------------------------------------------------------------

def _same(given: str, accepted: str) -> bool:
    """A value as given against an accepted one: integers and decimals compare as numbers, words exactly."""
    if given == accepted:
        return True
    try:
        if "." not in accepted and "e" not in accepted.lower():
            return int(given) == int(accepted)
        return float(given) == float(accepted)
    except ValueError:
        return False


def matches(values, accepted: Sequence[str]) -> bool:
    """Whether the values a flag was given (one string, or a list for ``nargs='+'``) are all accepted ones."""
    if not accepted or values is None:
        return False
    given = list(values) if isinstance(values, (list, tuple)) else [values]
    return bool(given) and all(any(_same(str(v), a) for a in accepted) for v in given)


def without_off_value(flag: str):
    """Why no value of ``flag`` asks for what this project does, or None where not decided."""
    for prefixes, why in WITHOUT_OFF_VALUE:
        if flag.startswith(prefixes):
            return why
    return None


def problems(rows: Iterable) -> List[str]:
    """What keeps the rules from covering the table (``rows``: flag_table rows): a refused flag taking a
    value that is neither given a rule nor said to have no such value, or a rule for a flag that is not a
    refused value-taking flag of the table, or whose example 'on' value it accepts."""
    rows = {row.flag: row for row in rows}
    found = []
    for flag, row in sorted(rows.items()):
        if row.cls == "refused" and row.nargs != "0" and flag not in VALUE_RULES and not without_off_value(flag):
            found.append(f"{flag}: undecided -- give it a rule in VALUE_RULES (values that ask for what "
                         "pretrain_llama.py does) or name it in WITHOUT_OFF_VALUE")
    for flag, rule in sorted(VALUE_RULES.items()):
        row = rows.get(flag)
        if row is None or row.cls != "refused" or row.nargs == "0":
            found.append(f"{flag}: VALUE_RULES names it, but it is not a refused flag of the table that takes "
                         "a value")
        elif matches(rule.on, rule.values) or not rule.values:
            found.append(f"{flag}: the rule's 'on' example {rule.on!r} is one of its accepted values")
    return found


def rule_count() -> int:
    """The (flag, value) rules: one per accepted value."""
    return sum(len(rule.values) for rule in VALUE_RULES.values())

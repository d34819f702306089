"""Hugging Face weights in and out (tools/hf_checkpoint.py), and what Megatron-LM's converter writes.

Tiny random Hugging Face models are made here with transformers (Llama 3.1 with rope base 500000 and its rope
scaling, grouped-query attention; Qwen 2 with QKV biases and tied embeddings; Qwen 3 with q/k norms and a head
size other than hidden / heads; Mistral). Each is imported; the first training loss of pretrain_llama.py's loop
(--load OUT --finetune, the flags of model_flags.txt) must equal the Hugging Face model's own loss on the same
tokens to 1e-6 (fp32), under tawpipe, weipipe and 1F1B. After a few steps the checkpoint is exported and the
exported model's logits (transformers) must equal the project's model's.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys

import pytest
import torch

from distributed_harness import run_ranks
from training_helpers import loaded_trainer, train_rank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "hf_checkpoint.py")
SEQ, BATCH = 64, 4
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def make_hf_model(kind: str, path: str) -> str:
    """A tiny random model of ``kind`` saved with transformers' own save_pretrained. The query and key weights
    are large, so that attention is sharp and the rope settings move the loss well above the tolerance."""
    import transformers

    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4, rms_norm_eps=1e-5,
                  max_position_embeddings=16384)
    if kind == "llama31":
        config = transformers.LlamaConfig(num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
                                          rope_parameters=dict(LLAMA3, rope_theta=500000.0), **common)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **common)
        model = transformers.Qwen2ForCausalLM(config)
    elif kind == "qwen3":
        config = transformers.Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=48,
                                          tie_word_embeddings=False, **common)
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=None,
                                            tie_word_embeddings=False, **common)
        model = transformers.MistralForCausalLM(config)
    generator = torch.Generator().manual_seed(11)
    state = {}
    for name, value in model.state_dict().items():
        noise = torch.randn(value.shape, generator=generator)
        if "norm" in name:
            state[name] = 1.0 + 0.1 * noise
        elif name.endswith("bias"):
            state[name] = 0.1 * noise
        else:
            state[name] = noise * (0.5 if ("q_proj" in name or "k_proj" in name) else 0.02)
    model.load_state_dict(state)
    model.save_pretrained(path)
    return path


def hf_import(hf_dir: str, out_dir: str, *extra: str) -> list:
    result = subprocess.run([sys.executable, TOOL, "import", hf_dir, out_dir, *extra], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    with open(os.path.join(out_dir, "model_flags.txt"), encoding="utf-8") as handle:
        return shlex.split(handle.read())


def run_argv(flags, *extra: str) -> list:
    return list(flags) + ["--seq-length", str(SEQ), "--mock-data", "--train-iters", "1", "--global-batch-size",
                          str(BATCH), "--micro-batch-size", "1", "--lr", "1e-4", "--min-lr", "1e-5",
                          "--eval-iters", "0", "--num-workers", "0", "--seed", "7", "--log-interval", "1000",
                          *extra]


def first_batch(argv):
    """The samples of the first global batch, as the training loop reads them: tokens, labels, loss mask."""
    from megatron_tawpipe import data
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    args = validate_args(parse_args(argv), world_size=1)
    train = data.build_datasets(args, data.build_tokenizer(args))[0]
    samples = [train[i] for i in range(args.global_batch_size)]
    return tuple(torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in ("tokens", "labels", "loss_mask"))


def hf_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.double()


def mean_loss(logits, labels, mask) -> float:
    losses = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                               reduction="none")
    mask = mask.reshape(-1).double()
    return float((losses * mask).sum() / mask.sum())


def hf_loss(hf_dir: str, argv) -> float:
    tokens, labels, mask = first_batch(argv)
    return mean_loss(hf_logits(hf_dir, tokens), labels, mask)


def first_loss(argv, ranks: int) -> float:
    records = run_ranks(train_rank, ranks, argv)
    return records[0][0]["lm_loss"]


def assert_rel(value: float, reference: float, rtol: float = 1e-6) -> None:
    print(f"first loss {value:.9f}, Hugging Face's {reference:.9f}: relative difference "
          f"{abs(value - reference) / abs(reference):.1e}")     # (python -m pytest -s shows the figures)
    assert abs(value - reference) <= rtol * abs(reference), (value, reference, (value - reference) / reference)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each family's Hugging Face directory and its import: ``{kind: (hf_dir, out_dir, flags)}``."""
    root = tmp_path_factory.mktemp("hf")
    made = {}
    for kind in ("llama31", "qwen2", "qwen3", "mistral"):
        hf_dir = make_hf_model(kind, str(root / kind))
        out = str(root / f"{kind}_mcore")
        made[kind] = (hf_dir, out, hf_import(hf_dir, out))
    return made


@pytest.mark.parametrize("schedule,ranks,extra", [
    ("tawpipe", 2, []), ("weipipe", 2, []), ("1f1b", 2, ["--pipeline-model-parallel-size", "2"])])
def test_llama31_import_first_loss_equals_hugging_face(models, schedule, ranks, extra, capfd):
    hf_dir, out, flags = models["llama31"]
    assert flags[flags.index("--rotary-base") + 1] == "500000" and "--use-rope-scaling" in flags
    assert "--group-query-attention" in flags
    argv = run_argv(flags, "--load", out, "--finetune", "--pipeline-schedule", schedule, *extra)
    loss = first_loss(argv, ranks)
    out_text = capfd.readouterr().out
    assert_rel(loss, hf_loss(hf_dir, run_argv(flags)))   # (the same batches)
    assert f"loaded checkpoint from {out} at iteration 0: {out}/release (--ckpt-format torch, release); " \
           "restored: weights; not restored: optimizer state, LR schedule, iteration and data position, RNG states " \
           "(--finetune)" in out_text
    assert f" checkpoints  loaded {out}/release; none saved" in out_text


@pytest.mark.parametrize("kind,schedule,ranks,extra", [
    ("qwen2", "tawpipe", 2, []), ("qwen2", "1f1b", 2, ["--tensor-model-parallel-size", "2"]),
    ("qwen3", "weipipe", 2, []), ("mistral", "1f1b", 1, [])])
def test_other_families_import_first_loss_equals_hugging_face(models, kind, schedule, ranks, extra):
    hf_dir, out, flags = models[kind]
    argv = run_argv(flags, "--load", out, "--finetune", "--pipeline-schedule", schedule, *extra)
    assert_rel(first_loss(argv, ranks), hf_loss(hf_dir, run_argv(flags)))   # (the same batches)


def test_rope_base_and_scaling_are_the_models(models):
    """The imported flags carry Llama 3.1's rope base and scaling: dropping either moves the first loss far
    beyond the tolerance; a run's --rotary-base differing from the checkpoint is taken under --finetune (one
    line) and refused, naming the flag, on a resume."""
    hf_dir, out, flags = models["llama31"]
    reference = hf_loss(hf_dir, run_argv(flags))
    wrong_base = list(flags)
    wrong_base[wrong_base.index("--rotary-base") + 1] = "10000"
    no_scaling = [flag for flag in flags if flag != "--use-rope-scaling"]
    for changed in (wrong_base, no_scaling):
        loss = first_loss(run_argv(changed, "--load", out, "--finetune", "--pipeline-schedule", "1f1b"), 1)
        print(f"first loss {loss:.6f} with {'no rope scaling' if changed is no_scaling else 'rope base 10000'}, "
              f"Hugging Face's {reference:.6f}: relative difference {abs(loss - reference) / reference:.1e}")
        assert abs(loss - reference) > 1e-4 * reference, (changed, loss, reference)
    with pytest.raises(AssertionError, match=r"checkpoint has rotary_base=500000, this run --rotary-base gives "
                                             r"10000 \(it changes no tensor's shape: with --finetune or "
                                             r"--no-load-optim this run's value is used\)"):
        run_ranks(train_rank, 1, run_argv(wrong_base, "--load", out, "--pipeline-schedule", "1f1b"))


def _project_logits(rank, argv, tokens):
    """The model pretrain_llama.py builds (native, one rank) with the checkpoint under --load: its logits."""
    from megatron_tawpipe.models.parameters import unwrap_model

    with loaded_trainer(argv) as (trainer, _position):
        model = unwrap_model(trainer.model[0])
        model.eval()
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        with torch.no_grad():   # (a numpy array: a tensor would cross to the parent through shared memory)
            return model(tokens, positions, None).double().numpy()


@pytest.mark.parametrize("kind", ["llama31", "qwen2"])
def test_export_after_training_gives_the_projects_logits(models, kind, tmp_path):
    """Three steps under tawpipe from the import, saved (torch_dist), exported: transformers loads the export
    and its logits equal the project's model's on the saved weights."""
    hf_dir, out, flags = models[kind]
    save, exported = str(tmp_path / "trained"), str(tmp_path / "exported")
    argv = run_argv(flags, "--load", out, "--finetune", "--pipeline-schedule", "tawpipe", "--save", save,
                    "--lr", "1e-2")
    argv[argv.index("--train-iters") + 1] = "3"
    records = run_ranks(train_rank, 2, argv)[0]
    assert records[0]["lm_loss"] != records[-1]["lm_loss"]     # the weights moved
    result = subprocess.run([sys.executable, TOOL, "export", save, exported], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    config = json.load(open(os.path.join(exported, "config.json"), encoding="utf-8"))
    original = json.load(open(os.path.join(hf_dir, "config.json"), encoding="utf-8"))
    assert config["rope_parameters"] == original["rope_parameters"]
    assert config["tie_word_embeddings"] == original["tie_word_embeddings"]
    tokens = first_batch(run_argv(flags))[0]
    ours = run_ranks(_project_logits, 1, run_argv(flags, "--load", save, "--pipeline-schedule", "1f1b",
                                                  "--no-load-optim", "--no-load-rng"), tokens)[0]
    ours = torch.from_numpy(ours)
    theirs = hf_logits(exported, tokens)
    # fp32 on both sides, in different orders: the models' sharp attention (large query/key weights) lifts the
    # rounding differences to about 1e-5 of the largest logit (as between the Hugging Face model and its import)
    scale = float(ours.abs().max())
    print(f"{kind}: exported logits vs the project's: largest difference {float((ours - theirs).abs().max()):.1e}, "
          f"largest logit {scale:.3f}")
    assert float((ours - theirs).abs().max()) <= 1e-4 * scale, float((ours - theirs).abs().max()) / scale
    before = hf_logits(hf_dir, tokens)
    assert float((before - theirs).abs().max()) > 1e-2 * scale     # the export holds the trained weights
    # and exactly: imported again, the export gives back every trained tensor bit for bit
    from megatron_tawpipe.checkpoint import read_parameters
    from megatron_tawpipe.checkpoint.hf_weights import local_spelling

    trained = {local_spelling(name): value for name, value in read_parameters(os.path.join(save, "iter_0000003")).items()}
    again, _ = _imported(hf_import(exported, str(tmp_path / "again")) and str(tmp_path / "again"))
    assert sorted(again) == sorted(trained)
    assert all(torch.equal(again[name].float(), trained[name]) for name in trained)


# ---- what Megatron-LM's converter writes with its default saver: the older model's names ---------------------

_OLDER = {"embedding.word_embeddings.weight": ("language_model", "embedding", "word_embeddings", "weight"),
          "decoder.final_layernorm.weight": ("language_model", "encoder", "final_norm.weight"),
          "output_layer.weight": ("language_model", "output_layer", "weight")}
_OLDER_LAYER = {"input_layernorm.weight": "input_norm.weight",
                "self_attention.linear_qkv.weight": "self_attention.query_key_value.weight",
                "self_attention.linear_qkv.bias": "self_attention.query_key_value.bias",
                "self_attention.linear_proj.weight": "self_attention.dense.weight",
                "pre_mlp_layernorm.weight": "post_attention_norm.weight",
                "mlp.linear_fc1.weight": "mlp.dense_h_to_4h.weight", "mlp.linear_fc2.weight": "mlp.dense_4h_to_h.weight"}


def _slice(name, whole, t, tp):
    if name.endswith("linear_fc1.weight"):
        gate, up = whole.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[t], up.chunk(tp, dim=0)[t]], dim=0).clone()
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")):
        return whole.chunk(tp, dim=0)[t].clone()
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return whole.chunk(tp, dim=1)[t].clone()
    return whole.clone()


def write_older_model_checkpoint(root, weights, saved_args, tp, pp, extra=None, version=3.0):
    """Megatron-LM's default converter output: per (tensor, pipeline) rank the older GPT model's nested
    ``state_dict_for_save_checkpoint()`` (``language_model`` -> ``embedding`` / ``encoder`` / ``output_layer``),
    layers numbered within each stage, a ``release`` tracker."""
    layers = saved_args.num_layers // pp
    for p in range(pp):
        for t in range(tp):
            model = {}
            for name, whole in weights.items():
                value = _slice(name, whole, t, tp)
                if name.startswith("decoder.layers."):
                    index, rest = name[len("decoder.layers."):].split(".", 1)
                    if int(index) // layers != p:
                        continue
                    encoder = model.setdefault("language_model", {}).setdefault("encoder", {})
                    encoder[f"layers.{int(index) - p * layers}.{_OLDER_LAYER[rest]}"] = value
                    continue
                if (p == 0) != name.startswith("embedding."):
                    continue
                node = model
                for key in _OLDER[name][:-1]:
                    node = node.setdefault(key, {})
                node[_OLDER[name][-1]] = value
            if "output_layer.weight" not in weights and pp > 1 and p == pp - 1:   # tied: the last stage's copy
                model["word_embeddings_for_head"] = {"weight": _slice(
                    "word_embeddings.weight", weights["embedding.word_embeddings.weight"], t, tp)}
            model.update(extra or {})
            args = argparse.Namespace(**vars(saved_args))
            args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
            args.use_legacy_models = True
            rank_dir = os.path.join(root, "release", f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""))
            os.makedirs(rank_dir)
            torch.save({"args": args, "checkpoint_version": version, "iteration": 0, "model": model},
                       os.path.join(rank_dir, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as handle:
        handle.write("release")


def _imported(out):
    from megatron_tawpipe.checkpoint.legacy_torch import LegacyCheckpoint, saved_args

    directory = os.path.join(out, "release")
    source = LegacyCheckpoint(directory, swiglu=True)
    return {name: source.tensor(name) for name in source.names()}, saved_args(directory)


@pytest.mark.parametrize("schedule,ranks,extra", [
    ("tawpipe", 2, []), ("weipipe", 2, []), ("1f1b", 2, ["--pipeline-model-parallel-size", "2"])])
def test_megatron_lm_older_model_names_load(models, tmp_path, schedule, ranks, extra):
    """Qwen 2 (QKV biases) written as Megatron-LM's default saver writes it, 2 x 2 tensor x pipeline ranks:
    every schedule's first loss equals the Hugging Face model's."""
    hf_dir, out, flags = models["qwen2"]
    weights, saved = _imported(out)
    older = str(tmp_path / "older")
    write_older_model_checkpoint(older, weights, saved, tp=2, pp=2)
    argv = run_argv(flags, "--load", older, "--finetune", "--pipeline-schedule", schedule, *extra)
    assert_rel(first_loss(argv, ranks), hf_loss(hf_dir, run_argv(flags)))   # (the same batches)


def test_older_model_names_without_an_exact_mapping_are_refused(models, tmp_path):
    """Transformer Engine's fused names (``--saver-transformer-impl transformer_engine``) and a checkpoint
    before version 3.0 are refused in one line naming the converter's --saver core."""
    from megatron_tawpipe.checkpoint.legacy_names import core_state
    from megatron_tawpipe.common.errors import CheckpointSetupError

    hf_dir, out, flags = models["qwen2"]
    weights, saved = _imported(out)
    state = {"language_model": {"encoder": {"layers.0.self_attention.layernorm_qkv.layer_norm_weight":
                                            torch.ones(4)}}}
    with pytest.raises(CheckpointSetupError, match="layernorm_qkv.layer_norm_weight of Megatron-LM's older model "
                                                   r"\(language_model\.\*\) has no exact megatron-core counterpart "
                                                   "here; convert it with Megatron-LM's tools/checkpoint/convert.py "
                                                   "--saver core"):
        core_state(state, "f.pt")
    older = str(tmp_path / "v2")
    write_older_model_checkpoint(older, weights, saved, tp=1, pp=1, version=2.0)
    with pytest.raises(AssertionError, match="checkpoint_version 2.0 .* --saver core"):
        run_ranks(train_rank, 1, run_argv(flags, "--load", older, "--finetune", "--pipeline-schedule", "1f1b"))


# ---- the mapping and the config, without training ---------------------------------------------------------

def test_qkv_fusion_round_trip_and_row_order():
    from megatron_tawpipe.checkpoint.hf_config import ModelShape
    from megatron_tawpipe.checkpoint.hf_weights import fuse_qkv, split_qkv

    shape = ModelShape("llama", 1, 8, 16, num_attention_heads=4, num_query_groups=2, kv_channels=2, vocab_size=8,
                       max_position_embeddings=8, norm_epsilon=1e-5, rotary_base=1e4, tied=False)
    q, k, v = torch.arange(16.0).reshape(8, 2), 100 + torch.arange(8.0).reshape(4, 2), 200 + torch.arange(8.0).reshape(4, 2)
    fused = fuse_qkv(q, k, v, shape)
    # group 0: query heads 0 and 1, key head 0, value head 0; then group 1
    assert fused[:, 0].tolist() == [0, 2, 4, 6, 100, 102, 200, 202, 8, 10, 12, 14, 104, 106, 204, 206]
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, shape), (q, k, v)))


def _write_config(tmp_path, **config):
    base = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "vocab_size": 256}
    base.update(config)
    (tmp_path / "config.json").write_text(json.dumps(base))
    return str(tmp_path)


def test_hf_configs_without_an_exact_counterpart_are_refused(tmp_path):
    from megatron_tawpipe.checkpoint.hf_config import read_hf_config, vocab_divisor
    from megatron_tawpipe.common.errors import CheckpointSetupError

    for config, message in (
            ({"attention_bias": True}, "attention_bias true"),
            ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling of type 'yarn'"),
            ({"rope_scaling": dict(LLAMA3, original_max_position_embeddings=4096)},
             r"original_max_position_embeddings 4096 \(megatron-core: 8192\)"),
            ({"model_type": "gemma"}, "model_type 'gemma'"), ({"hidden_act": "gelu"}, "hidden_act 'gelu'")):
        with pytest.raises(CheckpointSetupError, match=message):
            read_hf_config(_write_config(tmp_path, **config))
    shape = read_hf_config(_write_config(tmp_path, rope_theta=500000.0, rope_scaling=LLAMA3))   # transformers 4
    assert (shape.rotary_base, shape.rope_scaling_factor) == (500000.0, 8.0)
    shape = read_hf_config(_write_config(tmp_path, rope_scaling={"type": "linear", "factor": 2.0}))
    assert shape.interpolation_factor == 2
    # the tokenizer's size padded to exactly the model's vocabulary
    assert vocab_divisor(128256, 128256) == 128 and vocab_divisor(32000, 32000) == 128
    assert vocab_divisor(151936, 151646) == 1187 and -(-151646 // 1187) * 1187 == 151936

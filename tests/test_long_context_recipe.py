"""examples/long_context_from_hf.sh at CPU scale: a tiny Hugging Face Llama (rope base 10000, 64 positions)
imported, trained under TawPipe on 2 gloo ranks at 128 tokens with rope base 500000 and Llama 3.x rope scaling,
exported; transformers loads the export, which carries the new rope settings and the trained weights."""

import json
import os
import subprocess
import sys

import torch

from distributed_harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_long_context_recipe_imports_extends_and_exports(tmp_path):
    import transformers

    hf_dir = str(tmp_path / "base")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(hf_dir)
    out = tmp_path / "run"
    env = dict(os.environ, HF_MODEL=hf_dir, OUT_DIR=str(out), NNODES="1", NPROC="2", NUM_GROUPS="2",
               BACKEND="gloo", SEQ="128", ROTARY_BASE="500000", ROPE_SCALING_FACTOR="8", TRAIN_ITERS="2",
               GLOBAL_BATCH="4", SAVE_INTERVAL="2", LR="1e-3", MASTER_PORT=str(free_port()), PYTHONPATH=ROOT)
    proc = subprocess.run(["bash", os.path.join(ROOT, "examples", "long_context_from_hf.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    imported = out / "imported"
    assert f"-> {imported}/release, 1 x 1 tensor x pipeline ranks" in text
    # the run's rope settings, not the checkpoint's, said in one line
    assert ("the checkpoint's weights with this run's --rotary-base 500000 (checkpoint: rotary_base=10000), "
            "--use-rope-scaling True (checkpoint: use_rope_scaling=False)") in text
    assert f"loaded checkpoint from {imported} at iteration 0: {imported}/release (--ckpt-format torch, release)" in text
    assert "trained      iterations 1-2 of 2" in text and "--pipeline-schedule tawpipe, 2 ranks" in text
    exported = out / "hf_export"
    assert f"{out}/checkpoints/iter_0000002 (--ckpt-format torch_dist) -> {exported}: llama" in text
    saved = json.load(open(exported / "config.json", encoding="utf-8"))
    assert saved["rope_theta"] == 500000 and saved["max_position_embeddings"] == 128
    assert saved["rope_scaling"]["rope_type"] == "llama3" and saved["rope_scaling"]["factor"] == 8.0
    model = transformers.AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32)
    assert model.config.rope_parameters["rope_theta"] == 500000
    from megatron_tawpipe.checkpoint import read_parameters

    trained = read_parameters(str(out / "checkpoints" / "iter_0000002"))
    assert torch.equal(model.lm_head.weight, trained["output_layer.weight"])
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight, trained["decoder.layers.1.mlp.linear_fc2.weight"])
    original = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    assert not torch.equal(model.lm_head.weight, original.lm_head.weight)     # trained
    tokens = torch.arange(128).remainder(255).unsqueeze(0)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=tokens).logits).all()

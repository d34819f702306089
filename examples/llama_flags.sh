# Sourced by the example scripts: Llama's architecture in Megatron-LM's flags (RMSNorm, SwiGLU, no
# linear biases, rotary positions, no dropout; the causal mask applied by attention, not built per
# sample). The same list as LLAMA_FLAGS in megatron_tawpipe/arguments/flags.py (a test checks it).
LLAMA_FLAGS=(--normalization RMSNorm --swiglu --disable-bias-linear --position-embedding-type rope
             --hidden-dropout 0.0 --attention-dropout 0.0 --attention-softmax-in-fp32
             --no-create-attention-mask-in-dataloader)

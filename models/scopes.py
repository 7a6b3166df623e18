"""The named scopes of the model's work outside its linear layers' GEMMs, as profiles and the cost model
group it.

``with scopes.part("mamba2_conv_silu"):`` puts ``models/mamba2_conv_silu`` into the op_name of every HLO
instruction traced inside: the forward pass, a remat's recomputation and the backward pass alike (the name
stack survives jvp, transpose and checkpoint). bench/predict/hlo_parts.py's ``part`` reads it back
(``models/<part>``, the innermost one), so the compiled step's time splits by these parts instead of one
"other" line. The scopes are metadata: the computation and its bits do not change.
"""
from __future__ import annotations

import jax

PARTS = {
    "embed": "the token embedding's gather (and its scatter-add gradient)",
    "residual": "a block's residual add",
    "rmsnorm": "a pre-norm or the final norm (RMSNorm)",
    "linear": "a linear layer (its GEMMs, and fp4jax.dot's quantize passes inside)",
    "param_cast": "the float32 master weights of bf16 layers cast to bf16 (and their gradients back)",
    "mamba2_split": "the in_proj output split into z, x B C, dt, the conv's output into x, B, C (and back)",
    "mamba2_conv_silu": "the Mamba-2 causal depthwise conv over x, B, C and its SiLU",
    "mamba2_dt": "dt = softplus(dt + dt_bias) and A = -exp(A_log)",
    "mamba2_ssd": "the SSD scan with the D skip (ssd_chunked or the Pallas kernels)",
    "mamba2_gate_norm": "the gated group-wise RMSNorm: rmsnorm(y * silu(z)) * scale",
    "attention_rope": "rotary embeddings of q and k",
    "attention_core": "softmax(q kᵀ) v: cuDNN's fused attention or the chunked one",
    "mlp_act": "the MLP's activation: relu(u)² or silu(gate) * up",
    "moe_router": "the MoE router's scores and top-k choice",
    "moe_dispatch": "the MoE's sort of (token, choice) pairs into expert rows, and the weighted sum back",
    "moe_experts": "the routed experts' grouped GEMMs and relu² (with expert parallelism: and its all-to-all)",
    "lm_head": "the LM head's logits (without targets)",
    "cross_entropy": "the LM head's GEMMs and the vocabulary-chunked cross entropy",
}


def part(name: str):
  """``jax.named_scope("models/<name>")`` for one of ``PARTS``."""
  if name not in PARTS:
    raise ValueError(f"unknown model part {name!r}; add it to models.scopes.PARTS (one of {sorted(PARTS)})")
  return jax.named_scope(f"models/{name}")

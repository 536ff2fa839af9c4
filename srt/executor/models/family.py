"""How a family differs from the Llama layout, in the model and in its checkpoints.

Each family file (llama.py, gemma.py, phi3.py, mixtral.py, qwen3_moe.py) declares one of
these; the shared decoder (decoder.py) and the checkpoint mapping (checkpoint.py) read it.
Numeric options (windows, soft-caps, rope, expert counts) live in ModelConfig instead.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    norm_offset: float = 0.0  # Gemma: RMSNorm scales by (1 + w)
    sandwich_norms: bool = False  # Gemma: norms on the attention and MLP outputs too
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size), in the model dtype
    local_rope: bool = False  # Gemma 3: sliding-window layers rotate with local_rope_theta
    fused_qkv_checkpoint: bool = False  # Phi-3: the checkpoint holds qkv_proj, not q/k/v_proj
    fused_gate_up_checkpoint: bool = False  # Phi-3: the checkpoint holds gate_up_proj
    mlp_name: str = "mlp"  # the checkpoint's name for the MLP or MoE block (Mixtral: block_sparse_moe)
    # The checkpoint's per-expert tensor names for gate, up, down (Mixtral: w1, w3, w2).
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")

"""LoRA adapters served beside one base model (docs/lora.md): the adapter files and their
checks (adapter.py), the policy's device slots (slots.py, no torch), the batched low-rank
products in the model's projections (layers.py)."""

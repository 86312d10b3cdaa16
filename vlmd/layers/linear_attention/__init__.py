"""Linear-attention layers (Gated DeltaNet) and the per-request state they keep in the KV
model's recurrent-state groups (``state.py``)."""

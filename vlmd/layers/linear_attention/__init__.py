"""Linear-attention layers (Gated DeltaNet: ``gated_delta.py``'s operations, the layer in
``gated_delta_net.py``) and the per-request state they keep in the KV model's
recurrent-state groups (``state.py``)."""

"""Linear attention: Gated DeltaNet (Qwen3.5's), its operations and its layer."""

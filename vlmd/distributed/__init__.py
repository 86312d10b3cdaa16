"""Tensor-parallel ranks: who is where (world.py), and how a step reaches them (channel.py)."""

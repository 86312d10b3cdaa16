"""The CPU backend room: C kernels built with the package (``setup.py``), one library per
instruction-set variant (``variants.py``), the variant for this CPU chosen and loaded at
run time (``library.py``) and called through ctypes.

Each kernel is one C file with a Python binding beside it (``paged_decode.c`` /
``paged_decode.py``: decode attention through block tables; ``paged_prefill``: a prefill
chunk's causal attention, likewise; ``packed_linear``: a few rows times a oneDNN-packed
weight; ``elementwise``: residual add + RMSNorm, rotary, SiLU * up; ``decoder_step``: a
decode step through every layer in one call). ``kernels.h`` declares every exported
function once. Where no library was built, each binding reports its kernel unavailable and
its caller keeps its torch path: nothing depends on a kernel being built.
"""

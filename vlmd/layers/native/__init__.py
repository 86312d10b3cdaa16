"""C kernels built for this host at start-up (``build.py``), called through ctypes.

Each kernel is one C file in this package with a Python binding beside it
(``paged_decode.c`` / ``paged_decode.py``: decode attention through block tables;
``paged_prefill.c`` / ``paged_prefill.py``: a prefill chunk's causal attention, likewise;
``packed_linear.c`` / ``packed_linear.py``: a few rows times a oneDNN-packed weight).
Where no compiler is found, or a build fails, the binding reports the kernel unavailable
and its caller keeps its torch path: nothing depends on a kernel being built.
"""

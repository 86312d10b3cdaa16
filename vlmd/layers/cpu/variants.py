"""The instruction-set variants the kernel library is built in, and which one a CPU runs.

Torch-free and import-free: ``setup.py`` reads this file by path to build every variant
when the package is built or installed, and ``library.py`` reads it to choose one at run
time. A variant is compiled with its ``-march`` level and loaded only on a CPU whose
``/proc/cpuinfo`` flags include everything that level may use.

Why these levels: the kernels' sources branch on one thing, ``__AVX512F__`` (16-lane
vectors and wider register tiles) against everything else (8-lane vectors), so x86-64-v4
(AVX-512 F/BW/CD/DQ/VL) and x86-64-v3 (AVX2, FMA) are the two that differ in code; v2
(SSE4.2) keeps a pre-2013 or emulated x86 CPU off torch ops, and ``generic`` serves any
other architecture. AVX512-BF16 is not a level of its own: the v4 kernels that use it
(`packed_linear.c`'s dot product, `flash_bf16.c`) build those functions with a target
attribute and ask the CPU at run time (`__builtin_cpu_supports`), so one v4 library serves
Zen 4 and Intel hosts with and without it. No source line uses AMX.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}

# Every variant's build flags; the kernels' common ones are in COMMON_FLAGS.
COMMON_FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-std=gnu11", "-Wno-psabi")
LINK_FLAGS = ("-fopenmp", "-Wl,-Bsymbolic")  # a library's calls to its own kernels stay inside it
SOURCES = ("packed_linear.c", "quantized_linear.c", "paged_decode.c", "paged_prefill.c", "flash_bf16.c",
           "elementwise.c",
           "decoder_step.c", "signatures.c")


@dataclass(frozen=True)
class Variant:
    name: str  # as --cpu-kernels and the library's file name spell it
    machine: str  # platform.machine() of the CPUs it is for
    march: str | None  # -march level, or None for the compiler's default
    needs: frozenset[str]  # /proc/cpuinfo flags the CPU must have

    @property
    def module(self) -> str:
        """The library's module name (its file is this plus the extension suffix)."""
        return "_kernels_" + self.name.replace("-", "_")

    @property
    def compile_flags(self) -> tuple[str, ...]:
        march = () if self.march is None else (f"-march={self.march}", "-mtune=generic")
        return COMMON_FLAGS + march + (f'-DVLMD_VARIANT="{self.name}"',)


# Best first: the first one the CPU runs is chosen.
VARIANTS = (
    Variant("x86-64-v4", "x86_64", "x86-64-v4", _V4),
    Variant("x86-64-v3", "x86_64", "x86-64-v3", _V3),
    Variant("x86-64-v2", "x86_64", "x86-64-v2", _V2),
    Variant("generic", "", None, frozenset()),  # any machine: the compiler's default target
)
NAMES = tuple(v.name for v in VARIANTS)
# The environment variable that names the variant to load ("auto": the best the CPU runs);
# `vlmd serve --cpu-kernels` supplies it and sets it for the tensor-parallel ranks.
ENV = "VLMD_CPU_KERNELS"


def for_machine(machine: str | None = None) -> tuple[Variant, ...]:
    """The variants built for this machine type, best first."""
    machine = machine or platform.machine()
    own = tuple(v for v in VARIANTS if v.machine == machine)
    return own or tuple(v for v in VARIANTS if v.machine == "")


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The first CPU's feature flags (``flags`` on x86, ``Features`` on Arm)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as handle:
                cpuinfo = handle.read()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def runnable(flags: frozenset[str], machine: str | None = None) -> tuple[Variant, ...]:
    """The variants a CPU with ``flags`` executes, best first."""
    return tuple(v for v in for_machine(machine) if v.needs <= flags)

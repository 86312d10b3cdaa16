"""Builds the CPU kernel library with the package, once per instruction-set variant.

Everything else about the package is in pyproject.toml. Why setuptools extensions and not
scikit-build-core or meson-python: the kernels are six plain C files with no dependency
but libgomp and libm, so a build system of their own would add a tool and a second
configuration language for one compiler call per variant. ``Extension(optional=True)``
lets an install on a machine whose compiler lacks a level (or has no compiler at all)
finish without it: vlmd then loads the best variant that was built, or serves through
torch ops and says so once (vlmd/layers/cpu/library.py).
"""

import importlib.util
import sys
from pathlib import Path

from setuptools import Extension, setup

NATIVE = Path("vlmd/layers/cpu")
spec = importlib.util.spec_from_file_location("vlmd_variants", NATIVE / "variants.py")
variants = sys.modules["vlmd_variants"] = importlib.util.module_from_spec(spec)  # its dataclass looks itself up
spec.loader.exec_module(variants)

setup(ext_modules=[
    Extension(f"vlmd.layers.cpu.{variant.module}", [str(NATIVE / source) for source in variants.SOURCES],
              depends=[str(path) for path in sorted(NATIVE.glob("*.h"))], extra_compile_args=list(variant.compile_flags),
              extra_link_args=list(variants.LINK_FLAGS), libraries=["m"], optional=True)
    for variant in variants.for_machine()
])

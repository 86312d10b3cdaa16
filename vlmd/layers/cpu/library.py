"""The CPU kernel library: the variant built for this CPU, loaded once, each function bound
with the signature the library itself declares.

The library is built with the package (``setup.py``), once per instruction-set variant
(``variants.py``); nothing is compiled at serve time and the serving host needs no
compiler. The variant loaded is the best one the CPU executes (its ``/proc/cpuinfo``
flags), or the one ``VLMD_CPU_KERNELS`` names (``vlmd serve --cpu-kernels``, which sets
it for the tensor-parallel ranks too): the AVX2 library on an AVX-512 host, say, to
compare the two. Where no library was built (a source tree used without ``pip install``,
or an install whose compiler built none), ``load_functions()`` returns None, every caller
keeps its torch ops, and one log line says so.

Signatures: ``kernels.h`` declares every exported function once; the compiler checks each
definition against it, and the library carries the same lines as text
(``vlmd_kernel_signatures``), parsed here into ctypes types. A symbol asked for that the
table lacks is an error at load, not a misread argument at run time.

OpenMP: the library is linked with ``-fopenmp`` and loaded after torch, so its
``libgomp.so.1`` resolves to the runtime torch already holds (same soname): one runtime,
and a calling thread reuses its own team (docs/decisions.md D10, "One OpenMP team per
process"). ``tests/test_native_kernels.py`` checks that one libgomp is mapped.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
import re
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch  # noqa: F401  (loaded first: its libgomp is the one the kernels bind to)

from vlmd.layers.cpu import variants

log = structlog.get_logger(__name__)

ENV = variants.ENV
_HERE = Path(__file__).parent
_SCALARS = {"int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "float": ctypes.c_float,
            "double": ctypes.c_double, "void": None}
_DECLARATION = re.compile(r"^(\w+) (\w+)\((.*)\)$")


@dataclass(frozen=True)
class Signature:
    name: str
    restype: type | None
    argtypes: tuple

    @classmethod
    def parse(cls, line: str) -> "Signature":
        """One line of ``vlmd_kernel_signatures``: ``int name(const float *x, int64_t n)``."""
        found = _DECLARATION.match(line.strip())
        if found is None or found.group(1) not in _SCALARS:
            raise ValueError(f"the kernel library declares a signature the binding cannot read: {line!r}")
        restype, name, parameters = _SCALARS[found.group(1)], found.group(2), found.group(3).strip()
        argtypes = []
        for parameter in ([] if parameters in ("", "void") else parameters.split(",")):
            if "*" in parameter:
                argtypes.append(ctypes.c_void_p)
                continue
            words = parameter.replace("const ", " ").split()
            if len(words) != 2 or words[0] not in _SCALARS or _SCALARS[words[0]] is None:
                raise ValueError(f"parameter {parameter.strip()!r} of {name}: a type the binding cannot pass")
            argtypes.append(_SCALARS[words[0]])
        return cls(name, restype, tuple(argtypes))


@dataclass(frozen=True)
class Library:
    variant: str
    path: Path
    signatures: dict[str, Signature]
    released: ctypes.CDLL  # calls release the GIL
    holding: ctypes.PyDLL  # calls keep the GIL

    def bind(self, names: tuple[str, ...], hold_gil: bool) -> dict:
        handle = self.holding if hold_gil else self.released
        bound = {}
        for name in names:
            if name not in self.signatures:
                raise RuntimeError(f"{self.path.name} declares no {name}: the binding and the build disagree")
            function = getattr(handle, name)
            function.argtypes, function.restype = self.signatures[name].argtypes, self.signatures[name].restype
            bound[name] = function
        return bound


def built_variants(directory: Path = _HERE) -> dict[str, Path]:
    """Variant name -> its built library in ``directory``, for this machine's variants."""
    found = {}
    for variant in variants.for_machine():
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = directory / (variant.module + suffix)
            if path.exists():
                found[variant.name] = path
                break
    return found


class VariantError(ValueError):
    """A variant asked for that cannot be loaded here; ``reason`` says why."""

    def __init__(self, requested: str, reason: str):
        super().__init__(f"{ENV}={requested}: {reason}")
        self.requested, self.reason = requested, reason


def choose(requested: str, built: dict[str, Path], flags: frozenset[str]) -> str | None:
    """The variant to load: ``requested`` if not "auto" (it must be built and runnable
    here), else the best built one the CPU runs; None if there is none."""
    runnable = [v.name for v in variants.runnable(flags)]
    if requested == "auto":
        return next((name for name in runnable if name in built), None)
    if requested not in variants.NAMES:
        raise VariantError(requested, f"not a kernel variant ({', '.join(('auto',) + variants.NAMES)})")
    if requested not in runnable:
        raise VariantError(requested, f"this CPU cannot run it (it runs {', '.join(runnable) or 'none'})")
    if requested not in built:
        raise VariantError(requested, f"not built in this install (built: {', '.join(built) or 'none'})")
    return requested


def open_library(variant: str, path: Path) -> Library:
    released = ctypes.CDLL(str(path))
    table = ctypes.cast(released.vlmd_kernel_signatures, ctypes.c_char_p).value.decode()
    built_as = ctypes.cast(released.vlmd_kernel_variant, ctypes.c_char_p).value.decode()
    if built_as != variant:
        raise RuntimeError(f"{path.name} was built as {built_as!r}, not {variant!r}")
    signatures = {s.name: s for s in map(Signature.parse, filter(None, table.splitlines()))}
    return Library(variant, path, signatures, released, ctypes.PyDLL(str(path)))


_loaded: list[Library | None] = []  # empty until the first load: then the library or None
# (names, hold_gil) -> the loaded library's bound functions, or None without a library.
# Bindings ask per kernel call (~40 times a decode step): one dict lookup, cleared with the library.
_bound: dict[tuple, dict | None] = {}


def _open_variant(requested: str) -> Library | None:
    """The library ``requested`` ("auto" or a variant name) names here, opened and
    checked, or None where none is built for this CPU; logged either way."""
    built = built_variants()
    chosen = choose(requested, built, variants.cpu_flags())
    if chosen is None:
        log.warning("no native kernel library was built for this install or CPU: torch ops serve instead",
                    built=sorted(built), runnable=[v.name for v in variants.runnable(variants.cpu_flags())])
        return None
    library = open_library(chosen, built[chosen])
    _warn_if_stale(library.path)
    log.info("native kernels", variant=library.variant, library=library.path.name)
    return library


def load() -> Library | None:
    """This process's kernel library (chosen from ``VLMD_CPU_KERNELS``, opened and checked
    on first call), or None."""
    if not _loaded:
        _loaded.append(_open_variant(os.environ.get(ENV, "auto") or "auto"))
    return _loaded[0]


def _warn_if_stale(path: Path) -> None:
    """In a source tree (an editable install builds the libraries in place), a kernel
    source edited after the build is not in the library until ``pip install -e .`` runs
    again: say so rather than serve the old code silently."""
    sources = [p for pattern in ("*.c", "*.h") for p in _HERE.glob(pattern)]
    newer = sorted(p.name for p in sources if p.stat().st_mtime > path.stat().st_mtime)
    if newer:
        log.warning("kernel sources are newer than the built library: rebuild with pip install -e .",
                    library=path.name, newer=newer)


def reset() -> None:
    """Forget the loaded library: the next ``load()`` chooses again (from ``VLMD_CPU_KERNELS``)."""
    _loaded.clear()
    _bound.clear()


def use(variant: str | None) -> Library | None:
    """Load ``variant`` ("auto", a name, or None for no library) in place of the current
    one, for every binding from now on: the tests run each runnable variant's kernels."""
    reset()
    _loaded.append(None if variant is None else _open_variant(variant))
    return _loaded[0]


def load_functions(names: tuple[str, ...], hold_gil: bool = False) -> dict | None:
    """The library's functions ``names`` (a tuple: the binding's constant) bound with their declared signatures, or None
    where no library is loaded here. ``hold_gil``: the calls keep the GIL
    (``ctypes.PyDLL``) instead of releasing it. For kernels whose calls take microseconds:
    a released GIL is taken by the event loop's thread (streaming the last token's
    chunks), and the engine thread then waits for that thread's turn to end before its
    next op."""
    key = (names, hold_gil)
    found = _bound.get(key, _bound)  # _bound itself: not looked up yet (None is an answer)
    if found is _bound:
        library = load()
        found = _bound[key] = None if library is None else library.bind(names, hold_gil)
    return found

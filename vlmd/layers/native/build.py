"""Compile one of this package's C files for this host, once, and load it with ctypes.

Why at run time and not at install: ``-march=native`` code must be built on the host
that runs it (hosts of one machine kind differ: AVX-512 and bf16 on some, AVX2 only on
others), a plain C file with no torch headers compiles in well under a second, and an
install needs no build step. The shared object is kept in ``$VLMD_CACHE_DIR/native``
(default ``~/.cache/vlmd/native``) under a name that hashes the source, the package's
headers, the compiler's identity, the flags and the CPU's model and feature flags, so an
edit, another compiler or another host builds afresh and nothing stale is loaded. A build writes a temporary
file and renames it, so processes that build at once (tensor-parallel ranks) never load
a partial file.

OpenMP: the object is linked with ``-fopenmp`` and loaded after torch, so its
``libgomp.so.1`` resolves to the runtime torch already holds (same soname): one runtime,
and a calling thread reuses its own team (docs/architecture.md, "One OpenMP team per
process"). ``tests/test_native_kernels.py`` checks that one libgomp is mapped.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import structlog
import torch  # noqa: F401  (loaded first: its libgomp is the one the kernels bind to)
from blake3 import blake3

log = structlog.get_logger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared", "-std=gnu11")
_SOURCES = Path(__file__).parent
_LOADED: dict[str, ctypes.CDLL | None] = {}
_BOUND: dict[str, dict | None] = {}


def cache_dir() -> Path:
    return Path(os.environ.get("VLMD_CACHE_DIR", Path.home() / ".cache" / "vlmd")) / "native"


def compiler() -> str | None:
    """``$CC`` if set, else the first of cc, gcc, clang on the PATH."""
    if os.environ.get("CC"):
        return os.environ["CC"]
    return next((found for name in ("cc", "gcc", "clang") if (found := shutil.which(name))), None)


def _cpu_identity() -> bytes:
    """The model and feature lines of /proc/cpuinfo's first CPU (what -march=native reads)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine.encode()
    first = text.split("\n\n", 1)[0]
    keep = ("vendor_id", "cpu family", "model", "model name", "flags", "Features", "CPU part")
    return "\n".join(line for line in first.splitlines() if line.split(":", 1)[0].strip() in keep).encode()


def _build(name: str, cc: str) -> Path:
    source = _SOURCES / f"{name}.c"
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    # The package's headers too: a kernel may include any of them (vector_exp.h).
    headers = b"".join(path.read_bytes() for path in sorted(_SOURCES.glob("*.h")))
    key = blake3(source.read_bytes() + headers + version.encode() + " ".join(FLAGS).encode()
                 + _cpu_identity()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        done = subprocess.run([cc, *FLAGS, "-o", partial, str(source), "-lm"], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    log.info("built a native kernel", kernel=name, path=str(target))
    return target


def load_native(name: str, hold_gil: bool = False) -> ctypes.CDLL | None:
    """The kernel library ``name`` (``<name>.c`` in this package), built on first use, or
    None where it cannot be built here (logged once with the reason).

    ``hold_gil``: its functions keep the GIL while they run (``ctypes.PyDLL``) instead of
    releasing it (``CDLL``). For kernels whose calls take microseconds: a released GIL
    is taken by the event loop's thread (streaming the last token's chunks), and the
    engine thread then waits for that thread's turn to end before its next op."""
    if name in _LOADED:
        return _LOADED[name]
    library = None
    cc = compiler()
    if cc is None:
        log.warning("no C compiler found: native kernels are off, torch ops serve instead", kernel=name)
    else:
        try:
            library = (ctypes.PyDLL if hold_gil else ctypes.CDLL)(str(_build(name, cc)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            log.warning("a native kernel did not build: torch ops serve instead", kernel=name, reason=str(exc))
    _LOADED[name] = library
    return library


def load_functions(name: str, signatures: dict[str, tuple[list, type]], hold_gil: bool = False) -> dict | None:
    """The functions of kernel ``name``, symbol -> ctypes function with its C signature
    (``signatures``: symbol -> (argument types, result type)) set: built and bound on
    first use, then kept; None where the kernel cannot be built here. ``hold_gil``: as
    for ``load_native``."""
    if name not in _BOUND:
        library = load_native(name, hold_gil)
        functions = None
        if library is not None:
            functions = {}
            for symbol, (arguments, result) in signatures.items():
                function = getattr(library, symbol)
                function.argtypes, function.restype = arguments, result
                functions[symbol] = function
        _BOUND[name] = functions
    return _BOUND[name]

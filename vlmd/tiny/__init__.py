"""Build deterministic random ("tiny") checkpoints, offline: the embedded default model
``vlmd serve`` builds without MODEL_DIR, the benches' models and the tests' fixtures.

    python -m vlmd.tiny --family FAMILY --out DIR [--seed N] [--size tiny|small]

or from Python: ``build_tiny("llava", out_dir, seed=0, size="tiny") -> Path``.

The same family, seed and size always give byte-identical files.  Each family's plugin registers
its builder through the ``vlmd_register_tiny_builders`` hook (this module names no family); the
builder is imported only when building, so listing the families imports no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

__all__ = ["SIZES", "build_tiny", "builders", "main"]

SIZES = ("tiny", "small")


def builders() -> dict[str, str]:
    """family -> "module:function" of every installed plugin's builder
    (``f(out_dir, seed=..., size=...) -> Path``)."""
    from vlmd.plugins.manager import tiny_builders

    return tiny_builders()


def _resolve(family: str):
    known = builders()
    if family not in known:
        names = ", ".join(sorted(known)) or "(none installed)"
        raise ValueError(f"unknown model family {family!r}; known families: {names}")
    from vlmd.plugins.registry import resolve

    return resolve(known[family])


def build_tiny(family: str, out_dir, seed: int = 0, size: str = "tiny") -> Path:
    """Build a random checkpoint of ``family`` into ``out_dir`` and return its path."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {', '.join(SIZES)}")
    builder = _resolve(family)
    return Path(builder(out_dir, seed=int(seed), size=size))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vlmd.tiny",
        description="Build a deterministic random checkpoint (offline).",
    )
    known = builders()
    parser.add_argument("--family", required=True, help=f"model family: {', '.join(sorted(known))}")
    parser.add_argument("--out", required=True, type=Path, help="output directory (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weights/tokenizer seed (default 0)")
    parser.add_argument("--size", choices=SIZES, default="tiny", help="tiny (fast tests) or small (~100M params)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the hub

    if args.family not in known:
        parser.error(f"unknown model family {args.family!r}; known families: {', '.join(sorted(known))}")
    start = time.monotonic()
    out = build_tiny(args.family, args.out, seed=args.seed, size=args.size)
    elapsed = time.monotonic() - start
    summary_path = out / "vlmd_tiny.json"
    summary = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.exists() else {}
    n_params = summary.get("num_parameters")
    params_txt = f"{n_params:,} parameters" if isinstance(n_params, int) else "parameters: unknown"
    print(f"built {args.family} ({args.size}, seed {args.seed}) in {out} in {elapsed:.1f}s: {params_txt}")
    return 0

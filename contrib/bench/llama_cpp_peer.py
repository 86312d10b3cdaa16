"""llama.cpp as a peer for side_by_side.py: the same checkpoint converted to GGUF with
llama.cpp's own converter, served by its own ``llama-server`` (multimodal through
``--mmproj``).

How it was built here (2026-12-04, recorded in the issue note): llama.cpp's tree as vendored in
the ``llama-cpp-python`` 0.3.36 source distribution on PyPI (``pip download --no-deps
--no-binary :all: llama-cpp-python==0.3.36``, ``vendor/llama.cpp``), configured with
``cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON`` and built
with ``cmake --build build --target llama-server -j 2``; the converter runs in a venv with
torch 2.13.0, the same transformers as vlmd's and llama.cpp's ``gguf-py``.

vlmd's tiny checkpoints carry a byte-level BPE tokenizer without a pre-tokenizer regex, which
the converter's table of known pre-tokenizers does not list; ``convert`` declares it as
Qwen2's (the family's own). llama.cpp then splits text with Qwen2's regex before BPE, so a
prompt's text may take a few tokens more or fewer than in vlmd; the image's tokens, which
dominate these prompts, are the processor's either way. side_by_side.py reports each
server's prompt length for the same request so the difference is visible.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_WRAPPER = """
import runpy, sys
llama_cpp = sys.argv.pop(1)
sys.path.insert(0, llama_cpp)
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv[0] = llama_cpp + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(model_dir: str, llama_cpp: Path, python: Path, outtype: str) -> tuple[Path, Path]:
    """(model GGUF of ``outtype``, projector GGUF in f32), written beside the checkpoint once."""
    source = Path(model_dir)
    model = source.parent / f"{source.name}-{outtype}.gguf"
    mmproj = source.parent / f"{source.name}-mmproj-f32.gguf"
    for target, extra in ((model, ["--outtype", outtype]), (mmproj, ["--mmproj", "--outtype", "f32"])):
        if target.exists():
            continue
        done = subprocess.run([str(python), "-c", _WRAPPER, str(llama_cpp), str(source), *extra, "--outfile",
                               str(target)], capture_output=True, text=True)
        if done.returncode != 0 or not target.exists():
            raise RuntimeError(f"llama.cpp's converter failed for {target.name}:\n{done.stderr[-3000:]}")
    return model, mmproj


def image_token_limits(model_dir: str) -> list[str]:
    """The checkpoint's own image-size limits as llama-server's token limits: it reads its
    defaults from the projector, not from the checkpoint's processor config, and a 640x480
    image took 418 tokens there against the processor's 143 (the tiny Qwen2-VL's max_pixels)."""
    path = Path(model_dir) / "preprocessor_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    if "min_pixels" not in config:
        return []
    cell = (config["patch_size"] * config["merge_size"]) ** 2
    return ["--image-min-tokens", str(config["min_pixels"] // cell), "--image-max-tokens",
            str(config["max_pixels"] // cell)]


def command(llama_cpp: Path, model_dir: str, model: Path, mmproj: Path, port: int, slots: int,
            context_per_slot: int) -> tuple[list[str], dict]:
    """``llama-server`` on every core, ``slots`` requests at once (each with its own context)."""
    binary = llama_cpp / "build" / "bin" / "llama-server"
    if not binary.exists():
        raise FileNotFoundError(f"no llama-server at {binary}: build it first (see this module's doc)")
    threads = str(os.cpu_count())
    return [str(binary), "-m", str(model), "--mmproj", str(mmproj), "--host", "127.0.0.1", "--port", str(port),
            "--alias", "bench", "-t", threads, "-tb", threads, "--parallel", str(slots),
            "-c", str(slots * context_per_slot), "--jinja", "--no-webui", *image_token_limits(model_dir)], dict(os.environ)


if __name__ == "__main__":
    sys.exit("used by side_by_side.py (--llama-cpp DIR --llama-cpp-python PYTHON)")

"""A random-weight Qwen2.5-VL checkpoint of a real model's shape, drawn on the GPU it runs on.

The tiny builder (``vlmd_qwen2_5_vl.tiny``) makes float32 weights on the CPU and saves them
with transformers: at 7B that is 30 GB drawn on one CPU thread and written in float32.
This builds the family's tiny checkpoint first (tokenizer, chat template, processor files,
the saved weight names), then replaces its config with the real shape's and its weights
with bfloat16 ones drawn on ``--device`` by the same per-name rule (``PARAM_STD``), saved as
safetensors shards. The image processor's pixel limits become a real deployment's (Qwen's
own suggestion caps an image at 1,280 tokens; 2,048 here, so that a 1024 px image is its
whole 1,369 tokens as in Qwen2.5-VL-7B, and the largest image fits a 4,096-token context).
The tokenizer stays the tiny one (8k tokens, not 152k): the embeddings and the LM head are
29M parameters each instead of 545M, so the checkpoint has 7.26B parameters (13.5 GiB)
against the real model's 8.29B; ``weight_bytes`` in the summary counts what was built.

    python contrib/device/real_shape.py --out DIR [--shape qwen2.5-vl-7b|tiny] [--device cuda]

Prints one JSON line: the shape, parameters, weight bytes, seconds.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

# Qwen2.5-VL-7B-Instruct's config.json (text and vision); the tokenizer is the tiny one.
SHAPES = {
    "qwen2.5-vl-7b": {
        "text": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, max_position_embeddings=128000),
        "vision": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                       fullatt_block_indexes=[7, 15, 23, 31]),
        "mrope_section": [16, 24, 24],
        "rope_theta": 1000000.0,
        "window_size": 112,
        "min_pixels": 3136,
        "max_pixels": 2048 * 28 * 28,
    },
    # The tiny checkpoint's sizes through the same steps (the CPU dry run of
    # contrib/device/check.sh), with the real pixel limits.
    "tiny": {"min_pixels": 3136, "max_pixels": 2048 * 28 * 28},
}
SHARD_BYTES = 4 << 30


def saved_name(name: str) -> str:
    """The checkpoint's name of a transformers parameter (save_pretrained's renames for
    Qwen2.5-VL in transformers 5; checked against the tiny checkpoint before use)."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("model.visual."):
        return name[len("model."):]
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--shape", default="qwen2.5-vl-7b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    import transformers
    from safetensors import safe_open
    from safetensors.torch import save_file
    from vlmd.tiny import build_tiny
    from vlmd.tiny.weights import norm_parameter_names
    from vlmd_qwen2_5_vl.tiny import SIZES, WINDOW_SIZE, qwen2_5_vl_config
    from vlmd_qwen2_vl.tiny import PARAM_STD, ROPE_THETA

    started = time.monotonic()
    out = build_tiny("qwen2_5_vl", args.out, seed=args.seed, size="tiny")
    shape = SHAPES[args.shape]
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    vocab = tokenizer.get_vocab()
    ids = {token: vocab[token] for token in ("<|endoftext|>", "<|im_end|>", "<|image_pad|>", "<|video_pad|>",
                                             "<|vision_start|>", "<|vision_end|>")}
    with safe_open(out / "model.safetensors", "pt") as tiny_weights:
        tiny_names = set(tiny_weights.keys())
    tiny_config = transformers.AutoConfig.from_pretrained(out)
    with torch.device("meta"):
        tiny_model = transformers.Qwen2_5_VLForConditionalGeneration(tiny_config)
    renamed = {saved_name(name) for name in tiny_model.state_dict()}
    if renamed != tiny_names:
        raise RuntimeError(f"transformers saves other names than saved_name gives: {sorted(renamed ^ tiny_names)[:4]}")
    if "text" not in shape:
        tiny = SIZES["tiny"]
        shape = {**shape, "text": tiny["text"], "vision": tiny["vision"], "mrope_section": tiny["mrope_section"],
                 "rope_theta": ROPE_THETA, "window_size": WINDOW_SIZE}

    # The real shape: the family's config function at a size of our own, then what that
    # function fixes at the tiny checkpoint's values.
    spec = {**SIZES["tiny"], "text": shape["text"], "vision": shape["vision"], "mrope_section": shape["mrope_section"]}
    SIZES[args.shape] = spec  # qwen2_5_vl_config reads its sizes from the module
    config = qwen2_5_vl_config(args.shape, vocab_size=len(tokenizer), ids=ids)
    config.text_config.rope_parameters["rope_theta"] = shape["rope_theta"]
    config.vision_config.window_size = shape["window_size"]
    config.dtype = "bfloat16"
    (out / "model.safetensors").unlink()
    config.save_pretrained(out)
    saved = json.loads((out / "config.json").read_text())
    rope = saved["text_config"]["rope_parameters"]  # the 4.x spelling beside 5.x's, as the builder writes
    saved["text_config"]["rope_theta"] = rope["rope_theta"]
    saved["text_config"]["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    (out / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    for name in ("preprocessor_config.json", "processor_config.json", "vlmd_tiny.json"):
        path = out / name
        settings = json.loads(path.read_text())
        for target in (settings, settings.get("image_processor")):
            if target is None:
                continue
            for key, value in (("min_pixels", shape["min_pixels"]), ("max_pixels", shape["max_pixels"]),
                               ("image_min_pixels", shape["min_pixels"]), ("image_max_pixels", shape["max_pixels"])):
                if key in target:
                    target[key] = value
            if "size" in target:
                target["size"] = {"shortest_edge": shape["min_pixels"], "longest_edge": shape["max_pixels"]}
        path.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")

    with torch.device("meta"):
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    norms = norm_parameter_names(model)
    device = torch.device(args.device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    special = torch.tensor(sorted(ids.values()), device=device)
    shards: list[dict] = [{}]
    shard_bytes = 0
    total = parameters = 0
    for name, meta in sorted(model.state_dict().items()):
        mean, std = PARAM_STD(name, tuple(meta.shape), name in norms)
        tensor = torch.empty(meta.shape, dtype=torch.bfloat16, device=device).normal_(mean, std, generator=generator)
        if name.startswith("lm_head"):
            tensor[special] = 0  # greedy decoding writes ordinary text only (vlmd/tiny/weights.py)
        size = tensor.numel() * tensor.element_size()
        if shard_bytes + size > SHARD_BYTES and shards[-1]:
            shards.append({})
            shard_bytes = 0
        shards[-1][saved_name(name)] = tensor.cpu()
        shard_bytes += size
        total += size
        parameters += tensor.numel()
    weight_map = {}
    for index, shard in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / file, metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")
    print(json.dumps({"shape": args.shape, "dir": str(out), "num_parameters": parameters, "weight_bytes": total,
                      "text_layers": shape["text"]["num_hidden_layers"], "shards": len(shards),
                      "gib": round(total / 2**30, 2), "seconds": round(time.monotonic() - started, 1),
                      "floor_ms_per_token_at_4_8_TBps": round(total / 4.8e12 * 1e3, 2)}))


if __name__ == "__main__":
    main()

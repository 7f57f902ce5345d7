"""Write a random-init Hugging Face checkpoint of a real model's shape, for build memory and time.

    python benchmarks/random_checkpoint.py llama-3.2-1b -o /tmp/rand-1b
    /usr/bin/time -v specexport build /tmp/rand-1b/fp32-int8.yaml -o /tmp/a1 --force

The folder holds config.json (the real shape), fp16 safetensors shards of at most 2 GB with their
index (written one tensor at a time: the script itself never holds the model), the default
model's tokenizer (SmolLM2's: the build needs one; its vocabulary is smaller than the embedding,
which the runtime pads), and two recipes beside them: `fp32-int8.yaml` (fp32 target + int8
self-draft, fused) and `int4.yaml` (int4 target, n-gram proposer). Weights are N(0, std) with
std 0.02 (`--std`): random weights accept nothing, so such an artifact measures the build and the
runtime's mechanics only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

SHAPES = {
    # meta-llama/Llama-3.2-1B-Instruct, Llama-3.2-3B-Instruct and Llama-3.1-8B-Instruct config.json
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    # the tests' dry run
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, vocab_size=49152),
}  # fmt: skip
LLAMA3 = dict(
    model_type="llama",
    vocab_size=128256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    bos_token_id=1,
    eos_token_id=2,
)
SHARD_BYTES = 2 << 30

RECIPES = {
    "fp32-int8.yaml": "precision: fp32\ndraft:\n  from_target:\n    precision: int8\nspeculation:\n  gamma: 4\n",
    "int4.yaml": "precision: int4\ndraft:\n  proposer: ngram\n  ngram_sizes: [3, 2, 1]\nspeculation:\n  gamma: 4\n",
}


def write_checkpoint(shape: str, out: Path, std: float, seed: int) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from specexport.models.streaming import skeleton

    out.mkdir(parents=True, exist_ok=True)
    data = {**LLAMA3, **SHAPES[shape]}
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    config.save_pretrained(out)
    model = skeleton(config)  # parameters on meta: names and shapes only
    gen = torch.Generator().manual_seed(seed)
    weight_map, shard, size, n = {}, {}, 0, 0

    def flush():
        nonlocal shard, size, n
        if shard:
            n += 1
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            shard, size = {}, 0

    for name, p in model.named_parameters():  # a tied head appears once (the embedding)
        t = torch.ones(p.shape) if name.endswith("norm.weight") else torch.randn(p.shape, generator=gen) * std
        t = t.to(torch.float16)
        if size + t.nbytes > SHARD_BYTES:
            flush()
        shard[name], size = t, size + t.nbytes
        print(f"{name} {list(p.shape)}", flush=True)
    flush()
    total = sum((out / f).stat().st_size for f in set(weight_map.values()))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    _tokenizer(out)
    for file, body in RECIPES.items():
        name = f"rand-{shape}-{file.removesuffix('.yaml')}"
        head = f"name: {name}\nmax_context: 2048\ngraph: fused\ntarget:\n  model: {out}\n  "
        (out / file).write_text(head + body)


def _tokenizer(out: Path) -> None:
    from transformers import AutoTokenizer

    from specexport.models.sources import DEFAULT_MODEL, resolve_source

    source = resolve_source(DEFAULT_MODEL)
    AutoTokenizer.from_pretrained(source.location, gguf_file=source.gguf_file).save_pretrained(out)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES), help="the real model whose shape is copied")
    ap.add_argument("-o", "--output", type=Path, required=True, help="folder to write (new or empty)")
    ap.add_argument("--std", type=float, default=0.02, help="standard deviation of the random weights")
    ap.add_argument("--seed", type=int, default=0, help="random seed")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.output.exists() and any(args.output.iterdir()):
        raise SystemExit(f"error: output folder {str(args.output)!r} is not empty")
    if args.std <= 0:
        raise SystemExit(f"error: --std {args.std} must be > 0")
    write_checkpoint(args.shape, args.output, args.std, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())

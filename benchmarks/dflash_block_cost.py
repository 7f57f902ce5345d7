"""What one DFlash block costs as a share of a target step (random-init weights of real shapes).

A Qwen3-shaped target (default: Qwen3-0.6B's shape; --hidden 2048 --intermediate 6144 --heads 16
--layers 28 for Qwen3-1.7B's) with hidden_states at the drafter's layers, and a drafter of the
published shape (5 layers, block 16, the target's hidden width, reading 5 target layers), both fp32
portable graphs on ONNX Runtime's CPU provider with --threads threads. At a past of --past
positions it times, median of --repeats calls each: the target's 1-row step, its 16-row verify
call, and one drafter block (C context rows, then the 16-row block), and prints each in ms and the
block as a share of the target's step and of its verify call.

    PYTHONPATH=runtime:. python benchmarks/dflash_block_cost.py --layers 28 --past 256
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1000


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024, help="target hidden size (default 1024, Qwen3-0.6B)")
    ap.add_argument("--intermediate", type=int, default=3072, help="target MLP width (default 3072)")
    ap.add_argument("--heads", type=int, default=16, help="attention heads (default 16)")
    ap.add_argument("--kv-heads", type=int, default=8, help="K/V heads (default 8)")
    ap.add_argument("--layers", type=int, default=28, help="target layers (default 28)")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary (default 151936)")
    ap.add_argument("--draft-layers", type=int, default=5, help="drafter layers (default 5)")
    ap.add_argument("--block", type=int, default=16, help="drafter block size (default 16)")
    ap.add_argument("--context", type=int, default=4, help="context rows per block (accepted tokens + 1)")
    ap.add_argument("--past", type=int, default=256, help="cached positions before the timed calls (default 256)")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default 2)")
    ap.add_argument("--repeats", type=int, default=10, help="timed calls per figure; medians (default 10)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)

    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.muse_glimmer_assistant import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    from specexport.graphs.decoder import build_decoder
    from specexport.graphs.dflash import build_dflash_graph
    from specexport.models.dflash import load_dflash
    from specexport_runtime import contract
    from specexport_runtime.dflash import DFlashModel
    from specexport_runtime.engine import OrtModel, SessionConfig

    L, ids_n = args.layers, args.draft_layers
    layer_ids = [round(1 + i * (L - 3) / (ids_n - 1)) for i in range(ids_n)]  # spread like the published 1, 9, .., 33
    common = dict(hidden_size=args.hidden, intermediate_size=args.intermediate, num_attention_heads=args.heads)
    common.update(num_key_value_heads=args.kv_heads, head_dim=128)
    torch.manual_seed(0)
    tcfg = AutoConfig.for_model("qwen3", vocab_size=args.vocab, num_hidden_layers=L, tie_word_embeddings=True, **common)
    target = AutoModelForCausalLM.from_config(tcfg).eval()
    dcfg = MuseGlimmerAssistantConfig(
        num_hidden_layers=args.draft_layers,
        block_size=args.block,
        mask_token_id=args.vocab - 1,
        target_layer_ids=layer_ids,
        layer_types=["full_attention"] * args.draft_layers,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        **common,
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        MuseGlimmerAssistantModel(dcfg).save_pretrained(root / "drafter")
        drafter = load_dflash(root / "drafter", tcfg)
        feature_layers = drafter.config.feature_layers
        t_graph = build_decoder(
            target, root / "target", args.past + 64, kv_layout=contract.TIME_MAJOR, feature_layers=feature_layers
        )
        embed = target.get_input_embeddings().weight.detach().float()
        d_graph = build_dflash_graph(drafter, embed, None, root / "draft")
        del target, embed
        config = SessionConfig(threads=args.threads)
        tmodel = OrtModel(t_graph.path, t_graph.spec, args.past + 64, config, max_rows=args.block + 1)
        dmodel = DFlashModel(d_graph.path, d_graph.spec, args.past + 64, config, args.block)
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, args.vocab - 1, args.past).tolist()
        tmodel.forward(prompt)
        dmodel.forward([1] + [args.vocab - 1] * (args.block - 1), args.block - 1, features=tmodel.features)

        def step():
            tmodel.forward([5])
            tmodel.truncate(args.past)

        def verify():
            tmodel.forward(list(range(args.block)), last_rows=args.block)
            tmodel.truncate(args.past)

        context = np.zeros((args.context, drafter.config.feature_width), np.float32)

        def block():
            dmodel.forward([1] + [args.vocab - 1] * (args.block - 1), args.block - 1, features=context)
            dmodel.truncate(args.past)

        t_step, t_verify, t_block = (_time(f, args.repeats) for f in (step, verify, block))
    print(f"target: Qwen3 shape, {L} layers, hidden {args.hidden};", end=" ")
    print(f"drafter: {args.draft_layers} layers, block {args.block}")
    print(f"past {args.past}, {args.threads} ORT threads, median of {args.repeats}")
    print(f"target step (1 row)      {t_step:8.2f} ms")
    print(f"target verify ({args.block} rows)  {t_verify:8.2f} ms")
    print(f"DFlash block (C={args.context}, B={args.block}) {t_block:8.2f} ms")
    print(f"block / step   {t_block / t_step:.3f}")
    print(f"block / verify {t_block / t_verify:.3f}")


if __name__ == "__main__":
    main()

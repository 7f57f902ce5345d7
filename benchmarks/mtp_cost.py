"""What one MTP step costs as a share of one step of its target (random-init Qwen3.5-0.8B shape).

    python benchmarks/mtp_cost.py [--target-layers 24] [--past 512] [--graph fused|portable]
        [--threads 2] [--json OUT]

The target is a random-init Qwen3_5TextConfig of Qwen3.5-0.8B's text model
(specexport/plan/known.py KNOWN_CONFIGS["Qwen/Qwen3.5-0.8B"]: hidden 1024, 3 Gated DeltaNet : 1
gated full-attention layer, head_dim 256, vocabulary 248320, tied) with --target-layers layers
(fewer than 24 keep every width and the output head, so the share measured is then an upper bound
of the 24-layer one). Its MTP layer is random (tests/mtp_checkpoints.py: one full-attention layer,
fc and three norms) written into a safetensors file beside it, read as the build reads it
(models/mtp.py). Both graphs are written by the build's writers (the target with its
final-normed hidden rows, feature layer L) and run by the runtime (engine.OrtModel) at a
--past-token cache. Timed, interleaved, median of --calls calls, best of --repeats rounds: the
target's 1-row decode step and one MTP step (one drafted token, the chained form), and the MTP's
catch-up call of 4 rows (a round that accepted 3 drafts).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))
sys.path.insert(0, str(REPO / "tests"))

from specexport.bench import harness  # noqa: E402


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("--target-layers", type=int, default=24, help="target layers, a multiple of 4 (default 24)")
    ap.add_argument("--past", type=int, default=512, help="target cache length when timed (default 512)")
    ap.add_argument("--graph", choices=("fused", "portable"), default="fused", help="graph form (default fused)")
    ap.add_argument("--calls", type=int, default=9, help="timed calls per cell and round (default 9)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds; the best median is kept (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default 2)")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the machine, command and cells as JSON here")
    return ap


def main(argv=None) -> int:
    import torch
    from mtp_checkpoints import mtp_tensors
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from specexport.graphs.decoder import build_decoder
    from specexport.graphs.mtp import build_mtp
    from specexport.models.config import normalize
    from specexport.models.mtp import mtp_model
    from specexport.plan.known import KNOWN_CONFIGS
    from specexport_runtime import contract
    from specexport_runtime.engine import OrtModel, SessionConfig

    args = parser().parse_args(argv)
    if args.target_layers < 4 or args.target_layers % 4:
        raise harness.HarnessError(f"--target-layers must be a positive multiple of 4, got {args.target_layers}")
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    layout = contract.layout_for_form(args.graph).name
    max_context = args.past + 64
    text = dict(KNOWN_CONFIGS["Qwen/Qwen3.5-0.8B"]["text_config"])
    text["num_hidden_layers"] = args.target_layers
    text["layer_types"] = (["linear_attention"] * 3 + ["full_attention"]) * (args.target_layers // 4)
    text["max_position_embeddings"] = max_context
    config = AutoConfig.for_model(**text)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(config).eval()
    norm = normalize(target.config, max_context)
    config_s = SessionConfig(threads=args.threads, shared_pool=True)
    with tempfile.TemporaryDirectory(prefix="mtp-cost.") as scratch:
        root = Path(scratch)
        folder = root / "mtp-hf"
        folder.mkdir()
        save_file({k: v.contiguous() for k, v in mtp_tensors(config).items()}, str(folder / "model.safetensors"))
        t_res = build_decoder(
            target, root / "target", max_context, kv_layout=layout, feature_layers=(norm.num_layers,), norm=norm
        )
        m_res = build_mtp(mtp_model(target, folder), root / "mtp", max_context, layout)
        del target
        model = OrtModel(t_res.path, t_res.spec, max_context, config_s, max_rows=8)
        head = OrtModel(m_res.path, m_res.spec, max_context, config_s, max_rows=8)
        prompt = [int(t) for t in np.random.default_rng(0).integers(100, 248320, args.past)]
        model.forward(prompt)  # a recurrent target with features: one call, every row's features
        features = model.features.copy()  # [past, 1024] the target's final-normed rows
        head.forward(prompt[1:], last_rows=1, features=features[:-1])
        hidden = head.hidden_out.copy()  # [1, 1024]
        base = head.length

        def target_step() -> None:
            model.truncate(args.past)
            model.forward(prompt[:1])

        def mtp_step() -> None:
            head.truncate(base)
            head.forward(prompt[:1], hidden=hidden)

        def mtp_catch_up() -> None:
            head.truncate(base)
            head.forward(prompt[:4], last_rows=1, features=features[:4])

        cells = [("target step", target_step), ("mtp step", mtp_step), ("mtp catch-up 4", mtp_catch_up)]
        best = harness.best_medians(cells, args.repeats, args.calls)
    step = best["target step"]
    out = [{"graph": k, "ms": round(v * 1e3, 3), "share_of_target_step": round(v / step, 4)} for k, v in best.items()]
    print(harness.header(meta))
    print(
        f"target: random-init Qwen3.5-0.8B text shape, {args.target_layers} layers; MTP: one random layer;"
        f" {args.graph} graphs, past {args.past}, {args.threads} threads, best of {args.repeats}"
    )
    print(f"{'graph':<15} {'ms':>9} {'x target step':>14}")
    for r in out:
        print(f"{r['graph']:<15} {r['ms']:>9.3f} {r['share_of_target_step']:>14.4f}")
    if args.json:
        harness.write_json(args.json, {"meta": meta, "cells": out})
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))

"""What a Gemma 4 assistant's drafted token costs against one step of its target, and its
centroid-masked head against its full head (random-init models of the real shapes).

    python benchmarks/assistant_cost.py [--target-layers 35] [--past 512] [--graph fused|portable]
        [--assistant-hidden 256] [--assistant-layers 4] [--json OUT]

The target is a random-init Gemma4TextConfig of Gemma 4 E2B's widths (hidden 1536, MLP 6144 and
twice that on K/V-sharing layers, 8 heads of 256 on sliding layers and 512 on full ones, one K/V
head, per-layer inputs of 256, vocabulary 262144, 4 sliding : 1 full, 20 of 35 layers sharing
K/V) with --target-layers layers (fewer than 35 keep every width and the 1.6 GB output head, so
the share measured is an upper bound of the 35-layer one). The assistant is a
Gemma4AssistantForCausalLM of --assistant-* shapes (defaults are a guess at the published E2B
assistant: 4 layers, hidden 256; 2048 centroids, top 32), built twice: centroid head and full head.

Both graphs are written by the build's writers into a temporary folder, the target with its
final-normed hidden rows (feature layer L), and run by the runtime (engine.OrtModel,
assistant.AssistantModel bound to the target's caches) at a --past-token cache on --threads
threads. Timed, interleaved, median of --calls calls, best of --repeats rounds: the target's
1-row decode step (2 rows with row padding: its plain step) and one assistant draft step (one
drafted token).
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
    ap.add_argument("--target-layers", type=int, default=35, help="target layers (default 35: E2B)")
    ap.add_argument("--assistant-layers", type=int, default=4, help="assistant layers, 3 sliding : 1 full (default 4)")
    ap.add_argument("--assistant-hidden", type=int, default=256, help="assistant hidden size (default 256)")
    ap.add_argument("--past", type=int, default=512, help="target cache length when timed (default 512)")
    ap.add_argument("--graph", choices=("fused", "portable"), default="fused", help="graph form (default fused)")
    ap.add_argument("--calls", type=int, default=9, help="timed calls per cell and round (default 9)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds; the best median is kept (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default 2)")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the machine, command and cells as JSON here")
    return ap


def target_config(layers: int):
    from transformers import Gemma4TextConfig

    types = [("full_attention" if i % 5 == 4 else "sliding_attention") for i in range(layers)]
    shared = (layers * 20) // 35
    owners = set(types[: layers - shared])
    if owners != set(types):  # every shared type needs an owning layer before the shared ones
        shared = 0
    return Gemma4TextConfig(
        vocab_size=262144,
        hidden_size=1536,
        intermediate_size=6144,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=256,
        global_head_dim=512,
        sliding_window=512,
        layer_types=types,
        num_kv_shared_layers=shared,
        hidden_size_per_layer_input=256,
        vocab_size_per_layer_input=262144,
        use_double_wide_mlp=True,
        final_logit_softcapping=30.0,
        max_position_embeddings=4096,
    )


def assistant_model(layers: int, hidden: int, centroids: bool):
    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    text = Gemma4TextConfig(
        vocab_size=262144,
        hidden_size=hidden,
        intermediate_size=8 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        global_head_dim=512,
        sliding_window=512,
        layer_types=["full_attention" if i == layers - 1 else "sliding_attention" for i in range(layers)],
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
    )
    config = Gemma4AssistantConfig(
        text_config=text,
        backbone_hidden_size=1536,
        use_ordered_embeddings=centroids,
        num_centroids=2048,
        centroid_intermediate_top_k=32,
    )
    model = Gemma4AssistantForCausalLM(config).eval()
    if centroids:
        with torch.no_grad():
            model.masked_embedding.token_ordering.copy_(torch.randperm(262144))
    return model


def main(argv=None) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from specexport.build.eagle import target_embedding
    from specexport.graphs.assistant import build_assistant
    from specexport.graphs.decoder import build_decoder
    from specexport.models.assistant import check_pair
    from specexport.models.config import normalize
    from specexport_runtime import contract
    from specexport_runtime.assistant import AssistantModel
    from specexport_runtime.engine import OrtModel, SessionConfig

    args = parser().parse_args(argv)
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    layout = contract.layout_for_form(args.graph).name
    max_context = args.past + 64
    torch.manual_seed(0)
    config = target_config(args.target_layers)
    with torch.device("cpu"):
        target = AutoModelForCausalLM.from_config(config).eval()
    norm = normalize(target.config, max_context)
    embed = target_embedding(target)
    config_s = SessionConfig(threads=args.threads, shared_pool=True)
    with tempfile.TemporaryDirectory(prefix="assistant-cost.") as scratch:
        root = Path(scratch)
        t_res = build_decoder(
            target, root / "target", max_context, kv_layout=layout, feature_layers=(norm.num_layers,), norm=norm
        )
        heads = {}
        for label, centroids in (("centroid head", True), ("full head", False)):
            assistant = assistant_model(args.assistant_layers, args.assistant_hidden, centroids)
            facts = check_pair(assistant.config, target.config, norm)
            res = build_assistant(
                assistant, embed, facts, root / label.replace(" ", "-"), kv_heads=norm.kv_heads,
                head_dim=norm.head_dim, kv_layout=layout,
            )  # fmt: skip
            heads[label] = res
            del assistant
        del target, embed
        model = OrtModel(t_res.path, t_res.spec, max_context, config_s, max_rows=8)
        prompt = [int(t) for t in np.random.default_rng(0).integers(100, 262144, args.past)]
        model.forward(prompt)
        drafts = {k: AssistantModel(r.path, r.spec, model, config_s) for k, r in heads.items()}
        hidden = np.random.default_rng(1).normal(size=(1, 1536)).astype(np.float32)

        def target_step() -> None:
            model.truncate(args.past)
            model.forward(prompt[:1])

        cells = [("target step", target_step)]
        cells += [(k, lambda d=d: d.forward([prompt[0]], hidden=hidden)) for k, d in drafts.items()]
        best = harness.best_medians(cells, args.repeats, args.calls, before=lambda: model.truncate(args.past))
    step = best["target step"]
    out = [{"graph": k, "ms": round(v * 1e3, 3), "share_of_target_step": round(v / step, 4)} for k, v in best.items()]
    print(harness.header(meta))
    print(
        f"target: Gemma 4 E2B widths, {args.target_layers} layers; assistant: {args.assistant_layers} layers, hidden"
        f" {args.assistant_hidden}; {args.graph} graphs, past {args.past}, {args.threads} threads,"
        f" best of {args.repeats}"
    )
    print(f"{'graph':<14} {'ms':>9} {'x target step':>14}")
    for r in out:
        print(f"{r['graph']:<14} {r['ms']:>9.3f} {r['share_of_target_step']:>14.4f}")
    if args.json:
        harness.write_json(args.json, {"meta": meta, "cells": out})
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))

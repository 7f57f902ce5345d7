"""Click command `train-draft` with its progress bars (registered on the `specexport` group in
cli.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click


class _TrainBar:
    """train-draft progress on stderr: stage lines, a bar per counted stage, then the step bar
    with the loss and the held-out top-1 agreement (step 0 of the head)."""

    def __init__(self, enabled: bool):
        self.enabled, self.bar, self.kind = enabled, None, None

    def __call__(self, event: dict) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        kind = event["event"]
        if kind == "stage":
            if "total" in event:
                self._bar(
                    ("stage", event["message"]),
                    lambda: tqdm(
                        total=event["total"], desc=event["message"], unit="prompt", file=sys.stderr, dynamic_ncols=True
                    ),
                )
                self.bar.update(event["done"] - self.bar.n)
            else:
                self.close()
                click.echo(event["message"], err=True)
        elif kind == "step":
            self._bar(
                ("step",),
                lambda: tqdm(
                    total=event["total"],
                    initial=event["start"],
                    desc="training",
                    unit="step",
                    file=sys.stderr,
                    dynamic_ncols=True,
                ),
            )
            agree = event.get("agreement")
            postfix = f"loss {event['loss']:.3f}" + (f", agree {agree[0]:.1%}" if agree else "")
            self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.update(event["step"] - self.bar.n)

    def _bar(self, kind: tuple, make) -> None:
        if self.kind != kind:
            self.close()
            self.bar, self.kind = make(), kind

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar, self.kind = None, None


@click.command("train-draft")
@click.argument("target")
@click.option(
    "--data",
    "data",
    multiple=True,
    required=True,
    help="Training text, repeatable: a file or folder (recursive *.py *.md *.txt *.rst), 'stdlib' (the Python "
    "standard library's sources), 'site-docs' (Markdown / reST and package descriptions in site-packages) "
    "'calibration' (the calibration prompts not held out, with the target's own greedy answers) or 'instructions' "
    "(chat requests synthesized from local stdlib functions and docs in the benchmark's five domains, with the "
    "target's own greedy answers; docs/training.md).",
)
@click.option(
    "-o",
    "--out",
    required=True,
    type=click.Path(path_type=Path),
    help="Folder to write: the head in the published EAGLE-3 format, training.json and checkpoint/"
    " (replaced atomically).",
)
@click.option(
    "--steps",
    type=int,
    default=None,
    help="Optimizer steps in all, counting those of a resumed checkpoint [default: 1 epoch].",
)
@click.option("--epochs", type=float, default=None, help="Passes over the training windows, instead of --steps.")
@click.option("--batch-size", type=int, default=None, help="Windows per step [default: 4].")
@click.option("--seq-len", type=int, default=None, help="Tokens per window [default: 256].")
@click.option("--lr", type=float, default=None, help="AdamW peak learning rate [default: 5e-4].")
@click.option(
    "--schedule",
    type=click.Choice(["cosine", "linear"]),
    default=None,
    help="Decay after the warmup, to 10% of the peak [default: cosine].",
)
@click.option("--warmup", type=float, default=None, help="Fraction of the steps with a linear warmup [default: 0.03].")
@click.option(
    "--draft-vocab-size",
    type=int,
    default=None,
    help="Draft vocabulary: the N most frequent target tokens of the data, EOS always in [default: 8192, "
    "or the target's vocabulary if smaller].",
)
@click.option(
    "--ttt-steps",
    type=int,
    default=None,
    help="Training-time-test steps, each fed the head's own hidden state [default: 3].",
)
@click.option("--ttt-decay", type=float, default=None, help="Loss weight of TTT step k: DECAY**k [default: 0.8].")
@click.option(
    "--layers",
    default=None,
    help="Target feature layers, 3 entering-layer ids such as 2,15,27 [default: 2, L//2, L-3].",
)
@click.option(
    "--seed", type=int, default=None, help="Seed of the held-out split, the data order and the init [default: 0]."
)
@click.option(
    "--held-out",
    type=float,
    default=None,
    help="Fraction of the windows kept out of training to measure agreement (at most --eval-sequences)"
    " [default: 0.05].",
)
@click.option("--eval-sequences", type=int, default=None, help="Most held-out windows [default: 32].")
@click.option("--eval-every", type=int, default=None, help="Steps between held-out evaluations [default: 100].")
@click.option(
    "--save-every",
    type=int,
    default=None,
    help="Steps between checkpoints written to --out, 0 = at the end only [default: 200].",
)
@click.option(
    "--resume",
    type=click.Path(path_type=Path),
    default=None,
    help="Continue from a train-draft output folder (or its checkpoint/ folder); --steps counts on from its step.",
)
@click.option("--threads", type=int, default=None, help="torch threads [default: torch's choice].")
@click.option(
    "--max-data-mb",
    type=float,
    default=None,
    help="Text read per --data entry, in MB (calibration excluded) [default: 4].",
)
@click.option("--max-file-kb", type=int, default=None, help="Larger files are skipped [default: 512].")
@click.option(
    "--answer-tokens",
    type=int,
    default=None,
    help="Greedy tokens the target answers per calibration prompt (generated once, cached) [default: 64].",
)
@click.option(
    "--instructions", type=int, default=None, help="Requests synthesized for --data instructions [default: 1000]."
)
@click.option(
    "--instruction-tokens",
    type=int,
    default=None,
    help="Greedy tokens the target answers per synthesized request (generated once, cached) [default: 160].",
)
@click.option(
    "--answer-batch",
    type=int,
    default=None,
    help="Synthesized requests answered per batched generate call [default: 16].",
)
@click.option(
    "--holdout-prompts",
    multiple=True,
    default=None,
    help="The benchmark's prompt sets (as bench --prompts), never trained on; repeatable [default: all].",
)
@click.option(
    "--holdout-limit",
    type=int,
    default=None,
    help="The benchmark's --limit: hold out only the first N prompts per domain (N >= 6), the rest may train "
    "(--data calibration) [default: all held out].",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the training summary as JSON (the full record is OUT/training.json)."
)
@click.option("--quiet", is_flag=True, help="No progress output.")
def train_draft_cmd(
    target: str,
    data: tuple[str, ...],
    out: Path,
    as_json: bool,
    quiet: bool,
    layers: str | None,
    holdout_prompts: tuple[str, ...],
    **options,
) -> None:
    """Train an EAGLE-3 draft head for TARGET (a recipe, e.g. smollm2-135m, or a model source) on the CPU.

    The head is written in the published format (config.json + model.safetensors), readable by
    specexport (recipe draft.eagle3), vLLM, SGLang and llama.cpp's converter; docs/training.md."""
    from ..train.config import TrainConfig, parse_layer_ids
    from ..train.draft import train_draft

    kwargs = {k: v for k, v in options.items() if v is not None}
    if layers is not None:
        kwargs["layers"] = parse_layer_ids(layers)
    if holdout_prompts:
        kwargs["holdout_prompts"] = tuple(p.strip() for item in holdout_prompts for p in item.split(",") if p.strip())
    config = TrainConfig(target=target, data=data, out=out, **kwargs)
    bar = _TrainBar(not quiet and not as_json)
    try:
        report = train_draft(config, progress=bar)
    finally:
        bar.close()
    if as_json:
        summary = report.to_dict()
        summary.pop("loss_history")
        click.echo(json.dumps(summary, indent=2))
        return
    click.echo(
        f"wrote {report.out} (layers {list(report.layer_ids)}, draft vocabulary {report.draft_vocab['size']}, "
        f"covering {report.draft_vocab['coverage_of_train_tokens']:.1%} of the training tokens)"
    )
    click.echo(
        f"  steps {report.start_step}..{report.steps}, {report.tokens_trained} tokens trained, "
        f"{report.tokens_per_second:.0f} tokens/s, {report.seconds['train']:.0f} s training"
    )
    click.echo("  loss per TTT step " + ", ".join(f"{x:.3f}" for x in report.final_losses))
    if report.agreement is not None:
        click.echo("  held-out top-1 agreement per TTT step " + ", ".join(f"{a:.1%}" for a in report.agreement))

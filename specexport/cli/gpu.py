"""GPU-planning commands of `specexport`: `check-trt` and `plan`.

Defined here so that specexport/cli/main.py only registers them:

    from .gpu import check_trt_cmd, plan_cmd
    cli.add_command(check_trt_cmd)   # specexport check-trt
    cli.add_command(plan_cmd)        # specexport plan

Neither command needs a GPU or TensorRT: both read shapes and graph structure only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click


@click.command("check-trt")
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@click.option(
    "--trt-version",
    default=None,
    help="TensorRT version of the device (default 10.3: JetPack 6.1/6.2 on Orin; JetPack 6.0 has 8.6,"
    " Thor/JetPack 7 a newer 10.x).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def check_trt_cmd(path: Path, trt_version: str | None, as_json: bool) -> None:
    """Check that an artifact's graphs (or one .onnx file) can be built by TensorRT.

    PATH is an artifact folder (every graph of its manifest) or an .onnx file. Operators are
    checked against TensorRT's ONNX operator support matrix for --trt-version, plus types and
    dynamic dimensions. Exit code 0 when every graph passes (warnings allowed), 1 otherwise."""
    from ..plan.trtcheck import DEFAULT_TRT_VERSION, check_artifact, check_trt

    version = trt_version or DEFAULT_TRT_VERSION
    report = check_artifact(path, version) if path.is_dir() else check_trt(path, version)
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else "\n".join(report.lines()))
    sys.exit(0 if report.ok else 1)


@click.command("plan")
@click.argument("recipe")
@click.option(
    "--device",
    "device",
    required=True,
    help="Device name, e.g. orin-nano-8gb, agx-orin-64gb, thor, rtx-4090 (`--device list` lists them).",
)
@click.option("--max-context", type=int, default=None, help="Plan for this max_context instead of the recipe's.")
@click.option(
    "--max-prompt",
    type=int,
    default=None,
    help="Longest prompt fed in one call (default: max_context; TensorRT engines chunk at 512).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan_cmd(recipe: str, device: str, max_context: int | None, max_prompt: int | None, as_json: bool) -> None:
    """Estimate whether RECIPE (a YAML path or bundled recipe name) fits a device's memory.

    Weights, both KV caches at max context, working memory and runtime overhead against the
    device's usable memory; when it does not fit, what to change. Exit code 0 when it fits,
    1 when it does not."""
    from ..plan.estimate import DEVICES, plan

    if device == "list":
        for dev in DEVICES.values():
            click.echo(
                f"{dev.name:<15} {dev.label:<34} {dev.memory_gib:>5g} GiB, budget {dev.budget_bytes / 2**30:.1f} GiB"
            )
        return
    report = plan(recipe, device, max_prompt=max_prompt, max_context=max_context)
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else "\n".join(report.lines()))
    sys.exit(0 if report.fits else 1)

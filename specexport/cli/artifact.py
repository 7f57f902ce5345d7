"""Click commands for shipping artifacts: `inspect`, `pack`, `keygen` and `sign` (registered on the
`specexport` group in cli.py)."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command()
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
    from ..build.inspect import summarize

    summary = summarize(artifact, verify=not no_verify, trusted_keys=trusted_keys)
    click.echo(json.dumps(summary, indent=2) if as_json else "\n".join(_lines(summary)))


@click.command()
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


@click.command()
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


@click.command()
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


@click.command("triton-repo")
@click.argument("artifact", type=click.Path(path_type=Path, exists=True))
@click.option(
    "-o",
    "--output",
    "output",
    required=True,
    type=click.Path(path_type=Path),
    help="The model repository folder to write (must not exist; written next to it, then renamed).",
)
@click.option("--name", default=None, help="The model's name in Triton (default: the artifact's name).")
@click.option("--instances", type=int, default=1, show_default=True, help="Model instances (instance_group count).")
@click.option("--threads", type=int, default=None, help="ONNX Runtime threads per instance (default: all cores).")
@click.option(
    "--provider",
    type=click.Choice(["cpu", "cuda", "tensorrt"]),
    default="cpu",
    show_default=True,
    help="ONNX Runtime execution provider inside Triton (cuda/tensorrt: instance kind KIND_GPU).",
)
@click.option(
    "--trusted-key",
    "trusted_keys",
    multiple=True,
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="An ed25519 public key (PEM), repeatable: the artifact must be signed by one of them, here and"
    " again when Triton loads it (the keys are copied into the repository).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (repository, model, files, signed).")
def triton_repo(
    artifact: Path,
    output: Path,
    name: str | None,
    instances: int,
    threads: int | None,
    provider: str,
    trusted_keys: tuple[Path, ...],
    as_json: bool,
) -> None:
    """Write a Triton Inference Server model repository for ARTIFACT (a folder or a .spx): config.pbtxt
    (Python backend, decoupled, inputs and outputs of Triton's generate extension), model.py (the
    speculative loop, streaming a response per round) and the verified artifact. docs/serving.md."""
    import json

    from specexport_runtime.triton.repo import RepoSettings, write_repository

    settings = RepoSettings(name=name, instances=instances, threads=threads, provider=provider)
    report = write_repository(artifact, output, settings, list(trusted_keys) or None)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "repository": str(report.repository),
                    "model": report.model,
                    "files": report.files,
                    "signed": report.signed,
                }
            )
        )
    else:
        signed = ", signature checked at load" if report.signed else ""
        click.echo(f"wrote {report.repository}/{report.model} ({report.files} files{signed})")

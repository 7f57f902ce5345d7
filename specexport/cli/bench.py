"""Click commands `bench` and `calibrate` (registered on the `specexport` group in cli.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from specexport_runtime import registry
from specexport_runtime.constants import HYBRID_RETRIEVALS, MAX_GAMMA, MIN_GAMMA
from specexport_runtime.errors import InvalidArgument
from specexport_runtime.suffix import SuffixConfig

from ..bench.calibrate_trees import DEFAULT_TREE_NODES, TREE_DRAFTERS
from ..bench.prompts import DOMAINS

# what --proposer offers calibrate: the proposers with a draft step to time, and the tree drafters
CALIBRATED_NAMES = [n for n in registry.names() if registry.get(n).calibrate or n in TREE_DRAFTERS]


def _split(values: tuple[str, ...]) -> list[str]:
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


def parse_gammas(text: str) -> list[int | None]:
    """'2,4,8' -> [2, 4, 8]; 'adaptive' -> [None]; mixing is allowed ('adaptive,4')."""
    out: list[int | None] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part == "adaptive":
            out.append(None)
            continue
        try:
            g = int(part)
        except ValueError:
            raise click.BadParameter(f"{part!r} is neither an integer nor 'adaptive'", param_hint="--gamma") from None
        if not MIN_GAMMA <= g <= MAX_GAMMA:
            raise click.BadParameter(f"gamma {g} is outside {MIN_GAMMA}..{MAX_GAMMA}", param_hint="--gamma")
        out.append(g)
    if not out:
        raise click.BadParameter("give at least one gamma or 'adaptive'", param_hint="--gamma")
    if len(set(out)) != len(out):
        raise click.BadParameter(f"repeated value in {text!r}", param_hint="--gamma")
    return out


class _Progress:
    """A tqdm bar on stderr fed by the (done, total, label) callback."""

    def __init__(self, enabled: bool, unit: str):
        self.enabled, self.unit, self.bar = enabled, unit, None

    def __call__(self, done: int, total: int, label: str) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit=self.unit, file=sys.stderr, dynamic_ncols=True)
        self.bar.set_postfix_str(label, refresh=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option(
    "--prompts",
    "prompt_specs",
    multiple=True,
    default=("all",),
    show_default=True,
    help="Prompt set: a domain (" + ", ".join(DOMAINS) + "), 'all', or a prompt file: JSONL (messages, prompt"
    " or text per line) or plain text (one prompt per line); repeatable or comma-separated.",
)
@click.option(
    "--proposer",
    type=click.Choice(registry.speculative_names()),
    default=None,
    help="; ".join(f"{n}: {registry.get(n).label}" for n in registry.speculative_names())
    + " (the suffix store of earlier answers is emptied before every run); default: the artifact's.",
)
@click.option(
    "--hybrid-retrieval",
    type=click.Choice(HYBRID_RETRIEVALS),
    default=None,
    help="What hybrid retrieves with besides its draft: n-gram prompt lookup, or suffix drafts (request"
    " and earlier answers) where they score, then lookup (default: the artifact's).",
)
@click.option(
    "--suffix-factor",
    type=float,
    default=None,
    help="Suffix proposer (alone or as hybrid's retrieval): draft up to this many tokens per matched token,"
    " fixed (default: 1.0, scaled x0.5 / x1 / x2 by whichever measures fastest on the target).",
)
@click.option(
    "--suffix-max-spec",
    type=int,
    default=None,
    help="Suffix proposer: most tokens per draft, fixed (default: 16, tuned like --suffix-factor; one"
    " verify call holds at most 63).",
)
@click.option(
    "--sequential",
    is_flag=True,
    help="Run each domain's prompts in order as one session: the suffix proposer keeps earlier answers"
    " from prompt to prompt (learning across requests); reports the first and last third's speedup.",
)
@click.option(
    "--constrained",
    is_flag=True,
    help="Decode under each prompt's constraint (its 'schema' or 'tools', e.g. --prompts"
    " structured_json) with speculation off and on; reports valid answers and forced tokens.",
)
@click.option(
    "--gamma",
    "gamma_text",
    default="adaptive",
    show_default=True,
    help="Draft lengths to compare with speculation off: a comma list such as 2,4,8, and/or 'adaptive'.",
)
@click.option(
    "--temperature",
    type=float,
    default=0.0,
    show_default=True,
    help="0 = greedy (outputs are checked for equality); > 0 = sampling (quality is compared instead).",
)
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass in (0, 1].")
@click.option("--top-k", type=int, default=0, show_default=True, help="Keep the k most likely tokens (0 = off).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of sampling and of the bootstrap intervals.")
@click.option("--repeats", type=int, default=3, show_default=True, help="Runs per prompt and configuration.")
@click.option(
    "--max-new-tokens",
    type=int,
    default=None,
    help="Tokens to generate per prompt (default: each prompt's own max_new_tokens).",
)
@click.option("--limit", type=int, default=None, help="Use at most N prompts per domain (the first N of each set).")
@click.option("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: all cores).")
@click.option(
    "--json",
    "json_out",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Write the full report as JSON to this file ('-' for stdout).",
)
@click.option(
    "--markdown",
    "md_out",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Write the report as Markdown to this file.",
)
@click.option(
    "--plot",
    "plot_dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Write PNG plots into this folder (needs matplotlib: pip install 'specexport[plot]').",
)
@click.option("--quiet", is_flag=True, help="No progress bar.")
def bench(
    artifact: Path,
    prompt_specs: tuple[str, ...],
    proposer: str | None,
    hybrid_retrieval: str | None,
    suffix_factor: float | None,
    suffix_max_spec: int | None,
    sequential: bool,
    constrained: bool,
    gamma_text: str,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int,
    repeats: int,
    max_new_tokens: int | None,
    limit: int | None,
    threads: int | None,
    json_out: Path | None,
    md_out: Path | None,
    plot_dir: Path | None,
    quiet: bool,
) -> None:
    """Benchmark ARTIFACT with speculation off versus on over prompt sets.

    Prints acceptance, tokens/s and speedup with a 95% CI, latency percentiles, draft
    overhead and output equivalence (greedy) or quality (sampling); docs/benchmarking.md
    explains every figure."""
    from ..bench.harness import load_prompt_set
    from ..bench.plots import write_plots
    from ..bench.report import BenchError
    from ..bench.run import run_bench

    gammas = parse_gammas(gamma_text)
    try:
        suffix = SuffixConfig.fixed_limit(suffix_factor, suffix_max_spec)
    except InvalidArgument as exc:
        raise click.BadParameter(str(exc), param_hint="--suffix-factor / --suffix-max-spec") from None
    if limit is not None and limit < 1:
        raise click.BadParameter("must be >= 1", param_hint="--limit")
    if plot_dir is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.UsageError("--plot needs matplotlib: pip install 'specexport[plot]'") from None
    prompts = load_prompt_set(_split(prompt_specs), limit=limit)
    bar = _Progress(not quiet, "run")
    try:
        report = run_bench(
            artifact,
            prompts,
            proposer=proposer,
            gammas=gammas,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            repeats=repeats,
            max_new_tokens=max_new_tokens,
            threads=threads,
            shared_pool=True,
            progress=bar,
            hybrid_retrieval=hybrid_retrieval,
            sequential=sequential,
            suffix=suffix,
            constrained=constrained,
        )
    except BenchError as exc:
        raise click.UsageError(str(exc)) from None
    finally:
        bar.close()
    to_stdout = json_out is not None and str(json_out) == "-"
    if not to_stdout:
        click.echo("\n".join(report.summary_lines()))
    if json_out is not None:
        text = json.dumps(report.to_dict(), indent=2)
        if to_stdout:
            click.echo(text)
        else:
            json_out.write_text(text + "\n", encoding="utf-8")
            click.echo(f"  json        {json_out}")
    if md_out is not None:
        md_out.write_text(report.to_markdown(), encoding="utf-8")
        click.echo(f"  markdown    {md_out}", err=to_stdout)
    if plot_dir is not None:
        for path in write_plots(report, plot_dir):
            click.echo(f"  plot        {path}", err=to_stdout)


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option(
    "--domains",
    "domain_args",
    multiple=True,
    default=DOMAINS,
    show_default=True,
    help="Domains to calibrate (repeatable or comma-separated); 'default' pools them all.",
)
@click.option(
    "--proposer",
    "proposer_args",
    multiple=True,
    type=click.Choice(CALIBRATED_NAMES),
    help="Proposers to calibrate (repeatable; default: every one the artifact allows; suffix and assistant"
    " for their trees, on an artifact with a tree graph).",
)
@click.option(
    "--tree-nodes",
    "tree_text",
    default=",".join(map(str, DEFAULT_TREE_NODES)),
    show_default=True,
    help="Candidate tree sizes run on an artifact with a tree graph (comma list; 'none': chains only).",
)
@click.option(
    "--prompts",
    "prompt_specs",
    multiple=True,
    default=(),
    help="Prompt sets to draw from instead of the shipped ones: a JSONL file, a domain or 'all' (repeatable).",
)
@click.option(
    "--gammas",
    "gamma_text",
    default="1,2,3,4,6,8",
    show_default=True,
    help="Candidate draft lengths (comma list); the largest is run so every position is observed.",
)
@click.option(
    "--device",
    "device_name",
    default=None,
    help="Profile name for this machine (default: machine-provider-cores); another name adds a profile.",
)
@click.option("--prompts-per-domain", type=int, default=6, show_default=True, help="Prompts per domain (the first N).")
@click.option(
    "--max-new-tokens", type=int, default=64, show_default=True, help="Tokens generated per prompt (at most)."
)
@click.option("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: all cores).")
@click.option(
    "--no-default", is_flag=True, help="Keep the current default profile instead of making this one the default."
)
@click.option("--dry-run", is_flag=True, help="Measure and print, but do not write calibration.json.")
@click.option("--json", "as_json", is_flag=True, help="Print the calibration document as JSON.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def calibrate(
    artifact: Path,
    domain_args: tuple[str, ...],
    proposer_args: tuple[str, ...],
    prompt_specs: tuple[str, ...],
    gamma_text: str,
    tree_text: str,
    device_name: str | None,
    prompts_per_domain: int,
    max_new_tokens: int,
    threads: int | None,
    no_default: bool,
    dry_run: bool,
    as_json: bool,
    quiet: bool,
) -> None:
    """Measure acceptance per domain and this machine's costs, pick gamma per domain and
    proposer, and store it in ARTIFACT/calibration.json (checksum added to the manifest)."""
    from ..bench.calibrate import calibrate as run_calibration
    from ..bench.calibrate import default_device_name
    from ..bench.harness import load_prompt_set

    domains = _split(domain_args)
    bad = [d for d in domains if d not in DOMAINS]
    if bad:
        raise click.BadParameter(f"{bad[0]!r} is not one of {', '.join(DOMAINS)}", param_hint="--domains")
    gammas = [g for g in parse_gammas(gamma_text) if g is not None]
    if not gammas:
        raise click.BadParameter("give integer gammas", param_hint="--gammas")
    try:
        tree_nodes = [] if tree_text.strip().lower() == "none" else [int(n) for n in tree_text.split(",") if n.strip()]
    except ValueError as exc:
        message = f"{tree_text!r} is not a comma list of integers or 'none'"
        raise click.BadParameter(message, param_hint="--tree-nodes") from exc
    device = device_name or default_device_name()
    prompts = load_prompt_set(_split(prompt_specs)) if prompt_specs else None
    bar = _Progress(not quiet and not as_json, "run")
    try:
        doc = run_calibration(
            artifact,
            domains=domains,
            proposers=list(proposer_args) or None,
            gammas=gammas,
            prompts_per_domain=prompts_per_domain,
            max_new_tokens=max_new_tokens,
            device_name=device,
            prompts=prompts,
            threads=threads,
            progress=bar,
            shared_pool=True,
            set_default=not no_default,
            write=not dry_run,
            tree_nodes=tree_nodes,
        )
    finally:
        bar.close()
    if as_json:
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
        return
    prof = doc["profiles"][device]
    c = prof["costs"]
    click.echo(
        f"calibration profile {device!r}"
        + (" (dry run, not written)" if dry_run else f" -> {artifact / 'calibration.json'}")
    )
    ratios = ", ".join(f"{p} {v:.3f}" for p, v in c["ratios"]["c"].items())
    click.echo(f"  costs       decode {c['decode_s'] * 1e3:.2f} ms; draft step / decode: {ratios}")
    click.echo("  verify/decode " + " ".join(f"S={s}:{v:.2f}" for s, v in c["ratios"]["v"].items()))
    if c.get("tree_ratios"):
        click.echo("  tree/decode  " + " ".join(f"R={r}:{v:.2f}" for r, v in c["tree_ratios"]["v"].items()))
    for d, per in prof["domains"].items():
        parts = [
            f"{p} gamma {e['gamma']}"
            + (f" tree_nodes {e['tree_nodes']}" if "tree_nodes" in e else "")
            + f" (x{e['expected_speedup']:.2f}, acceptance {e['acceptance_rate']:.2f})"
            for p, e in per.items()
        ]
        click.echo(f"  {d:<11} " + "; ".join(parts))
    click.echo(f"  default profile: {doc['default_profile']}; profiles: {', '.join(doc['profiles'])}")


commands = [bench, calibrate]

"""`specexport build`, packaging: tokenizer, chat template, recipe, datastore and the manifest
beside the graphs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specexport_runtime import contract
from specexport_runtime.constants import DEFAULT_NGRAM_SIZES
from specexport_runtime.manifest import (
    Manifest,
    ModelEntry,
    RetrievalEntry,
    SpeculationDefaults,
    TokenizerEntry,
    write_manifest,
)

from .. import __version__
from ..models.tokcheck import tokenizer_hash
from ..recipe.spec import Recipe
from .datastore import SUFFIX_ARRAY_NAME, TOKENS_NAME, build_datastore, corpus_files

if TYPE_CHECKING:
    from .load import LoadedModels
    from .progress import Clock, Progress


def _eos_ids(tokenizer, model) -> tuple[int, ...]:
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "eos_token_id", None), tokenizer.eos_token_id):
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if item is not None and int(item) not in ids:
                ids.append(int(item))
    return tuple(ids)


def package_artifact(
    recipe: Recipe,
    root: Path,
    m: LoadedModels,
    target_entry: ModelEntry,
    draft_entry: ModelEntry | None,
    progress: Progress,
    clock: Clock,
) -> Manifest:
    """Tokenizer, chat template, recipe, datastore and the manifest beside the graphs."""
    tok = m.tokenizer
    tok.backend_tokenizer.save(str(root / "tokenizer.json"))
    template = getattr(tok, "chat_template", None)
    if isinstance(template, str) and template:
        (root / "chat_template.jinja").write_text(template, encoding="utf-8")
    (root / "recipe.json").write_text(json.dumps(recipe.to_dict(), indent=2), encoding="utf-8")
    retrieval = None
    if recipe.retrieval is not None:
        progress("datastore")
        retrieval = _datastore(recipe, root)
        clock.stage("datastore")
    manifest = Manifest(
        name=recipe.name,
        max_context=recipe.max_context,
        target=target_entry,
        draft=draft_entry,
        tokenizer=TokenizerEntry(
            file="tokenizer.json",
            chat_template="chat_template.jinja" if (root / "chat_template.jinja").exists() else None,
            eos_token_ids=_eos_ids(tok, m.reference),
            bos_token_id=tok.bos_token_id,
            add_bos=bool(tok("a")["input_ids"][:1] == [tok.bos_token_id]) if tok.bos_token_id is not None else False,
            sha256=tokenizer_hash(tok),
        ),
        speculation=SpeculationDefaults(
            proposer=recipe.proposer,
            gamma=recipe.speculation.gamma,
            ngram_sizes=tuple(recipe.draft.ngram_sizes) or DEFAULT_NGRAM_SIZES,
            hybrid_retrieval=recipe.speculation.hybrid_retrieval,
        ),
        generation={"max_gamma": recipe.speculation.max_gamma, "adaptive": recipe.speculation.adaptive},
        tools=_tool_versions(),
        retrieval=retrieval,
        contract_version=_declared_version(target_entry, draft_entry),
    )
    write_manifest(root, manifest)
    return manifest


def _datastore(recipe: Recipe, root: Path) -> RetrievalEntry:
    """Tokenize recipe.retrieval.corpus with the artifact's own tokenizer (tokenizer.json, as the
    runtime will) into retrieval/*.npy."""
    from tokenizers import Tokenizer

    spec = recipe.retrieval
    files = corpus_files(spec.corpus, Path.cwd())
    info = build_datastore(files, Tokenizer.from_file(str(root / "tokenizer.json")), spec.max_tokens, root)
    return RetrievalEntry(
        tokens=TOKENS_NAME,
        suffix_array=SUFFIX_ARRAY_NAME,
        token_count=info.tokens,
        info={**info.to_dict(), "corpus": list(spec.corpus), "max_tokens": spec.max_tokens},
    )


def _declared_version(*entries: ModelEntry | None) -> str:
    """The lowest contract version defining every graph's layout, so that older runtimes still
    read artifacts that do not need the newer layout."""
    versions = [e.required_version for e in entries if e is not None]
    return max(versions, key=contract.parse_version)


def _tool_versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import transformers

    return {
        "specexport": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
    }

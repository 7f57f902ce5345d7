"""Data for `specexport train-draft`: the frozen target (tokenizer, features), text sources,
self-distilled answers (calibration, instructions; cached), windows, the draft vocabulary and
batches (docs/training.md, "Data")."""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..build.eagle import target_embedding
from ..formats.eagle3 import TargetShape
from .config import MIN_WINDOW, NAMED_SOURCES, Progress, TrainConfig, TrainDraftError, is_int
from .head import TargetBatch

DATA_EXTENSIONS = (".py", ".md", ".txt", ".rst")
_SKIP_DIRS = {"__pycache__", ".git", ".hg", ".svn", "node_modules", ".tox", ".venv"}

# ------------------------------------------------------------------------------------ target


@dataclass
class FrozenTarget:
    model: object  # transformers causal LM, eval, frozen
    tokenizer: object
    description: str
    shape: TargetShape
    embed: torch.Tensor  # [V_t, H]
    eos_ids: tuple[int, ...]
    pad_id: int
    key: str  # identity of the weights (calibration answer cache)


def resolve_target(target: str):
    """(ModelSource, trust_remote_code, description) of a recipe's target or a model source."""
    from ..models.sources import resolve_source
    from ..recipe.load import RECIPES_DIR, load_recipe, resolve_recipe

    path = Path(target)
    is_recipe = path.suffix in (".yaml", ".yml") or ("/" not in target and (RECIPES_DIR / f"{target}.yaml").is_file())
    if is_recipe:
        recipe = load_recipe(resolve_recipe(target))
        spec = recipe.target
        source = resolve_source(spec.model, spec.gguf_file, spec.revision)
        return (
            source,
            spec.trust_remote_code,
            f"recipe {recipe.name}: {spec.model} (trained against its float32 weights)",
        )
    source = resolve_source(target)
    return source, False, source.describe()


def load_target(target: str) -> FrozenTarget:
    from ..models.sources import load_model, load_tokenizer

    source, trust, description = resolve_target(target)
    model = load_model(source, "float32", trust)
    model.requires_grad_(False)
    tokenizer = load_tokenizer(source, trust)
    shape = TargetShape.from_hf_config(model.config)
    embed = target_embedding(model)
    if embed.shape[1] != shape.hidden_size:
        raise TrainDraftError(
            f"the target's embedding width {embed.shape[1]} != its hidden size {shape.hidden_size}: "
            f"an EAGLE-3 head takes the target's embedding at its own width"
        )
    eos = set()
    for value in (
        tokenizer.eos_token_id,
        getattr(model.config, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        for i in value if isinstance(value, (list, tuple)) else [value]:
            if is_int(i) and 0 <= i < shape.vocab_size:
                eos.add(int(i))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (min(eos) if eos else 0)
    digest = hashlib.sha256(description.encode())
    digest.update(model.config.to_json_string().encode())
    digest.update(embed[: min(8, embed.shape[0])].numpy().tobytes())
    return FrozenTarget(
        model, tokenizer, description, shape, embed, tuple(sorted(eos)), int(pad), digest.hexdigest()[:16]
    )


# -------------------------------------------------------------------------------------- data


@dataclass
class Window:
    ids: np.ndarray  # int64 [n], n <= seq_len
    first_row: int = 0  # first target row in the loss region (calibration: the row predicting the answer's first token)
    source: str = ""


def _collect_files(
    root: Path, max_file_bytes: int, accept: Callable[[Path], bool], exclude: Sequence[str] = ()
) -> tuple[list[Path], int]:
    """Files under root that `accept` takes (sorted walk, hidden and cache folders skipped), and
    how many were skipped for being larger than max_file_bytes."""
    files, skipped = [], 0
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith(".") and d not in exclude)
        for name in sorted(names):
            path = Path(folder) / name
            if not accept(path):
                continue
            try:
                size = path.stat().st_size
            except OSError:
                continue
            if 0 < size <= max_file_bytes:
                files.append(path)
            elif size > max_file_bytes:
                skipped += 1
    return files, skipped


def _read_texts(files: list[Path], max_bytes: int, seed: int) -> tuple[list[str], dict]:
    order = np.random.default_rng(seed).permutation(len(files)) if len(files) > 1 else range(len(files))
    texts, used, undecodable = [], 0, 0
    for i in order:
        if used >= max_bytes:
            break
        try:
            raw = files[int(i)].read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            undecodable += 1
            continue
        if text.strip():
            texts.append(text)
            used += len(raw)
    return texts, {"files_found": len(files), "files_used": len(texts), "bytes": used, "unreadable": undecodable}


def _text_source(item: str, config: TrainConfig) -> tuple[list[str], dict]:
    cap_file, cap_total = config.max_file_kb * 1024, int(config.max_data_mb * 1e6)
    if item == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files, skipped = _collect_files(
            root, cap_file, lambda f: f.suffix == ".py", exclude=("site-packages", "dist-packages")
        )
        kind = str(root)
    elif item == "site-docs":
        root = Path(sysconfig.get_paths()["purelib"])
        files, skipped = _collect_files(
            root,
            cap_file,
            lambda f: f.suffix in (".md", ".rst") or (f.name == "METADATA" and f.parent.name.endswith(".dist-info")),
        )
        kind = str(root)
    else:
        path = Path(item).expanduser()
        if path.is_file():
            files, skipped, kind = [path], 0, "file"
        elif path.is_dir():
            files, skipped = _collect_files(path, cap_file, lambda f: f.suffix in DATA_EXTENSIONS)
            kind = "folder"
        else:
            raise TrainDraftError(f"data {item!r} is neither a file, a folder nor one of {', '.join(NAMED_SOURCES)}")
    texts, info = _read_texts(files, cap_total, config.seed)
    if not texts:
        raise TrainDraftError(
            f"data {item!r} ({kind}) has no readable UTF-8 text files "
            f"({', '.join('*' + e for e in DATA_EXTENSIONS)}, at most {config.max_file_kb} KB each)"
        )
    return texts, {"source": item, "where": kind, **info, "skipped_large": skipped}


def _windows_of_texts(texts: list[str], tok: FrozenTarget, seq_len: int, name: str) -> list[Window]:
    """Documents joined with EOS (the target sees the previous document as context, as in packed
    pretraining), cut into windows of seq_len tokens; a tail shorter than MIN_WINDOW is dropped."""
    eos = tok.eos_ids[0] if tok.eos_ids else tok.pad_id
    stream: list[int] = []
    encoded = tok.tokenizer(texts, add_special_tokens=False)["input_ids"]
    for ids in encoded:
        stream.extend(ids)
        stream.append(eos)
    arr = np.asarray(stream, dtype=np.int64)
    return [Window(arr[i : i + seq_len], 0, name) for i in range(0, len(arr), seq_len) if len(arr) - i >= MIN_WINDOW]


def held_out_prompt_ids(specs: Sequence[str], limit: int | None) -> list[str]:
    """The benchmark's prompt ids (harness.load_prompt_set with the same --prompts / --limit)."""
    from ..bench.harness import load_prompt_set

    return [p.id for p in load_prompt_set(list(specs), limit=limit)] if specs else []


def _calibration_windows(tgt: FrozenTarget, config: TrainConfig, progress: Progress) -> tuple[list[Window], dict]:
    from ..bench.prompts import load_prompts

    held = set(held_out_prompt_ids(config.holdout_prompts, config.holdout_limit))
    prompts = [p for p in load_prompts("all") if p.id not in held]
    if not prompts:
        raise TrainDraftError(
            f"data 'calibration' has no prompt left: all {len(held)} calibration prompts are held out"
            " as the benchmark's "
            f"(holdout_prompts {list(config.holdout_prompts)}, holdout_limit {config.holdout_limit});"
            " hold out only the "
            f"first N per domain (--holdout-limit N, then bench with --limit N) or train on other data"
        )
    cache_dir = config.cache_dir or _default_cache()
    cache_path = cache_dir / f"answers-{tgt.key}.json"
    cache = read_json(cache_path) or {}
    windows, generated, answer_tokens, t0 = [], 0, 0, time.perf_counter()
    for n, p in enumerate(prompts):
        if p.is_chat:
            text = tgt.tokenizer.apply_chat_template(p.chat(), tokenize=False, add_generation_prompt=True)
            prompt_ids = tgt.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            prompt_ids = tgt.tokenizer(p.text, add_special_tokens=True)["input_ids"]
        budget = min(config.answer_tokens, p.max_new_tokens)
        key = f"{p.id}|{budget}|{hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest()[:16]}"
        if key not in cache:
            progress({"event": "stage", "message": "answering calibration prompts", "done": n, "total": len(prompts)})
            cache[key] = _greedy_answer(tgt, prompt_ids, budget)
            generated += 1
            if generated % 8 == 0:
                write_json(cache_path, cache)
        answer_tokens += len(cache[key])
        window = _sample_window(prompt_ids, cache[key], config.seq_len, "calibration")
        if window is not None:
            windows.append(window)
    if generated:
        write_json(cache_path, cache)
    info = {
        "source": "calibration",
        "where": str(cache_path),
        "prompts": len(prompts),
        "prompts_held_out": len(held),
        "answers_generated": generated,
        "answer_tokens": answer_tokens,
        "seconds_generating": round(time.perf_counter() - t0, 2),
    }
    return windows, info


def _sample_window(prompt_ids: list[int], answer: list[int], seq_len: int, name: str) -> Window | None:
    """prompt + answer as one window (the loss covers the answer from its first token on); a long
    prompt loses its start, never the answer; None when too short to train on."""
    ids = list(prompt_ids) + list(answer)
    start = max(0, len(ids) - seq_len)
    first_row = max(0, len(prompt_ids) - 1 - start)
    if len(ids) - start >= MIN_WINDOW and first_row < len(ids) - start - 1:
        return Window(np.asarray(ids[start:], dtype=np.int64), first_row, name)
    return None


def _instruction_windows(tgt: FrozenTarget, config: TrainConfig, progress: Progress) -> tuple[list[Window], dict]:
    """Synthesized requests (train_instructions.synthesize) answered by the target in batches; the
    answers are cached under the same cache folder as the calibration answers."""
    from . import instructions as train_instructions

    t0 = time.perf_counter()
    try:
        requests = train_instructions.synthesize(config.instructions, seed=config.seed)
    except ValueError as exc:
        raise TrainDraftError(f"data 'instructions': {exc}") from None
    prompts = []
    for _, request in requests:
        text = tgt.tokenizer.apply_chat_template(
            [{"role": "user", "content": request}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tgt.tokenizer(text, add_special_tokens=False)["input_ids"][-(config.seq_len // 2) :])
    cache_dir = config.cache_dir or _default_cache()
    cache_path = cache_dir / f"instructions-{tgt.key}.json"
    cache = read_json(cache_path) or {}
    keys = [f"{config.instruction_tokens}|{hashlib.sha256(json.dumps(p).encode()).hexdigest()[:16]}" for p in prompts]
    todo = sorted({k: i for i, k in enumerate(keys) if k not in cache}.values())
    done_before = len(prompts) - len(todo)

    chunk = 4 * config.answer_batch  # the cache is written after every chunk: an interrupted run keeps them
    for c in range(0, len(todo), chunk):
        progress(
            {
                "event": "stage",
                "message": "answering synthesized requests",
                "done": done_before + c,
                "total": len(prompts),
            }
        )
        part = todo[c : c + chunk]
        answers = train_instructions.answer(
            tgt.model, tgt.pad_id, [prompts[i] for i in part], config.instruction_tokens, config.answer_batch
        )
        cache.update({keys[i]: a for i, a in zip(part, answers)})
        write_json(cache_path, cache)
    windows = [
        w
        for p, k in zip(prompts, keys)
        if (w := _sample_window(p, cache[k], config.seq_len, "instructions")) is not None
    ]
    by_domain: dict[str, int] = {}
    for domain, _ in requests:
        by_domain[domain] = by_domain.get(domain, 0) + 1
    info = {
        "source": "instructions",
        "where": str(cache_path),
        "requests": len(requests),
        "by_domain": by_domain,
        "answers_generated": len(todo),
        "answer_tokens": int(sum(len(cache[k]) for k in keys)),
        "seconds_generating": round(time.perf_counter() - t0, 2),
    }
    return windows, info


@torch.no_grad()
def _greedy_answer(tgt: FrozenTarget, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids], dtype=torch.int64)
    out = tgt.model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tgt.pad_id,
    )
    return [int(i) for i in out[0, len(prompt_ids) :]]


def _default_cache() -> Path:
    from ..models.sources import cache_root

    return cache_root() / "train-draft"


def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)


def build_windows(tgt: FrozenTarget, config: TrainConfig, progress: Progress) -> tuple[list[Window], list[dict]]:
    windows, sources = [], []
    for item in config.data:
        progress({"event": "stage", "message": f"reading {item}"})
        if item == "calibration":
            got, info = _calibration_windows(tgt, config, progress)
        elif item == "instructions":
            got, info = _instruction_windows(tgt, config, progress)
        else:
            texts, info = _text_source(item, config)
            got = _windows_of_texts(texts, tgt, config.seq_len, item)
        info["windows"] = len(got)
        info["tokens"] = int(sum(len(w.ids) for w in got))
        windows.extend(got)
        sources.append(info)
    if len(windows) < 2:
        raise TrainDraftError(
            f"the data gives {len(windows)} window(s) of up to {config.seq_len} tokens; "
            f"training needs at least 2 (one held out)"
        )
    return windows, sources


def split_held_out(n: int, config: TrainConfig) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, held-out indices): a seeded fraction, at least 1 when held_out > 0, at most
    eval_sequences, always leaving one window to train on."""
    order = np.random.default_rng(config.seed).permutation(n)
    k = 0 if config.held_out == 0 else min(config.eval_sequences, n - 1, max(1, round(config.held_out * n)))
    return np.sort(order[k:]), np.sort(order[:k])


def choose_draft_vocab(
    windows: Sequence[Window], size: int, vocab: int, eos_ids: Sequence[int]
) -> tuple[np.ndarray, float]:
    """(sorted target ids [size], share of the windows' tokens they cover): the EOS ids, then the
    most frequent tokens (ties: lower id first), then the lowest unused ids if the data has fewer."""
    counts = np.zeros(vocab, dtype=np.int64)
    for w in windows:
        np.add.at(counts, w.ids[(w.ids >= 0) & (w.ids < vocab)], 1)
    chosen = list(dict.fromkeys(int(i) for i in eos_ids))[:size]
    taken = np.zeros(vocab, dtype=bool)
    taken[chosen] = True
    order = np.lexsort((np.arange(vocab), -counts))  # count descending, then id ascending
    for i in order:
        if len(chosen) >= size:
            break
        if not taken[i]:
            chosen.append(int(i))
            taken[i] = True
    ids = np.sort(np.asarray(chosen, dtype=np.int64))
    total = counts.sum()
    return ids, float(counts[ids].sum() / total) if total else 0.0


# --------------------------------------------------------------------------------- batches


def make_batch(
    tgt: FrozenTarget, windows: Sequence[Window], layer_ids: Sequence[int], draft_ids: torch.Tensor | None
) -> TargetBatch:
    """Run the frozen target on right-padded windows (causal, so padding never reaches a real row)."""
    S = max(len(w.ids) for w in windows)
    ids = torch.full((len(windows), S), tgt.pad_id, dtype=torch.int64)
    rows = torch.zeros((len(windows), S), dtype=torch.bool)
    for b, w in enumerate(windows):
        ids[b, : len(w.ids)] = torch.from_numpy(w.ids)
        rows[b, w.first_row : len(w.ids)] = True
    with torch.no_grad():
        out = tgt.model(input_ids=ids, output_hidden_states=True, use_cache=False)
        features = torch.cat([out.hidden_states[i] for i in layer_ids], dim=-1).float()  # [B, S, 3 H_t]
        logits = out.logits.float()  # [B, S, V_t]
        argmax = logits.argmax(-1)
        draft_logits = logits.index_select(-1, draft_ids) if draft_ids is not None else None
    return TargetBatch(ids, features, draft_logits, argmax, rows)

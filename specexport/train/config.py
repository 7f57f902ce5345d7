"""`specexport train-draft` configuration: TrainConfig (validated on creation), its errors and the
names of the data sources it accepts (docs/training.md)."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import BuildError

NAMED_SOURCES = ("calibration", "instructions", "stdlib", "site-docs")
SCHEDULES = ("cosine", "linear")
DEFAULT_DRAFT_VOCAB = 8192  # or the target's vocabulary when smaller (docs/training.md)
MIN_WINDOW = 16  # shorter tail windows / samples are dropped
CALIBRATE_PROMPTS_PER_DOMAIN = 6  # `specexport calibrate` measures the first 6 prompts per domain


class TrainDraftError(BuildError, ValueError):
    """train-draft cannot run: bad data, a target it cannot train for, a checkpoint that does not fit."""


class TrainConfigError(TrainDraftError):
    """A TrainConfig value is out of range or of the wrong type."""


Progress = Callable[[dict], None]  # {"event": "stage", "message"} | {"event": "step", ...} | {"event": "eval", ...}


# -------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class TrainConfig:
    """Everything train_draft needs; validated on creation (TrainConfigError names value and range)."""

    # a recipe (YAML path or bundled name): its target; else a model source (folder, .gguf, hub id, builtin:NAME)
    target: str
    data: tuple[str, ...]  # paths and/or NAMED_SOURCES
    out: Path  # the head folder to write (replaced atomically)
    steps: int | None = None  # total optimizer steps (a resumed run counts on from the checkpoint's step)
    epochs: float | None = None  # instead of steps; neither given: 1 epoch
    batch_size: int = 4  # sequences per step
    seq_len: int = 256  # tokens per sequence (window)
    lr: float = 5e-4  # AdamW peak learning rate
    schedule: str = "cosine"  # decay after warmup: SCHEDULES
    warmup: float = 0.03  # fraction of the steps with a linear warmup
    weight_decay: float = 0.0
    grad_clip: float = 0.5  # max gradient norm (0 = off)
    draft_vocab_size: int | None = None  # None: min(DEFAULT_DRAFT_VOCAB, the target's vocabulary)
    ttt_steps: int = 3  # training-time-test steps
    ttt_decay: float = 0.8  # weight of step k: ttt_decay ** k
    layers: tuple[int, int, int] | None = None  # entering-layer ids; None: (2, L // 2, L - 3)
    seed: int = 0
    held_out: float = 0.05  # fraction of the windows held out (at most eval_sequences of them)
    eval_sequences: int = 32
    eval_every: int = 100  # steps between held-out evaluations (and at the start and the end)
    save_every: int = 200  # steps between checkpoints written to `out` (0: at the end only)
    resume: Path | None = None  # a train-draft output folder or its checkpoint/ folder
    threads: int | None = None  # torch.set_num_threads; None: torch's default
    max_data_mb: float = 4.0  # text read per file / folder / named source (calibration excluded)
    max_file_kb: int = 512  # larger files are skipped (generated tables, data dumps)
    answer_tokens: int = 64  # greedy tokens generated per calibration prompt (at most the prompt's own max_new_tokens)
    instructions: int = 1000  # requests synthesized for data "instructions" (train_instructions.py)
    instruction_tokens: int = 160  # greedy tokens the target answers per synthesized request
    answer_batch: int = 16  # requests answered per batched generate call (instructions)
    holdout_prompts: tuple[str, ...] = ("all",)  # the benchmark's prompt sets (bench --prompts), never trained on
    holdout_limit: int | None = None  # the benchmark's --limit (first N per domain held out); None: all of them
    cache_dir: Path | None = None  # generated calibration answers; None: ~/.cache/specexport/train-draft

    def __post_init__(self) -> None:
        _require(
            isinstance(self.target, str) and self.target.strip() != "",
            f"target must be a recipe or a model source, got {self.target!r}",
        )
        data = self.data
        if isinstance(data, str) or not isinstance(data, (tuple, list)) or not data:
            raise TrainConfigError(
                f"data must name at least one file, folder or source ({', '.join(NAMED_SOURCES)}), got {data!r}"
            )
        for item in data:
            _require(
                isinstance(item, (str, os.PathLike)) and str(item).strip() != "",
                f"data entry {item!r} must be a path or one of {', '.join(NAMED_SOURCES)}",
            )
        object.__setattr__(self, "data", tuple(str(d) for d in data))
        object.__setattr__(self, "out", Path(self.out))
        if self.steps is not None and self.epochs is not None:
            raise TrainConfigError(f"give steps ({self.steps}) or epochs ({self.epochs}), not both")
        if self.steps is not None:
            _int("steps", self.steps, 1, 10_000_000)
        if self.epochs is not None:
            _float("epochs", self.epochs, 0.0, 1000.0, low_open=True)
        _int("batch_size", self.batch_size, 1, 1024)
        _int("seq_len", self.seq_len, MIN_WINDOW, 32768)
        _float("lr", self.lr, 0.0, 1.0, low_open=True)
        _require(self.schedule in SCHEDULES, f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        _float("warmup", self.warmup, 0.0, 0.5)
        _float("weight_decay", self.weight_decay, 0.0, 1.0)
        _float("grad_clip", self.grad_clip, 0.0, 1e6)
        if self.draft_vocab_size is not None:
            _int("draft_vocab_size", self.draft_vocab_size, 2, 1 << 24)
        _int("ttt_steps", self.ttt_steps, 1, 16)
        _require(
            self.ttt_steps + 2 <= self.seq_len,
            f"ttt_steps {self.ttt_steps} needs seq_len >= {self.ttt_steps + 2}, got {self.seq_len}",
        )
        _float("ttt_decay", self.ttt_decay, 0.0, 1.0, low_open=True)
        if self.layers is not None:
            layers = self.layers
            if (
                not isinstance(layers, (tuple, list))
                or len(layers) != 3
                or not all(is_int(i) and i >= 0 for i in layers)
            ):
                raise TrainConfigError(f"layers must be 3 non-negative integers (entering-layer ids), got {layers!r}")
            object.__setattr__(self, "layers", tuple(int(i) for i in layers))
        _int("seed", self.seed, 0, 2**32 - 1)
        _float("held_out", self.held_out, 0.0, 0.5)
        _int("eval_sequences", self.eval_sequences, 1, 100_000)
        _int("eval_every", self.eval_every, 1, 10_000_000)
        _int("save_every", self.save_every, 0, 10_000_000)
        if self.resume is not None:
            object.__setattr__(self, "resume", Path(self.resume))
        if self.threads is not None:
            _int("threads", self.threads, 1, 1024)
        _float("max_data_mb", self.max_data_mb, 0.0, 1e6, low_open=True)
        _int("max_file_kb", self.max_file_kb, 1, 1 << 30)
        _int("answer_tokens", self.answer_tokens, 1, 4096)
        _int("instructions", self.instructions, 1, 1_000_000)
        _int("instruction_tokens", self.instruction_tokens, 1, 4096)
        _int("answer_batch", self.answer_batch, 1, 1024)
        holdout = self.holdout_prompts
        if isinstance(holdout, str) or not isinstance(holdout, (tuple, list)):
            raise TrainConfigError(f"holdout_prompts must be a list of prompt sets (bench --prompts), got {holdout!r}")
        object.__setattr__(self, "holdout_prompts", tuple(str(h) for h in holdout))
        if self.holdout_limit is not None:
            _int(
                "holdout_limit",
                self.holdout_limit,
                CALIBRATE_PROMPTS_PER_DOMAIN,
                100_000,
                why=f" (specexport calibrate measures the first {CALIBRATE_PROMPTS_PER_DOMAIN} prompts of each domain)",
            )
        if self.cache_dir is not None:
            object.__setattr__(self, "cache_dir", Path(self.cache_dir))

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        for key in ("out", "resume", "cache_dir"):
            data[key] = None if data[key] is None else str(data[key])
        for key in ("data", "layers", "holdout_prompts"):
            data[key] = None if data[key] is None else list(data[key])
        return data


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise TrainConfigError(message)


def is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _int(name: str, value, lo: int, hi: int, why: str = "") -> None:
    if not is_int(value) or not lo <= value <= hi:
        raise TrainConfigError(f"{name} must be an integer in {lo}..{hi}{why}, got {value!r}")


def _float(name: str, value, lo: float, hi: float, low_open: bool = False) -> None:
    ok = isinstance(value, (int, float, np.floating)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (lo < value if low_open else lo <= value) and value <= hi
    if not ok:
        raise TrainConfigError(f"{name} must be a number in {'(' if low_open else '['}{lo:g}, {hi:g}], got {value!r}")


def parse_layer_ids(text: str) -> tuple[int, int, int]:
    """'2,15,27' -> (2, 15, 27) (entering-layer ids)."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    try:
        ids = tuple(int(p) for p in parts)
    except ValueError:
        raise TrainConfigError(f"layers must be 3 comma-separated integers such as 2,15,27, got {text!r}") from None
    if len(ids) != 3 or min(ids) < 0:
        raise TrainConfigError(f"layers must be 3 comma-separated non-negative integers such as 2,15,27, got {text!r}")
    return ids  # type: ignore[return-value]

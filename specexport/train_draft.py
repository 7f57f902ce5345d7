"""`specexport train-draft`: train an EAGLE-3 head for a target on the CPU (issue 11, docs/training.md).

The head is written in the published format (specexport/formats/eagle3.py), so specexport,
vLLM, SGLang and llama.cpp's converter read it.

Pipeline
  1. Target: a recipe's target or a model source, loaded with transformers in float32, frozen.
  2. Data (`data` entries, in order): files / folders (recursive *.py *.md *.txt *.rst, size-capped),
     "stdlib" (the Python standard library's sources), "site-docs" (Markdown / reST files and
     package descriptions in site-packages), "calibration" (the calibration prompts that are NOT
     held out for the benchmark, each with the target's own greedy answer, generated once and
     cached), "instructions" (chat requests in the benchmark's five domains synthesized from local
     stdlib functions and docs, train_instructions.py, with the target's own answers, cached). Text is tokenized with the target's tokenizer, documents are joined with EOS and cut
     into windows of `seq_len` tokens; a calibration sample is its prompt + answer (the loss covers
     the answer only). A seeded `held_out` fraction of the windows (at most `eval_sequences`) is
     kept out of training to measure agreement.
  3. Draft vocabulary: the `draft_vocab_size` most frequent target tokens of the training windows
     (plus every EOS id), sorted by id; d2t[i] = id_i - i, t2d True at those ids.
  4. Training (EAGLE-3, see ttt_forward / ttt_losses): per batch the target runs once
     (torch.no_grad, eval mode, output_hidden_states=True) and gives the features
     hidden_states[i] for the three entering-layer ids, concatenated, and its logits. The head then
     runs `ttt_steps` training-time-test steps; step k's loss is the soft cross-entropy of the
     head's draft-vocabulary log-softmax against the target's distribution restricted to the draft
     vocabulary, weighted by ttt_decay**k. AdamW, linear warmup then cosine or linear decay to
     FINAL_LR_RATIO of the peak, gradient clipping.
  5. Output (atomic): the head folder (config.json + model.safetensors), training.json (data,
     token counts, losses, held-out agreement per step, seconds, config) and checkpoint/ (weights,
     AdamW moments and step as safetensors + json, no pickle) that `resume` continues from.

Alignment (SafeAILab EAGLE `eagle/traineagle3/cnets.py`, Model.forward and LlamaAttention.forward,
read for this; the code here is written from that description). Tokens x_0..x_{S-1}, target
features f_t (from x_0..x_t), target logits z_j (row j predicts x_{j+1}). Head row t is the branch
that starts after the target's row t:
  step 0: h = fc(f_t), token x_{t+1}, rotary position t; attends causally to the step-0 rows
          0..t; its logits are trained against softmax(z_{t+1}) over the draft vocabulary, i.e. the
          distribution of x_{t+2}.
  step k: h = the head's own step-(k-1) hidden output of the SAME row t (no shift of h), token
          x_{t+1+k}, rotary position t+k, target softmax(z_{t+1+k}) (x_{t+2+k}); it attends to
          the step-0 keys of rows 0..t and to row t's own keys of steps 1..k, exactly the cache the
          runtime holds when it chains draft k after catching up on rows 0..t (tests/eagle_heads.py).
  Rows are kept only where the target row t+1+k exists, lies in the loss region (the answer of a
  calibration sample, everything for text) and, as in EAGLE, where the target's argmax is in the
  draft vocabulary (otherwise the draft cannot propose it). Held-out agreement of step k: the
  fraction of held-out rows (loss region, argmax outside the draft vocabulary counted as a miss)
  where d2t(argmax head logits) == argmax of the target's full logits z_{t+1+k}.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import sysconfig
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .errors import BuildError
from .formats.eagle3 import Eagle3Config, Eagle3Head, TargetShape, replace_folder, write_eagle3_head

# ----------------------------------------------------------------------------------- constants

DATA_EXTENSIONS = (".py", ".md", ".txt", ".rst")
NAMED_SOURCES = ("calibration", "instructions", "stdlib", "site-docs")
SCHEDULES = ("cosine", "linear")
DEFAULT_DRAFT_VOCAB = 8192  # or the target's vocabulary when smaller (docs/training.md)
FINAL_LR_RATIO = 0.1  # the schedule decays to this fraction of the peak
MIN_WINDOW = 16  # shorter tail windows / samples are dropped
CALIBRATE_PROMPTS_PER_DOMAIN = 6  # `specexport calibrate` measures the first 6 prompts per domain
CHECKPOINT_DIR = "checkpoint"
CHECKPOINT_TENSORS = "state.safetensors"
CHECKPOINT_JSON = "state.json"
CHECKPOINT_FORMAT = "specexport-train-draft-checkpoint/1"
REPORT_NAME = "training.json"
_SKIP_DIRS = {"__pycache__", ".git", ".hg", ".svn", "node_modules", ".tox", ".venv"}


class TrainDraftError(BuildError, ValueError):
    """train-draft cannot run: bad data, a target it cannot train for, a checkpoint that does not fit."""


class TrainConfigError(TrainDraftError):
    """A TrainConfig value is out of range or of the wrong type."""


Progress = Callable[[dict], None]  # {"event": "stage", "message"} | {"event": "step", ...} | {"event": "eval", ...}


# -------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class TrainConfig:
    """Everything train_draft needs; validated on creation (TrainConfigError names value and range)."""

    target: str  # a recipe (YAML path or bundled name): its target; else a model source (folder, .gguf, hub id, builtin:NAME)
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
        _require(isinstance(self.target, str) and self.target.strip() != "", f"target must be a recipe or a model source, got {self.target!r}")
        data = self.data
        if isinstance(data, str) or not isinstance(data, (tuple, list)) or not data:
            raise TrainConfigError(f"data must name at least one file, folder or source ({', '.join(NAMED_SOURCES)}), got {data!r}")
        for item in data:
            _require(isinstance(item, (str, os.PathLike)) and str(item).strip() != "", f"data entry {item!r} must be a path or one of {', '.join(NAMED_SOURCES)}")
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
        _require(self.ttt_steps + 2 <= self.seq_len, f"ttt_steps {self.ttt_steps} needs seq_len >= {self.ttt_steps + 2}, got {self.seq_len}")
        _float("ttt_decay", self.ttt_decay, 0.0, 1.0, low_open=True)
        if self.layers is not None:
            layers = self.layers
            if not isinstance(layers, (tuple, list)) or len(layers) != 3 or not all(_is_int(i) and i >= 0 for i in layers):
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
            _int("holdout_limit", self.holdout_limit, CALIBRATE_PROMPTS_PER_DOMAIN, 100_000,
                 why=f" (specexport calibrate measures the first {CALIBRATE_PROMPTS_PER_DOMAIN} prompts of each domain)")
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


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _int(name: str, value, lo: int, hi: int, why: str = "") -> None:
    if not _is_int(value) or not lo <= value <= hi:
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


# ---------------------------------------------------------------------------------- the head


@dataclass(frozen=True)
class HeadShape:
    hidden: int  # H (= the target's hidden size)
    target_hidden: int  # H_t
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    rope_theta: float
    draft_vocab: int


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


class _Attention(nn.Module):
    def __init__(self, s: HeadShape):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads, s.head_dim
        self.q_proj = _linear(2 * s.hidden, s.heads * s.head_dim)
        self.k_proj = _linear(2 * s.hidden, s.kv_heads * s.head_dim)
        self.v_proj = _linear(2 * s.hidden, s.kv_heads * s.head_dim)
        self.o_proj = _linear(s.heads * s.head_dim, s.hidden)


class _MLP(nn.Module):
    def __init__(self, s: HeadShape):
        super().__init__()
        self.gate_proj = _linear(s.hidden, s.intermediate)
        self.up_proj = _linear(s.hidden, s.intermediate)
        self.down_proj = _linear(s.intermediate, s.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Midlayer(nn.Module):
    def __init__(self, s: HeadShape):
        super().__init__()
        self.input_layernorm = _RMSNorm(s.hidden, s.eps)
        self.hidden_norm = _RMSNorm(s.hidden, s.eps)
        self.self_attn = _Attention(s)
        self.post_attention_layernorm = _RMSNorm(s.hidden, s.eps)
        self.mlp = _MLP(s)


class Eagle3Draft(nn.Module):
    """The trainable head; its state_dict names are exactly the published ones (formats/eagle3.py).
    The token embedding is the target's, frozen, passed in (never a parameter, never saved)."""

    def __init__(self, shape: HeadShape):
        super().__init__()
        self.shape = shape
        self.fc = _linear(3 * shape.target_hidden, shape.hidden)
        self.midlayer = _Midlayer(shape)
        self.norm = _RMSNorm(shape.hidden, shape.eps)
        self.lm_head = _linear(shape.hidden, shape.draft_vocab)

    def step(self, e: torch.Tensor, h: torch.Tensor, positions: torch.Tensor,
             cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One training-time-test step k = len(cache) over S_k rows (module docstring).

        e [B, S_k, H] embeddings of the step's tokens; h [B, S_k, H] fc(features) at step 0 or the
        step-(k-1) hidden output of the same rows; positions [S_k] rotary positions (t + k).
        cache: (K_i, V_i) of steps 0..k-1, each [B, kv_heads, S_i, hd] rotated (S_i >= S_k); this
        step's keys are appended. Row t attends to the step-0 rows 0..t (causal) and to its own
        row of steps 1..k. Returns the hidden output [B, S_k, H]."""
        m, a = self.midlayer, self.midlayer.self_attn
        B, S, _ = h.shape
        x = torch.cat([m.input_layernorm(e), m.hidden_norm(h)], dim=-1)  # [B, S, 2H]
        q = a.q_proj(x).view(B, S, a.heads, a.head_dim).transpose(1, 2)  # [B, nh, S, hd]
        k = a.k_proj(x).view(B, S, a.kv_heads, a.head_dim).transpose(1, 2)  # [B, nkv, S, hd]
        v = a.v_proj(x).view(B, S, a.kv_heads, a.head_dim).transpose(1, 2)
        cos, sin = _rope(positions, a.head_dim, self.shape.rope_theta)  # [S, hd]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        cache.append((k, v))
        step = len(cache) - 1
        groups = a.heads // a.kv_heads
        keys = torch.cat([ck[:, :, :S] for ck, _ in cache], dim=2).repeat_interleave(groups, dim=1)  # [B, nh, (k+1)S, hd]
        values = torch.cat([cv[:, :, :S] for _, cv in cache], dim=2).repeat_interleave(groups, dim=1)
        rows = torch.arange(S)
        causal = rows[None, :] <= rows[:, None]  # [S, S] block of the step-0 keys
        own = torch.eye(S, dtype=torch.bool).repeat(1, step)  # [S, k S]: row t sees its own row of steps 1..k
        mask = torch.cat([causal, own], dim=1)  # [S, (k+1) S]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [B, nh, S, hd]
        out = a.o_proj(out.transpose(1, 2).reshape(B, S, a.heads * a.head_dim))
        r = out + h  # the attention block's residual is h itself
        return r + m.mlp(m.post_attention_layernorm(r))  # [B, S, H]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))  # [.., draft_vocab]


def _rope(positions: torch.Tensor, hd: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, hd] of the rotate-half rotary embedding (plain, unscaled: what the published
    format supports)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def ttt_forward(model: Eagle3Draft, embed: torch.Tensor, features: torch.Tensor, ids: torch.Tensor,
                steps: int) -> list[torch.Tensor]:
    """Head logits of every training-time-test step (module docstring, "Alignment").

    embed [V_t, H] the target's embedding; features [B, S, 3 H_t] (row t from tokens x_0..x_t);
    ids [B, S]. Returns logits_k [B, S - 1 - k, draft_vocab] for k < steps: row t of step k
    predicts x_{t+2+k} and is trained against the target's logits row t+1+k."""
    S = ids.shape[1]
    cache: list[tuple[torch.Tensor, torch.Tensor]] = []
    h = model.fc(features[:, : S - 1])  # [B, S-1, H]: step 0 rows t = 0..S-2
    out = []
    for k in range(steps):
        n = S - 1 - k  # rows whose token x_{t+1+k} and target row t+1+k exist
        if n <= 0:
            break
        e = F.embedding(ids[:, 1 + k : 1 + k + n], embed)  # [B, n, H]: x_{t+1+k}
        h = model.step(e, h[:, :n], torch.arange(n) + k, cache)  # same row t, position t + k
        out.append(model.logits(h))
    return out


@dataclass
class TargetBatch:
    """The frozen target's view of a batch of right-padded windows."""

    ids: torch.Tensor  # int64 [B, S]
    features: torch.Tensor  # float32 [B, S, 3 H_t]
    draft_logits: torch.Tensor | None  # float32 [B, S, draft_vocab]: target logits at the draft ids (None for evaluation)
    argmax: torch.Tensor  # int64 [B, S]: argmax of the full target logits
    rows: torch.Tensor  # bool [B, S]: target rows in the loss region


def ttt_losses(logits: Sequence[torch.Tensor], batch: TargetBatch, t2d: torch.Tensor) -> list[torch.Tensor]:
    """Loss of every step k (module docstring): the soft cross-entropy -sum_v p_v log q_v of the
    head's draft softmax q (logits_k row t) against p = softmax of the target's logits row t+1+k
    restricted to the draft columns (renormalised over the draft vocabulary, temperature 1),
    averaged over the kept rows: loss region, and the target's full argmax in the draft vocabulary
    (t2d bool [V_t]), as EAGLE does."""
    losses = []
    for k, lg in enumerate(logits):
        n = lg.shape[1]
        target = batch.draft_logits[:, 1 + k : 1 + k + n]  # [B, n, Vd]: target rows t+1+k
        keep = batch.rows[:, 1 + k : 1 + k + n] & t2d[batch.argmax[:, 1 + k : 1 + k + n]]  # [B, n]
        p = torch.softmax(target, dim=-1)
        ce = -(p * torch.log_softmax(lg, dim=-1)).sum(-1)  # [B, n]
        losses.append((ce * keep).sum() / keep.sum().clamp_min(1))
    return losses


def agreement_counts(logits: Sequence[torch.Tensor], batch: TargetBatch, draft_ids: torch.Tensor) -> list[tuple[int, int]]:
    """Per step k: (rows where draft_ids[argmax head] == the target's argmax, loss-region rows)."""
    counts = []
    for k, lg in enumerate(logits):
        n = lg.shape[1]
        rows = batch.rows[:, 1 + k : 1 + k + n]
        hit = (draft_ids[lg.argmax(-1)] == batch.argmax[:, 1 + k : 1 + k + n]) & rows
        counts.append((int(hit.sum()), int(rows.sum())))
    return counts


# ------------------------------------------------------------------------------------ target


@dataclass
class _Target:
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
    from .recipe import RECIPES_DIR, load_recipe, resolve_recipe
    from .sources import resolve_source

    path = Path(target)
    is_recipe = path.suffix in (".yaml", ".yml") or ("/" not in target and (RECIPES_DIR / f"{target}.yaml").is_file())
    if is_recipe:
        recipe = load_recipe(resolve_recipe(target))
        spec = recipe.target
        source = resolve_source(spec.model, spec.gguf_file, spec.revision)
        return source, spec.trust_remote_code, f"recipe {recipe.name}: {spec.model} (trained against its float32 weights)"
    source = resolve_source(target)
    return source, False, source.describe()


def load_target(target: str) -> _Target:
    from .sources import load_model, load_tokenizer

    source, trust, description = resolve_target(target)
    model = load_model(source, "float32", trust)
    model.requires_grad_(False)
    tokenizer = load_tokenizer(source, trust)
    shape = TargetShape.from_hf_config(model.config)
    embed = model.get_input_embeddings().weight.detach().float()
    if embed.shape[1] != shape.hidden_size:
        raise TrainDraftError(f"the target's embedding width {embed.shape[1]} != its hidden size {shape.hidden_size}: "
                              f"an EAGLE-3 head takes the target's embedding at its own width")
    eos = set()
    for value in (tokenizer.eos_token_id, getattr(model.config, "eos_token_id", None),
                  getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        for i in (value if isinstance(value, (list, tuple)) else [value]):
            if _is_int(i) and 0 <= i < shape.vocab_size:
                eos.add(int(i))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (min(eos) if eos else 0)
    digest = hashlib.sha256(description.encode())
    digest.update(model.config.to_json_string().encode())
    digest.update(embed[: min(8, embed.shape[0])].numpy().tobytes())
    return _Target(model, tokenizer, description, shape, embed, tuple(sorted(eos)), int(pad), digest.hexdigest()[:16])


def default_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """formats/eagle3.py's default rule: entering layers (2, L // 2, L - 3)."""
    return (2, num_layers // 2, num_layers - 3)


def head_shape(config, draft_vocab: int) -> HeadShape:
    """One decoder layer's worth of the target (its heads, KV heads, head_dim, intermediate size),
    at the target's hidden size; rope: the target's theta, unscaled."""
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size") if getattr(config, k, None) is None]
    if missing:
        raise TrainDraftError(f"the target's config ({getattr(config, 'model_type', '?')}) has no {', '.join(missing)}: "
                              f"train-draft sizes the head from a Llama-style decoder config")
    H = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    params = getattr(config, "rope_parameters", None) or {}
    theta = getattr(config, "rope_theta", None) or params.get("rope_theta") or 10000.0
    return HeadShape(
        hidden=H, target_hidden=H, heads=heads,
        kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or H // heads),
        intermediate=int(config.intermediate_size),
        eps=float(getattr(config, "rms_norm_eps", None) or 1e-6),
        rope_theta=float(theta), draft_vocab=draft_vocab)


def init_from_target(model: Eagle3Draft, target, draft_ids: torch.Tensor, seed: int) -> str:
    """Initialise the head from the target (returns a one-line description for training.json):
      - midlayer from the target's LAST decoder layer where names and shapes match: o_proj, the MLP,
        post_attention_layernorm; q/k/v: the target's [out, H] weights in the hidden half (input
        columns H..2H, fed by hidden_norm(h)) and N(0, initializer_range) in the embedding half;
        hidden_norm = the layer's input_layernorm, input_layernorm = ones;
      - fc: identity on the high feature block (the stream entering layer L-3, the closest to the
        last layer's input) and zeros on the low and mid blocks, so the head starts as a shortcut
        through the target's last layer;
      - norm: the target's final norm; lm_head: the target's lm_head rows of the draft vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    std = float(getattr(target.config, "initializer_range", 0.02) or 0.02)
    for p in model.parameters():
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * std if p.ndim == 2 else torch.ones(p.shape))
    done, skipped = [], []
    H = model.shape.hidden
    decoder = getattr(target, "model", None)
    layers = getattr(decoder, "layers", None)
    last = layers[-1] if layers is not None and len(layers) else None
    own = dict(model.named_parameters())

    def take(dst: str, module, names: str, columns: slice | None = None) -> None:
        src = module
        for part in names.split("."):
            src = getattr(src, part, None)
        w = own[dst]
        target_w = w[:, columns] if columns is not None else w
        if not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(target_w.shape):
            skipped.append(dst)
            return
        with torch.no_grad():
            target_w.copy_(src.detach().float())
        done.append(dst)

    if last is not None:
        hidden_half = slice(H, 2 * H)
        for name in ("q_proj", "k_proj", "v_proj"):
            take(f"midlayer.self_attn.{name}.weight", last, f"self_attn.{name}.weight", hidden_half)
        take("midlayer.self_attn.o_proj.weight", last, "self_attn.o_proj.weight")
        for name in ("gate_proj", "up_proj", "down_proj"):
            take(f"midlayer.mlp.{name}.weight", last, f"mlp.{name}.weight")
        take("midlayer.post_attention_layernorm.weight", last, "post_attention_layernorm.weight")
        take("midlayer.hidden_norm.weight", last, "input_layernorm.weight")
    if decoder is not None:
        take("norm.weight", decoder, "norm.weight")
    with torch.no_grad():
        fc = own["fc.weight"]
        fc.zero_()
        fc[:, 2 * H : 3 * H] = torch.eye(H)
        head = target.get_output_embeddings()
        if head is not None and tuple(head.weight.shape[1:]) == (H,):
            own["lm_head.weight"].copy_(head.weight.detach().float()[draft_ids])
            done.append("lm_head.weight")
        else:
            skipped.append("lm_head.weight")
    note = f"from the target's last decoder layer, final norm and lm_head ({len(done)} tensors); fc = identity on the high block"
    return note + (f"; random: {', '.join(skipped)}" if skipped else "")


# -------------------------------------------------------------------------------------- data


@dataclass
class Window:
    ids: np.ndarray  # int64 [n], n <= seq_len
    first_row: int = 0  # first target row in the loss region (calibration: the row predicting the answer's first token)
    source: str = ""


def _collect_files(root: Path, max_file_bytes: int, accept: Callable[[Path], bool],
                   exclude: Sequence[str] = ()) -> tuple[list[Path], int]:
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
        files, skipped = _collect_files(root, cap_file, lambda f: f.suffix == ".py", exclude=("site-packages", "dist-packages"))
        kind = str(root)
    elif item == "site-docs":
        root = Path(sysconfig.get_paths()["purelib"])
        files, skipped = _collect_files(
            root, cap_file, lambda f: f.suffix in (".md", ".rst") or (f.name == "METADATA" and f.parent.name.endswith(".dist-info")))
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
        raise TrainDraftError(f"data {item!r} ({kind}) has no readable UTF-8 text files "
                              f"({', '.join('*' + e for e in DATA_EXTENSIONS)}, at most {config.max_file_kb} KB each)")
    return texts, {"source": item, "where": kind, **info, "skipped_large": skipped}


def _windows_of_texts(texts: list[str], tok: _Target, seq_len: int, name: str) -> list[Window]:
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
    """The benchmark's prompt ids (bench.resolve_prompts with the same --prompts / --limit)."""
    from .bench import resolve_prompts

    return [p.id for p in resolve_prompts(list(specs), limit=limit)] if specs else []


def _calibration_windows(tgt: _Target, config: TrainConfig, progress: Progress) -> tuple[list[Window], dict]:
    from .prompts import load_prompts

    held = set(held_out_prompt_ids(config.holdout_prompts, config.holdout_limit))
    prompts = [p for p in load_prompts("all") if p.id not in held]
    if not prompts:
        raise TrainDraftError(
            f"data 'calibration' has no prompt left: all {len(held)} calibration prompts are held out as the benchmark's "
            f"(holdout_prompts {list(config.holdout_prompts)}, holdout_limit {config.holdout_limit}); hold out only the "
            f"first N per domain (--holdout-limit N, then bench with --limit N) or train on other data")
    cache_dir = config.cache_dir or _default_cache()
    cache_path = cache_dir / f"answers-{tgt.key}.json"
    cache = _read_json(cache_path) or {}
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
                _write_json(cache_path, cache)
        answer_tokens += len(cache[key])
        window = _sample_window(prompt_ids, cache[key], config.seq_len, "calibration")
        if window is not None:
            windows.append(window)
    if generated:
        _write_json(cache_path, cache)
    info = {"source": "calibration", "where": str(cache_path), "prompts": len(prompts), "prompts_held_out": len(held),
            "answers_generated": generated, "answer_tokens": answer_tokens, "seconds_generating": round(time.perf_counter() - t0, 2)}
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


def _instruction_windows(tgt: _Target, config: TrainConfig, progress: Progress) -> tuple[list[Window], dict]:
    """Synthesized requests (train_instructions.synthesize) answered by the target in batches; the
    answers are cached under the same cache folder as the calibration answers."""
    from . import train_instructions

    t0 = time.perf_counter()
    try:
        requests = train_instructions.synthesize(config.instructions, seed=config.seed)
    except ValueError as exc:
        raise TrainDraftError(f"data 'instructions': {exc}") from None
    prompts = []
    for _, request in requests:
        text = tgt.tokenizer.apply_chat_template([{"role": "user", "content": request}], tokenize=False,
                                                 add_generation_prompt=True)
        prompts.append(tgt.tokenizer(text, add_special_tokens=False)["input_ids"][-(config.seq_len // 2):])
    cache_dir = config.cache_dir or _default_cache()
    cache_path = cache_dir / f"instructions-{tgt.key}.json"
    cache = _read_json(cache_path) or {}
    keys = [f"{config.instruction_tokens}|{hashlib.sha256(json.dumps(p).encode()).hexdigest()[:16]}" for p in prompts]
    todo = sorted({k: i for i, k in enumerate(keys) if k not in cache}.values())
    done_before = len(prompts) - len(todo)

    chunk = 4 * config.answer_batch  # the cache is written after every chunk: an interrupted run keeps them
    for c in range(0, len(todo), chunk):
        progress({"event": "stage", "message": "answering synthesized requests", "done": done_before + c,
                  "total": len(prompts)})
        part = todo[c : c + chunk]
        answers = train_instructions.answer(tgt.model, tgt.pad_id, [prompts[i] for i in part],
                                            config.instruction_tokens, config.answer_batch)
        cache.update({keys[i]: a for i, a in zip(part, answers)})
        _write_json(cache_path, cache)
    windows = [w for p, k in zip(prompts, keys)
               if (w := _sample_window(p, cache[k], config.seq_len, "instructions")) is not None]
    by_domain: dict[str, int] = {}
    for domain, _ in requests:
        by_domain[domain] = by_domain.get(domain, 0) + 1
    info = {"source": "instructions", "where": str(cache_path), "requests": len(requests), "by_domain": by_domain,
            "answers_generated": len(todo), "answer_tokens": int(sum(len(cache[k]) for k in keys)),
            "seconds_generating": round(time.perf_counter() - t0, 2)}
    return windows, info


@torch.no_grad()
def _greedy_answer(tgt: _Target, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids], dtype=torch.int64)
    out = tgt.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tgt.pad_id)
    return [int(i) for i in out[0, len(prompt_ids):]]


def _default_cache() -> Path:
    from .sources import cache_root

    return cache_root() / "train-draft"


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)


def build_windows(tgt: _Target, config: TrainConfig, progress: Progress) -> tuple[list[Window], list[dict]]:
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
        raise TrainDraftError(f"the data gives {len(windows)} window(s) of up to {config.seq_len} tokens; "
                              f"training needs at least 2 (one held out)")
    return windows, sources


def split_held_out(n: int, config: TrainConfig) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, held-out indices): a seeded fraction, at least 1 when held_out > 0, at most
    eval_sequences, always leaving one window to train on."""
    order = np.random.default_rng(config.seed).permutation(n)
    k = 0 if config.held_out == 0 else min(config.eval_sequences, n - 1, max(1, round(config.held_out * n)))
    return np.sort(order[k:]), np.sort(order[:k])


def choose_draft_vocab(windows: Sequence[Window], size: int, vocab: int, eos_ids: Sequence[int]) -> tuple[np.ndarray, float]:
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


def make_batch(tgt: _Target, windows: Sequence[Window], layer_ids: Sequence[int], draft_ids: torch.Tensor | None
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


def lr_at(step: int, total: int, config: TrainConfig) -> float:
    """Linear warmup over round(warmup * total) steps, then cosine / linear decay to FINAL_LR_RATIO."""
    warm = round(config.warmup * total)
    if step < warm:
        return config.lr * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    shape = 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) if config.schedule == "cosine" else 1 - min(1.0, progress)
    return config.lr * (FINAL_LR_RATIO + (1 - FINAL_LR_RATIO) * shape)


# ----------------------------------------------------------------------------------- report


@dataclass
class TrainReport:
    out: Path
    target: dict
    layer_ids: tuple[int, int, int]
    layer_ids_reason: str
    draft_vocab: dict
    data: dict
    init: str
    start_step: int
    steps: int
    tokens_trained: int
    final_losses: list[float]  # per ttt step, mean over the last window of steps
    final_loss: float  # weighted sum, same window
    agreement: list[float] | None  # held-out top-1 agreement per ttt step, at the end
    agreement_history: list[dict]
    loss_history: list[float]  # weighted loss of every step (from step 0, across resumes)
    seconds: dict
    tokens_per_second: float
    config: dict
    resumed_from: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["out"] = str(self.out)
        data["layer_ids"] = list(self.layer_ids)
        return data


# ------------------------------------------------------------------------------- checkpoints


def _checkpoint_folder(path: Path) -> Path:
    path = Path(path)
    if (path / CHECKPOINT_JSON).is_file():
        return path
    if (path / CHECKPOINT_DIR / CHECKPOINT_JSON).is_file():
        return path / CHECKPOINT_DIR
    raise TrainDraftError(f"resume {str(path)!r} holds no train-draft checkpoint ({CHECKPOINT_DIR}/{CHECKPOINT_JSON})")


def _read_checkpoint(path: Path) -> tuple[dict, dict[str, torch.Tensor], Path]:
    from safetensors.torch import load_file

    folder = _checkpoint_folder(path)
    meta = _read_json(folder / CHECKPOINT_JSON)
    if not meta or meta.get("format") != CHECKPOINT_FORMAT:
        raise TrainDraftError(f"{folder / CHECKPOINT_JSON} is not a {CHECKPOINT_FORMAT} file")
    try:
        tensors = load_file(str(folder / CHECKPOINT_TENSORS))
    except (OSError, ValueError, RuntimeError) as exc:
        raise TrainDraftError(f"{folder / CHECKPOINT_TENSORS} cannot be read: {str(exc).splitlines()[0] if str(exc) else exc}") from exc
    return meta, tensors, folder


def _checkpoint_tensors(model: Eagle3Draft, opt: torch.optim.Optimizer, draft_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    tensors = {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        state = opt.state.get(p) or {}
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                tensors[f"{key}.{n}"] = state[key].detach().clone()
    tensors["draft_ids"] = draft_ids.clone()
    return tensors


def _restore(model: Eagle3Draft, opt: torch.optim.Optimizer, tensors: dict, adam_steps: int) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            value = tensors.get(f"model.{n}")
            if value is None or value.shape != p.shape:
                raise TrainDraftError(f"checkpoint tensor model.{n} is missing or has shape "
                                      f"{None if value is None else list(value.shape)}, expected {list(p.shape)}")
            p.copy_(value)
            if f"exp_avg.{n}" in tensors and f"exp_avg_sq.{n}" in tensors:
                opt.state[p] = {"step": torch.tensor(float(adam_steps)), "exp_avg": tensors[f"exp_avg.{n}"].clone(),
                                "exp_avg_sq": tensors[f"exp_avg_sq.{n}"].clone()}


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / REPORT_NAME).is_file())):
        raise TrainDraftError(f"out {str(out)!r} exists and is not a train-draft output (no {REPORT_NAME}); "
                              f"remove it or choose another folder")


def _write_output(out: Path, head: Eagle3Head, report: dict, ckpt_tensors: dict, ckpt_meta: dict) -> None:
    """The head (published format), training.json and checkpoint/, replacing `out` in one rename."""
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".staging", dir=out.parent))
    try:
        write_eagle3_head(head, staging)
        (staging / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        (staging / CHECKPOINT_DIR).mkdir()
        save_file({k: v.contiguous() for k, v in ckpt_tensors.items()}, str(staging / CHECKPOINT_DIR / CHECKPOINT_TENSORS))
        (staging / CHECKPOINT_DIR / CHECKPOINT_JSON).write_text(json.dumps(ckpt_meta, indent=2) + "\n", encoding="utf-8")
        replace_folder(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def export_head(model: Eagle3Draft, draft_ids: torch.Tensor, vocab: int, layer_ids: Sequence[int], reason: str) -> Eagle3Head:
    s = model.shape
    config = Eagle3Config(hidden_size=s.hidden, target_hidden_size=s.target_hidden, num_attention_heads=s.heads,
                          num_key_value_heads=s.kv_heads, head_dim=s.head_dim, intermediate_size=s.intermediate,
                          rms_norm_eps=s.eps, rope_theta=s.rope_theta, rope_scaling=None, draft_vocab_size=s.draft_vocab,
                          vocab_size=vocab, hidden_act="silu", layer_ids=tuple(layer_ids), layer_ids_source="recipe",
                          layer_ids_reason=reason)
    ids = draft_ids.numpy().astype(np.int64)
    t2d = np.zeros(vocab, dtype=np.bool_)
    t2d[ids] = True
    weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return Eagle3Head(config=config, weights=weights, d2t=ids - np.arange(len(ids), dtype=np.int64), t2d=t2d)


# ------------------------------------------------------------------------------------- train


def _no_progress(_: dict) -> None:
    pass


def train_draft(config: TrainConfig, progress: Progress | None = None) -> TrainReport:
    """Train (or continue training) an EAGLE-3 head and write it to config.out (module docstring)."""
    threads = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    try:
        return _train(config, progress or _no_progress)
    finally:
        torch.set_num_threads(threads)


def _train(config: TrainConfig, progress: Progress) -> TrainReport:
    t_start = time.perf_counter()
    seconds: dict[str, float] = {}
    _check_out(config.out)
    resume = _read_checkpoint(config.resume) if config.resume is not None else None

    progress({"event": "stage", "message": "loading the target"})
    tgt = load_target(config.target)
    L = tgt.shape.num_layers
    if resume is not None:
        meta = resume[0]
        if meta["target"] != _target_meta(tgt):
            raise TrainDraftError(f"checkpoint {resume[2]} was trained for target {meta['target']}, not {_target_meta(tgt)}")
        layer_ids = tuple(meta["layer_ids"])
        if config.layers is not None and tuple(config.layers) != layer_ids:
            raise TrainDraftError(f"layers {list(config.layers)} differ from the checkpoint's {list(layer_ids)}")
        reason = meta["layer_ids_reason"]
    elif config.layers is not None:
        layer_ids, reason = config.layers, f"entering layers {list(config.layers)} given by the caller"
    else:
        layer_ids = default_layer_ids(L)
        reason = f"entering layers {list(layer_ids)}: EAGLE-3 default (2, L//2, L-3) for L = {L}"
    bad = [i for i in layer_ids if not 0 <= i < L]
    if bad:
        raise TrainDraftError(f"layer ids {list(layer_ids)} are outside the target's entering layers 0..{L - 1} "
                              f"(L = {L}): {bad}; pass layers explicitly")
    seconds["load_target"] = time.perf_counter() - t_start

    t0 = time.perf_counter()
    windows, sources = build_windows(tgt, config, progress)
    train_idx, held_idx = split_held_out(len(windows), config)
    train = [windows[i] for i in train_idx]
    held = [windows[i] for i in held_idx]
    fingerprint = hashlib.sha256(b"".join(w.ids.tobytes() + w.first_row.to_bytes(4, "little") for w in train)).hexdigest()[:16]
    seconds["data"] = time.perf_counter() - t0

    V = tgt.shape.vocab_size
    notes: list[str] = []
    if resume is not None:
        draft_ids = resume[1]["draft_ids"].to(torch.int64)
        if config.draft_vocab_size is not None and config.draft_vocab_size != len(draft_ids):
            raise TrainDraftError(f"draft_vocab_size {config.draft_vocab_size} differs from the checkpoint's {len(draft_ids)}")
        coverage = _coverage(train, draft_ids.numpy(), V)
        if resume[0].get("data_fingerprint") != fingerprint:
            notes.append(f"the data differs from the checkpoint's (fingerprint {resume[0].get('data_fingerprint')} -> {fingerprint})")
    else:
        size = config.draft_vocab_size if config.draft_vocab_size is not None else min(DEFAULT_DRAFT_VOCAB, V)
        if size > V:
            raise TrainDraftError(f"draft_vocab_size {size} > the target's vocabulary {V}")
        ids_np, coverage = choose_draft_vocab(train, size, V, tgt.eos_ids)
        draft_ids = torch.from_numpy(ids_np)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True

    shape = head_shape(tgt.model.config, len(draft_ids))
    rope = dict(getattr(tgt.model.config, "rope_parameters", None) or getattr(tgt.model.config, "rope_scaling", None) or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        notes.append(f"the target's rope is {rope.get('rope_type', rope.get('type'))!r}; the head uses plain rope "
                     f"(theta {shape.rope_theta:g}), the only kind the published format supports here")
    if shape.heads % shape.kv_heads:
        raise TrainDraftError(f"the target's {shape.heads} attention heads are not a multiple of its {shape.kv_heads} KV heads")
    torch.manual_seed(config.seed)
    model = Eagle3Draft(shape)
    init = init_from_target(model, tgt.model, draft_ids, config.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)
    start_step, loss_history, agreement_history, trained_before, tokens_before = 0, [], [], 0.0, 0
    per_step_history: list[list[float]] = []
    if resume is not None:
        meta = resume[0]
        _restore(model, opt, resume[1], int(meta["adam_steps"]))
        start_step = int(meta["step"])
        loss_history = list(meta.get("loss_history", []))
        per_step_history = [list(x) for x in meta.get("step_losses_history", [])]
        agreement_history = list(meta.get("agreement_history", []))
        trained_before = float(meta.get("train_seconds", 0.0))
        tokens_before = int(meta.get("tokens_trained", 0))
        init = meta.get("init", init) + f"; resumed at step {start_step}"

    batches_per_epoch = math.ceil(len(train) / config.batch_size)
    total = config.steps if config.steps is not None else math.ceil((config.epochs or 1.0) * batches_per_epoch)
    if start_step >= total:
        raise TrainDraftError(f"the checkpoint is at step {start_step}; steps {total} asks for no more (give steps > {start_step})")

    t0 = time.perf_counter()
    progress({"event": "stage", "message": f"target features of {len(held)} held-out windows"})
    by_source: dict[str, list[Window]] = {}
    for w in held:
        by_source.setdefault(w.source, []).append(w)
    # (source, batch): batches never mix sources, so agreement is also reported per source (a mix of
    # easy source code and chat answers hides how the head does on chat)
    held_batches = [(src, make_batch(tgt, ws[i : i + config.batch_size], layer_ids, None))
                    for src, ws in sorted(by_source.items()) for i in range(0, len(ws), config.batch_size)]
    seconds["held_out_features"] = time.perf_counter() - t0

    def evaluate(step: int) -> list[float] | None:
        if not held_batches:
            return None
        model.eval()
        hits = {src: np.zeros(config.ttt_steps) for src, _ in held_batches}
        rows = {src: np.zeros(config.ttt_steps) for src, _ in held_batches}
        with torch.no_grad():
            for src, b in held_batches:
                logits = ttt_forward(model, tgt.embed, b.features, b.ids, config.ttt_steps)
                for k, (h, n) in enumerate(agreement_counts(logits, b, draft_ids)):
                    hits[src][k] += h
                    rows[src][k] += n
        model.train()

        def ratio(h, n) -> list[float]:
            return [round(float(a / c), 5) if c else 0.0 for a, c in zip(h, n)]

        agree = ratio(sum(hits.values()), sum(rows.values()))
        agreement_history.append({"step": step, "agreement": agree,
                                  "by_source": {src: ratio(hits[src], rows[src]) for src in sorted(hits)}})
        progress({"event": "eval", "step": step, "agreement": agree})
        return agree

    meta_base = {"format": CHECKPOINT_FORMAT, "target": _target_meta(tgt), "layer_ids": list(layer_ids),
                 "layer_ids_reason": reason, "data_fingerprint": fingerprint, "init": init.split("; resumed")[0]}
    data_info = {
        "sources": sources,
        "windows": len(windows), "seq_len": config.seq_len,
        "train_windows": len(train), "train_tokens": int(sum(len(w.ids) for w in train)),
        "held_out_windows": len(held), "held_out_tokens": int(sum(len(w.ids) for w in held)),
        "benchmark_prompts_held_out": {"prompts": list(config.holdout_prompts), "limit": config.holdout_limit},
        "fingerprint": fingerprint,
    }
    vocab_info = {"size": len(draft_ids), "target_vocab": V, "coverage_of_train_tokens": round(coverage, 5),
                  "eos_ids": list(tgt.eos_ids), "choice": "most frequent target tokens of the training windows, EOS ids always in"}

    def save(step: int, agree: list[float] | None, train_seconds: float, tokens: int) -> TrainReport:
        window = per_step_history[-max(1, min(50, len(per_step_history) // 5 or 1)):]
        final_losses = [float(np.mean([h[k] for h in window])) for k in range(config.ttt_steps)] if window else []
        final_loss = float(np.mean(loss_history[-len(window):])) if window else float("nan")
        elapsed = time.perf_counter() - t_start
        report = TrainReport(
            out=config.out, target={"description": tgt.description, **_target_meta(tgt)}, layer_ids=tuple(layer_ids),
            layer_ids_reason=reason, draft_vocab=vocab_info, data=data_info, init=init, start_step=start_step,
            steps=step, tokens_trained=tokens, final_losses=final_losses, final_loss=final_loss, agreement=agree,
            agreement_history=agreement_history, loss_history=[round(x, 5) for x in loss_history],
            seconds={**{k: round(v, 2) for k, v in seconds.items()}, "train": round(train_seconds, 2), "total_this_run": round(elapsed, 2)},
            tokens_per_second=round((tokens - tokens_before) / max(1e-9, train_seconds - trained_before), 1),
            config=config.to_dict(), resumed_from=None if resume is None else str(resume[2]), notes=notes)
        head = export_head(model, draft_ids, V, layer_ids, reason)
        ckpt_meta = {**meta_base, "step": step, "adam_steps": int(_adam_steps(opt)), "lr": lr_at(min(step, total - 1), total, config),
                     "loss_history": report.loss_history, "step_losses_history": [[round(x, 5) for x in h] for h in per_step_history],
                     "agreement_history": agreement_history, "train_seconds": train_seconds, "tokens_trained": tokens,
                     "config": config.to_dict()}
        _write_output(config.out, head, report.to_dict(), _checkpoint_tensors(model, opt, draft_ids), ckpt_meta)
        return report

    agree = evaluate(start_step) if start_step == 0 else (agreement_history[-1]["agreement"] if agreement_history else None)
    model.train()
    t_train = time.perf_counter()
    tokens = tokens_before
    weights = [config.ttt_decay ** k for k in range(config.ttt_steps)]
    for step in range(start_step, total):
        epoch, pos = divmod(step, batches_per_epoch)
        perm = np.random.default_rng([config.seed, epoch]).permutation(len(train))
        batch_windows = [train[i] for i in perm[pos * config.batch_size : (pos + 1) * config.batch_size]]
        batch = make_batch(tgt, batch_windows, layer_ids, draft_ids)
        lr = lr_at(step, total, config)
        for group in opt.param_groups:
            group["lr"] = lr
        logits = ttt_forward(model, tgt.embed, batch.features, batch.ids, config.ttt_steps)
        losses = ttt_losses(logits, batch, t2d)
        loss = sum(w * l for w, l in zip(weights, losses))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        opt.step()
        tokens += int(batch.rows.sum())
        loss_history.append(float(loss.detach()))
        per_step_history.append([float(x.detach()) for x in losses])
        done = step + 1
        if done % config.eval_every == 0 or done == total:
            agree = evaluate(done)
        progress({"event": "step", "step": done, "total": total, "start": start_step, "loss": loss_history[-1],
                  "losses": per_step_history[-1], "lr": lr, "agreement": agree})
        if config.save_every and done % config.save_every == 0 and done < total:
            save(done, agree, trained_before + time.perf_counter() - t_train, tokens)
    progress({"event": "stage", "message": f"writing {config.out}"})
    return save(total, agree, trained_before + time.perf_counter() - t_train, tokens)


def _coverage(windows: Sequence[Window], ids: np.ndarray, vocab: int) -> float:
    keep = np.zeros(vocab, dtype=bool)
    keep[ids] = True
    total = sum(len(w.ids) for w in windows)
    return float(sum(int(keep[w.ids].sum()) for w in windows) / total) if total else 0.0


def _adam_steps(opt: torch.optim.Optimizer) -> float:
    for state in opt.state.values():
        if "step" in state:
            return float(state["step"])
    return 0.0


def _target_meta(tgt: _Target) -> dict:
    return {"hidden_size": tgt.shape.hidden_size, "num_layers": tgt.shape.num_layers, "vocab_size": tgt.shape.vocab_size}


__all__ = [
    "DEFAULT_DRAFT_VOCAB",
    "NAMED_SOURCES",
    "Eagle3Draft",
    "HeadShape",
    "TargetBatch",
    "TrainConfig",
    "TrainConfigError",
    "TrainDraftError",
    "TrainReport",
    "Window",
    "agreement_counts",
    "choose_draft_vocab",
    "default_layer_ids",
    "export_head",
    "head_shape",
    "held_out_prompt_ids",
    "init_from_target",
    "load_target",
    "lr_at",
    "make_batch",
    "parse_layer_ids",
    "resolve_target",
    "split_held_out",
    "train_draft",
    "ttt_forward",
    "ttt_losses",
]

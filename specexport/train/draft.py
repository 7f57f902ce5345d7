"""`specexport train-draft`: train an EAGLE-3 head for a target on the CPU (docs/training.md).

The head is written in the published format (specexport/formats/eagle3.py), so specexport,
vLLM, SGLang and llama.cpp's converter read it. This module is the training loop; its report and
checkpoints are train_output.py, the configuration train_config.py, the torch head, its loss and
export train_head.py, the target, data and batches train_data.py.

Pipeline
  1. Target: a recipe's target or a model source, loaded with transformers in float32, frozen.
  2. Data (`data` entries, in order): files / folders (recursive *.py *.md *.txt *.rst, size-capped),
     "stdlib" (the Python standard library's sources), "site-docs" (Markdown / reST files and
     package descriptions in site-packages), "calibration" (the calibration prompts that are NOT
     held out for the benchmark, each with the target's own greedy answer, generated once and
     cached), "instructions" (chat requests in the benchmark's five domains synthesized from local
     stdlib functions and docs, train_instructions.py, with the target's own answers, cached).
     Text is tokenized with the target's tokenizer, documents are joined with EOS and cut
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

import hashlib
import math
import time
from collections.abc import Sequence

import numpy as np
import torch

from ..models.config import normalize
from .config import DEFAULT_DRAFT_VOCAB, Progress, TrainConfig, TrainDraftError
from .data import FrozenTarget, Window, build_windows, choose_draft_vocab, load_target, make_batch, split_held_out
from .head import (
    Eagle3Draft,
    agreement_counts,
    default_layer_ids,
    export_head,
    head_shape,
    init_from_target,
    ttt_forward,
    ttt_losses,
)
from .output import (
    CHECKPOINT_FORMAT,
    TrainReport,
    adam_steps,
    check_out,
    checkpoint_tensors,
    read_checkpoint,
    restore_checkpoint,
    write_output,
)

FINAL_LR_RATIO = 0.1  # the schedule decays to this fraction of the peak


def lr_at(step: int, total: int, config: TrainConfig) -> float:
    """Linear warmup over round(warmup * total) steps, then cosine / linear decay to FINAL_LR_RATIO."""
    warm = round(config.warmup * total)
    if step < warm:
        return config.lr * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    shape = (
        0.5 * (1 + math.cos(math.pi * min(1.0, progress))) if config.schedule == "cosine" else 1 - min(1.0, progress)
    )
    return config.lr * (FINAL_LR_RATIO + (1 - FINAL_LR_RATIO) * shape)


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
    clock = time.perf_counter()
    check_out(config.out)
    resume = read_checkpoint(config.resume) if config.resume is not None else None
    progress({"event": "stage", "message": "loading the target"})
    tgt = load_target(config.target)
    layer_ids, reason = _layer_ids(tgt, config, resume)
    seconds = {"load_target": time.perf_counter() - clock}
    t0 = time.perf_counter()
    windows, sources = build_windows(tgt, config, progress)
    train_idx, held_idx = split_held_out(len(windows), config)
    train, held = [windows[i] for i in train_idx], [windows[i] for i in held_idx]
    fingerprint = hashlib.sha256(
        b"".join(w.ids.tobytes() + w.first_row.to_bytes(4, "little") for w in train)
    ).hexdigest()[:16]
    seconds["data"] = time.perf_counter() - t0
    notes: list[str] = []
    draft_ids, coverage = _draft_vocab(tgt, config, resume, train, fingerprint, notes)
    run = _Session(config, tgt, layer_ids, draft_ids, progress, notes, resume, clock)
    run.seconds.update(seconds)
    t0 = time.perf_counter()
    progress({"event": "stage", "message": f"target features of {len(held)} held-out windows"})
    run.held_out(held)
    run.seconds["held_out_features"] = time.perf_counter() - t0
    run.meta = {
        "format": CHECKPOINT_FORMAT,
        "target": _target_meta(tgt),
        "layer_ids": list(layer_ids),
        "layer_ids_reason": reason,
        "data_fingerprint": fingerprint,
        "init": run.init.split("; resumed")[0],
    }
    run.data_info = {
        "sources": sources,
        "windows": len(windows),
        "seq_len": config.seq_len,
        "train_windows": len(train),
        "train_tokens": int(sum(len(w.ids) for w in train)),
        "held_out_windows": len(held),
        "held_out_tokens": int(sum(len(w.ids) for w in held)),
        "benchmark_prompts_held_out": {"prompts": list(config.holdout_prompts), "limit": config.holdout_limit},
        "fingerprint": fingerprint,
    }
    run.vocab_info = {
        "size": len(draft_ids),
        "target_vocab": tgt.shape.vocab_size,
        "coverage_of_train_tokens": round(coverage, 5),
        "eos_ids": list(tgt.eos_ids),
        "choice": "most frequent target tokens of the training windows, EOS ids always in",
    }
    run.reason = reason
    return run.fit(train)


def _layer_ids(tgt: FrozenTarget, config: TrainConfig, resume) -> tuple[tuple[int, ...], str]:
    """The three entering layers the head reads: the checkpoint's, the caller's, or EAGLE-3's default."""
    L = tgt.shape.num_layers
    if resume is not None:
        meta = resume[0]
        if meta["target"] != _target_meta(tgt):
            raise TrainDraftError(
                f"checkpoint {resume[2]} was trained for target {meta['target']}, not {_target_meta(tgt)}"
            )
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
        raise TrainDraftError(
            f"layer ids {list(layer_ids)} are outside the target's entering layers 0..{L - 1} "
            f"(L = {L}): {bad}; pass layers explicitly"
        )
    return tuple(layer_ids), reason


def _draft_vocab(
    tgt: FrozenTarget, config: TrainConfig, resume, train: list[Window], fingerprint: str, notes: list[str]
) -> tuple[torch.Tensor, float]:
    """(draft ids int64 [V_draft], share of training tokens they cover): the checkpoint's, or the
    most frequent tokens of the training windows."""
    V = tgt.shape.vocab_size
    if resume is not None:
        draft_ids = resume[1]["draft_ids"].to(torch.int64)
        if config.draft_vocab_size is not None and config.draft_vocab_size != len(draft_ids):
            raise TrainDraftError(
                f"draft_vocab_size {config.draft_vocab_size} differs from the checkpoint's {len(draft_ids)}"
            )
        if resume[0].get("data_fingerprint") != fingerprint:
            notes.append(
                "the data differs from the checkpoint's"
                f" (fingerprint {resume[0].get('data_fingerprint')} -> {fingerprint})"
            )
        return draft_ids, _coverage(train, draft_ids.numpy(), V)
    size = config.draft_vocab_size if config.draft_vocab_size is not None else min(DEFAULT_DRAFT_VOCAB, V)
    if size > V:
        raise TrainDraftError(f"draft_vocab_size {size} > the target's vocabulary {V}")
    ids_np, coverage = choose_draft_vocab(train, size, V, tgt.eos_ids)
    return torch.from_numpy(ids_np), coverage


class _Session:
    """One training run: the head, its optimizer and histories (carried on from a checkpoint),
    held-out evaluation, the step loop and the atomic output."""

    def __init__(
        self,
        config: TrainConfig,
        tgt: FrozenTarget,
        layer_ids: tuple[int, ...],
        draft_ids: torch.Tensor,
        progress: Progress,
        notes: list[str],
        resume,
        clock: float,
    ):
        self.config, self.tgt, self.layer_ids, self.draft_ids = config, tgt, layer_ids, draft_ids
        self.progress, self.notes, self.resume, self.clock = progress, notes, resume, clock
        self.seconds: dict[str, float] = {}
        self.t2d = torch.zeros(tgt.shape.vocab_size, dtype=torch.bool)
        self.t2d[draft_ids] = True
        shape = head_shape(tgt.model.config, len(draft_ids))
        kinds = sorted({r.kind for _, r in normalize(tgt.model.config).ropes} - {"default"})
        if kinds:
            notes.append(
                f"the target's rope is {'/'.join(kinds)}; the head uses plain rope (theta {shape.rope_theta:g}),"
                " the only kind the published format supports here"
            )
        if shape.heads % shape.kv_heads:
            raise TrainDraftError(
                f"the target's {shape.heads} attention heads are not a multiple of its {shape.kv_heads} KV heads"
            )
        torch.manual_seed(config.seed)
        self.model = Eagle3Draft(shape)
        self.init = init_from_target(self.model, tgt.model, draft_ids, config.seed)
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay
        )
        self.start_step, self.trained_before, self.tokens_before = 0, 0.0, 0
        self.loss_history: list[float] = []
        self.per_step_history: list[list[float]] = []  # per step: the loss of each ttt step
        self.agreement_history: list[dict] = []
        if resume is not None:
            meta = resume[0]
            restore_checkpoint(self.model, self.opt, resume[1], int(meta["adam_steps"]))
            self.start_step = int(meta["step"])
            self.loss_history = list(meta.get("loss_history", []))
            self.per_step_history = [list(x) for x in meta.get("step_losses_history", [])]
            self.agreement_history = list(meta.get("agreement_history", []))
            self.trained_before = float(meta.get("train_seconds", 0.0))
            self.tokens_before = int(meta.get("tokens_trained", 0))
            self.init = meta.get("init", self.init) + f"; resumed at step {self.start_step}"
        self.held_batches: list = []
        self.meta: dict = {}
        self.data_info: dict = {}
        self.vocab_info: dict = {}
        self.reason = ""

    def held_out(self, held: list[Window]) -> None:
        """(source, batch) of the held-out windows: batches never mix sources, so agreement is also
        reported per source (a mix of easy source code and chat answers hides how the head does on chat)."""
        by_source: dict[str, list[Window]] = {}
        for w in held:
            by_source.setdefault(w.source, []).append(w)
        size = self.config.batch_size
        self.held_batches = [
            (src, make_batch(self.tgt, ws[i : i + size], self.layer_ids, None))
            for src, ws in sorted(by_source.items())
            for i in range(0, len(ws), size)
        ]

    def evaluate(self, step: int) -> list[float] | None:
        """Held-out top-1 agreement per ttt step (recorded in the history), None without held-out rows."""
        if not self.held_batches:
            return None
        steps = self.config.ttt_steps
        self.model.eval()
        hits = {src: np.zeros(steps) for src, _ in self.held_batches}
        rows = {src: np.zeros(steps) for src, _ in self.held_batches}
        with torch.no_grad():
            for src, b in self.held_batches:
                logits = ttt_forward(self.model, self.tgt.embed, b.features, b.ids, steps)
                for k, (h, n) in enumerate(agreement_counts(logits, b, self.draft_ids)):
                    hits[src][k] += h
                    rows[src][k] += n
        self.model.train()

        def ratio(h, n) -> list[float]:
            return [round(float(a / c), 5) if c else 0.0 for a, c in zip(h, n)]

        agree = ratio(sum(hits.values()), sum(rows.values()))
        self.agreement_history.append(
            {"step": step, "agreement": agree, "by_source": {src: ratio(hits[src], rows[src]) for src in sorted(hits)}}
        )
        self.progress({"event": "eval", "step": step, "agreement": agree})
        return agree

    def fit(self, train: list[Window]) -> TrainReport:
        """The step loop from the start step to the total, evaluating and saving as configured."""
        config = self.config
        batches_per_epoch = math.ceil(len(train) / config.batch_size)
        total = config.steps if config.steps is not None else math.ceil((config.epochs or 1.0) * batches_per_epoch)
        if self.start_step >= total:
            raise TrainDraftError(
                f"the checkpoint is at step {self.start_step}; steps {total} asks for no more"
                f" (give steps > {self.start_step})"
            )
        self.total = total
        history = self.agreement_history
        agree = (
            self.evaluate(self.start_step) if self.start_step == 0 else (history[-1]["agreement"] if history else None)
        )
        self.model.train()
        t_train = time.perf_counter()
        tokens = self.tokens_before
        weights = [config.ttt_decay**k for k in range(config.ttt_steps)]
        for step in range(self.start_step, total):
            epoch, pos = divmod(step, batches_per_epoch)
            perm = np.random.default_rng([config.seed, epoch]).permutation(len(train))
            batch_windows = [train[i] for i in perm[pos * config.batch_size : (pos + 1) * config.batch_size]]
            batch = make_batch(self.tgt, batch_windows, self.layer_ids, self.draft_ids)
            lr = lr_at(step, total, config)
            for group in self.opt.param_groups:
                group["lr"] = lr
            logits = ttt_forward(self.model, self.tgt.embed, batch.features, batch.ids, config.ttt_steps)
            losses = ttt_losses(logits, batch, self.t2d)
            loss = sum(w * step_loss for w, step_loss in zip(weights, losses))
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            if config.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.grad_clip)
            self.opt.step()
            tokens += int(batch.rows.sum())
            self.loss_history.append(float(loss.detach()))
            self.per_step_history.append([float(x.detach()) for x in losses])
            done = step + 1
            if done % config.eval_every == 0 or done == total:
                agree = self.evaluate(done)
            self.progress(
                {
                    "event": "step",
                    "step": done,
                    "total": total,
                    "start": self.start_step,
                    "loss": self.loss_history[-1],
                    "losses": self.per_step_history[-1],
                    "lr": lr,
                    "agreement": agree,
                }
            )
            if config.save_every and done % config.save_every == 0 and done < total:
                self.save(done, agree, self.trained_before + time.perf_counter() - t_train, tokens)
        self.progress({"event": "stage", "message": f"writing {config.out}"})
        return self.save(total, agree, self.trained_before + time.perf_counter() - t_train, tokens)

    def save(self, step: int, agree: list[float] | None, train_seconds: float, tokens: int) -> TrainReport:
        """The head, training.json and the checkpoint at `step`, written atomically."""
        config, steps = self.config, self.per_step_history
        window = steps[-max(1, min(50, len(steps) // 5 or 1)) :]
        final_losses = [float(np.mean([h[k] for h in window])) for k in range(config.ttt_steps)] if window else []
        final_loss = float(np.mean(self.loss_history[-len(window) :])) if window else float("nan")
        elapsed = time.perf_counter() - self.clock
        report = TrainReport(
            out=config.out,
            target={"description": self.tgt.description, **_target_meta(self.tgt)},
            layer_ids=tuple(self.layer_ids),
            layer_ids_reason=self.reason,
            draft_vocab=self.vocab_info,
            data=self.data_info,
            init=self.init,
            start_step=self.start_step,
            steps=step,
            tokens_trained=tokens,
            final_losses=final_losses,
            final_loss=final_loss,
            agreement=agree,
            agreement_history=self.agreement_history,
            loss_history=[round(x, 5) for x in self.loss_history],
            seconds={
                **{k: round(v, 2) for k, v in self.seconds.items()},
                "train": round(train_seconds, 2),
                "total_this_run": round(elapsed, 2),
            },
            tokens_per_second=round((tokens - self.tokens_before) / max(1e-9, train_seconds - self.trained_before), 1),
            config=config.to_dict(),
            resumed_from=None if self.resume is None else str(self.resume[2]),
            notes=self.notes,
        )
        head = export_head(self.model, self.draft_ids, self.tgt.shape.vocab_size, self.layer_ids, self.reason)
        ckpt_meta = {
            **self.meta,
            "step": step,
            "adam_steps": int(adam_steps(self.opt)),
            "lr": lr_at(min(step, self.total - 1), self.total, config),
            "loss_history": report.loss_history,
            "step_losses_history": [[round(x, 5) for x in h] for h in steps],
            "agreement_history": self.agreement_history,
            "train_seconds": train_seconds,
            "tokens_trained": tokens,
            "config": config.to_dict(),
        }
        write_output(
            config.out, head, report.to_dict(), checkpoint_tensors(self.model, self.opt, self.draft_ids), ckpt_meta
        )
        return report


def _coverage(windows: Sequence[Window], ids: np.ndarray, vocab: int) -> float:
    keep = np.zeros(vocab, dtype=bool)
    keep[ids] = True
    total = sum(len(w.ids) for w in windows)
    return float(sum(int(keep[w.ids].sum()) for w in windows) / total) if total else 0.0


def _target_meta(tgt: FrozenTarget) -> dict:
    return {
        "hidden_size": tgt.shape.hidden_size,
        "num_layers": tgt.shape.num_layers,
        "vocab_size": tgt.shape.vocab_size,
    }


__all__ = ["TrainReport", "lr_at", "train_draft"]

"""The output of `specexport train-draft`: its report (TrainReport, written as training.json) and
its checkpoint (head weights, AdamW moments and step as safetensors + json, no pickle), read back
to resume and written with the head in the published format in one atomic rename.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..formats.eagle3 import Eagle3Head
from ..formats.eagle3_writer import replace_folder, write_eagle3_head
from .config import TrainDraftError
from .data import read_json
from .head import Eagle3Draft

CHECKPOINT_DIR = "checkpoint"
CHECKPOINT_TENSORS = "state.safetensors"
CHECKPOINT_JSON = "state.json"
CHECKPOINT_FORMAT = "specexport-train-draft-checkpoint/1"
REPORT_NAME = "training.json"


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


def read_checkpoint(path: Path) -> tuple[dict, dict[str, torch.Tensor], Path]:
    from safetensors.torch import load_file

    folder = _checkpoint_folder(path)
    meta = read_json(folder / CHECKPOINT_JSON)
    if not meta or meta.get("format") != CHECKPOINT_FORMAT:
        raise TrainDraftError(f"{folder / CHECKPOINT_JSON} is not a {CHECKPOINT_FORMAT} file")
    try:
        tensors = load_file(str(folder / CHECKPOINT_TENSORS))
    except (OSError, ValueError, RuntimeError) as exc:
        raise TrainDraftError(
            f"{folder / CHECKPOINT_TENSORS} cannot be read: {str(exc).splitlines()[0] if str(exc) else exc}"
        ) from exc
    return meta, tensors, folder


def checkpoint_tensors(
    model: Eagle3Draft, opt: torch.optim.Optimizer, draft_ids: torch.Tensor
) -> dict[str, torch.Tensor]:
    tensors = {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        state = opt.state.get(p) or {}
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                tensors[f"{key}.{n}"] = state[key].detach().clone()
    tensors["draft_ids"] = draft_ids.clone()
    return tensors


def restore_checkpoint(model: Eagle3Draft, opt: torch.optim.Optimizer, tensors: dict, adam_steps: int) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            value = tensors.get(f"model.{n}")
            if value is None or value.shape != p.shape:
                raise TrainDraftError(
                    f"checkpoint tensor model.{n} is missing or has shape "
                    f"{None if value is None else list(value.shape)}, expected {list(p.shape)}"
                )
            p.copy_(value)
            if f"exp_avg.{n}" in tensors and f"exp_avg_sq.{n}" in tensors:
                opt.state[p] = {
                    "step": torch.tensor(float(adam_steps)),
                    "exp_avg": tensors[f"exp_avg.{n}"].clone(),
                    "exp_avg_sq": tensors[f"exp_avg_sq.{n}"].clone(),
                }


def check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / REPORT_NAME).is_file())):
        raise TrainDraftError(
            f"out {str(out)!r} exists and is not a train-draft output (no {REPORT_NAME}); "
            f"remove it or choose another folder"
        )


def write_output(out: Path, head: Eagle3Head, report: dict, ckpt_tensors: dict, ckpt_meta: dict) -> None:
    """The head (published format), training.json and checkpoint/, replacing `out` in one rename."""
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".staging", dir=out.parent))
    try:
        write_eagle3_head(head, staging)
        (staging / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        (staging / CHECKPOINT_DIR).mkdir()
        save_file(
            {k: v.contiguous() for k, v in ckpt_tensors.items()}, str(staging / CHECKPOINT_DIR / CHECKPOINT_TENSORS)
        )
        (staging / CHECKPOINT_DIR / CHECKPOINT_JSON).write_text(
            json.dumps(ckpt_meta, indent=2) + "\n", encoding="utf-8"
        )
        replace_folder(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def adam_steps(opt: torch.optim.Optimizer) -> float:
    for state in opt.state.values():
        if "step" in state:
            return float(state["step"])
    return 0.0

"""Triton Inference Server Python-backend model of a specexport artifact (copied into a model
repository as `<model>/1/model.py` by `specexport triton-repo`; runs inside Triton only, which
provides `triton_python_backend_utils`).

Interface (config.pbtxt, decoupled transaction policy, max_batch_size 0), in the shape of
Triton's generate extension (POST /v2/models/<model>/generate and generate_stream):
    inputs   text_input STRING [1]; optional max_tokens INT32 [1], stream BOOL [1],
             temperature FP32 [1], top_k INT32 [1], top_p FP32 [1], seed INT64 [1], proposer STRING [1]
    outputs  text_output STRING [1]       the text of this response (a round's, or the whole answer)
             token_ids INT64 [-1]         the token ids of this response
             finish_reason STRING [1]     'stop' | 'length' (last response only)
             drafted, accepted, rounds INT64 [1], acceptance_rate FP32 [1]  (last response only)
             speculative STRING [1]       the JSON `speculative` object of `specexport serve` (last only)
With stream true, one response per speculative round, then a last one (empty text) carrying the
figures with the FINAL flag; otherwise one response with everything and the FINAL flag.

The artifact sits next to this file (parameter `artifact`, default "artifact"); it is opened with
its checksums verified, and with its signature checked against the keys listed in the parameter
`trusted_keys` (comma-separated paths relative to this folder) when there are any. A request
that fails (bad input, a prompt too long) gets one error response with the FINAL flag.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

OPTIONS = {  # optional input -> (GeneratorConfig field, how to read its one element)
    "max_tokens": ("max_new_tokens", int),
    "temperature": ("temperature", float),
    "top_k": ("top_k", int),
    "top_p": ("top_p", float),
    "seed": ("seed", int),
}


def _scalar(request, name: str):
    """The one element of an optional input, or None when the request does not carry it."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise ValueError(f"input {name} must hold one element, got {values.size}")
    value = values[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _tensor(name: str, value, dtype) -> object:
    return pb_utils.Tensor(name, np.array(value, dtype=dtype))


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        from specexport_runtime.api import load

        config = json.loads(args["model_config"])
        params = {key: value.get("string_value", "") for key, value in config.get("parameters", {}).items()}
        here = Path(args["model_repository"]) / args["model_version"]
        keys = [str(here / key) for key in params.get("trusted_keys", "").split(",") if key]
        threads = int(params["threads"]) if params.get("threads") else None
        self.gen = load(
            here / params.get("artifact", "artifact"),
            provider=params.get("provider", "cpu"),
            threads=threads,
            verify=True,
            trusted_keys=keys or None,
        )
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)

    def execute(self, requests: list) -> None:
        """Decoupled: each request's responses go through its own sender; requests run in turn
        (one sequence at a time per model instance: instance_group count for more)."""
        for request in requests:
            self._run(request, request.get_response_sender())
        return None

    def _run(self, request, sender) -> None:
        from specexport_runtime.errors import SpecExportError
        from specexport_runtime.generator import validate_prompt_ids
        from specexport_runtime.server.responses import FINISH_REASONS, Outcome, speculative

        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            text = _scalar(request, "text_input")
            if not isinstance(text, str):
                raise ValueError("input text_input (STRING [1]) is required")
            overrides = {}
            for name, (field, kind) in OPTIONS.items():
                value = _scalar(request, name)
                if value is not None:
                    overrides[field] = kind(value)
            proposer = _scalar(request, "proposer")
            if proposer is not None:
                overrides["proposer"] = self.gen.resolve_proposer(proposer)
            stream = bool(_scalar(request, "stream") or False)
            config = self.gen.configure(**overrides)
            context = self.gen.manifest.max_context
            ids = validate_prompt_ids(self.gen.codec.encode(text), self.gen.manifest.target.embedding_rows, context)
            if len(ids) + config.max_new_tokens > context:  # as `specexport serve` answers it: never cut silently
                raise ValueError(
                    f"max_tokens {config.max_new_tokens} + the prompt's {len(ids)} tokens exceed this model's"
                    f" context of {context} tokens (at most {context - len(ids)} new tokens fit)"
                )
            run = self.gen.events(ids, config)
            tokens: list[int] = []
            pieces: list[str] = []
            reason = "length"
            for new, piece, why in run:
                reason = why or reason
                if stream and new:
                    outputs = [
                        _tensor("text_output", [piece.encode()], np.object_),
                        _tensor("token_ids", new, np.int64),
                    ]
                    sender.send(pb_utils.InferenceResponse(output_tensors=outputs))
                tokens += new
                pieces.append(piece)
        except (SpecExportError, ValueError) as exc:
            sender.send(
                pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(exc))), flags=final
            )
            return
        stats = run.stats
        figures = speculative(
            Outcome(
                reason,
                stats,
                config.proposer if config.speculating else "none",
                run.gamma_policy,
                config.gamma,
                0.0,
                None,
            )
        )
        outputs = [
            _tensor("text_output", [b"" if stream else "".join(pieces).encode()], np.object_),
            _tensor("token_ids", [] if stream else tokens, np.int64),
            _tensor("finish_reason", [FINISH_REASONS[reason].encode()], np.object_),
            _tensor("drafted", [stats.drafted], np.int64),
            _tensor("accepted", [stats.accepted], np.int64),
            _tensor("rounds", [stats.rounds], np.int64),
            _tensor("acceptance_rate", [stats.acceptance_rate], np.float32),
            _tensor("speculative", [json.dumps(figures).encode()], np.object_),
        ]
        sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=final)

    def finalize(self) -> None:
        self.gen = None

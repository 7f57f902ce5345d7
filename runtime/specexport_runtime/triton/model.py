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
`trusted_keys` (comma-separated paths relative to this folder) when there are any. A config.pbtxt
without the decoupled transaction policy is refused at initialize.

Every request ends with exactly one response carrying the FINAL flag, after any streamed rounds:
    the figures                 the generation ran to its end
    error INVALID_ARG           bad input (missing text_input, an option out of range, a prompt too long)
    error CANCELLED             the client cancelled the request (request.is_cancelled(), checked
                                before the first round and between rounds; the generation is abandoned)
    error INTERNAL              anything else (a runtime failure, a bug): "internal error: <type>",
                                logged with its traceback; the next request is answered as usual
(codes where the backend's TritonError has them, else a plain error).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from specexport_runtime.errors import InvalidArgument, PromptError

log = logging.getLogger("specexport.triton")
OPTIONS = {  # optional input -> (GeneratorConfig field, how to read its one element, what it must be)
    "max_tokens": ("max_new_tokens", int, "an integer"),
    "temperature": ("temperature", float, "a number"),
    "top_k": ("top_k", int, "an integer"),
    "top_p": ("top_p", float, "a number"),
    "seed": ("seed", int, "an integer"),
}
DECOUPLED = "model_transaction_policy { decoupled: true }"


def _scalar(request, name: str):
    """The one element of an optional input (a Python value: str for STRING), or None when the
    request does not carry it."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise InvalidArgument(f"input {name} must hold one element, got {values.size}")
    value = values[0]
    value = value.item() if isinstance(value, np.generic) else value
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidArgument(f"input {name} must be UTF-8 text, got {value[:40]!r}") from exc
    return value


def _option(request, name: str):
    """The GeneratorConfig value of optional input `name` (OPTIONS), or None when it is absent."""
    value = _scalar(request, name)
    if value is None:
        return None
    kind, what = OPTIONS[name][1:]
    try:
        return kind(value)
    except (ValueError, OverflowError, TypeError) as exc:  # int(inf), int(nan), int(None), float("x")
        raise InvalidArgument(f"input {name} must be {what}, got {value!r}") from exc


def _tensor(name: str, value, dtype) -> object:
    return pb_utils.Tensor(name, np.array(value, dtype=dtype))


def _failure(message: str, code: str) -> object:
    """An error response; `code` names a TritonError code, used where this backend has it (the
    Python backend of Triton 23.10 and later)."""
    value = getattr(pb_utils.TritonError, code, None)
    error = pb_utils.TritonError(message) if value is None else pb_utils.TritonError(message, value)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


def _cancelled(request) -> bool:
    """Whether the client cancelled `request` (False on a backend older than 23.10, which cannot tell)."""
    return hasattr(request, "is_cancelled") and bool(request.is_cancelled())


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        from specexport_runtime.api import load

        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):  # execute answers through senders
            raise InvalidArgument(
                f"model {config.get('name', '')!r} needs `{DECOUPLED}` in its config.pbtxt"
                " (it sends a response per round through each request's sender), got a non-decoupled policy"
            )
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

    def execute(self, requests: list) -> None:
        """Decoupled: each request's responses go through its own sender; requests run in turn
        (one sequence at a time per model instance: instance_group count for more)."""
        for request in requests:
            self._run(request, request.get_response_sender())
        return None

    def _run(self, request, sender) -> None:
        """Answer one request: its streamed rounds, then exactly one FINAL response whatever failed
        (an exception never leaves here, so the requests after it are answered too)."""
        try:
            response = self._answer(request, sender)
        except Exception as exc:  # a runtime failure or a bug (not KeyboardInterrupt / SystemExit)
            log.exception("specexport triton model: a request failed")
            response = _failure(f"internal error: {type(exc).__name__} (the server log has the traceback)", "INTERNAL")
        try:
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:  # the sender is gone (the client left): nobody is left to answer
            log.exception("specexport triton model: the final response could not be sent")

    def _answer(self, request, sender) -> object:
        """The request's last response (figures, or a bad-input or cancelled error); with stream
        true the rounds go through `sender` first. Raises on anything but bad input."""
        from specexport_runtime.generator import validate_prompt_ids
        from specexport_runtime.server.responses import FINISH_REASONS, Outcome, speculative

        if _cancelled(request):  # while it waited for this instance
            return _failure("request cancelled before it started", "CANCELLED")
        try:
            text = _scalar(request, "text_input")
            if not isinstance(text, str):
                raise InvalidArgument("input text_input (STRING [1]) is required")
            overrides = {}
            for name, (field, _, _) in OPTIONS.items():
                value = _option(request, name)
                if value is not None:
                    overrides[field] = value
            proposer = _scalar(request, "proposer")
            if proposer is not None:
                overrides["proposer"] = self.gen.resolve_proposer(proposer)
            stream = bool(_scalar(request, "stream") or False)
            config = self.gen.configure(**overrides)
            context = self.gen.manifest.max_context
            ids = validate_prompt_ids(self.gen.codec.encode(text), self.gen.manifest.target.embedding_rows, context)
            if len(ids) + config.max_new_tokens > context:  # as `specexport serve` answers it: never cut silently
                raise InvalidArgument(
                    f"max_tokens {config.max_new_tokens} + the prompt's {len(ids)} tokens exceed this model's"
                    f" context of {context} tokens (at most {context - len(ids)} new tokens fit)"
                )
            run = self.gen.events(ids, config)
        except ValueError as exc:  # bad input: the checks above and the runtime's (InvalidArgument, PromptError)
            return _failure(str(exc), "INVALID_ARG")
        tokens: list[int] = []
        pieces: list[str] = []
        reason = "length"
        try:
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
                # after the last round the iterator must run out (the proposer learns from it): only between rounds
                if why is None and _cancelled(request):
                    return _failure(f"request cancelled after {len(tokens)} tokens", "CANCELLED")
        except (InvalidArgument, PromptError) as exc:  # an input only the running generation could check
            return _failure(str(exc), "INVALID_ARG")
        finally:
            run.close()  # abandons the generation when it stopped early (no-op when it ran to its end)
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
                tree_nodes=run.config.tree_nodes or 0,
                tree_policy=run.tree_policy,
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
        return pb_utils.InferenceResponse(output_tensors=outputs)

    def finalize(self) -> None:
        self.gen = None

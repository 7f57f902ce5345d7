"""A stand-in for Triton's `triton_python_backend_utils` (the module the Python backend provides to
model.py), with the part of its documented interface a decoupled model uses: Tensor, InferenceResponse,
TritonError (with its codes), get_input_tensor_by_name, using_decoupled_model_transaction_policy and
the FINAL flag.
Requests (with is_cancelled) and their response senders are the tests' own (FakeRequest, Sender
below), recording what the model sends."""

from __future__ import annotations

import numpy as np

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


class Tensor:
    def __init__(self, name: str, array: np.ndarray):
        if not isinstance(array, np.ndarray):
            raise TypeError(f"Tensor {name}: expected a numpy array, got {type(array).__name__}")
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class TritonError:
    """An error with a code (the Python backend's since 23.10; the numbers are the stand-in's own)."""

    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = UNKNOWN):
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class InferenceResponse:
    def __init__(self, output_tensors: list, error: TritonError | None = None):
        for tensor in output_tensors:
            if not isinstance(tensor, Tensor):
                raise TypeError(f"output_tensors holds a {type(tensor).__name__}, not a Tensor")
        self._outputs, self._error = list(output_tensors), error

    def output_tensors(self) -> list:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


def get_input_tensor_by_name(inference_request, name: str):
    for tensor in inference_request.inputs():
        if tensor.name() == name:
            return tensor
    return None


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


class Sender:
    """A request's response sender: records (response, flags); nothing may follow the FINAL flag."""

    def __init__(self):
        self.sent: list[tuple[InferenceResponse | None, int]] = []

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if self.sent and self.sent[-1][1] & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            raise RuntimeError("a response was sent after the FINAL flag")
        self.sent.append((response, flags))


class FakeRequest:
    """A request of `inputs` (numpy arrays by input name). is_cancelled() answers False
    `cancel_after` times, then True (None: never cancelled); `cancel_checks` counts the calls."""

    def __init__(self, cancel_after: int | None = None, **inputs):
        self._inputs = [Tensor(name, np.asarray(value)) for name, value in inputs.items()]
        self.sender = Sender()
        self.cancel_after, self.cancel_checks = cancel_after, 0

    def inputs(self) -> list:
        return self._inputs

    def is_cancelled(self) -> bool:
        self.cancel_checks += 1
        return self.cancel_after is not None and self.cancel_checks > self.cancel_after

    def get_response_sender(self) -> Sender:
        return self.sender

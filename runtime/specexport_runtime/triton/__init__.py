"""Triton Inference Server: a model repository of one artifact (docs/serving.md#more-than-one-machine).

repo (write_repository: `specexport triton-repo`), model (the Python-backend model copied into the
repository; it imports Triton's `triton_python_backend_utils` and runs inside Triton only).
"""

"""Bounds and defaults shared by the recipe, the manifest, the runtime, the CLIs and the server.

The build side imports this module too (it never imports anything heavy), so a bound is
stated once and every layer that checks it names the same range.

Draft length (gamma), in tokens drafted per round; one round verifies gamma + 1 rows:
    MIN_GAMMA .. MAX_GAMMA  the range of every gamma: a recipe's speculation.gamma and
                            max_gamma, the manifest's, a fixed per-call gamma, the server's
                            `gamma` field, bench and calibrate candidates
    DEFAULT_GAMMA           the adaptive controller's start (and the fixed gamma of an
                            artifact built with `adaptive: false`) when a recipe names none
    DEFAULT_MAX_GAMMA       the controller's ceiling and prompt lookup's longest draft when a
                            recipe names none
MAX_GAMMA + 1 = 33 rows stays within the 64 rows one verify call binds (engine.OrtModel.max_rows).
"""

from __future__ import annotations

MIN_GAMMA = 1
MAX_GAMMA = 32
DEFAULT_GAMMA = 4
DEFAULT_MAX_GAMMA = 8

# what runs an artifact's graphs (api.load's backend; loading.py): ONNX Runtime on an execution
# provider, or the native TensorRT backend on engines built for the GPU at hand (trt_backend.py)
ONNXRUNTIME, TENSORRT = "onnxruntime", "tensorrt"
BACKENDS = (ONNXRUNTIME, TENSORRT)

# what the build measured of a target's rows (feature row_padding): "bitwise" = a row's logits are the
# same bits whatever the number of rows in its call (greedy speculation == target-only, bit for
# bit); "numerical" = they differ in low bits (max |diff| and argmax agreement in validation.rows)
BITWISE, NUMERICAL = "bitwise", "numerical"
EXACTNESS = (BITWISE, NUMERICAL)

# n-gram prompt lookup: the suffix lengths tried, longest first
DEFAULT_NGRAM_SIZES = (3, 2, 1)
MAX_NGRAM = 16  # longest n-gram size a recipe or manifest may name
MAX_TREE_NODES = 63  # drafted tokens of one tree: with its root, the 64 rows one call binds

# what the `hybrid` proposer retrieves with besides its draft model or head: "suffix" (suffix
# drafts from the request, earlier answers and the corpus where they score, then prompt lookup)
# or "lookup" (prompt lookup only). Manifests without the field retrieve with the default.
HYBRID_RETRIEVALS = ("lookup", "suffix")
DEFAULT_HYBRID_RETRIEVAL = "suffix"

# an EAGLE-3 head reads the residual streams entering three target layers (low, mid, high)
FEATURE_LAYER_COUNT = 3


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default feature layers for a target of `num_layers` layers: (2, L // 2, L - 3),
    the rule of SafeAILab's EAGLE and vLLM (specexport/formats/eagle3.py)."""
    return (2, num_layers // 2, num_layers - 3)


__all__ = [
    "BITWISE",
    "DEFAULT_GAMMA",
    "DEFAULT_HYBRID_RETRIEVAL",
    "DEFAULT_MAX_GAMMA",
    "DEFAULT_NGRAM_SIZES",
    "EXACTNESS",
    "FEATURE_LAYER_COUNT",
    "HYBRID_RETRIEVALS",
    "MAX_GAMMA",
    "MAX_NGRAM",
    "MAX_TREE_NODES",
    "MIN_GAMMA",
    "NUMERICAL",
    "default_feature_layers",
]

"""TensorRT's ONNX operator support, as data: the tables trtcheck.py checks a graph against.

Each table is keyed by an ONNX op type (default domain unless noted), a TensorRT version as
(major, minor), or an ONNX TensorProto element type. Versions are "MAJOR.MINOR" strings in the
tables and (major, minor) tuples in OPSET_RANGES.
"""

from __future__ import annotations

from onnx import TensorProto

# --------------------------------------------------------------------------- the support matrix
#
# Source: onnx/onnx-tensorrt, docs/operators.md ("Supported ONNX Operators", the operator support
# matrix of TensorRT's ONNX parser; https://github.com/onnx/onnx-tensorrt/blob/main/docs/operators.md),
# read at its TensorRT 10.15 revision, with the per-release additions from the same repository's
# docs/Changelog.md (TensorRT 8.6 .. 10.15). The release branches (release/10.3-GA, ...) hold the
# matrix of each version; re-check there when a version matters.
#
# Opset ranges stated by that document: TensorRT 8.6 "up to opset 17"; 10.0 "opset 9 to opset 20";
# 10.15 "opset 9 to opset 24". For 10.1 .. 10.14 we keep 20 (the last range we could confirm).

OPSET_RANGES: dict[tuple[int, int], tuple[int, int]] = {(8, 6): (9, 17), (10, 0): (9, 20), (10, 15): (9, 24)}
KNOWN_VERSIONS = (
    "8.6",
    "10.0",
    "10.1",
    "10.2",
    "10.3",
    "10.4",
    "10.5",
    "10.6",
    "10.7",
    "10.8",
    "10.9",
    "10.10",
    "10.11",
    "10.12",
    "10.13",
    "10.14",
    "10.15",
)

# Every operator the matrix marks "Y". Ops absent from the TensorRT 8.6 parser carry the first
# version whose matrix / changelog lists them (SUPPORTED_SINCE); all others are taken as
# supported from 8.6 on (8.6 is the JetPack 6.0 version and only a secondary target here).
SUPPORTED_OPS = frozenset(
    """
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh Attention AveragePool BatchNormalization
BlackmanWindow Cast CastLike Ceil Celu Clip Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh
CumSum DeformConv DepthToSpace DequantizeLinear Div Dropout Einsum Elu Equal Erf Exp Expand EyeLike Flatten
Floor Gather GatherElements GatherND Gelu Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool Greater
GreaterOrEqual GridSample GroupNormalization GRU HammingWindow HannWindow HardSigmoid HardSwish Hardmax
Identity If ImageScaler InstanceNormalization IsInf IsNaN LayerNormalization LeakyRelu Less LessOrEqual Log
LogSoftmax Loop LRN LSTM LpNormalization LpPool MatMul Max MaxPool Mean MeanVarianceNormalization Min Mish
Mod Mul Neg NonMaxSuppression NonZero Not OneHot Or Pad ParametricSoftplus Pow PRelu QuantizeLinear
RandomNormal RandomNormalLike RandomUniform RandomUniformLike Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum
ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize
ReverseSequence RMSNormalization RNN RoiAlign RotaryEmbedding Round STFT ScaledTanh Scan Scatter
ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign Sin Sinh Size Slice Softmax Softplus Softsign
SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh TensorScatter ThresholdedRelu Tile TopK Transpose Trilu
Unsqueeze Upsample Where Xor
""".split()
)

SUPPORTED_SINCE: dict[str, str] = {
    "Hardmax": "9.2",
    "CastLike": "10.0",
    "Gelu": "10.0",
    "Mish": "10.0",  # opset 15-20 ops, first seen in the 10.0 matrix
    "DeformConv": "10.1",
    "BlackmanWindow": "10.4",
    "HammingWindow": "10.4",
    "HannWindow": "10.4",
    "STFT": "10.5",
    "Attention": "10.14",
    "RotaryEmbedding": "10.15",
    "RMSNormalization": "10.15",
    "TensorScatter": "10.15",
}

# Operators the matrix marks "N" (with its note where it gives one).
UNSUPPORTED_OPS: dict[str, str] = {
    "DynamicQuantizeLinear": "not supported by TensorRT (its IDynamicQuantize is only reachable through a model"
    " local function); dynamic-int8 graphs cannot be built",
    "MatMulInteger": "not supported by TensorRT (dynamic-int8 graphs); quantize with Q/DQ nodes instead",
    "ConvInteger": "not supported by TensorRT",
    "QLinearConv": "not supported by TensorRT (use Q/DQ nodes)",
    "QLinearMatMul": "not supported by TensorRT (use Q/DQ nodes)",
    **{
        op: "not supported by TensorRT"
        for op in """
        AffineGrid Bernoulli BitShift BitwiseAnd BitwiseNot BitwiseOr BitwiseXor Col2Im CenterCropPad Compress
        ConcatFromSequence DFT Det ImageDecoder MaxRoiPool MaxUnpool MelWeightMatrix Multinomial
        NegativeLogLikelihoodLoss Optional OptionalGetElement OptionalHasElement RegexFullMatch SequenceAt
        SequenceConstruct SequenceEmpty SequenceErase SequenceInsert SequenceLength SequenceMap
        SoftmaxCrossEntropyLoss SplitToSequence StringConcat StringNormalizer StringSplit TfIdfVectorizer Unique
    """.split()
    },
}

# Contrib operators ONNX Runtime's quantizers and fusions emit; none is a TensorRT ONNX operator.
CONTRIB_NOTES: dict[str, str] = {
    "MatMulNBits": "ONNX Runtime contrib op (weight-only int8/int4 from specexport's int8/int4 drafts): not a"
    " TensorRT operator; use an fp16 draft for TensorRT, or the ONNX Runtime CUDA provider",
    "GroupQueryAttention": "ONNX Runtime contrib op: not a TensorRT operator",
    "MultiHeadAttention": "ONNX Runtime contrib op: not a TensorRT operator",
    "SkipLayerNormalization": "ONNX Runtime contrib op: not a TensorRT operator",
    "SimplifiedLayerNormalization": "ONNX Runtime contrib op: not a TensorRT operator (use RMSNormalization,"
    " TensorRT >= 10.15, or plain ops)",
    "RotaryEmbedding": "ONNX Runtime contrib op: not a TensorRT operator",
}

# Ops whose listed input must be a build-time constant (initializer or Constant output) before
# a version: (input index, name, version from which a tensor is accepted or None).
CONSTANT_INPUTS: dict[str, tuple[int, str, str | None]] = {
    "Slice": (3, "axes", "10.3"),  # changelog 10.3: tensor axes inputs for Slice
    "CumSum": (1, "axis", "10.8"),  # changelog 10.8: dynamic axes for CumSum
    "Squeeze": (1, "axes", "10.7"),  # changelog 10.7: dynamic axes for Squeeze / Unsqueeze
    "Unsqueeze": (1, "axes", "10.7"),
    "TopK": (1, "K", None),
    "OneHot": (1, "depth", None),
    **{
        op: (1, "axes", None)
        for op in (
            "ReduceL1",
            "ReduceL2",
            "ReduceLogSum",
            "ReduceLogSumExp",
            "ReduceMax",
            "ReduceMean",
            "ReduceMin",
            "ReduceProd",
            "ReduceSum",
            "ReduceSumSquare",
        )
    },
}

# element types TensorRT does not take (an error), by name
DTYPE_ERRORS = {
    TensorProto.STRING: "string",
    TensorProto.COMPLEX64: "complex64",
    TensorProto.COMPLEX128: "complex128",
    TensorProto.INT16: "int16",
    TensorProto.UINT16: "uint16",
    TensorProto.UINT32: "uint32",
    TensorProto.UINT64: "uint64",
}
# element types TensorRT takes from a version on: element type -> (name, first version)
DTYPE_SINCE = {
    TensorProto.BFLOAT16: ("bfloat16", "9.0"),
    TensorProto.FLOAT8E4M3FN: ("float8e4m3fn", "9.0"),
    TensorProto.INT4: ("int4", "10.0"),
}
# every element type -> its lower-case name, for the report's type counts
DTYPE_NAMES = {v: k.lower() for k, v in TensorProto.DataType.items()}

"""Lossless speculative decoding for Qwen3 models with DSpark block drafts.

A DSpark draft proposes a block of tokens in one pass, the Qwen3 target checks them in one
forward pass, and an exact acceptance rule keeps the output distribution identical to the
target's own sampling. The engine is the Rust library ``dspark``; this package is a thin layer
over it.

>>> import dspark
>>> engine = dspark.Engine("Qwen3-8B", draft="dspark_qwen3_8b_block7", device="cuda", dtype="bf16")
>>> out = engine.generate([{"role": "user", "content": "Write a haiku"}],
...                       dspark.SamplingParams(max_new_tokens=64), enable_thinking=False)
>>> print(out.text, out.stats.tau)
"""

from ._dspark import (
    BackendError,
    BatchStats,
    CheckpointError,
    ConfigError,
    DsparkError,
    Engine,
    Generation,
    GenerationStats,
    InternalError,
    InvalidInputError,
    InvalidSamplingError,
    IoError,
    JsonError,
    KvCacheFullError,
    MissingTensorError,
    RoundRecord,
    SafetensorsError,
    SamplingParams,
    StreamChunk,
    TensorDtypeError,
    TensorShapeError,
    TextError,
    TokenOutOfRangeError,
    TokenStream,
    UnknownSequenceError,
    UnsupportedError,
    __version__,
    graphs_enabled,
    set_graphs_enabled,
)

__all__ = [
    "BackendError",
    "BatchStats",
    "CheckpointError",
    "ConfigError",
    "DsparkError",
    "Engine",
    "Generation",
    "GenerationStats",
    "InternalError",
    "InvalidInputError",
    "InvalidSamplingError",
    "IoError",
    "JsonError",
    "KvCacheFullError",
    "MissingTensorError",
    "RoundRecord",
    "SafetensorsError",
    "SamplingParams",
    "StreamChunk",
    "TensorDtypeError",
    "TensorShapeError",
    "TextError",
    "TokenOutOfRangeError",
    "TokenStream",
    "UnknownSequenceError",
    "UnsupportedError",
    "__version__",
    "graphs_enabled",
    "set_graphs_enabled",
]

"""The module surface: exports, exception classes, SamplingParams, Engine construction errors."""

import os
from pathlib import Path

import pytest

import dspark
from conftest import DRAFT, GOLDEN, TARGET


def test_exports_and_version():
    for name in dspark.__all__:
        assert hasattr(dspark, name), name
    assert dspark.__version__.count(".") == 2
    assert dspark.Engine.__module__ == "dspark"


def test_the_graph_switch_round_trips():
    # Process-wide: restored whatever happens, so the other tests keep the default.
    assert dspark.graphs_enabled() is True
    try:
        dspark.set_graphs_enabled(False)
        assert dspark.graphs_enabled() is False
    finally:
        dspark.set_graphs_enabled(True)
    assert dspark.graphs_enabled() is True


def test_types_ship_with_the_package():
    package = Path(dspark.__file__).parent
    assert (package / "py.typed").is_file()
    stubs = (package / "_dspark.pyi").read_text()
    for name in dspark.__all__:
        assert name in stubs, name


def test_docstrings_come_from_the_rust_docs():
    assert "Qwen3 target" in dspark.Engine.__doc__
    assert "Generate continuations" in dspark.Engine.generate.__doc__
    assert "Log-probability" in dspark.Engine.score.__doc__
    assert "Softmax temperature" in dspark.SamplingParams.temperature.__doc__
    assert "τ" in dspark.GenerationStats.tau.__doc__


@pytest.mark.parametrize(
    "name, bases",
    [
        ("IoError", (OSError,)),
        ("CheckpointError", ()),
        ("JsonError", (dspark.CheckpointError,)),
        ("ConfigError", (dspark.CheckpointError,)),
        ("SafetensorsError", (dspark.CheckpointError,)),
        ("MissingTensorError", (dspark.CheckpointError,)),
        ("TensorShapeError", (dspark.CheckpointError,)),
        ("TensorDtypeError", (dspark.CheckpointError,)),
        ("TokenOutOfRangeError", (ValueError,)),
        ("InvalidInputError", (ValueError,)),
        ("InvalidSamplingError", (ValueError,)),
        ("KvCacheFullError", ()),
        ("UnknownSequenceError", ()),
        ("UnsupportedError", (ValueError,)),
        ("TextError", ()),
        ("BackendError", (RuntimeError,)),
        ("InternalError", (RuntimeError,)),
    ],
)
def test_exception_hierarchy(name, bases):
    cls = getattr(dspark, name)
    assert issubclass(cls, dspark.DsparkError)
    assert issubclass(dspark.DsparkError, Exception)
    for base in bases:
        assert issubclass(cls, base)
    assert cls.__module__ == "dspark"
    assert cls.__doc__


def test_sampling_params_defaults_follow_rust():
    p = dspark.SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_k, p.top_p, p.seed) == (64, 0.0, 0, 1.0, 0)
    assert p.stop_token_ids == [] and p.ignore_eos is False and p.is_greedy
    assert dspark.SamplingParams.greedy(7) == dspark.SamplingParams(7)
    q = dspark.SamplingParams(
        10, temperature=0.7, top_k=5, top_p=0.9, seed=3, stop_token_ids=[2, 4], ignore_eos=True
    )
    assert (q.max_new_tokens, q.top_k, q.seed, q.stop_token_ids, q.ignore_eos) == (10, 5, 3, [2, 4], True)
    assert q.temperature == pytest.approx(0.7) and q.top_p == pytest.approx(0.9)
    assert not q.is_greedy
    assert "temperature=0.7" in repr(q)
    q.temperature = 0.0
    assert q.is_greedy and q != p


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1.0}, {"temperature": float("nan")}, {"top_p": 0.0}, {"top_p": 1.5}]
)
def test_sampling_params_out_of_range(kwargs):
    with pytest.raises(dspark.InvalidSamplingError):
        dspark.SamplingParams(**kwargs)
    p = dspark.SamplingParams()
    for k, v in kwargs.items():
        setattr(p, k, v)
    with pytest.raises(ValueError):
        p.validate()


def test_sampling_params_type_errors():
    with pytest.raises(OverflowError):
        dspark.SamplingParams(-1)
    with pytest.raises(TypeError):
        dspark.SamplingParams(stop_token_ids="abc")


def test_engine_properties(target_engine, spec_engine):
    e = target_engine
    assert not e.is_speculative and spec_engine.is_speculative
    assert e.vocab_size == 512
    assert e.device == "cpu" and e.dtype == "f32"
    assert not e.has_tokenizer
    assert e.eos_token_ids == [2]
    assert "speculative=False" in repr(e) and "speculative=True" in repr(spec_engine)


def test_engine_accepts_path_like_and_dtype_aliases():
    e = dspark.Engine(os.fspath(TARGET), dtype="float32", device="cpu")
    assert e.dtype == "f32"


def test_bf16_engine_loads():
    e = dspark.Engine(TARGET, dtype="bf16")
    assert e.dtype == "bf16"
    assert len(e.generate([1, 2, 3], dspark.SamplingParams(4)).token_ids) == 4


def test_progress_callback_sees_every_byte():
    calls = []
    dspark.Engine(TARGET, progress=lambda done, total: calls.append((done, total)))
    assert calls and calls[-1][0] == calls[-1][1] > 0
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:]))


def test_bad_target_path_raises_io_error(tmp_path):
    with pytest.raises(dspark.IoError) as info:
        dspark.Engine(tmp_path / "missing")
    assert isinstance(info.value, OSError)
    assert "missing" in str(info.value) and "missing" in info.value.path


def test_malformed_config_raises_json_error(tmp_path):
    (tmp_path / "config.json").write_text("{ not json")
    with pytest.raises(dspark.JsonError) as info:
        dspark.Engine(tmp_path)
    assert isinstance(info.value, dspark.CheckpointError)
    assert info.value.path.endswith("config.json")


def test_missing_weights_raise(tmp_path):
    (tmp_path / "config.json").write_bytes((TARGET / "config.json").read_bytes())
    with pytest.raises(dspark.DsparkError):
        dspark.Engine(tmp_path)


@pytest.mark.parametrize("dtype", ["f64", "int8", ""])
def test_bad_dtype(dtype):
    with pytest.raises(dspark.UnsupportedError, match="dtype"):
        dspark.Engine(TARGET, dtype=dtype)
    with pytest.raises(ValueError):
        dspark.Engine(TARGET, dtype=dtype)


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "CPU"])
def test_bad_device(device):
    with pytest.raises(dspark.UnsupportedError, match="device"):
        dspark.Engine(TARGET, device=device)


def test_cuda_without_the_cuda_build_is_unsupported():
    try:
        engine = dspark.Engine(TARGET, device="cuda")
    except dspark.UnsupportedError as e:
        assert "cuda" in str(e)
    else:  # a CUDA build on a GPU machine
        assert engine.device == "cuda:0"


def test_verify_options_are_checked():
    for kwargs in ({"verify_width": 0}, {"verify_width": 6}, {"confidence_threshold": 1.5}):
        with pytest.raises(dspark.InvalidInputError):
            dspark.Engine(TARGET, draft=DRAFT, **kwargs)
    with pytest.raises(dspark.InvalidInputError, match="need a draft"):
        dspark.Engine(TARGET, verify_width=2)
    with pytest.raises(dspark.InvalidInputError, match="not both"):
        dspark.Engine(TARGET, draft=DRAFT, verify_width=2, confidence_threshold=0.5)


def test_draft_that_is_not_a_draft(tmp_path):
    with pytest.raises(dspark.DsparkError):
        dspark.Engine(TARGET, draft=GOLDEN / "tiny-qwen3-sharded")


def test_kv_budget_without_a_page():
    with pytest.raises(dspark.InvalidInputError):
        dspark.Engine(TARGET, kv_budget_bytes=1)


def test_kv_cache_full_leaves_the_engine_usable():
    # One page of 16 rows: the prompt fits, 40 new tokens do not.
    page_bytes = 6 * 2 * 2 * 16 * 16 * 4
    engine = dspark.Engine(TARGET, kv_budget_bytes=page_bytes, page_size=16)
    with pytest.raises(dspark.KvCacheFullError) as info:
        engine.generate([1, 2, 3, 4, 5], dspark.SamplingParams(40))
    e = info.value
    assert e.total_pages == 1 and e.page_bytes == page_bytes and e.budget_bytes == page_bytes
    assert e.needed_pages >= 1
    assert len(engine.generate([1, 2, 3, 4, 5], dspark.SamplingParams(8)).token_ids) == 8

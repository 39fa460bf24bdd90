"""Shared fixtures: the tiny golden models of dspark/tests/fixtures and engines over them."""

import json
import shutil
import struct
from pathlib import Path

import pytest

import dspark

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "dspark" / "tests" / "fixtures"
GOLDEN = FIXTURES / "golden"
TARGET = GOLDEN / "tiny-qwen3"
DRAFT = GOLDEN / "tiny-dspark"
TEXT = FIXTURES / "text"


def read_safetensors(path):
    """{name: (shape, list of floats)} of an F32 safetensors file, in pure Python."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32"
        start, end = info["data_offsets"]
        raw = data[8 + n + start : 8 + n + end]
        out[name] = (info["shape"], list(struct.unpack(f"<{len(raw) // 4}f", raw)))
    return out


def write_safetensors(path, tensors):
    """Write {name: (shape, floats)} as F32 safetensors."""
    header, blobs, offset = {}, [], 0
    for name, (shape, values) in tensors.items():
        blob = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


@pytest.fixture(scope="session")
def golden_cases():
    return json.loads((GOLDEN / "cases.json").read_text())["sets"][0]


@pytest.fixture(scope="session")
def target_engine():
    return dspark.Engine(TARGET)


@pytest.fixture(scope="session")
def spec_engine():
    return dspark.Engine(TARGET, draft=DRAFT)


@pytest.fixture(scope="session")
def text_target(tmp_path_factory):
    """tiny-qwen3 widened to the text fixture's vocabulary (645 ids: the new embedding and LM
    head rows repeat the first ones), with that tokenizer, its chat template and its
    generation_config.json."""
    folder = tmp_path_factory.mktemp("tiny-qwen3-text")
    vocab = json.loads((TEXT / "tokenizer.json").read_text())
    size = max(max(vocab["model"]["vocab"].values()), max(t["id"] for t in vocab["added_tokens"])) + 1
    tensors = read_safetensors(TARGET / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        (rows, hidden), values = tensors[name]
        extra = (size - rows) * hidden
        tensors[name] = ([size, hidden], values + values[:extra])
    write_safetensors(folder / "model.safetensors", tensors)
    config = json.loads((TARGET / "config.json").read_text())
    config["vocab_size"] = size
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TEXT / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def text_engine(text_target):
    return dspark.Engine(text_target)

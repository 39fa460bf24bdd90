#!/usr/bin/env python3
"""Build the code corpus and tokenizer for the small trained target/draft pair (issue 7).

Runs on a CPU machine; nothing is downloaded. Sources (only material with a clear licence that
is already on the machine):

* the Python standard library's ``.py`` files (PSF licence) of the running interpreter, without
  ``site-packages`` (third-party code under other licences);
* Rust crate sources from the local Cargo registry (``~/.cargo/registry/src``), newest version of
  each crate only, and only crates whose ``Cargo.toml`` ``license`` is an ``OR`` of alternatives
  at least one of which is ``MIT`` or ``Apache-2.0`` (expressions with ``AND`` are skipped);
  crates of machine-generated bindings (``windows*``, ``*-sys``, ``libc``, ...) and files marked
  as generated are left out, and each crate contributes at most ``--max-bytes-per-crate``.

Files are deduplicated by content hash; the held-out split is chosen by the content hash too
(``--heldout-permille`` of the files), so it is stable and no file is in both splits. A byte-level
BPE tokenizer (Qwen2 pre-tokenizer regex, like ``scripts/make_text_fixture.py``) is trained on
the training split; the special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` and
``<|mask|>`` (the draft's mask token) come after the learned vocabulary.

Output (``--out``, default ``out/pair/corpus``, git-ignored):

* ``tokenizer.json``, ``tokenizer_config.json`` (ChatML chat template, ``eos_token``
  ``<|endoftext|>``);
* ``train.bin.xz`` and ``heldout.bin.xz``: little-endian uint16 token streams, documents
  separated by ``<|endoftext|>`` (xz-compressed);
* ``meta.json``: counts, token ids, and the list of sources with their licences.

Usage: ``python3 scripts/pair/build_corpus.py [--out DIR] [--max-train-tokens N]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import random
import re
import shutil
import sys
import sysconfig
import time
import tomllib
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors, trainers

QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
EOT, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"
SPECIAL = [EOT, IM_START, IM_END, MASK]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ALLOWED_LICENCES = {"MIT", "Apache-2.0"}
MAX_FILE_BYTES = 256 * 1024
MIN_FILE_BYTES = 64
# Crates that are mostly machine-generated bindings: left out so the corpus is written code.
GENERATED_CRATES = re.compile(r"^(windows|winapi|objc2|web-sys|js-sys|libc$|.*-sys$)")
GENERATED_MARKERS = ("@generated", "automatically generated", "do not edit", "auto-generated")


def licence_ok(expr: str | None) -> str | None:
    """The alternative we use the crate under, or None when the expression does not allow MIT or
    Apache-2.0 on its own."""
    if not expr or " AND " in expr.upper() or "(" in expr:
        return None
    alternatives = [a.strip() for a in re.split(r"\s+OR\s+|/", expr) if a.strip()]
    for a in alternatives:
        if a in ALLOWED_LICENCES:
            return a
    return None


def version_key(v: str) -> tuple:
    core, _, pre = v.partition("-")
    nums = []
    for part in core.split("."):
        nums.append(int(part) if part.isdigit() else 0)
    # A release sorts after its pre-releases.
    return (tuple(nums), pre == "", pre)


def python_files(stdlib: Path) -> list[tuple[str, Path, str]]:
    out = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if rel.parts and rel.parts[0] in ("site-packages", "dist-packages"):
            continue
        if "__pycache__" in rel.parts:
            continue
        out.append(("python-stdlib", path, "PSF-2.0"))
    return out


def crate_files(registry: Path) -> tuple[list[tuple[str, Path, str]], dict]:
    """Newest version of each licence-compatible crate in every index folder of the registry."""
    newest: dict[str, tuple[tuple, Path, str]] = {}
    skipped = {}
    for index in sorted(p for p in registry.iterdir() if p.is_dir()):
        for crate in sorted(p for p in index.iterdir() if p.is_dir()):
            manifest = crate / "Cargo.toml"
            if not manifest.is_file():
                continue
            try:
                package = tomllib.loads(manifest.read_text(encoding="utf-8")).get("package", {})
            except (tomllib.TOMLDecodeError, UnicodeDecodeError):
                continue
            name, version = package.get("name"), package.get("version")
            lic = package.get("license")
            if not isinstance(name, str) or not isinstance(version, str):
                continue
            if GENERATED_CRATES.match(name):
                continue
            chosen = licence_ok(lic if isinstance(lic, str) else None)
            if chosen is None:
                skipped[f"{name}-{version}"] = lic if isinstance(lic, str) else None
                continue
            key = version_key(version)
            if name not in newest or key > newest[name][0]:
                newest[name] = (key, crate, chosen)
    out = []
    crates = {}
    for name, (_, crate, chosen) in sorted(newest.items()):
        crates[crate.name] = chosen
        for path in sorted(crate.rglob("*.rs")):
            if "target" in path.relative_to(crate).parts:
                continue
            out.append((f"crate:{crate.name}", path, chosen))
    return out, {"crates": crates, "skipped_for_licence": skipped}


def read_text(path: Path) -> str | None:
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES or size < MIN_FILE_BYTES:
            return None
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    text = text.replace("\r\n", "\n")
    if "\x00" in text or any(s in text for s in SPECIAL):
        return None
    head = text[:2000].lower()
    if any(m in head for m in GENERATED_MARKERS):
        return None
    return text


def build_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Like Qwen3, the special tokens come after the learned vocabulary.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    return tok


def tokenizer_config(tok: Tokenizer) -> dict:
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END, MASK],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOT,
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": EOT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def encode_stream(tok: Tokenizer, texts: list[str], eot: int, max_tokens: int | None) -> np.ndarray:
    parts, total = [], 0
    batch = 256
    for i in range(0, len(texts), batch):
        for enc in tok.encode_batch(texts[i : i + batch], add_special_tokens=False):
            ids = np.asarray(enc.ids, dtype=np.uint16)
            parts.append(ids)
            parts.append(np.asarray([eot], dtype=np.uint16))
            total += len(ids) + 1
        if max_tokens is not None and total >= max_tokens:
            break
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)
    return stream[:max_tokens] if max_tokens is not None else stream


def write_xz(path: Path, array: np.ndarray) -> int:
    data = array.astype("<u2").tobytes()
    with lzma.open(path, "wb", preset=6) as f:
        f.write(data)
    return path.stat().st_size


def main() -> None:
    root = Path(__file__).resolve().parents[2]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=root / "out" / "pair" / "corpus")
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    ap.add_argument("--cargo-registry", type=Path, default=Path("~/.cargo/registry/src").expanduser())
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--heldout-permille", type=int, default=20, help="held-out share of files, per mille")
    ap.add_argument("--max-train-tokens", type=int, default=32_000_000)
    ap.add_argument("--max-heldout-tokens", type=int, default=1_000_000)
    ap.add_argument("--tokenizer-train-bytes", type=int, default=40_000_000)
    ap.add_argument("--max-bytes-per-crate", type=int, default=1_000_000,
                    help="stop taking a crate's files past this many bytes (keeps the mix diverse)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.time()
    final = args.out
    # Build in a side folder and swap it in at the end, so a corpus folder is never half-written.
    args.out = final.with_name(final.name + ".partial")
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)

    files = python_files(args.stdlib)
    n_py = len(files)
    crate_meta = {"crates": {}, "skipped_for_licence": {}}
    if args.cargo_registry.is_dir():
        rs, crate_meta = crate_files(args.cargo_registry)
        files += rs
    print(f"{n_py} stdlib files, {len(files) - n_py} crate files "
          f"({len(crate_meta['crates'])} crates kept, {len(crate_meta['skipped_for_licence'])} skipped "
          f"for licence)", flush=True)

    seen: set[str] = set()
    train, heldout = [], []
    per_source = {"python": 0, "rust": 0}
    per_crate: dict[str, int] = {}
    for source, path, _lic in files:
        text = read_text(path)
        if text is None:
            continue
        if source != "python-stdlib":
            if per_crate.get(source, 0) >= args.max_bytes_per_crate:
                continue
            per_crate[source] = per_crate.get(source, 0) + len(text)
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        per_source["python" if source == "python-stdlib" else "rust"] += 1
        (heldout if int(digest[:8], 16) % 1000 < args.heldout_permille else train).append(text)
    rng = random.Random(args.seed)
    rng.shuffle(train)
    rng.shuffle(heldout)
    print(f"{len(train)} train files, {len(heldout)} held-out files after dedup "
          f"({sum(map(len, train)) / 1e6:.1f} MB train text) [{time.time() - t0:.0f}s]", flush=True)

    sample, size = [], 0
    for text in train:
        if size >= args.tokenizer_train_bytes:
            break
        sample.append(text)
        size += len(text)
    tok = build_tokenizer(sample, args.vocab_size)
    assert tok.get_vocab_size() <= args.vocab_size, tok.get_vocab_size()
    ids = {t: tok.token_to_id(t) for t in SPECIAL}
    print(f"tokenizer: {tok.get_vocab_size()} tokens, specials {ids} [{time.time() - t0:.0f}s]", flush=True)
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok), indent=2) + "\n")

    eot = ids[EOT]
    train_ids = encode_stream(tok, train, eot, args.max_train_tokens)
    heldout_ids = encode_stream(tok, heldout, eot, args.max_heldout_tokens)
    print(f"tokens: train {len(train_ids):,}, held-out {len(heldout_ids):,}; "
          f"{sum(map(len, train)) / max(1, len(train_ids)):.2f} bytes/token upper bound "
          f"[{time.time() - t0:.0f}s]", flush=True)
    train_bytes = write_xz(args.out / "train.bin.xz", train_ids)
    heldout_bytes = write_xz(args.out / "heldout.bin.xz", heldout_ids)
    meta = {
        "vocab_size": args.vocab_size,
        "tokenizer_size": tok.get_vocab_size(),
        "special_token_ids": ids,
        "eot_token_id": eot,
        "mask_token_id": ids[MASK],
        "train_tokens": int(len(train_ids)),
        "heldout_tokens": int(len(heldout_ids)),
        "train_files": len(train),
        "heldout_files": len(heldout),
        "unique_files_by_source": per_source,
        "heldout_permille": args.heldout_permille,
        "compressed_bytes": {"train.bin.xz": train_bytes, "heldout.bin.xz": heldout_bytes},
        "python": f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}",
        "sources": {
            "python_stdlib": "PSF-2.0 (CPython standard library, site-packages excluded)",
            "crates_used_under": crate_meta["crates"],
            "crates_skipped_for_licence": crate_meta["skipped_for_licence"],
        },
    }
    (args.out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    args.out.rename(final)
    args.out = final
    print(f"wrote {args.out}: train.bin.xz {train_bytes / 1e6:.1f} MB, heldout.bin.xz "
          f"{heldout_bytes / 1e6:.1f} MB [{time.time() - t0:.0f}s]", flush=True)


if __name__ == "__main__":
    main()

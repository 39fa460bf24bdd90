#!/usr/bin/env python3
"""Regenerate the text fixtures under dspark/tests/fixtures/text/.

Nothing is downloaded. What the script writes:

* ``tokenizer.json``: a tiny byte-level BPE tokenizer laid out like Qwen3's (NFC normalizer,
  the Qwen2 ``Split`` pre-tokenizer regex followed by ``ByteLevel``, ``ByteLevel`` decoder,
  the special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` and the non-special
  added tokens ``<think>``, ``</think>`` appended after the learned vocabulary). It is trained
  on a few files of this Python's standard library (PSF licensed) plus a short text written
  for this fixture, so the exact merges depend on the Python version (3.11 was used).
* ``tokenizer_config.json``: Qwen3-8B's layout, with the chat template read from
  ``qwen3-8b.chat_template.jinja`` (Qwen3-8B's published template, Apache-2.0),
  ``eos_token: "<|im_end|>"`` and ``bos_token: null``.
* ``generation_config.json``: Qwen3-8B's, with this tokenizer's ids.
* ``chat_cases.json``: message lists with the rendering that Hugging Face's
  ``apply_chat_template`` produces, computed with jinja2 set up the way transformers sets it
  up (sandboxed, ``trim_blocks``, ``lstrip_blocks``, loop controls). Each case is rendered with
  both the current Qwen3-8B template and the initial-release one in
  ``jinja_layout/chat_template.jinja``; the two must agree. Where ``transformers`` is importable
  the renderings are cross-checked against ``AutoTokenizer.apply_chat_template`` as well.

Requirements: ``pip install tokenizers==0.22.2 jinja2`` (``transformers`` optional).
Run from anywhere: ``python3 scripts/make_text_fixture.py``.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "dspark" / "tests" / "fixtures" / "text"

QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
NON_SPECIAL = ["<think>", "</think>"]
VOCAB_SIZE = 640

STDLIB_FILES = ["textwrap.py", "string.py", "fnmatch.py", "shlex.py", "colorsys.py", "bisect.py"]

OWN_TEXT = """\
Speculative decoding lets a small draft model propose several tokens that the target model
verifies in a single forward pass. When the draft agrees with the target, many tokens are
accepted at once; when it does not, the target's own token is kept, so the output is exactly
what the target alone would have produced.

The quick brown fox jumps over the lazy dog. Hello, world! How are you today?
I'm fine, thanks. You're welcome. We've seen it. They'll come. It's done. He'd know.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 -7 1e-6.

Caf\u00e9, na\u00efve, r\u00e9sum\u00e9, h\u00e9llo, \u00fcber, stra\u00dfe, se\u00f1or, fa\u00e7ade.
\u4e16\u754c\u4f60\u597d\u3002\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3002\u00a1Hola! \u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440.
Emoji: \U0001f389 \U0001f680 \u2728 \U0001f600.

<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
What is the capital of France?<|im_end|>
<|im_start|>assistant
<think>
The user asks a simple question.
</think>

The capital of France is Paris.<|im_end|>
"""


def training_texts() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [OWN_TEXT] * 4
    for name in STDLIB_FILES:
        texts.append((stdlib / name).read_text(encoding="utf-8"))
    return texts


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(training_texts(), trainer=trainer)
    # Like Qwen3, the added tokens come after the learned vocabulary.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NON_SPECIAL])
    return tok


def tokenizer_config(tok: Tokenizer, chat_template: str) -> dict:
    added = {}
    for content in SPECIAL + NON_SPECIAL:
        added[str(tok.token_to_id(content))] = {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": content in SPECIAL,
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def generation_config(tok: Tokenizer) -> dict:
    eot = tok.token_to_id("<|endoftext|>")
    return {
        "bos_token_id": eot,
        "do_sample": True,
        "eos_token_id": [tok.token_to_id("<|im_end|>"), eot],
        "pad_token_id": eot,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }


def hf_jinja_env() -> jinja2.Environment:
    """The environment transformers' ``_compile_jinja_template`` builds (minus generation tags)."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


SYSTEM_USER = [msg("system", "You are helpful."), msg("user", "Hi")]
CASES = [
    ("system_user_no_thinking", SYSTEM_USER, True, False),
    ("system_user_thinking", SYSTEM_USER, True, True),
    ("system_user_thinking_absent", SYSTEM_USER, True, None),
    ("user_only", [msg("user", "Hello there")], True, None),
    ("user_only_no_generation_prompt", [msg("user", "Hello there")], False, None),
    (
        "multi_turn_history_think_stripped",
        [
            msg("system", "You are helpful."),
            msg("user", "What is 2+2?"),
            msg("assistant", "<think>\nSimple arithmetic.\n</think>\n\n2+2 = 4."),
            msg("user", "And 3+3?"),
        ],
        True,
        False,
    ),
    (
        "multi_turn_plain_history_thinking",
        [
            msg("user", "Hi"),
            msg("assistant", "Hello! How can I help?"),
            msg("user", "Tell me a joke."),
        ],
        True,
        True,
    ),
    (
        "final_assistant_with_reasoning",
        [
            msg("user", "Why is the sky blue?"),
            msg("assistant", "<think>\n\nRayleigh scattering.\n\n</think>\n\n\nShort light scatters more."),
        ],
        False,
        None,
    ),
    (
        "final_assistant_without_reasoning",
        [msg("user", "Say hi"), msg("assistant", "hi")],
        False,
        None,
    ),
    (
        "unicode_and_code",
        [
            msg("system", "R\u00e9ponds en fran\u00e7ais."),
            msg("user", "h\u00e9llo \u4e16\u754c \U0001f389\n\n    def f(x):\n        return x\n"),
        ],
        True,
        False,
    ),
    (
        "system_not_first",
        [msg("user", "first"), msg("system", "late system"), msg("user", "second")],
        True,
        None,
    ),
    (
        "tool_responses",
        [
            msg("user", "What is the weather?"),
            msg("assistant", "Let me check."),
            msg("tool", "sunny"),
            msg("tool", "22C"),
            msg("user", "<tool_response>\nwind: calm\n</tool_response>"),
        ],
        True,
        False,
    ),
]

HAND_DERIVED = (
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def render(env: jinja2.Environment, source: str, messages, add_generation_prompt, thinking):
    kwargs = {"messages": messages, "add_generation_prompt": add_generation_prompt}
    kwargs["eos_token"] = "<|im_end|>"
    kwargs["pad_token"] = "<|endoftext|>"
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    return env.from_string(source).render(**kwargs)


def chat_cases(current: str, initial: str) -> dict:
    env = hf_jinja_env()
    cases = []
    for name, messages, gen, thinking in CASES:
        expected = render(env, current, messages, gen, thinking)
        other = render(env, initial, messages, gen, thinking)
        if expected != other:
            sys.exit(f"case {name}: the two Qwen3 templates disagree:\n{expected!r}\n{other!r}")
        cases.append(
            {
                "name": name,
                "messages": messages,
                "add_generation_prompt": gen,
                "enable_thinking": thinking,
                "expected": expected,
            }
        )
    if cases[0]["expected"] != HAND_DERIVED:
        sys.exit(f"first case does not match the hand-derived rendering: {cases[0]['expected']!r}")
    return {
        "_comment": "Generated by scripts/make_text_fixture.py with jinja2 set up like "
        "transformers' apply_chat_template; enable_thinking null means not passed.",
        "cases": cases,
    }


def cross_check_transformers(cases: dict) -> None:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        print("transformers not importable: skipping the apply_chat_template cross-check")
        return
    hf = AutoTokenizer.from_pretrained(str(OUT))
    for case in cases["cases"]:
        kwargs = {}
        if case["enable_thinking"] is not None:
            kwargs["enable_thinking"] = case["enable_thinking"]
        got = hf.apply_chat_template(
            case["messages"],
            tokenize=False,
            add_generation_prompt=case["add_generation_prompt"],
            **kwargs,
        )
        if got != case["expected"]:
            sys.exit(f"case {case['name']}: transformers renders {got!r}, jinja2 {case['expected']!r}")
    print(f"transformers apply_chat_template agrees on {len(cases['cases'])} cases")


def write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main() -> None:
    current = (OUT / "qwen3-8b.chat_template.jinja").read_text(encoding="utf-8")
    initial = (OUT / "jinja_layout" / "chat_template.jinja").read_text(encoding="utf-8")

    tok = build_tokenizer()
    tok.save(str(OUT / "tokenizer.json"), pretty=False)
    # The Python ByteLevel decoder constructor takes no options; write Qwen3's (they do not
    # change decoding, only how the file reads).
    saved = json.loads((OUT / "tokenizer.json").read_text(encoding="utf-8"))
    saved["decoder"] = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    (OUT / "tokenizer.json").write_text(
        json.dumps(saved, ensure_ascii=False, separators=(",", ":")), encoding="utf-8"
    )
    write_json(OUT / "tokenizer_config.json", tokenizer_config(tok, current))
    write_json(OUT / "generation_config.json", generation_config(tok))

    # Sanity checks on the tokenizer just written.
    reloaded = Tokenizer.from_file(str(OUT / "tokenizer.json"))
    sample = "h\u00e9llo \u4e16\u754c \U0001f389\n<|im_start|>user\n<think>x</think><|im_end|>"
    ids = reloaded.encode(sample).ids
    assert reloaded.decode(ids, skip_special_tokens=False) == sample
    for t in SPECIAL + NON_SPECIAL:
        assert reloaded.token_to_id(t) is not None, t

    cases = chat_cases(current, initial)
    write_json(OUT / "chat_cases.json", cases)
    cross_check_transformers(cases)
    print(
        f"vocab size {reloaded.get_vocab_size(with_added_tokens=True)}, "
        f"tokenizer.json {(OUT / 'tokenizer.json').stat().st_size} bytes, "
        f"{len(cases['cases'])} chat cases"
    )


if __name__ == "__main__":
    main()

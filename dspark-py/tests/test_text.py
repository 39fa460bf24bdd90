"""Text in, text out: the tokenizer.json of the target folder, chat templates, streamed text."""

import json

import pytest

import dspark
from conftest import TARGET, TEXT

CHAT = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"}]


def test_tokenizer_is_found_in_the_target_folder(text_engine):
    assert text_engine.has_tokenizer
    assert text_engine.vocab_size == 645
    # config.json's eos, then the tokenizer's <|im_end|> and generation_config.json's ids.
    assert text_engine.eos_token_ids == [2, 642, 640]


def test_encode_decode_round_trip(text_engine):
    text = "def main():\n    return 'hello world'"
    ids = text_engine.encode(text)
    assert ids and all(isinstance(i, int) for i in ids)
    assert text_engine.decode(ids) == text
    special = text_engine.encode("<|im_start|>user")
    assert special[0] == 641
    assert text_engine.decode(special) == "user"
    assert text_engine.decode(special, skip_special_tokens=False) == "<|im_start|>user"
    with pytest.raises(dspark.TextError):
        text_engine.decode([644, 9999])


def test_chat_template_matches_the_reference_renderings(text_engine):
    for case in json.loads((TEXT / "chat_cases.json").read_text())["cases"]:
        rendered = text_engine.apply_chat_template(
            case["messages"], add_generation_prompt=case["add_generation_prompt"], enable_thinking=case["enable_thinking"]
        )
        assert rendered == case["expected"], case["name"]
    with pytest.raises(dspark.InvalidInputError, match="role"):
        text_engine.apply_chat_template([{"content": "no role"}])
    with pytest.raises(dspark.InvalidInputError, match="content"):
        text_engine.apply_chat_template([{"role": "user", "content": 3}])


def test_generate_from_text(text_engine):
    params = dspark.SamplingParams(12, ignore_eos=True)
    g = text_engine.generate("def main():", params)
    assert g.prompt_token_ids == text_engine.encode("def main():")
    assert g.text == text_engine.decode(g.token_ids)
    assert g.token_ids == text_engine.generate(g.prompt_token_ids, params).token_ids


def test_generate_from_chat_messages(text_engine):
    params = dspark.SamplingParams(10, temperature=0.7, seed=4)
    g = text_engine.generate(CHAT, params, enable_thinking=False)
    prompt = text_engine.apply_chat_template(CHAT, enable_thinking=False)
    assert prompt.endswith("<think>\n\n</think>\n\n")
    assert g.prompt_token_ids == text_engine.encode(prompt)
    assert g.text == text_engine.decode(g.token_ids)
    # A batch mixing the three prompt forms.
    batch = text_engine.generate([CHAT, "Hello", [5, 6, 7]], params, enable_thinking=False)
    assert [b.token_ids for b in batch][0] == g.token_ids
    assert batch[1].prompt_token_ids == text_engine.encode("Hello")
    assert batch[2].prompt_token_ids == [5, 6, 7]
    assert all(b.text is not None for b in batch)


def test_streamed_text_adds_up(text_engine):
    prompts = [CHAT, "class Foo:"]
    params = dspark.SamplingParams(16, temperature=1.0, seed=9)
    expected = text_engine.generate(prompts, params)
    texts = ["", ""]
    for chunk in text_engine.stream(prompts, params):
        assert chunk.text is not None
        texts[chunk.request] += chunk.text
    assert texts == [g.text for g in expected]


def test_score_text(text_engine):
    text = "import os\nimport sys"
    assert text_engine.score(text) == text_engine.score(text_engine.encode(text))


def test_tokenizer_from_another_folder():
    engine = dspark.Engine(TARGET, tokenizer=TEXT)
    assert engine.has_tokenizer and engine.vocab_size == 512
    # Chat prompts hold special-token ids (641, ...) beyond this target's 512-row vocabulary.
    with pytest.raises(dspark.TokenOutOfRangeError):
        engine.generate(CHAT)


def test_tokenizer_folder_without_tokenizer(tmp_path):
    with pytest.raises(dspark.TextError, match="tokenizer.json"):
        dspark.Engine(TARGET, tokenizer=tmp_path)


def test_malformed_tokenizer(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(dspark.TextError):
        dspark.Engine(TARGET, tokenizer=tmp_path)


def test_folder_without_chat_template(tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((TEXT / "tokenizer.json").read_bytes())
    engine = dspark.Engine(TARGET, tokenizer=tmp_path)
    assert engine.encode("abc")
    with pytest.raises(dspark.TextError, match="chat template"):
        engine.generate(CHAT)

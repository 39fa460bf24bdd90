"""stream: chunks add up to generate's result, errors surface from the iteration, and leaving a
stream early neither hangs nor breaks the engine."""

import gc

import pytest

import dspark


def collect(stream, n):
    tokens = [[] for _ in range(n)]
    finishes = [[] for _ in range(n)]
    for chunk in stream:
        assert isinstance(chunk, dspark.StreamChunk)
        assert chunk.token_ids
        assert chunk.text is None
        tokens[chunk.request] += chunk.token_ids
        finishes[chunk.request].append(chunk.finish_reason)
    return tokens, finishes


@pytest.mark.parametrize("engine_name", ["target_engine", "spec_engine"])
def test_stream_chunks_concatenate_to_generate(request, engine_name, golden_cases):
    engine = request.getfixturevalue(engine_name)
    prompts = golden_cases["prompts"]
    params = [dspark.SamplingParams(20), dspark.SamplingParams(9, temperature=0.8, seed=2), dspark.SamplingParams(1)]
    expected = engine.generate(prompts, params)
    stream = engine.stream(prompts, params)
    assert isinstance(stream, dspark.TokenStream)
    assert iter(stream) is stream
    tokens, finishes = collect(stream, len(prompts))
    assert tokens == [g.token_ids for g in expected]
    for f, g in zip(finishes, expected):
        assert f[-1] == g.finish_reason and all(x is None for x in f[:-1])
    results = stream.results
    assert [g.token_ids for g in results] == tokens
    assert [g.stats.rounds for g in results] == [g.stats.rounds for g in expected]
    assert engine.last_stats.generated_tokens == sum(len(t) for t in tokens)
    # Exhausted: further iteration ends at once.
    assert next(stream, None) is None


def test_speculative_stream_commits_several_tokens_per_chunk(spec_engine, golden_cases):
    chunks = list(spec_engine.stream(golden_cases["prompts"][0], dspark.SamplingParams(24, ignore_eos=True)))
    assert all(c.request == 0 for c in chunks)
    assert sum(len(c.token_ids) for c in chunks) == 24
    assert max(len(c.token_ids) for c in chunks) > 1


def test_stream_single_prompt_and_stop_token(target_engine, golden_cases):
    prompt = golden_cases["prompts"][0]
    full = target_engine.generate(prompt, dspark.SamplingParams(12)).token_ids
    stop = full[4]
    chunks = list(target_engine.stream(prompt, dspark.SamplingParams(12, stop_token_ids=[stop])))
    assert [t for c in chunks for t in c.token_ids] == full[: full.index(stop) + 1]
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_token_id == stop


def test_stream_errors_come_from_the_iteration(target_engine):
    stream = target_engine.stream([1, 2, 600])
    with pytest.raises(dspark.TokenOutOfRangeError):
        next(stream)
    assert stream.results is None
    assert next(stream, None) is None
    with pytest.raises(dspark.InvalidInputError):
        list(target_engine.stream([[]]))


def test_stream_prompt_errors_are_raised_at_once(target_engine):
    with pytest.raises(dspark.InvalidInputError, match="tokenizer"):
        target_engine.stream("text needs a tokenizer")
    with pytest.raises(TypeError):
        target_engine.stream(3.5)


def test_dropping_a_stream_early(target_engine, golden_cases):
    prompt = golden_cases["prompts"][2]
    params = dspark.SamplingParams(200, ignore_eos=True)
    stream = target_engine.stream(prompt, params)
    first = next(stream)
    assert first.token_ids
    del stream
    gc.collect()
    # The engine finishes the abandoned call in the background, then serves this one.
    g = target_engine.generate(prompt, dspark.SamplingParams(5))
    assert g.token_ids == first.token_ids + g.token_ids[len(first.token_ids) :]


def test_closing_a_stream(spec_engine, golden_cases):
    prompt = golden_cases["prompts"][1]
    with spec_engine.stream(prompt, dspark.SamplingParams(100, ignore_eos=True)) as stream:
        next(stream)
    assert next(stream, None) is None and stream.results is None
    stream.close()
    # Unread streams can be closed and dropped too.
    spec_engine.stream(prompt).close()
    spec_engine.stream(prompt)
    assert len(spec_engine.generate(prompt, dspark.SamplingParams(3)).token_ids) == 3


def test_empty_stream(target_engine):
    stream = target_engine.stream([])
    assert list(stream) == [] and stream.results == []

"""generate and score on the tiny golden models: against the reference vectors, speculative
against target-only, sampling reproducibility, batching, stop tokens and input errors."""

import math
import threading
import time

import pytest

import dspark
from conftest import DRAFT, GOLDEN, REPO, TARGET, read_safetensors


def cases(golden, kind):
    return [c for c in golden["cases"] if c["kind"] == kind]


def test_greedy_target_matches_the_reference(target_engine, golden_cases):
    for case in cases(golden_cases, "target_greedy"):
        params = dspark.SamplingParams(case["max_new_tokens"], ignore_eos=True)
        g = target_engine.generate(case["input_ids"], params)
        assert isinstance(g, dspark.Generation)
        assert g.token_ids == case["expected"]["tokens"]
        assert g.prompt_token_ids == case["input_ids"]
        assert g.finish_reason == "length" and g.stop_token_id is None
        assert g.text is None
        s = g.stats
        assert s.prompt_tokens == len(case["input_ids"])
        assert s.generated_tokens == case["max_new_tokens"]
        assert s.rounds == case["max_new_tokens"] - 1 and s.tau == 1.0
        assert s.drafted == s.accepted == 0 and s.round_log == []


def test_greedy_speculative_equals_greedy_target_only(target_engine, spec_engine, golden_cases):
    prompts = [c["input_ids"] for c in cases(golden_cases, "target_greedy")]
    params = dspark.SamplingParams(40)
    plain = target_engine.generate(prompts, params)
    spec = spec_engine.generate(prompts, params)
    assert [g.token_ids for g in spec] == [g.token_ids for g in plain]
    assert [g.finish_reason for g in spec] == [g.finish_reason for g in plain]
    batch = spec_engine.last_stats
    assert batch.peak_lanes == len(prompts) and batch.draft_passes > 0
    assert batch.draft_time > 0 and batch.verify_time > 0 and batch.commit_time > 0
    assert batch.draft_time + batch.verify_time + batch.commit_time <= batch.decode_time
    # Rounds with one device wait need recorded graphs (CUDA); the CPU reads drafts first.
    assert batch.one_sync_rounds == 0
    for g in spec:
        s = g.stats
        assert s.rounds >= 1 and s.drafted > 0 and 0 <= s.accepted <= s.drafted
        assert len(s.drafted_per_position) == 4 and len(s.accepted_per_position) == 4
        assert sum(s.drafted_per_position) == s.drafted and sum(s.accepted_per_position) == s.accepted
        assert len(s.round_log) == s.rounds
        assert s.tau == pytest.approx((s.generated_tokens - 1) / s.rounds)
        assert all(isinstance(r, dspark.RoundRecord) and len(r.drafted) == 4 for r in s.round_log)


def test_speculative_rounds_match_the_reference(spec_engine, golden_cases):
    for case in cases(golden_cases, "spec_greedy"):
        g = spec_engine.generate(case["input_ids"], dspark.SamplingParams(case["max_new_tokens"], ignore_eos=True))
        expected = case["expected"]
        assert g.token_ids == expected["output_tokens"]
        reference = [(r["anchor_position"], r["draft_tokens"], r["accepted"]) for r in expected["rounds"]]
        rounds = [(r.position, r.drafted, r.accepted) for r in g.stats.round_log]
        # The engine stops as soon as max_new_tokens is reached, so its last round may come
        # early and be cut; every round before it drafts and accepts as the reference does.
        assert len(reference) - 1 <= len(rounds) <= len(reference)
        assert rounds[:-1] == reference[: len(rounds) - 1]
        assert rounds[-1][:2] == reference[len(rounds) - 1][:2]


@pytest.mark.parametrize("kwargs", [{"verify_width": 1}, {"verify_width": 3}, {"confidence_threshold": 0.5}])
def test_verify_options_keep_greedy_output(target_engine, golden_cases, kwargs):
    engine = dspark.Engine(TARGET, draft=DRAFT, **kwargs)
    prompt = golden_cases["prompts"][1]
    params = dspark.SamplingParams(30)
    g = engine.generate(prompt, params)
    assert g.token_ids == target_engine.generate(prompt, params).token_ids
    if "verify_width" in kwargs:
        assert all(len(r.drafted) == kwargs["verify_width"] - 1 for r in g.stats.round_log)


def test_sampling_is_reproducible_and_batch_invariant(target_engine, spec_engine, golden_cases):
    prompts = golden_cases["prompts"]
    params = dspark.SamplingParams(20, temperature=0.9, top_k=50, top_p=0.95, seed=11)
    for engine in (target_engine, spec_engine):
        first = engine.generate(prompts, params)
        again = engine.generate(prompts, params)
        alone = engine.generate(prompts[1], params)
        assert [g.token_ids for g in first] == [g.token_ids for g in again]
        assert alone.token_ids == first[1].token_ids
    seeds = {
        tuple(target_engine.generate(prompts[0], dspark.SamplingParams(20, temperature=1.0, seed=s)).token_ids)
        for s in range(4)
    }
    assert len(seeds) > 1


def test_batch_forms(target_engine, golden_cases):
    prompts = golden_cases["prompts"][:2]
    one = target_engine.generate(prompts[0], dspark.SamplingParams(6))
    both = target_engine.generate(prompts, [dspark.SamplingParams(6), dspark.SamplingParams(3)])
    assert isinstance(both, list) and len(both) == 2
    assert both[0].token_ids == one.token_ids and len(both[1].token_ids) == 3
    stats = target_engine.last_stats
    assert isinstance(stats, dspark.BatchStats)
    assert stats.generated_tokens == 9 and stats.forward_passes >= 6 and stats.draft_passes == 0
    assert stats.prefill_time >= 0 and stats.decode_time >= 0 and stats.decode_tokens_per_second >= 0
    # Target-only: no speculative round, so no draft, verify or commit time.
    assert stats.draft_time == stats.verify_time == stats.commit_time == 0 and stats.one_sync_rounds == 0
    assert stats.peak_lanes == 2 and stats.preemptions == 0
    assert stats.prefill_tokens == len(prompts[0]) + len(prompts[1])
    assert "peak_lanes=2" in repr(stats)
    assert target_engine.generate(tuple(prompts[0]), dspark.SamplingParams(6)).token_ids == one.token_ids
    assert target_engine.generate([]) == []
    with pytest.raises(dspark.InvalidInputError, match="1 SamplingParams for 2 prompts"):
        target_engine.generate(prompts, [dspark.SamplingParams(6)])
    with pytest.raises(TypeError):
        target_engine.generate(prompts, 5)


def test_default_params_and_zero_tokens(target_engine):
    g = target_engine.generate([5, 6, 7])
    assert len(g.token_ids) <= 64
    z = target_engine.generate([5, 6, 7], dspark.SamplingParams(0))
    assert z.token_ids == [] and z.finish_reason is None and z.stats.generated_tokens == 0


def test_stop_tokens(target_engine, spec_engine, golden_cases):
    prompt = golden_cases["prompts"][0]
    full = target_engine.generate(prompt, dspark.SamplingParams(24)).token_ids
    stop = full[3]
    cut = full.index(stop) + 1
    for engine in (target_engine, spec_engine):
        g = engine.generate(prompt, dspark.SamplingParams(24, stop_token_ids=[stop]))
        assert g.token_ids == full[:cut]
        assert g.finish_reason == "stop" and g.stop_token_id == stop


def test_ignore_eos_and_the_eos_ids(target_engine, golden_cases):
    # The tiny target's eos id (2) becomes a stop token unless ignore_eos; its greedy paths never
    # reach it, so both give the same tokens here.
    prompt = golden_cases["prompts"][0]
    a = target_engine.generate(prompt, dspark.SamplingParams(10))
    b = target_engine.generate(prompt, dspark.SamplingParams(10, ignore_eos=True))
    assert a.token_ids == b.token_ids and 2 not in a.token_ids


@pytest.mark.parametrize("prompt", [[1, 2, 512], [600], [[1, 2], [3, 99999]]])
def test_token_out_of_range(target_engine, prompt):
    with pytest.raises(dspark.TokenOutOfRangeError) as info:
        target_engine.generate(prompt)
    assert info.value.vocab == 512 and info.value.token >= 512
    assert isinstance(info.value, ValueError)


def test_negative_token_id(target_engine):
    with pytest.raises(dspark.TokenOutOfRangeError) as info:
        target_engine.generate([1, -3])
    assert info.value.token == -3


@pytest.mark.parametrize("prompt, error", [([[]], dspark.InvalidInputError), (42, TypeError), ([1, "a"], TypeError)])
def test_malformed_prompts(target_engine, prompt, error):
    with pytest.raises(error):
        target_engine.generate(prompt)


def test_text_without_a_tokenizer(target_engine):
    for prompt in ("hello", [{"role": "user", "content": "hi"}], ["a", "b"]):
        with pytest.raises(dspark.InvalidInputError, match="tokenizer.json"):
            target_engine.generate(prompt)
    with pytest.raises(dspark.InvalidInputError, match="tokenizer.json"):
        target_engine.score("hello")
    with pytest.raises(dspark.InvalidInputError):
        target_engine.encode("hello")
    with pytest.raises(dspark.InvalidInputError):
        target_engine.decode([1, 2])
    with pytest.raises(dspark.InvalidInputError):
        target_engine.apply_chat_template([{"role": "user", "content": "hi"}])


def log_softmax_at(row, token):
    top = max(row)
    return row[token] - top - math.log(sum(math.exp(v - top) for v in row))


def test_score_matches_the_reference_logits(target_engine, golden_cases):
    vectors = read_safetensors(GOLDEN / "vectors" / "target_prefill.safetensors")
    for case in cases(golden_cases, "target_prefill"):
        ids = case["input_ids"]
        shape, logits = vectors[case["expected"]["logits"]["tensor"]]
        vocab = shape[1]
        expected = [log_softmax_at(logits[i * vocab : (i + 1) * vocab], ids[i + 1]) for i in range(len(ids) - 1)]
        got = target_engine.score(ids)
        assert len(got) == len(ids) - 1
        assert got == pytest.approx(expected, abs=1e-4)


def test_score_agrees_with_generation(target_engine, spec_engine):
    prompt = [37, 35, 253, 491, 331]
    g = target_engine.generate(prompt, dspark.SamplingParams(8))
    scores = target_engine.score(prompt + g.token_ids)
    assert spec_engine.score(prompt + g.token_ids) == scores
    # Greedy tokens are the argmax: never less likely than 1 / vocab, and more likely than a swap.
    for i, token in enumerate(g.token_ids):
        s = scores[len(prompt) - 1 + i]
        assert s <= 0 and s >= -math.log(512)
        other = (token + 1) % 512
        swapped = target_engine.score(prompt + g.token_ids[:i] + [other])[-1]
        assert swapped <= s


def test_score_errors(target_engine):
    with pytest.raises(dspark.InvalidInputError):
        target_engine.score([5])
    with pytest.raises(dspark.TokenOutOfRangeError):
        target_engine.score([5, 700])
    with pytest.raises(dspark.InvalidInputError):
        target_engine.score([{"role": "user", "content": "hi"}])


def test_generate_releases_the_gil(target_engine):
    ticks = []
    done = []
    worker = threading.Thread(
        target=lambda: done.append(target_engine.generate([1, 2, 3], dspark.SamplingParams(300, ignore_eos=True)))
    )
    start = time.monotonic()
    worker.start()
    while worker.is_alive():
        ticks.append(time.monotonic())
        time.sleep(0.002)
    elapsed = time.monotonic() - start
    assert len(done[0].token_ids) == 300
    if elapsed > 0.2:  # long enough to tell: with the GIL held, this loop could not run
        assert len(ticks) >= 10


def test_concurrent_calls_on_one_engine(spec_engine, golden_cases):
    prompts = golden_cases["prompts"]
    params = dspark.SamplingParams(16, temperature=0.8, seed=5)
    expected = [g.token_ids for g in spec_engine.generate(prompts, params)]
    results = {}

    def work(i):
        results[i] = spec_engine.generate(prompts[i], params).token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(len(prompts))] == expected


def test_fp8_draft_keeps_greedy_output(target_engine, golden_cases):
    prompts = [c["input_ids"] for c in cases(golden_cases, "target_greedy")]
    params = dspark.SamplingParams(40)
    plain = target_engine.generate(prompts, params)
    for head in (False, True):
        fp8 = dspark.Engine(TARGET, draft=DRAFT, draft_fp8=True, draft_fp8_head=head)
        spec = fp8.generate(prompts, params)
        assert [g.token_ids for g in spec] == [g.token_ids for g in plain]
        assert sum(g.stats.drafted for g in spec) > 0


def test_restricted_draft_vocabulary_keeps_greedy_output(target_engine, golden_cases, tmp_path):
    prompts = [c["input_ids"] for c in cases(golden_cases, "target_greedy")]
    params = dspark.SamplingParams(40)
    plain = target_engine.generate(prompts, params)
    engine = dspark.Engine(TARGET, draft=DRAFT, draft_vocab=128)
    spec = engine.generate(prompts, params)
    assert [g.token_ids for g in spec] == [g.token_ids for g in plain]
    assert sum(g.stats.drafted for g in spec) > 0
    with pytest.raises(dspark.InvalidInputError, match="draft_vocab"):
        dspark.Engine(TARGET, draft_vocab=128)
    with pytest.raises(dspark.InvalidInputError, match="outside|1..="):
        dspark.Engine(TARGET, draft=DRAFT, draft_vocab=100_000)


def test_draft_vocabulary_ranked_by_a_corpus(tmp_path):
    # The trained pair (it has a tokenizer): a draft vocabulary counted from a small corpus
    # folder (a file that is not text is skipped) keeps the greedy output.
    target, draft = REPO / "models" / "tiny-code-qwen3", REPO / "models" / "tiny-code-dspark"
    corpus = tmp_path / "corpus"
    (corpus / "src").mkdir(parents=True)
    (corpus / "src" / "a.py").write_text("def add(x, y):\n    return x + y\n\n" * 40)
    (corpus / "b.bin").write_bytes(b"\xff\xfe\x00\x81")
    params = dspark.SamplingParams(32)
    prompt = "def main():\n    "
    plain = dspark.Engine(target).generate(prompt, params)
    spec = dspark.Engine(target, draft=draft, draft_vocab=256, draft_vocab_corpus=corpus)
    out = spec.generate(prompt, params)
    assert out.token_ids == plain.token_ids
    assert out.stats.drafted > 0
    with pytest.raises(dspark.TextError, match="no UTF-8 text"):
        dspark.Engine(target, draft=draft, draft_vocab=256, draft_vocab_corpus=corpus / "b.bin")
    with pytest.raises(dspark.InvalidInputError, match="draft_vocab_corpus needs draft_vocab"):
        dspark.Engine(target, draft=draft, draft_vocab_corpus=corpus)
    with pytest.raises(dspark.InvalidInputError, match="draft_vocab_corpus needs draft_vocab"):
        dspark.Engine(target, draft=draft, draft_vocab=[1, 2, 3], draft_vocab_corpus=corpus)
    # The ids themselves, as a serving process would keep them.
    ids = dspark.Engine(target, draft=draft, draft_vocab=list(range(0, 4096, 3)))
    assert ids.generate(prompt, params).token_ids == plain.token_ids


def test_two_sync_rounds_keep_greedy_output(target_engine, golden_cases):
    prompts = [c["input_ids"] for c in cases(golden_cases, "target_greedy")]
    params = dspark.SamplingParams(24)
    plain = target_engine.generate(prompts, params)
    engine = dspark.Engine(TARGET, draft=DRAFT, one_sync_rounds=False)
    spec = engine.generate(prompts, params)
    assert [g.token_ids for g in spec] == [g.token_ids for g in plain]
    assert engine.last_stats.one_sync_rounds == 0 and engine.last_stats.draft_passes > 0


@pytest.mark.parametrize(
    "kwargs",
    [{"draft_fp8": True}, {"draft_fp8_head": True}, {"draft": DRAFT, "draft_fp8_head": True}],
)
def test_fp8_options_need_a_draft_and_each_other(kwargs):
    with pytest.raises(dspark.InvalidInputError, match="draft_fp8"):
        dspark.Engine(TARGET, **kwargs)

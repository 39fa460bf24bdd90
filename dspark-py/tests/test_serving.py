"""Serving calls: submit / step / cancel / pending. Requests join a running batch, under a KV
budget too small for all of them at once, and each output equals generating it alone."""

import pytest

import dspark
from conftest import DRAFT, TARGET

PROMPTS = [[37, 35, 253, 491, 331], [220, 79, 107, 117, 73, 108, 120, 305], [12, 400, 9], [5, 6, 7, 8]]


def params(i):
    if i % 2:
        return dspark.SamplingParams(20 + i, temperature=0.8, seed=11 + i)
    return dspark.SamplingParams(20 + i)


@pytest.mark.parametrize("draft", [None, DRAFT])
def test_requests_joining_under_kv_pressure_equal_generating_alone(draft):
    roomy = dspark.Engine(TARGET, draft=draft)
    expected = [roomy.generate(p, params(i)).token_ids for i, p in enumerate(PROMPTS)]
    # 6 pages of 16 rows: at most two requests fit at once, so requests wait and are preempted.
    row_bytes = 6 * 2 * 2 * 16 * 4
    engine = dspark.Engine(TARGET, draft=draft, kv_budget_bytes=6 * 16 * row_bytes, page_size=16)
    ids, streamed, done = [], {}, {}
    for i, prompt in enumerate(PROMPTS):
        ids.append(engine.submit(prompt, params(i)))
        chunks, finished = engine.step()
        for c in chunks:
            streamed.setdefault(c.request, []).extend(c.token_ids)
        done.update(finished)
    steps = 0
    while engine.pending() != (0, 0):
        chunks, finished = engine.step()
        for c in chunks:
            streamed.setdefault(c.request, []).extend(c.token_ids)
        done.update(finished)
        steps += 1
        assert steps < 1000
    for i, request_id in enumerate(ids):
        g = done[request_id]
        assert g.token_ids == expected[i], (draft, i)
        assert streamed[request_id] == g.token_ids
        assert g.finish_reason == "length"


def test_cancel_returns_the_tokens_so_far_and_bad_ids_raise():
    engine = dspark.Engine(TARGET, draft=DRAFT)
    request_id = engine.submit(PROMPTS[0], dspark.SamplingParams(30))
    chunks, _ = engine.step()
    assert engine.pending() == (1, 0)
    g = engine.cancel(request_id)
    assert g.finish_reason == "cancelled"
    assert g.token_ids == [t for c in chunks for t in c.token_ids]
    assert engine.pending() == (0, 0)
    with pytest.raises(dspark.InvalidInputError):
        engine.cancel(request_id)
    with pytest.raises(dspark.InvalidInputError):
        engine.submit([PROMPTS[0], PROMPTS[1]])
    with pytest.raises(dspark.TokenOutOfRangeError):
        engine.submit([600])
    small = dspark.Engine(TARGET, kv_budget_bytes=6 * 2 * 2 * 16 * 4 * 16, page_size=16)
    with pytest.raises(dspark.KvCacheFullError):
        small.submit(PROMPTS[0], dspark.SamplingParams(40))

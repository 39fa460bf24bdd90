//! Exact target marginals and χ² checks for the sampled-distribution tests.

use dspark::sampling::target_probs;
use dspark::{Engine, KvCache, LogitRows, PagedKvCache, Qwen3, Request, SamplingParams, SeqChunk, SeqId};

/// Exact marginal distribution of the second generated token under `params`:
/// Σ_{t1} p(t1 | prompt) · p(t2 | prompt, t1), from the target alone. First tokens are taken
/// in decreasing probability until at most `tail` of the mass is left out (0: every token with
/// nonzero probability), so the result may sum to `1 − tail`.
pub fn exact_second_token(model: &Qwen3, prompt: &[u32], params: &SamplingParams, tail: f64) -> Vec<f64> {
    let vocab = model.vocab_size();
    let mut cache = PagedKvCache::new(model.kv_layout(16), 64 << 20, model.device()).unwrap();
    let seq = cache.allocate();
    let out =
        model.forward(&[SeqChunk { seq, tokens: prompt, logits: LogitRows::Last }], &[], &mut cache).unwrap();
    let p1 = target_probs(&out.logits.unwrap().into_data().try_to_vec::<f32>().unwrap(), params);
    let mut order: Vec<u32> = (0..vocab as u32).filter(|&t| p1[t as usize] > 0.0).collect();
    order.sort_by(|&a, &b| p1[b as usize].total_cmp(&p1[a as usize]));
    let mut firsts = Vec::new();
    let mut left = 1.0;
    for t in order {
        if left <= tail {
            break;
        }
        left -= p1[t as usize];
        firsts.push(t);
    }
    let mut marginal = vec![0.0; vocab];
    for batch in firsts.chunks(64) {
        let mut cache = PagedKvCache::new(model.kv_layout(16), 64 << 20, model.device()).unwrap();
        let seqs: Vec<Vec<u32>> =
            batch.iter().map(|&t| prompt.iter().copied().chain([t]).collect()).collect();
        let ids: Vec<SeqId> = batch.iter().map(|_| cache.allocate()).collect();
        let chunks: Vec<SeqChunk<'_>> = seqs
            .iter()
            .zip(&ids)
            .map(|(s, &seq)| SeqChunk { seq, tokens: s, logits: LogitRows::Last })
            .collect();
        let logits = model.forward(&chunks, &[], &mut cache).unwrap().logits.unwrap();
        let logits = logits.into_data().try_to_vec::<f32>().unwrap();
        for (j, &t1) in batch.iter().enumerate() {
            let p2 = target_probs(&logits[j * vocab..(j + 1) * vocab], params);
            for (m, p) in marginal.iter_mut().zip(p2) {
                *m += p1[t1 as usize] * p;
            }
        }
    }
    marginal
}

/// Pearson χ² of `counts` against `expected` probabilities, bins with expected count < 5
/// pooled. Returns (statistic, degrees of freedom).
pub fn chi_square(counts: &[usize], expected: &[f64]) -> (f64, usize) {
    let n: usize = counts.iter().sum();
    let (mut stat, mut bins) = (0.0, 0usize);
    let (mut pooled_o, mut pooled_e) = (0.0, 0.0);
    for (&o, &p) in counts.iter().zip(expected) {
        let e = p * n as f64;
        if e >= 5.0 {
            stat += (o as f64 - e).powi(2) / e;
            bins += 1;
        } else {
            pooled_o += o as f64;
            pooled_e += e;
        }
    }
    if pooled_e > 0.0 {
        stat += (pooled_o - pooled_e).powi(2) / pooled_e.max(1e-9);
        bins += 1;
    }
    (stat, bins.saturating_sub(1))
}

/// Upper quantile of χ²(df) at false-alarm rate 1e-4 (Wilson–Hilferty, z = 3.719).
pub fn chi_square_limit(df: usize) -> f64 {
    let d = df as f64;
    let z = 3.719;
    d * (1.0 - 2.0 / (9.0 * d) + z * (2.0 / (9.0 * d)).sqrt()).powi(3)
}

/// Sample the second generated token `n` times (seeds `0..n`, 250 requests per `generate`
/// call) with `engine` and count it per token id.
pub fn second_token_counts(
    engine: &mut Engine,
    prompt: &[u32],
    params: &SamplingParams,
    n: u64,
) -> Vec<usize> {
    token_counts(engine, prompt, params, n, 1)
}

/// Exact marginal distribution of generated token `index` (0: the first) under `params`, from
/// the target alone: Σ over every prefix of generated tokens of its probability times the next
/// token's distribution. Prefixes whose probability falls below `min_weight` are dropped, so the
/// result may sum to a little less than 1; the second component returns the mass kept.
pub fn exact_token_marginal(
    model: &Qwen3,
    prompt: &[u32],
    params: &SamplingParams,
    index: usize,
    min_weight: f64,
) -> (Vec<f64>, f64) {
    let vocab = model.vocab_size();
    let mut frontier: Vec<(Vec<u32>, f64)> = vec![(prompt.to_vec(), 1.0)];
    for step in 0..=index {
        let mut next = Vec::new();
        let mut marginal = vec![0.0; vocab];
        for batch in frontier.chunks(128) {
            let mut cache = PagedKvCache::new(model.kv_layout(16), 256 << 20, model.device()).unwrap();
            let ids: Vec<SeqId> = batch.iter().map(|_| cache.allocate()).collect();
            let chunks: Vec<SeqChunk<'_>> = batch
                .iter()
                .zip(&ids)
                .map(|((s, _), &seq)| SeqChunk { seq, tokens: s, logits: LogitRows::Last })
                .collect();
            let logits = model.forward(&chunks, &[], &mut cache).unwrap().logits.unwrap();
            let logits = logits.into_data().try_to_vec::<f32>().unwrap();
            for (j, (prefix, w)) in batch.iter().enumerate() {
                let p = target_probs(&logits[j * vocab..(j + 1) * vocab], params);
                if step == index {
                    for (m, q) in marginal.iter_mut().zip(&p) {
                        *m += w * q;
                    }
                } else {
                    for (t, &q) in p.iter().enumerate() {
                        if w * q >= min_weight {
                            let mut longer = prefix.clone();
                            longer.push(t as u32);
                            next.push((longer, w * q));
                        }
                    }
                }
            }
        }
        if step == index {
            let kept = marginal.iter().sum();
            return (marginal, kept);
        }
        frontier = next;
    }
    unreachable!("the loop returns at step == index")
}

/// Sample `n` generations (seeds `0..n`, 250 per `generate` call) of `index + 1` tokens and count
/// generated token `index` per id.
pub fn token_counts(
    engine: &mut Engine,
    prompt: &[u32],
    params: &SamplingParams,
    n: u64,
    index: usize,
) -> Vec<usize> {
    let mut counts = vec![0; engine.target().vocab_size()];
    let seeds: Vec<u64> = (0..n).collect();
    for batch in seeds.chunks(250) {
        let requests: Vec<Request> = batch
            .iter()
            .map(|&seed| Request {
                prompt: prompt.to_vec(),
                params: SamplingParams { seed, max_new_tokens: index + 1, ..params.clone() },
            })
            .collect();
        for g in engine.generate(&requests).unwrap() {
            counts[g.tokens[index] as usize] += 1;
        }
    }
    counts
}

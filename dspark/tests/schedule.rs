//! The throughput scheduler (`dspark::engine::schedule`): cost-table interpolation and files,
//! budget bounds and optimality, the per-lane split (prefixes, tie order), and the exactness
//! property: a draft's own value never decides whether it is verified, so sampled output keeps
//! the target's distribution under the schedule.
#![allow(clippy::unwrap_used)]

use std::path::Path;

use dspark::Error;
use dspark::accept::chain_verify;
use dspark::engine::schedule::{
    CostMeta, CostTable, DraftCost, VerifyCost, choose_budget, expected_rate, split_budget, survivals,
};

/// A small seeded generator (splitmix64), enough for property tests.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }

    /// A confidence: often one of a few levels (to force ties), sometimes 0 or 1, else uniform.
    fn confidence(&mut self) -> f32 {
        match self.range(0, 9) {
            0 => 0.0,
            1 | 2 => 1.0,
            3..=6 => [0.25f32, 0.5, 0.75][self.range(0, 2)],
            _ => self.unit() as f32,
        }
    }

    /// Index drawn from `weights` (a distribution).
    fn pick(&mut self, weights: &[f64]) -> usize {
        let mut u = self.unit();
        for (i, &w) in weights.iter().enumerate() {
            if u < w {
                return i;
            }
            u -= w;
        }
        weights.len() - 1
    }
}

fn meta() -> CostMeta {
    CostMeta {
        device: "cpu".into(),
        dtype: "f32".into(),
        model: "test".into(),
        date: "2026-12-03".into(),
        machine: "test box".into(),
        gamma: Some(8),
        context: Some(128),
        notes: "synthetic".into(),
    }
}

fn table(verify: &[(usize, f64)], draft: &[(usize, f64)]) -> CostTable {
    CostTable::new(
        meta(),
        verify.iter().map(|&(t, ms)| VerifyCost::new(t, ms)).collect(),
        draft.iter().map(|&(lanes, ms)| DraftCost { lanes, ms }).collect(),
    )
    .unwrap()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn interpolation_is_piecewise_linear_and_extrapolates_past_the_ends() {
    let t = table(&[(1, 2.0), (4, 5.0), (8, 5.5)], &[(1, 1.0), (4, 2.5)]);
    for (tokens, ms) in [(1, 2.0), (2, 3.0), (4, 5.0), (6, 5.25), (8, 5.5), (16, 6.5), (0, 1.0)] {
        assert!(close(t.verify_ms(tokens), ms), "verify_ms({tokens}) = {}, want {ms}", t.verify_ms(tokens));
    }
    for (lanes, ms) in [(1, 1.0), (2, 1.5), (4, 2.5), (8, 4.5)] {
        assert!(close(t.draft_ms(lanes), ms), "draft_ms({lanes}) = {}, want {ms}", t.draft_ms(lanes));
    }
    // a falling last segment (noise) is not extrapolated downwards; never below 0 ms.
    let t = table(&[(2, 1.0), (3, 5.0), (4, 4.0)], &[(2, 3.0)]);
    assert!(close(t.verify_ms(10), 4.0));
    assert!(close(t.verify_ms(1), 0.0));
    assert!(close(t.verify_ms(0), 0.0));
    // one point: constant.
    assert!(close(t.draft_ms(1), 3.0) && close(t.draft_ms(100), 3.0));
}

#[test]
fn cost_table_round_trips_through_json() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("table.json");
    let mut verify = vec![VerifyCost::new(1, 1.5), VerifyCost::new(2, 1.75)];
    verify.push(VerifyCost { tokens: 8, ms: 2.125, lanes: Some(4), width: Some(2) });
    let t = CostTable::new(meta(), verify, vec![DraftCost { lanes: 1, ms: 0.5 }]).unwrap();
    t.save(&path).unwrap();
    let back = CostTable::load(&path).unwrap();
    assert_eq!(back, t);
    assert_eq!(back.meta().machine, "test box");
    assert_eq!(back.verify_points()[2].lanes, Some(4));
    assert_eq!(back.draft_points().len(), 1);
    // optional keys may be left out of a hand-written file.
    std::fs::write(
        &path,
        r#"{"meta": {"device": "cpu", "dtype": "f32", "model": "m", "date": "d"},
            "verify": [{"tokens": 1, "ms": 1.0}], "draft": [{"lanes": 1, "ms": 0.1}]}"#,
    )
    .unwrap();
    let t = CostTable::load(&path).unwrap();
    assert_eq!(t.meta().gamma, None);
    assert!(close(t.verify_ms(5), 1.0));
}

fn load_str(dir: &Path, text: &str) -> dspark::Result<CostTable> {
    let path = dir.join("t.json");
    std::fs::write(&path, text).unwrap();
    CostTable::load(&path)
}

#[test]
fn loading_a_bad_cost_table_gives_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let m = r#""meta": {"device": "cpu", "dtype": "f32", "model": "m", "date": "d"}"#;
    assert!(matches!(CostTable::load(&d.join("missing.json")), Err(Error::Io { .. })));
    assert!(matches!(load_str(d, "{not json"), Err(Error::Json { .. })));
    assert!(matches!(load_str(d, &format!("{{{m}, \"verify\": []}}")), Err(Error::Json { .. })));
    let config_error = |verify: &str, draft: &str, needle: &str| {
        let text = format!("{{{m}, \"verify\": {verify}, \"draft\": {draft}}}");
        match load_str(d, &text) {
            Err(Error::Config { message, .. }) => {
                assert!(message.contains(needle), "{message:?} lacks {needle:?}")
            }
            other => panic!("{text}: expected a config error, got {other:?}"),
        }
    };
    let ok_draft = r#"[{"lanes": 1, "ms": 0.1}]"#;
    let ok_verify = r#"[{"tokens": 1, "ms": 1.0}]"#;
    config_error("[]", ok_draft, "empty");
    config_error(ok_verify, "[]", "empty");
    config_error(r#"[{"tokens": 2, "ms": 1.0}, {"tokens": 2, "ms": 1.5}]"#, ok_draft, "increasing");
    config_error(r#"[{"tokens": 4, "ms": 1.0}, {"tokens": 2, "ms": 1.5}]"#, ok_draft, "increasing");
    config_error(r#"[{"tokens": 0, "ms": 1.0}]"#, ok_draft, "positive");
    config_error(r#"[{"tokens": 1, "ms": -1.0}]"#, ok_draft, "non-negative");
    config_error(ok_verify, r#"[{"lanes": 2, "ms": 0.1}, {"lanes": 1, "ms": 0.1}]"#, "increasing");
    config_error(ok_verify, r#"[{"lanes": 1, "ms": -0.5}]"#, "non-negative");
    config_error(r#"[{"tokens": 6, "ms": 1.0, "lanes": 4, "width": 2}]"#, ok_draft, "lanes");
    // the constructor checks the same, with InvalidInput (no file involved), non-finite included.
    for ms in [f64::NAN, f64::INFINITY, -0.1] {
        let bad = CostTable::new(meta(), vec![VerifyCost::new(1, ms)], vec![DraftCost { lanes: 1, ms: 0.1 }]);
        assert!(matches!(bad, Err(Error::InvalidInput(_))), "{ms}: {bad:?}");
    }
}

#[test]
fn survival_is_the_clamped_running_product() {
    let s = survivals(&[0.5, 2.0, f32::NAN, 0.5], 8);
    assert_eq!(s, vec![0.5, 0.5, 0.0, 0.0]);
    assert_eq!(survivals(&[0.5, 0.5, 0.5], 2), vec![0.5, 0.25]);
    assert!(survivals(&[-1.0], 1)[0] == 0.0);
}

#[test]
fn budget_stays_within_bounds_and_maximises_the_expected_rate() {
    let mut rng = Rng(7);
    for case in 0..400 {
        let gamma = rng.range(0, 9);
        let lanes = rng.range(0, 6);
        let conf: Vec<Vec<f32>> =
            (0..lanes).map(|_| (0..rng.range(0, gamma + 2)).map(|_| rng.confidence()).collect()).collect();
        let earlier: Vec<&[f32]> = conf.iter().map(Vec::as_slice).collect();
        let base = 0.5 + 3.0 * rng.unit();
        let slope = 0.01 + 0.5 * rng.unit();
        let t = table(
            &[(1, base), (8, base + 7.0 * slope), (64, base + 63.0 * slope * rng.unit())],
            &[(1, rng.unit()), (16, 2.0 * rng.unit())],
        );
        let b = choose_budget(&t, &earlier, gamma);
        if lanes == 0 {
            assert_eq!(b, 0);
            continue;
        }
        let covered: usize = earlier.iter().map(|c| c.len().min(gamma)).sum();
        let max = lanes + covered;
        assert!(max <= lanes * (gamma + 1));
        assert!((lanes..=max).contains(&b), "case {case}: budget {b} outside {lanes}..={max}");
        let best = expected_rate(&t, &earlier, gamma, b);
        for other in lanes..=lanes * (gamma + 1) {
            let r = expected_rate(&t, &earlier, gamma, other);
            assert!(r <= best * (1.0 + 1e-12), "case {case}: budget {other} rate {r} beats {b} ({best})");
            if other < b {
                assert!(r < best, "case {case}: smaller budget {other} ties {b}");
            }
        }
    }
}

#[test]
fn budget_follows_the_costs_and_the_earlier_confidences() {
    let gamma = 4;
    let sure: Vec<&[f32]> = vec![&[1.0; 4], &[1.0; 4]];
    let unsure: Vec<&[f32]> = vec![&[0.05; 4], &[0.05; 4]];
    // verify rows nearly free: verify everything the lanes hold.
    let flat = table(&[(1, 10.0), (64, 10.1)], &[(1, 1.0)]);
    assert_eq!(choose_budget(&flat, &sure, gamma), 2 * (gamma + 1));
    // a lane without an earlier round (`&[]`) plans its anchor row only.
    let new_lane: Vec<&[f32]> = vec![&[1.0; 4], &[]];
    assert_eq!(choose_budget(&flat, &new_lane, gamma), 2 + gamma);
    // every row costs as much as the whole step: anchors only for unlikely drafts.
    let steep = table(&[(1, 1.0), (2, 2.0)], &[(1, 0.0)]);
    assert_eq!(choose_budget(&steep, &unsure, gamma), 2);
    // a mixed profile: the sure lane's drafts are worth it, the unsure lane's are not.
    let mixed: Vec<&[f32]> = vec![&[1.0; 4], &[0.05; 4]];
    let mid = table(&[(1, 1.0), (64, 1.0 + 63.0 * 0.3)], &[(1, 0.5)]);
    assert_eq!(choose_budget(&mid, &mixed, gamma), 2 + 4);
    assert_eq!(split_budget(6, &mixed, gamma), vec![4, 0]);
}

/// Every admitted (lane, k) ranks before every other item in the order (survival descending,
/// k ascending, lane ascending), and the counts are what the budget allows.
#[test]
fn split_takes_the_best_items_as_per_lane_prefixes() {
    let mut rng = Rng(11);
    for case in 0..2000 {
        let gamma = rng.range(0, 8);
        let lanes = rng.range(0, 5);
        let conf: Vec<Vec<f32>> =
            (0..lanes).map(|_| (0..rng.range(0, gamma + 1)).map(|_| rng.confidence()).collect()).collect();
        let current: Vec<&[f32]> = conf.iter().map(Vec::as_slice).collect();
        let budget = rng.range(0, lanes * (gamma + 2) + 1);
        let counts = split_budget(budget, &current, gamma);
        assert_eq!(counts.len(), lanes);
        let held: usize = current.iter().map(|c| c.len().min(gamma)).sum();
        assert_eq!(counts.iter().sum::<usize>(), budget.saturating_sub(lanes).min(held), "case {case}");
        let mut admitted = Vec::new();
        let mut rest = Vec::new();
        for (lane, c) in current.iter().enumerate() {
            assert!(counts[lane] <= c.len().min(gamma), "case {case}");
            for (k, s) in survivals(c, gamma).into_iter().enumerate() {
                // the prefix shape: lane i verifies exactly drafts 0..counts[i].
                if k < counts[lane] { admitted.push((s, k, lane)) } else { rest.push((s, k, lane)) }
            }
        }
        for a in &admitted {
            for r in &rest {
                let before = a.0 > r.0 || (a.0 == r.0 && (a.1, a.2) < (r.1, r.2));
                assert!(before, "case {case}: admitted {a:?} ranks after rejected {r:?}");
            }
        }
    }
}

#[test]
fn split_ties_go_to_the_earlier_position_then_the_lower_lane() {
    let ones: Vec<&[f32]> = vec![&[1.0; 3], &[1.0; 3]];
    assert_eq!(split_budget(2 + 1, &ones, 3), vec![1, 0]);
    assert_eq!(split_budget(2 + 2, &ones, 3), vec![1, 1]);
    assert_eq!(split_budget(2 + 3, &ones, 3), vec![2, 1]);
    // lane 0: S = [1, .5]; lane 1: S = [.5, .5]. The 0.5 tie goes to position 0 (lane 1) first.
    let c: Vec<&[f32]> = vec![&[1.0, 0.5], &[0.5, 1.0]];
    assert_eq!(split_budget(2 + 1, &c, 2), vec![1, 0]);
    assert_eq!(split_budget(2 + 2, &c, 2), vec![1, 1]);
    assert_eq!(split_budget(2 + 3, &c, 2), vec![2, 1]);
    // edge cases: no lanes, a budget below the lane count, gamma 0, more than the lanes hold.
    assert!(split_budget(5, &[], 3).is_empty());
    assert_eq!(split_budget(1, &ones, 3), vec![0, 0]);
    assert_eq!(split_budget(9, &ones, 0), vec![0, 0]);
    assert_eq!(split_budget(100, &c, 2), vec![2, 2]);
    assert_eq!(split_budget(100, &c, 1), vec![1, 1]);
}

type Split = dyn Fn(usize, &[&[f32]], usize) -> Vec<usize>;

/// Search random cases for one where changing the confidences after position k of a lane (the
/// only ones draft k influences) changes whether draft k of that lane is verified.
fn find_value_dependent_admission(split: &Split, seed: u64, cases: usize) -> Option<String> {
    let mut rng = Rng(seed);
    for case in 0..cases {
        let gamma = rng.range(1, 8);
        let lanes = rng.range(1, 5);
        let mut conf: Vec<Vec<f32>> =
            (0..lanes).map(|_| (0..gamma).map(|_| rng.confidence()).collect()).collect();
        let budget = rng.range(lanes, lanes * (gamma + 1));
        let before = split(budget, &conf.iter().map(Vec::as_slice).collect::<Vec<_>>(), gamma);
        let lane = rng.range(0, lanes - 1);
        let k = rng.range(0, gamma - 1);
        for _ in 0..4 {
            let original = conf[lane].clone();
            for c in &mut conf[lane][k + 1..] {
                *c = rng.confidence();
            }
            let after = split(budget, &conf.iter().map(Vec::as_slice).collect::<Vec<_>>(), gamma);
            if (before[lane] > k) != (after[lane] > k) {
                return Some(format!(
                    "case {case}: lane {lane} draft {k}: {original:?} -> {:?} changes admission \
                     ({before:?} -> {after:?}, budget {budget})",
                    conf[lane]
                ));
            }
            conf[lane] = original;
        }
    }
    None
}

#[test]
fn a_drafts_own_value_never_decides_its_admission() {
    let split: &Split = &|b, c, g| split_budget(b, c, g);
    if let Some(counterexample) = find_value_dependent_admission(split, 2026, 20_000) {
        panic!("{counterexample}");
    }
}

/// The property search must catch splitters that peek at a draft's own value.
#[test]
fn the_admission_search_catches_splitters_that_look_ahead() {
    // ties broken by the later position first: an equal later survival (c_{k+1} = 1) jumps ahead.
    let later_first: &Split = &|budget, current, gamma| {
        let mut items: Vec<(f64, usize, usize)> = current
            .iter()
            .enumerate()
            .flat_map(|(lane, c)| survivals(c, gamma).into_iter().enumerate().map(move |(k, s)| (s, k, lane)))
            .collect();
        items.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)).then(a.2.cmp(&b.2)));
        let mut admitted = vec![vec![false; gamma]; current.len()];
        for &(_, k, lane) in items.iter().take(budget.saturating_sub(current.len())) {
            admitted[lane][k] = true;
        }
        admitted.iter().map(|a| a.iter().take_while(|&&x| x).count()).collect()
    };
    assert!(find_value_dependent_admission(later_first, 2026, 20_000).is_some());
    // ranking draft k by the survival after it (c_{k+1} reads draft k).
    let shifted: &Split = &|budget, current, gamma| {
        let next: Vec<Vec<f32>> =
            current.iter().map(|c| c.iter().skip(1).copied().chain([1.0]).collect()).collect();
        split_budget(budget, &next.iter().map(Vec::as_slice).collect::<Vec<_>>(), gamma)
    };
    assert!(find_value_dependent_admission(shifted, 2026, 20_000).is_some());
}

/// Toy target and draft Markov chains over 3 tokens, and the draft's confidence after each token
/// (confidence k reads draft k − 1, as the DSpark confidence head does).
const P: [[f64; 3]; 3] = [[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.3, 0.4, 0.3]];
const Q: [[f64; 3]; 3] = [[0.3, 0.5, 0.2], [0.4, 0.2, 0.4], [0.2, 0.2, 0.6]];
const CONFIDENCE: [f32; 3] = [0.9, 0.15, 0.6];

/// Sample `trials` runs of two lanes generating `n` tokens each under the scheduler, and return
/// the counts of lane `lane`'s `n`-token outputs (index in base 3). `look_ahead` makes the split
/// read the confidence computed from draft k itself (the mistake the scheduler must not make).
fn run_scheduled(trials: usize, n: usize, look_ahead: bool) -> ([Vec<usize>; 2], Vec<usize>) {
    const GAMMA: usize = 3;
    let costs = table(&[(1, 1.0), (2, 1.3), (8, 3.0)], &[(1, 0.4), (2, 0.5)]);
    let mut rng = Rng(99);
    let mut counts = [vec![0; 3usize.pow(n as u32)], vec![0; 3usize.pow(n as u32)]];
    // how often each number of drafts was verified, to show the schedule varies the width.
    let mut widths = vec![0; GAMMA + 1];
    for _ in 0..trials {
        let mut out: [Vec<u32>; 2] = [Vec::new(), Vec::new()];
        let mut anchor = [0u32, 2];
        let mut earlier: [Vec<f32>; 2] = [vec![0.5; GAMMA], vec![0.5; GAMMA]];
        loop {
            let live: Vec<usize> = (0..2).filter(|&i| out[i].len() < n).collect();
            if live.is_empty() {
                break;
            }
            let planned: Vec<&[f32]> = live.iter().map(|&i| earlier[i].as_slice()).collect();
            let budget = choose_budget(&costs, &planned, GAMMA);
            // draft: tokens from Q, confidence k from the token before draft k.
            let mut drafts = Vec::new();
            let mut conf = Vec::new();
            for &i in &live {
                let (mut prev, mut d, mut c) = (anchor[i] as usize, Vec::new(), Vec::new());
                for _ in 0..GAMMA {
                    c.push(CONFIDENCE[prev]);
                    prev = rng.pick(&Q[prev]);
                    d.push(prev as u32);
                }
                if look_ahead {
                    c = d.iter().map(|&t| CONFIDENCE[t as usize]).collect();
                }
                drafts.push(d);
                conf.push(c);
            }
            let current: Vec<&[f32]> = conf.iter().map(Vec::as_slice).collect();
            let split = split_budget(budget, &current, GAMMA);
            for (j, &i) in live.iter().enumerate() {
                let m = split[j];
                widths[m] += 1;
                let d = &drafts[j][..m];
                let prevs: Vec<usize> =
                    std::iter::once(anchor[i] as usize).chain(d.iter().map(|&t| t as usize)).collect();
                let p: Vec<&[f64]> = prevs.iter().map(|&t| P[t].as_slice()).collect();
                let q: Vec<&[f64]> = prevs[..m].iter().map(|&t| Q[t].as_slice()).collect();
                let u: Vec<f64> = (0..m).map(|_| rng.unit()).collect();
                let v: Vec<f64> = (0..=m).map(|_| rng.unit()).collect();
                let verdict = chain_verify(d, &p, &q, &u, &v, None).unwrap();
                out[i].extend(&verdict.committed);
                anchor[i] = verdict.bonus;
                earlier[i] = conf[j].clone();
            }
        }
        for (lane, tokens) in out.iter().enumerate() {
            let index = tokens[..n].iter().fold(0, |acc, &t| acc * 3 + t as usize);
            counts[lane][index] += 1;
        }
    }
    (counts, widths)
}

/// Pearson's statistic of `counts` against the target chain's `n`-token distribution from `start`.
fn chi_square(counts: &[usize], start: usize, n: usize) -> f64 {
    let total: usize = counts.iter().sum();
    (0..counts.len())
        .map(|index| {
            let digits: Vec<usize> = (0..n).rev().map(|i| index / 3usize.pow(i as u32) % 3).collect();
            let mut prev = start;
            let mut prob = 1.0;
            for &t in &digits {
                prob *= P[prev][t];
                prev = t;
            }
            let expected = prob * total as f64;
            (counts[index] as f64 - expected).powi(2) / expected
        })
        .sum()
}

#[test]
fn sampled_output_keeps_the_target_distribution_under_the_schedule() {
    // 27 outcomes, 26 degrees of freedom: mean 26, sd ≈ 7.2; the limit is ≈ 7 sd above the mean.
    let (n, limit) = (3, 78.0);
    let (exact, widths) = run_scheduled(60_000, n, false);
    eprintln!("drafts verified per lane and round: {widths:?}");
    assert!(widths.iter().all(|&w| w > 100), "the schedule should use every width: {widths:?}");
    for (lane, start) in [(0, 0), (1, 2)] {
        let x2 = chi_square(&exact[lane], start, n);
        eprintln!("lane {lane}: chi-square {x2:.1} (exact schedule)");
        assert!(x2 < limit, "lane {lane}: chi-square {x2:.1} >= {limit} under the scheduler");
    }
    // the same test detects a schedule that lets a draft's own value decide its admission.
    let (biased, _) = run_scheduled(60_000, n, true);
    let worst = chi_square(&biased[0], 0, n).max(chi_square(&biased[1], 2, n));
    eprintln!("look-ahead schedule: chi-square {worst:.1}");
    assert!(worst > limit, "look-ahead schedule not detected: chi-square {worst:.1}");
}

/// The CPU table the engine's tests and examples load stays a valid cost table.
#[test]
fn the_committed_cpu_cost_table_loads() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../benches/results/cost-tables/cpu-tiny-code.json");
    let t = CostTable::load(&path).unwrap();
    assert_eq!(t.meta().device, "cpu");
    assert_eq!(t.meta().gamma, Some(8));
    assert_eq!(t.verify_points().first().map(|v| v.tokens), Some(1));
    assert!(t.verify_ms(9) > 0.0 && t.draft_ms(1) > 0.0);
    let earlier: Vec<&[f32]> = vec![&[0.9; 8]];
    assert!((1..=9).contains(&choose_budget(&t, &earlier, 8)));
}

/// The table measured on the H200 (Qwen3-8B shapes, random weights) loads, and the budgets it
/// implies are the ones its markdown twin reports (`benches/results/cost-tables/h200-qwen3-8b-bf16.md`).
#[test]
fn the_committed_h200_cost_table_loads() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../benches/results/cost-tables/h200-qwen3-8b-bf16.json");
    let t = CostTable::load(&path).unwrap();
    assert_eq!((t.meta().device.as_str(), t.meta().gamma), ("cuda:0", Some(7)));
    assert_eq!(t.verify_points().first().map(|v| v.tokens), Some(1));
    assert_eq!(t.verify_points().last().map(|v| v.tokens), Some(64));
    // One lane: confident drafts get the whole window, doubtful ones less.
    assert_eq!(choose_budget(&t, &[&[0.99; 7]], 7), 8);
    assert_eq!(choose_budget(&t, &[&[0.5; 7]], 7), 7);
    // Eight lanes at c = 0.9: 4 rows each (32), where the verify step is still cheap.
    let eight: Vec<&[f32]> = vec![&[0.9; 7]; 8];
    assert_eq!(choose_budget(&t, &eight, 7), 32);
}

//! The throughput scheduler: how many verify rows a speculative round spends, and on which lanes.
//!
//! Pure functions over host data; no engine state. A round has two decisions:
//!
//! 1. **Budget** ([`choose_budget`]): the total number of verify rows `T` of the round, summed over
//!    lanes. Every lane always verifies its anchor row, so `lanes ≤ T ≤ lanes·(γ+1)`. `T` is chosen
//!    to maximise the expected committed tokens per second,
//!    `(lanes + Σ of the T − lanes largest survivals) / (draft_ms(lanes) + verify_ms(T))`, where
//!    the times come from a measured [`CostTable`] and the survivals from the confidences of an
//!    **earlier** round (so the budget never depends on the drafts it is about to admit).
//! 2. **Split** ([`split_budget`]): which drafts fill the `T − lanes` draft rows. The (lane, k)
//!    items with the largest **current** survival are taken; ties go to the earlier position k,
//!    then to the lower lane index.
//!
//! # Confidences and survival
//! Confidence `c_k` (0-based k) is the draft's estimate that draft `k` is accepted given draft
//! `k − 1` was. It is computed from the draft's hidden row `h_k` and draft `k − 1` (the anchor for
//! `k = 0`), never from draft `k` itself. The survival of draft `k` is `S_k = Π_{j ≤ k} c_j`, the
//! estimated probability that drafts `0..=k` are all accepted; verifying the first `m` drafts of
//! a lane commits `1 + Σ_{k < m} S_k` tokens in expectation (the accepted prefix plus the bonus).
//! Confidences are clamped to `[0, 1]` (NaN counts as 0), so `S` never increases with `k`, also in
//! floating point (a product with a factor in `[0, 1]` never rounds above the other factor).
//!
//! # Exactness
//! Sampled verification stays lossless when whether draft `k` is verified never depends on the
//! value of draft `k` (see [`crate::accept`]). Draft `k` influences only the later confidences
//! `c_{k+1}, …` (through the Markov head's `W1[d_k]`), hence only the survivals `S_{k+1}, …` of its
//! own lane. In [`split_budget`] the admission of item (lane, k) is decided by its rank in the
//! order (survival descending, k ascending, lane ascending), and every later item of the same lane
//! ranks after it whatever its value (its survival is no larger and its position is later). So
//! changing `c_{k+1..}` can reorder only items behind (lane, k) and never changes whether (lane, k)
//! is admitted. The budget itself reads only an earlier round. Other lanes' drafts are drawn from
//! independent random streams, so they may influence a lane's width without biasing it.
//!
//! # Using it in the engine
//! ```
//! # use dspark::engine::schedule::{CostMeta, CostTable, DraftCost, VerifyCost, choose_budget, split_budget};
//! # let table = CostTable::new(
//! #     CostMeta::default(),
//! #     vec![VerifyCost::new(1, 2.0), VerifyCost::new(64, 4.0)],
//! #     vec![DraftCost { lanes: 1, ms: 0.5 }],
//! # ).unwrap();
//! let gamma = 4;
//! // per lane: the confidences the previous round's proposal carried (a prior for new lanes)
//! let earlier: Vec<&[f32]> = vec![&[0.9, 0.8, 0.7, 0.6], &[0.5, 0.5, 0.5, 0.5]];
//! let budget = choose_budget(&table, &earlier, gamma);
//! // ... the draft proposes; per lane: this round's confidences
//! let current: Vec<&[f32]> = vec![&[0.95, 0.9, 0.2, 0.9], &[0.6, 0.6, 0.6, 0.6]];
//! let drafts_per_lane = split_budget(budget, &current, gamma);
//! // lane i verifies [anchor, d_0 .. d_{drafts_per_lane[i] − 1}]
//! # assert_eq!(drafts_per_lane.len(), 2);
//! ```

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Where and on what a [`CostTable`] was measured.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CostMeta {
    /// Device, e.g. `cpu` or `cuda:0`.
    pub device: String,
    /// Compute dtype, e.g. `f32` or `bf16`.
    pub dtype: String,
    /// Target (and draft) description, e.g. a checkpoint folder or `random qwen3-8b`.
    pub model: String,
    /// Measurement date, `YYYY-MM-DD`.
    pub date: String,
    /// The machine, in words (e.g. `2-core CPU dev box`, `NVIDIA H200`).
    #[serde(default)]
    pub machine: String,
    /// The draft block size γ the table was measured for, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gamma: Option<usize>,
    /// KV context rows per lane during the timed steps, if recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<usize>,
    /// Free-form notes (method, repetitions, what the times include).
    #[serde(default)]
    pub notes: String,
}

/// Measured time of one target verify step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct VerifyCost {
    /// Total verify rows of the step, all lanes summed (≥ 1).
    pub tokens: usize,
    /// Time of the step in milliseconds (forward and logits readback).
    pub ms: f64,
    /// How many lanes the measured step had, if recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lanes: Option<usize>,
    /// Rows per lane of the measured step, if recorded (`lanes · width = tokens`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub width: Option<usize>,
}

impl VerifyCost {
    /// A point without the lane/width breakdown.
    pub fn new(tokens: usize, ms: f64) -> Self {
        Self { tokens, ms, lanes: None, width: None }
    }
}

/// Measured time of one draft round (one batched proposal) over some lanes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DraftCost {
    /// Lanes proposed for at once (≥ 1).
    pub lanes: usize,
    /// Time of the round in milliseconds.
    pub ms: f64,
}

/// The on-disk layout of a cost table (also what [`CostTable::save`] writes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct CostFile {
    meta: CostMeta,
    verify: Vec<VerifyCost>,
    draft: Vec<DraftCost>,
}

/// Measured round costs: target verify-step time against total verify rows, and draft round
/// time against lane count. Always valid once built (see [`CostTable::new`]).
///
/// Between measured points times are interpolated linearly; past the ends they are extrapolated
/// along the nearest segment, never below 0 ms, and past the last point never with a negative
/// slope (a noisy last segment must not make larger steps look cheaper). A table of one point is
/// constant.
#[derive(Debug, Clone, PartialEq)]
pub struct CostTable {
    file: CostFile,
}

impl CostTable {
    /// A table from measured points, sorted by their key.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when either list is empty, token or lane counts are 0 or not
    /// strictly increasing, a time is negative or not finite, or a verify point's `lanes · width`
    /// differs from its `tokens`.
    pub fn new(meta: CostMeta, verify: Vec<VerifyCost>, draft: Vec<DraftCost>) -> Result<Self> {
        let file = CostFile { meta, verify, draft };
        check(&file).map_err(Error::InvalidInput)?;
        Ok(Self { file })
    }

    /// Read and validate a table written by [`CostTable::save`] (or the `bench-cost-table`
    /// benchmark).
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be read, [`Error::Json`] when it is not a cost table,
    /// [`Error::Config`] when its points are invalid (as in [`CostTable::new`]).
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let file: CostFile =
            serde_json::from_str(&text).map_err(|source| Error::Json { path: path.into(), source })?;
        check(&file).map_err(|message| Error::Config { path: path.into(), message })?;
        tracing::debug!(
            path = %path.display(),
            verify_points = file.verify.len(),
            draft_points = file.draft.len(),
            "loaded cost table"
        );
        Ok(Self { file })
    }

    /// Write the table as pretty-printed JSON.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be written.
    pub fn save(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.to_json()).map_err(|e| Error::io(path, e))
    }

    /// The table as pretty-printed JSON (what [`CostTable::save`] writes).
    pub fn to_json(&self) -> String {
        // Plain structs of strings and numbers always serialise; the fallback is unreachable.
        let mut s = serde_json::to_string_pretty(&self.file).unwrap_or_default();
        s.push('\n');
        s
    }

    /// Where and on what the table was measured.
    pub fn meta(&self) -> &CostMeta {
        &self.file.meta
    }

    /// The measured verify points, by increasing token count.
    pub fn verify_points(&self) -> &[VerifyCost] {
        &self.file.verify
    }

    /// The measured draft points, by increasing lane count.
    pub fn draft_points(&self) -> &[DraftCost] {
        &self.file.draft
    }

    /// Estimated time in ms of a target verify step over `tokens` rows (all lanes summed).
    pub fn verify_ms(&self, tokens: usize) -> f64 {
        interpolate(&self.file.verify, |p| (p.tokens as f64, p.ms), tokens as f64)
    }

    /// Estimated time in ms of one draft round over `lanes` lanes.
    pub fn draft_ms(&self, lanes: usize) -> f64 {
        interpolate(&self.file.draft, |p| (p.lanes as f64, p.ms), lanes as f64)
    }
}

/// Why a table's points are invalid, if they are.
fn check(file: &CostFile) -> std::result::Result<(), String> {
    let time = |what: &str, key: usize, ms: f64| {
        if ms.is_finite() && ms >= 0.0 {
            Ok(())
        } else {
            Err(format!("{what} time at {key} is {ms} ms (must be finite and non-negative)"))
        }
    };
    if file.verify.is_empty() {
        return Err("the verify cost table is empty".into());
    }
    if file.draft.is_empty() {
        return Err("the draft cost table is empty".into());
    }
    let mut last = 0;
    for p in &file.verify {
        if p.tokens <= last {
            return Err(format!(
                "verify token counts must be positive and strictly increasing: {} after {last}",
                p.tokens
            ));
        }
        last = p.tokens;
        time("verify", p.tokens, p.ms)?;
        if let (Some(l), Some(w)) = (p.lanes, p.width)
            && l.checked_mul(w) != Some(p.tokens)
        {
            return Err(format!("verify point of {} tokens says {l} lanes × {w} rows", p.tokens));
        }
    }
    last = 0;
    for p in &file.draft {
        if p.lanes <= last {
            return Err(format!(
                "draft lane counts must be positive and strictly increasing: {} after {last}",
                p.lanes
            ));
        }
        last = p.lanes;
        time("draft", p.lanes, p.ms)?;
    }
    Ok(())
}

/// Piecewise-linear interpolation through `points` (keys strictly increasing, at least one
/// point), linear extrapolation past the ends (slope at least 0 past the last point), never
/// below 0.
fn interpolate<P>(points: &[P], at: impl Fn(&P) -> (f64, f64), x: f64) -> f64 {
    let n = points.len();
    if n == 0 {
        return 0.0;
    }
    if n == 1 {
        return at(&points[0]).1;
    }
    // first point with key > x, kept inside 1..n so (i − 1, i) is a segment.
    let i = points.partition_point(|p| at(p).0 <= x).clamp(1, n - 1);
    let ((x0, y0), (x1, y1)) = (at(&points[i - 1]), at(&points[i]));
    let slope = (y1 - y0) / (x1 - x0);
    let y = if x > x1 { y1 + slope.max(0.0) * (x - x1) } else { y0 + slope * (x - x0) };
    y.max(0.0)
}

/// Survivals `S_k = Π_{j ≤ k} c_j` of one lane for `k < min(γ, confidences.len())`, each
/// confidence clamped to `[0, 1]` (NaN counts as 0). Never increasing in `k`.
pub fn survivals(confidences: &[f32], gamma: usize) -> Vec<f64> {
    let mut s = 1.0f64;
    confidences
        .iter()
        .take(gamma)
        .map(|&c| {
            let c = if c.is_nan() { 0.0 } else { f64::from(c).clamp(0.0, 1.0) };
            s *= c;
            s
        })
        .collect()
}

/// Expected committed tokens per second of a round of `budget` verify rows, given per-lane
/// confidences: `(lanes + Σ of the budget − lanes largest survivals) / (draft_ms(lanes) +
/// verify_ms(budget))`. The budget is clamped to `lanes..=lanes + n`, `n` the drafts the
/// confidences cover (at most γ per lane, so at most `lanes·(γ+1)`); 0 for no lanes. When
/// the table prices the round at 0 ms, the rate is taken over 1 ns.
pub fn expected_rate(table: &CostTable, confidences: &[&[f32]], gamma: usize, budget: usize) -> f64 {
    let lanes = confidences.len();
    if lanes == 0 {
        return 0.0;
    }
    let mut all = sorted_survivals(confidences, gamma);
    let budget = budget.clamp(lanes, lanes + all.len());
    all.truncate(budget - lanes);
    rate(table, lanes, budget, lanes as f64 + all.iter().sum::<f64>())
}

fn sorted_survivals(confidences: &[&[f32]], gamma: usize) -> Vec<f64> {
    let mut all: Vec<f64> = confidences.iter().flat_map(|c| survivals(c, gamma)).collect();
    all.sort_by(|a, b| b.total_cmp(a));
    all
}

fn rate(table: &CostTable, lanes: usize, budget: usize, tokens: f64) -> f64 {
    let ms = table.draft_ms(lanes) + table.verify_ms(budget);
    tokens / (ms.max(1e-6) * 1e-3)
}

/// The round's total verify rows `T`, all lanes summed, that maximises the expected committed
/// tokens per second (see [`expected_rate`]), from the confidences of an **earlier** round.
///
/// `earlier[i]` holds lane i's confidences from a previous round (for a lane without one, pass
/// a prior, e.g. a typical profile, or `&[]` to plan only its anchor row); entries past `γ` are
/// ignored and rows no confidence covers are never planned. The result lies in
/// `lanes..=lanes + Σ_i min(γ, earlier[i].len())`, so within `lanes..=lanes·(γ+1)` (0 for no
/// lanes); among equally good budgets the smallest wins. Never pass the current round's
/// confidences here: the split, not the budget, reads those.
pub fn choose_budget(table: &CostTable, earlier: &[&[f32]], gamma: usize) -> usize {
    let lanes = earlier.len();
    if lanes == 0 {
        return 0;
    }
    let all = sorted_survivals(earlier, gamma);
    let max = lanes + all.len();
    let (mut best, mut best_rate) = (lanes, rate(table, lanes, lanes, lanes as f64));
    let mut tokens = lanes as f64;
    for budget in lanes + 1..=max {
        tokens += all.get(budget - lanes - 1).copied().unwrap_or(0.0);
        let r = rate(table, lanes, budget, tokens);
        if r > best_rate {
            (best, best_rate) = (budget, r);
        }
    }
    tracing::trace!(lanes, gamma, budget = best, tokens_per_s = best_rate, "verify budget");
    best
}

/// Drafts verified per lane for a round of `budget` verify rows: the `budget − lanes` (lane, k)
/// items with the largest **current** survival, ties to the earlier position `k`, then to the
/// lower lane index. Lane i then verifies `[anchor, d_0 .. d_{n_i − 1}]` for `n_i = result[i]`.
///
/// Each lane gets a prefix of its drafts (survival never increases along a lane), at most
/// `min(γ, current[i].len())`. A budget below the lane count verifies anchors only; one above
/// what the lanes hold verifies everything. Whether draft k of a lane is admitted never depends
/// on draft k's value: see the module docs.
pub fn split_budget(budget: usize, current: &[&[f32]], gamma: usize) -> Vec<usize> {
    let mut items: Vec<(f64, usize, usize)> = current
        .iter()
        .enumerate()
        .flat_map(|(lane, c)| survivals(c, gamma).into_iter().enumerate().map(move |(k, s)| (s, k, lane)))
        .collect();
    items.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let mut counts = vec![0; current.len()];
    for &(_, _, lane) in items.iter().take(budget.saturating_sub(current.len())) {
        counts[lane] += 1;
    }
    counts
}

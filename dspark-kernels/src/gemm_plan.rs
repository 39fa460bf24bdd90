//! How the skinny GEMMs (bf16 and FP8 weights) cut a weight shape across cubes.
//!
//! The plan depends on the weight's shape only, never on the number of activation rows: the
//! order of a row's sums follows from the plan, so a row's result stays bit-identical alone,
//! inside a verify window or among other lanes.

use std::sync::Mutex;

/// Warps per cube; each takes every `WARPS`-th chunk of its cube's range of the reduction axis.
pub(crate) const WARPS: usize = 8;

/// How one weight shape is cut: `splits` cubes along the reduction axis per 16 output rows, and
/// `depth` chunks loaded by each warp before it multiplies (for one or two activation tiles;
/// halved for three or four, quartered beyond, so registers hold the loads).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmPlan {
    /// Cubes along the reduction axis per 16 output rows (1, 2, 4 or 8).
    pub splits: usize,
    /// Chunks in flight per warp with one or two activation tiles (1, 2, 4 or 8).
    pub depth: usize,
}

impl GemmPlan {
    /// Whether the kernels take this plan for a reduction of `chunks` chunks: the splits cut
    /// them into equal ranges, each with at least one chunk per warp.
    pub fn fits(self, chunks: usize) -> bool {
        matches!(self.splits, 1 | 2 | 4 | 8)
            && matches!(self.depth, 1 | 2 | 4 | 8)
            && chunks.is_multiple_of(self.splits)
            && chunks / self.splits >= WARPS
    }

    /// Chunks each warp loads before it multiplies, for `tiles` activation tiles of 8 rows:
    /// `depth` for one tile, at most 4 for two, 2 beyond (registers hold the loads; measured on
    /// the H200, two in flight beat one for 5–8 tiles). For three and four tiles, where the
    /// cubes of wide weights take two blocks (see [`Self::unroll_with`]), a cap of 4 was tried
    /// too and lost on the H100 (2026-12-05, `bench-target --windows 17,24,32 --unroll-wide
    /// 4|2`: 8.42 / 8.43 / 7.68 ms against 8.12 / 8.11 / 7.66); [`force_unroll_wide`] sets it
    /// for such A/Bs. It changes when loads are issued, never the order of the sums, so it may
    /// follow the number of rows.
    pub fn unroll(self, tiles: usize) -> usize {
        match tiles {
            0 | 1 => self.depth,
            2 => self.depth.min(4),
            3 | 4 => {
                self.depth.min(FORCED_UNROLL_WIDE.lock().unwrap_or_else(|e| e.into_inner()).unwrap_or(2))
            }
            _ => self.depth.min(2),
        }
    }
}

impl GemmPlan {
    /// Blocks of 16 weight rows per cube of the bf16 kernel for `tiles` activation tiles of a
    /// weight with `out` rows and a reduction of `chunks` chunks.
    ///
    /// - 2 where each warp of a cube multiplies a single chunk (a Markov head's W2, rank 256:
    ///   8 chunks, 151 936 rows) and 2 blocks fit. While each warp still unrolled over chunk slots
    ///   it did not have (before [`Self::unroll_with`] capped the unroll at a warp's chunks),
    ///   4 blocks won (H200, 2026-12-04: 24.4 µs against 37.1 for one row). With those caps, `bench-kernels
    ///   --plans-only --mtiles 1,2,4,8 --only "markov W2"` on the H200 (2026-12-05) gave, for
    ///   1 / 8 / 16 rows, 21.2 / 23.6 / 34.6 µs with 1 block, 20.9 / 22.5 / 31.8 with 2,
    ///   21.7 / 23.0 / 33.0 with 4 and 35.4 / 37.8 / 34.1 with 8.
    /// - 2 for 3–4 tiles (17–32 rows) where the weight still gives at least one cube per SM of
    ///   the H200 (132). Every activation row is fetched once per cube from L2; at 24 rows that
    ///   traffic is 1.5 times the weight's own bytes, and two blocks per cube halve it. Measured
    ///   on the H200 (2026-12-04): at 2 tiles two blocks cost more than they save (16-row verify
    ///   1.53× the one-row step against 1.30×), and on the wide products of a layer 2, 4 or 8
    ///   blocks at 1 and 8 rows are all slower than 1.
    /// - 1 otherwise.
    ///
    /// Each block's sums keep their order (see the kernel), so this may follow the number of
    /// rows. Past 8 (block, tile) pairs the partial sums would not fit the cube's shared memory.
    pub fn mtiles(self, tiles: usize, out: usize, chunks: usize) -> usize {
        if let Some(forced) = *FORCED_MTILES.lock().unwrap_or_else(|e| e.into_inner()) {
            return if Self::blocks_fit(forced, tiles, out) { forced } else { 1 };
        }
        if chunks / self.splits.max(1) <= WARPS && Self::blocks_fit(2, tiles, out) && out / 32 >= 132 {
            return 2;
        }
        if (3..=4).contains(&tiles) && out.is_multiple_of(32) && out / 32 * self.splits >= 132 {
            2
        } else {
            1
        }
    }

    /// Whether a cube may hold `mtiles` weight blocks for `tiles` activation tiles of a weight
    /// with `out` rows: 1, 2, 4 or 8 blocks that divide the rows, and at most 8 (block, tile)
    /// pairs, so the warps' partial sums fit the cube's shared memory (32 KiB).
    pub fn blocks_fit(mtiles: usize, tiles: usize, out: usize) -> bool {
        matches!(mtiles, 1 | 2 | 4 | 8) && out.is_multiple_of(16 * mtiles) && mtiles * tiles.max(1) <= 8
    }

    /// Blocks of 16 weight rows per cube of the FP8 kernel: 1 unless forced ([`force_mtiles`]).
    /// Its cubes of several blocks are exact (`gpu_kernels fp8_gemm_blocks_per_cube_match_one`)
    /// but measured slower, even on the short reduction they were made for: a Markov W2 of rank
    /// 256 (4 FP8 chunks of 64, one per warp) took 14.0 / 15.8 / 21.6 µs for 1 / 8 / 16 rows
    /// with 1 block per cube, 14.6 / 16.1 / 22.2 with 2 and 17.3 / 19.0 / 27.1 with 4 (H200,
    /// 2026-12-05, `bench-kernels --plans-only --fp8 --mtiles 1,2,4,8 --only "markov W2"`).
    pub fn mtiles_fp8(self, tiles: usize, out: usize, _chunks: usize) -> usize {
        match *FORCED_MTILES.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(forced) if Self::blocks_fit(forced, tiles, out) => forced,
            _ => 1,
        }
    }

    /// Warps per cube for a reduction of `chunks` chunks: `WARPS`, or one per chunk of a
    /// cube's range when it has fewer (a warp without a chunk would only add zeros). A function
    /// of the shape and the plan, so the order of the sums stays batch-invariant.
    pub fn warps(self, chunks: usize) -> usize {
        (chunks / self.splits.max(1)).clamp(1, WARPS)
    }

    /// [`Self::unroll`] for a cube of `mtiles` weight blocks: the same weight bytes in flight
    /// per warp (each chunk is `mtiles` times as many weight words), and never more chunks than
    /// a warp of `warps` has in a reduction of `chunks` (a Markov W2 gives each warp one chunk:
    /// a second slot would only load and multiply zeros, and hold registers).
    pub fn unroll_with(self, tiles: usize, mtiles: usize, chunks: usize, warps: usize) -> usize {
        let per_warp = (chunks / self.splits.max(1)).div_ceil(warps.max(1));
        (self.unroll(tiles) / mtiles.max(1)).min(per_warp).max(1)
    }
}

/// Blocks per cube forced on every bf16 and FP8 product where they fit, or `None` for the
/// choice of [`GemmPlan::mtiles`] and [`GemmPlan::mtiles_fp8`]. For A/B benchmarks; results do
/// not change (see there).
static FORCED_MTILES: Mutex<Option<usize>> = Mutex::new(None);

/// Forces the weight blocks per cube of the bf16 and FP8 skinny GEMMs where they [fit](GemmPlan::blocks_fit)
/// (1 elsewhere; see [`GemmPlan::mtiles`]); `None`
/// goes back to the choice per shape. Numerically neutral: for benchmarks.
#[doc(hidden)]
pub fn force_mtiles(mtiles: Option<usize>) {
    *FORCED_MTILES.lock().unwrap_or_else(|e| e.into_inner()) = mtiles;
}

/// Chunks in flight per warp for three and four activation tiles, forced; `None` for the choice
/// of [`GemmPlan::unroll`].
static FORCED_UNROLL_WIDE: Mutex<Option<usize>> = Mutex::new(None);

/// Forces the chunks each warp keeps in flight for 17–32 rows (three and four activation tiles;
/// 1, 2, 4 or 8, capped by the plan's depth; the choice is 2), or with `None` goes back to the
/// choice of [`GemmPlan::unroll`]. Numerically neutral (the order of the sums does not change):
/// for benchmarks.
#[doc(hidden)]
pub fn force_unroll_wide(chunks: Option<usize>) {
    *FORCED_UNROLL_WIDE.lock().unwrap_or_else(|e| e.into_inner()) =
        chunks.filter(|c| matches!(c, 1 | 2 | 4 | 8));
}

impl std::str::FromStr for GemmPlan {
    type Err = String;

    /// `SPLITSxDEPTH`, e.g. `4x8`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (a, b) =
            s.split_once('x').ok_or_else(|| format!("plan `{s}`: expected SPLITSxDEPTH, e.g. 4x8"))?;
        let num = |v: &str| v.trim().parse::<usize>().map_err(|e| format!("plan `{s}`: {e}"));
        let plan = GemmPlan { splits: num(a)?, depth: num(b)? };
        if !matches!(plan.splits, 1 | 2 | 4 | 8) || !matches!(plan.depth, 1 | 2 | 4 | 8) {
            return Err(format!("plan `{s}`: splits and depth must each be 1, 2, 4 or 8"));
        }
        Ok(plan)
    }
}

impl std::fmt::Display for GemmPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.splits, self.depth)
    }
}

/// A plan forced on every product, for measuring plans against each other.
static FORCED: Mutex<Option<GemmPlan>> = Mutex::new(None);

/// Forces `plan` on every skinny GEMM (bf16 and FP8) where it [fits](GemmPlan::fits), or with
/// `None` goes back to the plans chosen per shape. For benchmarks that compare plans
/// (`bench-kernels --plans`); results stay batch-invariant only while the same plan is in force.
#[doc(hidden)]
pub fn force_plan(plan: Option<GemmPlan>) {
    *FORCED.lock().unwrap_or_else(|e| e.into_inner()) = plan;
}

/// Which kernel a plan is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Weights {
    /// bf16 weights, chunks of 32 columns.
    Bf16,
    /// FP8 weights, chunks of 64 columns.
    Fp8,
}

/// The plan for a weight with `out` rows and a reduction of `chunks` chunks: a function of the
/// shape alone.
pub fn plan(weights: Weights, chunks: usize, out: usize) -> GemmPlan {
    if let Some(forced) = *FORCED.lock().unwrap_or_else(|e| e.into_inner())
        && forced.fits(chunks)
    {
        return forced;
    }
    chosen(weights, chunks, out)
}

/// The choice measured on the H200 (`bench-kernels --plans`, 2026-12-03): cubes of 16 output
/// rows are too few to keep the memory system busy below about 2 per SM, so a weight with at
/// most 1024 outputs (64 cubes) is cut in 4 along the reduction and one with at most 4096
/// (256 cubes: the o, down and draft fc projections) in 2; wider weights are not cut. bf16
/// weights take 8 chunks in flight per warp; cut FP8 weights 4 (their chunks are twice as wide),
/// whole ones 8. Where the reduction is too short for the cut, fewer splits.
fn chosen(weights: Weights, chunks: usize, out: usize) -> GemmPlan {
    let cubes = out / 16;
    let mut splits = match (weights, cubes) {
        (_, 0..=64) => 4,
        (Weights::Bf16, 65..=256) => 2,
        (Weights::Fp8, 65..=256) if chunks >= 192 => 2,
        _ => 1,
    };
    while splits > 1 && !(GemmPlan { splits, depth: 1 }).fits(chunks) {
        splits /= 2;
    }
    let depth = if weights == Weights::Fp8 && splits > 1 { 4 } else { 8 };
    GemmPlan { splits, depth }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Held by the tests that force the wide unroll or read it: the force is process-wide and
    /// tests run on parallel threads.
    static UNROLL_LOCK: Mutex<()> = Mutex::new(());

    fn unroll_lock() -> std::sync::MutexGuard<'static, ()> {
        UNROLL_LOCK.lock().unwrap_or_else(|e| e.into_inner())
    }

    #[test]
    fn chosen_plans_fit_every_model_shape() {
        // Qwen3 / DSpark widths (bf16 chunks of 32, FP8 of 64) and the tiny models'.
        for inp in [64usize, 256, 1024, 2048, 4096, 5120, 12288, 20480, 25600] {
            for out in [16usize, 256, 1024, 4096, 6144, 24576, 151_936] {
                for width in [32, 64] {
                    let chunks = inp / width;
                    if chunks < WARPS {
                        continue;
                    }
                    for weights in [Weights::Bf16, Weights::Fp8] {
                        let p = chosen(weights, chunks, out);
                        assert!(p.fits(chunks), "in {inp} out {out}: {p} does not fit {chunks} chunks");
                    }
                }
            }
        }
    }

    #[test]
    fn plans_parse_and_unroll() {
        let _lock = unroll_lock();
        let p: GemmPlan = "4x8".parse().expect("a valid plan");
        assert_eq!(p, GemmPlan { splits: 4, depth: 8 });
        assert_eq!(p.to_string(), "4x8");
        assert_eq!([1, 2, 3, 4, 5, 8].map(|t| p.unroll(t)), [8, 4, 2, 2, 2, 2]);
        assert!("3x8".parse::<GemmPlan>().is_err());
        assert!("4".parse::<GemmPlan>().is_err());
        assert!(p.fits(128) && !p.fits(24) && !GemmPlan { splits: 8, depth: 4 }.fits(56));
    }

    #[test]
    fn a_forced_wide_unroll_applies_to_three_and_four_tiles_only() {
        let _lock = unroll_lock();
        let p = GemmPlan { splits: 1, depth: 8 };
        force_unroll_wide(Some(4));
        let forced = [1, 2, 3, 4, 5].map(|t| p.unroll(t));
        force_unroll_wide(Some(3));
        let refused = p.unroll(3);
        force_unroll_wide(None);
        assert_eq!(forced, [8, 4, 4, 4, 2]);
        assert_eq!(refused, 2, "a count other than 1, 2, 4 or 8 leaves the choice");
        assert_eq!(p.unroll(3), 2);
    }

    #[test]
    fn a_forced_plan_applies_only_where_it_fits() {
        let p = GemmPlan { splits: 8, depth: 2 };
        force_plan(Some(p));
        let (fits, small) = (plan(Weights::Bf16, 128, 4096), plan(Weights::Bf16, 16, 4096));
        force_plan(None);
        assert_eq!(fits, p);
        assert_eq!(small, chosen(Weights::Bf16, 16, 4096));
    }

    #[test]
    fn blocks_per_cube_follow_the_tiles_and_the_reduction_length() {
        let _lock = unroll_lock();
        let p = |inp: usize, out: usize| chosen(Weights::Bf16, inp / 32, out);
        // o (cut in 2), fused qkv, gate+up, LM head: 2 blocks for 17–32 rows.
        for (inp, out) in [(4096, 4096), (4096, 6144), (4096, 24576), (4096, 151_936), (12288, 4096)] {
            let plan = p(inp, out);
            let c = inp / 32;
            assert_eq!(
                [1, 2, 3, 4, 5, 8].map(|t| plan.mtiles(t, out, c)),
                [1, 1, 2, 2, 1, 1],
                "{inp} -> {out}"
            );
        }
        // k/v (1024 rows, cut in 4: 128 cubes of two blocks) and a tiny weight stay at 1.
        assert_eq!(p(4096, 1024).mtiles(3, 1024, 128), 1);
        assert_eq!(p(256, 768).mtiles(3, 768, 8), 1);
        // A Markov W2 (rank 256: one chunk per warp): 2 blocks up to 4 tiles, then 1.
        let w2 = p(256, 151_936);
        assert_eq!([1, 2, 3, 4, 5].map(|t| w2.mtiles(t, 151_936, 8)), [2, 2, 2, 2, 1]);
        // FP8: one block per cube everywhere, a W2 (4 chunks of 64: four warps, one chunk
        // each) too; the wide products keep 8 warps.
        let w2 = chosen(Weights::Fp8, 4, 151_936);
        assert_eq!([1, 2, 3].map(|t| w2.mtiles_fp8(t, 151_936, 4)), [1, 1, 1]);
        assert_eq!(w2.warps(4), 4);
        let down = chosen(Weights::Fp8, 12288 / 64, 4096);
        assert_eq!((down.mtiles_fp8(1, 4096, 192), down.warps(192)), (1, 8));
        // The same weight bytes in flight.
        let plan = p(4096, 24576);
        let c = 4096 / 32;
        assert_eq!(
            [
                plan.unroll_with(2, 2, c, WARPS),
                plan.unroll_with(3, 2, c, WARPS),
                plan.unroll_with(1, 1, c, WARPS)
            ],
            [2, 1, 8]
        );
        // A W2 (8 bf16 chunks, one per warp; 4 FP8 chunks over 4 warps): one chunk in flight.
        let w2 = p(256, 151_936);
        assert_eq!(w2.unroll_with(1, 4, 8, WARPS), 1);
        assert_eq!(chosen(Weights::Fp8, 4, 151_936).unroll_with(1, 4, 4, 4), 1);
    }

    #[test]
    fn the_measured_choice() {
        let bf16 = |inp: usize, out: usize| chosen(Weights::Bf16, inp / 32, out).to_string();
        let fp8 = |inp: usize, out: usize| chosen(Weights::Fp8, inp / 64, out).to_string();
        // Qwen3-8B: o, k/v, fused qkv, fused gate+up, down, LM head; the DSpark fc.
        assert_eq!(
            [bf16(4096, 4096), bf16(4096, 1024), bf16(4096, 6144), bf16(4096, 24576), bf16(12288, 4096)],
            ["2x8", "4x8", "1x8", "1x8", "2x8"]
        );
        assert_eq!([bf16(4096, 151_936), bf16(20480, 4096)], ["1x8", "2x8"]);
        assert_eq!(
            [fp8(4096, 4096), fp8(4096, 1024), fp8(12288, 4096), fp8(20480, 4096), fp8(4096, 24576)],
            ["1x8", "4x4", "2x4", "2x4", "1x8"]
        );
        // A reduction too short to cut (256 columns: 8 chunks of 32) is not cut.
        assert_eq!(bf16(256, 768), "1x8");
    }
}

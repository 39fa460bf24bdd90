//! Interval estimates for the lossless gate: ratios of sums over independent replies (delta
//! method, replies as clusters, so tokens of one reply are not treated as independent), their
//! unpaired differences, and ratios of means. The intervals use Student's t with Welch's degrees
//! of freedom, not the normal quantile: with a few replies per mode, the variances are
//! themselves estimates, and a normal interval from five replies is too narrow.

/// Two-sided 95% normal quantile.
pub const Z95: f64 = 1.959_963_984_540_054;

/// Two-sided 95% quantile of Student's t with `df` degrees of freedom (`df` may be fractional,
/// as Welch's are; `NaN` below 1). Exact for `df` 1 and 2 (closed forms); between them, `ln t`
/// linear in `1/df` (about 3% above the true quantile: a slightly wider interval); from 2 up,
/// the Cornish–Fisher expansion in `1/df` around the normal quantile (Abramowitz & Stegun
/// 26.7.5), within 0.3% of the true quantile and exact in the limit.
pub fn t95(df: f64) -> f64 {
    if df.is_nan() || df < 1.0 {
        return f64::NAN;
    }
    // df = 1: tan(π(p − 1/2)); df = 2: (2p − 1) / sqrt(2p(1 − p)); p = 0.975.
    let t1 = (std::f64::consts::PI * 0.475).tan();
    let t2 = 0.95 / (2.0 * 0.975 * 0.025f64).sqrt();
    if df < 2.0 {
        let w = (1.0 - 1.0 / df) * 2.0;
        return (t1.ln() + w * (t2.ln() - t1.ln())).exp();
    }
    if df == 2.0 {
        return t2;
    }
    let z = Z95;
    let (z3, z5, z7, z9) = (z.powi(3), z.powi(5), z.powi(7), z.powi(9));
    let g1 = (z3 + z) / 4.0;
    let g2 = (5.0 * z5 + 16.0 * z3 + 3.0 * z) / 96.0;
    let g3 = (3.0 * z7 + 19.0 * z5 + 17.0 * z3 - 15.0 * z) / 384.0;
    let g4 = (79.0 * z9 + 776.0 * z7 + 1482.0 * z5 - 1920.0 * z3 - 945.0 * z) / 92160.0;
    z + g1 / df + g2 / df.powi(2) + g3 / df.powi(3) + g4 / df.powi(4)
}

/// Welch–Satterthwaite degrees of freedom of the sum of two independent variance estimates,
/// `va` from `na` units and `vb` from `nb`: `(va + vb)² / (va²/(na − 1) + vb²/(nb − 1))`.
fn welch_df(va: f64, na: usize, vb: f64, nb: usize) -> f64 {
    let term = |v: f64, n: usize| if n > 1 { v * v / (n as f64 - 1.0) } else { f64::INFINITY };
    let den = term(va, na) + term(vb, nb);
    if den > 0.0 { (va + vb).powi(2) / den } else { f64::INFINITY }
}

/// An estimate with a 95% interval (`NaN` bounds when there are too few observations).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Estimate {
    pub value: f64,
    pub lo: f64,
    pub hi: f64,
}

impl Estimate {
    pub fn has_interval(&self) -> bool {
        self.lo.is_finite() && self.hi.is_finite()
    }
}

/// `Σy / Σx` over clusters `(x_i, y_i)` and its delta-method standard error.
pub fn ratio_of_sums(pairs: &[(f64, f64)]) -> (f64, f64) {
    let m = pairs.len() as f64;
    let sx: f64 = pairs.iter().map(|p| p.0).sum();
    let sy: f64 = pairs.iter().map(|p| p.1).sum();
    if pairs.is_empty() || sx == 0.0 {
        return (f64::NAN, f64::NAN);
    }
    let r = sy / sx;
    if pairs.len() < 2 {
        return (r, f64::NAN);
    }
    let mean_x = sx / m;
    let var_e = pairs.iter().map(|&(x, y)| (y - r * x).powi(2)).sum::<f64>() / (m - 1.0);
    (r, (var_e / m).sqrt() / mean_x)
}

/// `b − a` of two independent ratio-of-sums estimates, with its 95% interval (Welch t).
pub fn ratio_difference(a: &[(f64, f64)], b: &[(f64, f64)]) -> Estimate {
    let (ra, sa) = ratio_of_sums(a);
    let (rb, sb) = ratio_of_sums(b);
    let d = rb - ra;
    let se = (sa * sa + sb * sb).sqrt();
    let q = quantile(welch_df(sa * sa, a.len(), sb * sb, b.len()));
    Estimate { value: d, lo: d - q * se, hi: d + q * se }
}

/// The 95% quantile for `df` degrees of freedom: [`t95`], or [`Z95`] when the variance is
/// known exactly (infinite `df`: zero spread on one side).
fn quantile(df: f64) -> f64 {
    if df.is_finite() { t95(df.max(1.0)) } else { Z95 }
}

fn mean_var(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var =
        if xs.len() > 1 { xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0) } else { f64::NAN };
    (mean, var)
}

/// `mean(b) / mean(a)` of two independent samples, with a 95% interval on the log scale.
pub fn ratio_of_means(a: &[f64], b: &[f64]) -> Estimate {
    if a.is_empty() || b.is_empty() {
        return Estimate { value: f64::NAN, lo: f64::NAN, hi: f64::NAN };
    }
    let (ma, va) = mean_var(a);
    let (mb, vb) = mean_var(b);
    let r = mb / ma;
    let (ea, eb) = (va / (a.len() as f64 * ma * ma), vb / (b.len() as f64 * mb * mb));
    let se = (ea + eb).sqrt();
    let q = quantile(welch_df(ea, a.len(), eb, b.len()));
    Estimate { value: r, lo: r * (-q * se).exp(), hi: r * (q * se).exp() }
}

/// Whether an interval estimate meets `[lo_limit, hi_limit]`: the whole 95% interval inside
/// (pass), the whole interval outside (fail: a significant violation), otherwise inconclusive
/// (more samples needed).
pub fn judge(e: &Estimate, lo_limit: f64, hi_limit: f64) -> super::report::Verdict {
    use super::report::Verdict;
    if !e.value.is_finite() {
        Verdict::NotRun
    } else if !e.has_interval() {
        Verdict::Inconclusive
    } else if e.lo >= lo_limit && e.hi <= hi_limit {
        Verdict::Pass
    } else if e.lo > hi_limit || e.hi < lo_limit {
        Verdict::Fail
    } else {
        Verdict::Inconclusive
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_of_sums_matches_hand_computation() {
        // replies (tokens, sum): r = 12 / 6 = 2; residuals 4−2·2 = 0, 8−2·4 = 0 → se 0.
        let (r, se) = ratio_of_sums(&[(2.0, 4.0), (4.0, 8.0)]);
        assert_eq!((r, se), (2.0, 0.0));
        // r = 4/4 = 1; residuals 3−1 = 2, 1−3 = −2; var_e = 8; se = sqrt(8/2)/2 = 1.
        let (r, se) = ratio_of_sums(&[(1.0, 3.0), (3.0, 1.0)]);
        assert!((r - 1.0).abs() < 1e-12 && (se - 1.0).abs() < 1e-12, "{r} {se}");
    }

    #[test]
    fn t_quantiles_match_the_tables() {
        // Two-sided 95% (upper 0.975) quantiles from the standard tables.
        for (df, want) in [
            (1.0, 12.706),
            (2.0, 4.303),
            (3.0, 3.182),
            (4.0, 2.776),
            (8.0, 2.306),
            (10.0, 2.228),
            (30.0, 2.042),
            (120.0, 1.980),
        ] {
            let got = t95(df);
            assert!((got - want).abs() < 2e-3 * want.max(1.0), "df {df}: {got} vs {want}");
        }
        assert!((t95(1e9) - Z95).abs() < 1e-6);
        // Fractional df (true quantiles by numerical integration of the density): 1.5 within
        // 3% above, 2.5 and 4.5 within 0.3%.
        let near = |df: f64, want: f64, rel: f64| (t95(df) - want).abs() <= rel * want;
        assert!(t95(1.5) >= 6.0167 && near(1.5, 6.0167, 0.03), "{}", t95(1.5));
        assert!(near(2.5, 3.5747, 3e-3) && near(4.5, 2.6589, 3e-3), "{} {}", t95(2.5), t95(4.5));
        assert!(t95(0.5).is_nan());
        // Fractional df lie between their neighbours.
        assert!(t95(4.5) < t95(4.0) && t95(4.5) > t95(5.0));
        // Welch: equal variances and sizes give 2(n − 1); one exact side gives the other's n − 1.
        assert!((welch_df(1.0, 5, 1.0, 5) - 8.0).abs() < 1e-12);
        assert!((welch_df(0.0, 5, 1.0, 7) - 6.0).abs() < 1e-12);
    }

    #[test]
    fn difference_and_ratio_intervals_cover_the_point_and_scale_with_noise() {
        let a = [(1.0, 3.0), (3.0, 1.0)];
        let d = ratio_difference(&a, &a);
        assert_eq!(d.value, 0.0);
        // Two replies a side: Welch df 2, se sqrt(2).
        assert!((d.hi - t95(2.0) * 2f64.sqrt()).abs() < 1e-12);
        let r = ratio_of_means(&[10.0, 10.0], &[11.0, 11.0]);
        assert!((r.value - 1.1).abs() < 1e-12 && (r.lo - 1.1).abs() < 1e-12);
        let r = ratio_of_means(&[8.0, 12.0], &[11.0, 11.0]);
        assert!(r.lo < 1.1 && r.hi > 1.1);
    }

    #[test]
    fn judge_passes_inside_fails_outside_and_waits_in_between() {
        use super::super::report::Verdict;
        let e = |value, lo, hi| Estimate { value, lo, hi };
        assert_eq!(judge(&e(0.0, -0.01, 0.02), -0.05, 0.05), Verdict::Pass);
        assert_eq!(judge(&e(0.1, 0.06, 0.14), -0.05, 0.05), Verdict::Fail);
        assert_eq!(judge(&e(0.07, 0.0, 0.14), -0.05, 0.05), Verdict::Inconclusive);
        assert_eq!(judge(&e(0.0, f64::NAN, f64::NAN), -0.05, 0.05), Verdict::Inconclusive);
        assert_eq!(judge(&e(f64::NAN, f64::NAN, f64::NAN), -0.05, 0.05), Verdict::NotRun);
    }
}

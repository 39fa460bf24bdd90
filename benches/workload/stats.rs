//! Interval estimates for the lossless gate: ratios of sums over independent replies (delta
//! method, replies as clusters, so tokens of one reply are not treated as independent), their
//! unpaired differences, and ratios of means.

/// Two-sided 95% normal quantile.
pub const Z95: f64 = 1.959_963_984_540_054;

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

/// `b − a` of two independent ratio-of-sums estimates, with its 95% interval.
pub fn ratio_difference(a: &[(f64, f64)], b: &[(f64, f64)]) -> Estimate {
    let (ra, sa) = ratio_of_sums(a);
    let (rb, sb) = ratio_of_sums(b);
    let d = rb - ra;
    let se = (sa * sa + sb * sb).sqrt();
    Estimate { value: d, lo: d - Z95 * se, hi: d + Z95 * se }
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
    let se = (va / (a.len() as f64 * ma * ma) + vb / (b.len() as f64 * mb * mb)).sqrt();
    Estimate { value: r, lo: r * (-Z95 * se).exp(), hi: r * (Z95 * se).exp() }
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
    fn difference_and_ratio_intervals_cover_the_point_and_scale_with_noise() {
        let a = [(1.0, 3.0), (3.0, 1.0)];
        let d = ratio_difference(&a, &a);
        assert_eq!(d.value, 0.0);
        assert!((d.hi - Z95 * 2f64.sqrt()).abs() < 1e-12);
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

//! Few-row f32 products `y = x · W` on the host, for the CPU backend.
//!
//! Decoding and verification multiply a handful of rows (1 for a decode step, γ + 1 for a
//! verify window) by weights that are far larger than the rows. A general GEMM vectorises along
//! the row dimension, which is nearly empty here; this kernel vectorises along the output
//! columns instead and keeps a block of rows (up to 12 with AVX-512) in registers, so each weight
//! element is loaded once per block of rows.
//!
//! The weight is packed once into column panels of [`PANEL`] floats (`[k, PANEL]` each,
//! contiguous, the last one zero-padded), which the kernel streams front to back.
//!
//! Every output element is the sum over `p = 0..k` of `x[r, p] · W[p, c]`, accumulated in that
//! order from zero with one rounding per step, whatever the number of rows or the block they
//! fall in (on one instruction set; the portable fallback rounds the product separately): a
//! row's result does not depend on the rows it is batched with.
//!
//! `cargo test --release -p dspark --lib proj_timing -- --ignored --nocapture` times it against
//! Flex's matmul at this project's shapes.

/// Output columns per packed panel.
pub(crate) const PANEL: usize = 32;

/// A weight `[k, n]` (`k` inputs, `n` outputs) packed for [`PackedWeight::matmul`].
#[derive(Debug, Clone)]
pub(crate) struct PackedWeight {
    k: usize,
    n: usize,
    /// `ceil(n / PANEL)` panels; panel `j` holds `W[p, j·PANEL + c]` at `(j·k + p)·PANEL + c`.
    panels: Vec<f32>,
}

impl PackedWeight {
    /// Pack a row-major `[k, n]` weight (inputs × outputs).
    #[cfg(test)]
    ///
    /// # Panics
    /// When `w.len() != k · n`.
    pub(crate) fn from_in_out(w: &[f32], k: usize, n: usize) -> Self {
        assert_eq!(w.len(), k * n, "weight of {} values is not [{k}, {n}]", w.len());
        Self::pack(k, n, |p, c| w[p * n + c])
    }

    /// Pack a row-major `[n, k]` weight (outputs × inputs, the checkpoints' layout).
    ///
    /// # Panics
    /// When `w.len() != n · k`.
    pub(crate) fn from_out_in(w: &[f32], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), k * n, "weight of {} values is not [{n}, {k}]", w.len());
        Self::pack(k, n, |p, c| w[c * k + p])
    }

    fn pack(k: usize, n: usize, at: impl Fn(usize, usize) -> f32) -> Self {
        let count = n.div_ceil(PANEL);
        let mut panels = vec![0.0; count * k * PANEL];
        for (j, panel) in panels.chunks_exact_mut(k * PANEL).enumerate() {
            let cols = j * PANEL..((j + 1) * PANEL).min(n);
            for (p, line) in panel.chunks_exact_mut(PANEL).enumerate() {
                for (slot, c) in line.iter_mut().zip(cols.clone()) {
                    *slot = at(p, c);
                }
            }
        }
        Self { k, n, panels }
    }

    /// Outputs.
    pub(crate) fn n(&self) -> usize {
        self.n
    }

    /// Inputs.
    pub(crate) fn k(&self) -> usize {
        self.k
    }

    /// The weight back in row-major `[n, k]` (outputs × inputs).
    pub(crate) fn to_out_in(&self) -> Vec<f32> {
        let mut w = vec![0.0; self.n * self.k];
        for (j, panel) in self.panels.chunks_exact(self.k * PANEL).enumerate() {
            for (p, line) in panel.chunks_exact(PANEL).enumerate() {
                for (cc, &v) in line.iter().enumerate().take(self.n.saturating_sub(j * PANEL)) {
                    w[(j * PANEL + cc) * self.k + p] = v;
                }
            }
        }
        w
    }

    /// `x · W` for `x` row-major `[m, k]`; returns `[m, n]` row-major.
    ///
    /// # Panics
    /// When `x.len()` is not a multiple of `k`.
    pub(crate) fn matmul(&self, x: &[f32]) -> Vec<f32> {
        let k = self.k;
        assert!(k > 0 && x.len().is_multiple_of(k), "input of {} values is not [m, {k}]", x.len());
        let m = x.len() / k;
        let mut out = vec![0.0; m * self.n];
        matmul_dispatch(self, x, m, &mut out);
        out
    }
}

/// The instruction sets [`PackedWeight::matmul`] can run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Isa {
    /// Portable Rust, one row at a time (left to the compiler to vectorise).
    Portable,
    /// x86-64 AVX2 + FMA.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// x86-64 AVX-512F.
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Isa {
    /// The widest one this CPU has.
    fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }

    /// Every one this CPU has (for tests).
    #[cfg(test)]
    fn available() -> Vec<Self> {
        let mut all = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                all.push(Isa::Avx2);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                all.push(Isa::Avx512);
            }
        }
        all
    }
}

fn matmul_dispatch(w: &PackedWeight, x: &[f32], m: usize, out: &mut [f32]) {
    matmul_on(Isa::best(), w, x, m, out);
}

fn matmul_on(isa: Isa, w: &PackedWeight, x: &[f32], m: usize, out: &mut [f32]) {
    match isa {
        Isa::Portable => drive(w, x, m, out, 1, portable_block),
        // SAFETY (both): `isa` names an instruction set the CPU was found to support
        // (`Isa::best`, `Isa::available`); these functions require nothing else.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::matmul_avx2(w, x, m, out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::matmul_avx512(w, x, m, out) },
    }
}

/// Split the rows into balanced blocks of at most `max_block` (9 rows with 8 run as 5 + 4, not
/// 8 + 1), transpose each block to `[k, rows]` so a kernel reads its rows' `p`-th inputs side by
/// side, then run `kernel(xt, panel, dst, col, width)` over every panel (outermost: each is read
/// from memory once) and every block (reusing the panel from cache). `dst` is the block's rows of
/// `out`; the kernel writes its columns `col..col + width`.
#[inline(always)]
fn drive(
    w: &PackedWeight,
    x: &[f32],
    m: usize,
    out: &mut [f32],
    max_block: usize,
    mut kernel: impl FnMut(&[f32], &[f32], &mut [f32], usize, usize),
) {
    let (k, n) = (w.k, w.n);
    let count = m.div_ceil(max_block);
    let mut blocks = Vec::with_capacity(count);
    let mut xt = vec![0.0f32; m * k];
    let mut row = 0;
    for b in 0..count {
        let rows = (m - row) / (count - b);
        let t = &mut xt[row * k..(row + rows) * k];
        for r in 0..rows {
            for (p, &v) in x[(row + r) * k..(row + r + 1) * k].iter().enumerate() {
                t[p * rows + r] = v;
            }
        }
        blocks.push(row..row + rows);
        row += rows;
    }
    for (j, panel) in w.panels.chunks_exact(k * PANEL).enumerate() {
        let col = j * PANEL;
        let width = PANEL.min(n - col);
        for rows in &blocks {
            let xs = &xt[rows.start * k..rows.end * k];
            kernel(xs, panel, &mut out[rows.start * n..rows.end * n], col, width);
        }
    }
}

/// One row (`xt` `[k]`) times one panel, in plain Rust.
fn portable_block(xt: &[f32], panel: &[f32], dst: &mut [f32], col: usize, width: usize) {
    let mut acc = [0.0f32; PANEL];
    for (line, &a) in panel.chunks_exact(PANEL).zip(xt) {
        for (s, &w) in acc.iter_mut().zip(line) {
            *s += a * w;
        }
    }
    dst[col..col + width].copy_from_slice(&acc[..width]);
}

/// AVX2 and AVX-512 kernels: a block of rows times one panel, the accumulators in registers.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{PANEL, PackedWeight, drive};

    /// AVX-512 rows per block: 12 rows × 2 zmm accumulators + 2 for the panel line + 1 broadcast
    /// fit the 32 registers.
    const BLOCK_512: usize = 12;
    /// AVX2 rows per block: 3 rows × 4 ymm accumulators + the panel line and broadcasts fit 16.
    const BLOCK_256: usize = 3;

    /// Runs only where the CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) fn matmul_avx512(w: &PackedWeight, x: &[f32], m: usize, out: &mut [f32]) {
        let n = w.n;
        drive(w, x, m, out, BLOCK_512, |xt, panel, dst, col, width| match dst.len() / n {
            1 => block512::<1>(xt, panel, dst, n, col, width),
            2 => block512::<2>(xt, panel, dst, n, col, width),
            3 => block512::<3>(xt, panel, dst, n, col, width),
            4 => block512::<4>(xt, panel, dst, n, col, width),
            5 => block512::<5>(xt, panel, dst, n, col, width),
            6 => block512::<6>(xt, panel, dst, n, col, width),
            7 => block512::<7>(xt, panel, dst, n, col, width),
            8 => block512::<8>(xt, panel, dst, n, col, width),
            9 => block512::<9>(xt, panel, dst, n, col, width),
            10 => block512::<10>(xt, panel, dst, n, col, width),
            11 => block512::<11>(xt, panel, dst, n, col, width),
            _ => block512::<12>(xt, panel, dst, n, col, width),
        });
    }

    /// Runs only where the CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn matmul_avx2(w: &PackedWeight, x: &[f32], m: usize, out: &mut [f32]) {
        let n = w.n;
        drive(w, x, m, out, BLOCK_256, |xt, panel, dst, col, width| match dst.len() / n {
            1 => block256::<1>(xt, panel, dst, n, col, width),
            2 => block256::<2>(xt, panel, dst, n, col, width),
            _ => block256::<3>(xt, panel, dst, n, col, width),
        });
    }

    /// `R` rows (`xt` `[k, R]`) times one panel (`[k, PANEL]`) into columns `col..col + width`
    /// of `dst` (`[R, n]`).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn block512<const R: usize>(
        xt: &[f32],
        panel: &[f32],
        dst: &mut [f32],
        n: usize,
        col: usize,
        width: usize,
    ) {
        const L: usize = PANEL / 16;
        let mut acc = [[_mm512_setzero_ps(); L]; R];
        for (line, xp) in panel.chunks_exact(PANEL).zip(xt.chunks_exact(R)) {
            // SAFETY: `line` holds PANEL = 16·L floats; each load reads 16 of them, in bounds.
            let w: [__m512; L] = std::array::from_fn(|i| unsafe { _mm512_loadu_ps(line[16 * i..].as_ptr()) });
            for r in 0..R {
                let a = _mm512_set1_ps(xp[r]);
                for i in 0..L {
                    acc[r][i] = _mm512_fmadd_ps(a, w[i], acc[r][i]);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            let mut lane = [0.0f32; PANEL];
            for (i, v) in acc.iter().enumerate() {
                // SAFETY: writes 16 floats at 16·i of a PANEL = 16·L array, in bounds.
                unsafe { _mm512_storeu_ps(lane[16 * i..].as_mut_ptr(), *v) };
            }
            dst[r * n + col..r * n + col + width].copy_from_slice(&lane[..width]);
        }
    }

    /// [`block512`] with 8-float registers.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn block256<const R: usize>(
        xt: &[f32],
        panel: &[f32],
        dst: &mut [f32],
        n: usize,
        col: usize,
        width: usize,
    ) {
        const L: usize = PANEL / 8;
        let mut acc = [[_mm256_setzero_ps(); L]; R];
        for (line, xp) in panel.chunks_exact(PANEL).zip(xt.chunks_exact(R)) {
            let a: [__m256; R] = std::array::from_fn(|r| _mm256_set1_ps(xp[r]));
            for i in 0..L {
                // SAFETY: `line` holds PANEL = 8·L floats; the load reads 8 of them, in bounds.
                let w = unsafe { _mm256_loadu_ps(line[8 * i..].as_ptr()) };
                for r in 0..R {
                    acc[r][i] = _mm256_fmadd_ps(a[r], w, acc[r][i]);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            let mut lane = [0.0f32; PANEL];
            for (i, v) in acc.iter().enumerate() {
                // SAFETY: writes 8 floats at 8·i of a PANEL = 8·L array, in bounds.
                unsafe { _mm256_storeu_ps(lane[8 * i..].as_mut_ptr(), *v) };
            }
            dst[r * n + col..r * n + col + width].copy_from_slice(&lane[..width]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-1, 1), never all zero.
    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// Reference in f64.
    fn reference(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut y = vec![0.0; m * n];
        for r in 0..m {
            for c in 0..n {
                y[r * n + c] = (0..k).map(|p| f64::from(x[r * k + p]) * f64::from(w[p * n + c])).sum();
            }
        }
        y
    }

    #[test]
    fn matches_an_f64_reference_for_every_row_count_and_odd_sizes() {
        for &(k, n) in &[(1, 1), (5, 3), (37, 33), (64, 32), (67, 95), (256, 768)] {
            let w = values(k * n, (k * 1000 + n) as u64);
            let packed = PackedWeight::from_in_out(&w, k, n);
            for (m, isa) in [1, 2, 3, 7, 8, 9, 12, 13, 16, 17, 64]
                .into_iter()
                .flat_map(|m| Isa::available().into_iter().map(move |isa| (m, isa)))
            {
                let x = values(m * k, m as u64 + 7);
                let mut got = vec![f32::NAN; m * n];
                matmul_on(isa, &packed, &x, m, &mut got);
                let want = reference(&x, &w, m, k, n);
                assert_eq!(got.len(), want.len());
                // |error| ≤ k·ε·Σ|x·w| bounds sequential f32 summation.
                for r in 0..m {
                    for c in 0..n {
                        let mag: f64 = (0..k)
                            .map(|p| f64::from(x[r * k + p]).abs() * f64::from(w[p * n + c]).abs())
                            .sum();
                        let err = (f64::from(got[r * n + c]) - want[r * n + c]).abs();
                        let bound = k as f64 * f64::from(f32::EPSILON) * mag + 1e-30;
                        assert!(err <= bound, "{isa:?} k={k} n={n} m={m} [{r},{c}]: error {err} > {bound}");
                    }
                }
            }
        }
    }

    #[test]
    fn both_layouts_pack_the_same() {
        let (k, n) = (45, 70);
        let w = values(k * n, 3);
        let wt: Vec<f32> = (0..n * k).map(|i| w[(i % k) * n + i / k]).collect();
        let a = PackedWeight::from_in_out(&w, k, n);
        let b = PackedWeight::from_out_in(&wt, n, k);
        assert_eq!(a.panels, b.panels);
        let x = values(9 * k, 4);
        assert_eq!(a.matmul(&x), b.matmul(&x));
    }

    #[test]
    fn a_row_does_not_depend_on_its_batch() {
        let (k, n) = (131, 77);
        let packed = PackedWeight::from_in_out(&values(k * n, 11), k, n);
        let x = values(17 * k, 12);
        for isa in Isa::available() {
            let mut all = vec![0.0; 17 * n];
            matmul_on(isa, &packed, &x, 17, &mut all);
            for r in 0..17 {
                let mut one = vec![0.0; n];
                matmul_on(isa, &packed, &x[r * k..(r + 1) * k], 1, &mut one);
                assert_eq!(one, all[r * n..(r + 1) * n], "{isa:?} row {r}");
            }
        }
    }
}

/// Timing against Flex's matmul (ignored: run in release, see the module header).
#[cfg(test)]
mod timing {
    use super::*;
    use burn::tensor::{Tensor, TensorData};
    use std::time::Instant;

    #[test]
    #[ignore]
    fn proj_timing() {
        let device = crate::device::DeviceKind::Cpu.device().expect("CPU backend");
        for &(k, n) in &[(256usize, 768usize), (768, 256), (256, 4096)] {
            let w: Vec<f32> = (0..k * n).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
            let packed = PackedWeight::from_in_out(&w, k, n);
            let wt = Tensor::<2>::from_data(TensorData::new(w.clone(), [k, n]), &device);
            for m in [1usize, 2, 3, 4, 5, 8, 9, 16, 64] {
                let x: Vec<f32> = (0..m * k).map(|i| ((i * 31) % 100) as f32 / 100.0).collect();
                let xt = Tensor::<2>::from_data(TensorData::new(x.clone(), [m, k]), &device);
                let time = |f: &mut dyn FnMut()| {
                    (0..7)
                        .map(|_| {
                            let t = Instant::now();
                            for _ in 0..30 {
                                f();
                            }
                            t.elapsed().as_secs_f64() * 1e6 / 30.0
                        })
                        .fold(f64::MAX, f64::min)
                };
                let ours = time(&mut || {
                    std::hint::black_box(packed.matmul(&x));
                });
                let flex = time(&mut || {
                    std::hint::black_box(xt.clone().matmul(wt.clone()).into_data());
                });
                println!("[{m}x{k}]x[{k}x{n}]: ours {ours:.1} us, flex {flex:.1} us");
            }
        }
    }
}

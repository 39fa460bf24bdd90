//! FP8 (e4m3fn) weights kept as FP8 on the device, and the product `x · Wᵀ` with them.
//!
//! # Element format
//! `float8_e4m3fn` (OCP OFP8 rev. 1.0, E4M3; `torch.float8_e4m3fn`, safetensors `F8_E4M3`): 1
//! sign bit, a 4-bit exponent with bias 7, a 3-bit mantissa; exponent 0 holds subnormals
//! `m/8 · 2⁻⁶`; `S.1111.111` is NaN; no infinities, ±448 is the largest finite value.
//!
//! # A matrix on the device
//! An [`Fp8Matrix`] holds an `[out, in]` weight as one byte per element plus f32
//! dequantisation scales (`W = decode(byte) · scale`), one per output row ([`ScaleGrid::PerRow`])
//! or one per 128×128 block ([`ScaleGrid::Blocks`]). The bytes are packed four to a 32-bit word
//! in the order `(k, k+2, k+1, k+3)` within each group of four columns: the kernel turns the
//! even and the odd bytes of a word into two bf16 pairs `(k, k+1)`, `(k+2, k+3)` with a few bit
//! operations. The order is internal; [`Fp8Matrix::upload`] takes and
//! [`reference::dequantize_fp8`](crate::reference::dequantize_fp8) gives row-major values.
//!
//! # The product
//! [`linear_fp8`] computes `Σ_k x[k] · decode(W[k])` in f32 and applies the scales to those
//! sums (per row at the end, per block after each 128 columns' worth of products), so the
//! weights enter as their exact e4m3 values; never rounded to bf16 after scaling. On CUDA with
//! bf16 activations it is one tensor-core kernel with the skinny GEMM's batch invariance;
//! elsewhere [`reference::linear_fp8`](crate::reference::linear_fp8).

use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::{DType, Device, Int, Tensor, TensorCreationOptions, TensorData};

/// Largest finite e4m3 magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// Side of the square scale blocks of [`ScaleGrid::Blocks`].
pub const BLOCK: usize = 128;

static FP8_REFERENCE: AtomicBool = AtomicBool::new(false);

/// Make [`fp8_weights_run`] say yes on every device, with [`linear_fp8`] running its plain-burn
/// body where the kernel does not: models then keep FP8 weights as [`Fp8Matrix`] on the CPU
/// too, so that path (packing, fused projections, block scales) is tested without a GPU. Off by
/// default; process-wide.
pub fn set_fp8_reference(enabled: bool) {
    FP8_REFERENCE.store(enabled, Ordering::Relaxed);
}

/// Whether models on `device` computing in `dtype` keep FP8 weights as [`Fp8Matrix`] (the CUDA
/// kernel runs: a CUDA device, this crate's kernels on, bf16) rather than dequantising them at
/// load. See also [`set_fp8_reference`].
pub fn fp8_weights_run(device: &Device, dtype: DType) -> bool {
    FP8_REFERENCE.load(Ordering::Relaxed) || (dtype == DType::BF16 && crate::kernels_available(device))
}

/// Decode one e4m3fn byte exactly (NaN for 0x7F and 0xFF).
pub fn e4m3_to_f32(byte: u8) -> f32 {
    let sign = u32::from(byte >> 7) << 31;
    let exp = u32::from((byte >> 3) & 0xF);
    let man = u32::from(byte & 0x7);
    if exp == 0xF && man == 0x7 {
        return f32::from_bits(sign | 0x7FC0_0000);
    }
    if exp == 0 {
        // Subnormal: m · 2^-9, exact in f32 (2^-9 has bits 0x3B00_0000).
        let magnitude = man as f32 * f32::from_bits(0x3B00_0000);
        return f32::from_bits(sign | magnitude.to_bits());
    }
    // Normal: rebias the exponent (7 → 127) and move the mantissa to the top of f32's 23 bits.
    f32::from_bits(sign | ((exp + 120) << 23) | (man << 20))
}

/// Which entries of the scale tensor apply to which weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleGrid {
    /// One scale per output row: `scales[r]`.
    PerRow,
    /// One scale per 128×128 block, row-major `[ceil(out/128), ceil(in/128)]`: `scales[r/128,
    /// c/128]` (blocks at the ragged edge are partial).
    Blocks,
}

impl ScaleGrid {
    /// Number of scales of an `[out, in]` matrix.
    pub fn len(self, out: usize, inp: usize) -> usize {
        match self {
            Self::PerRow => out,
            Self::Blocks => out.div_ceil(BLOCK) * inp.div_ceil(BLOCK),
        }
    }
}

/// Why an FP8 matrix could not be built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fp8Error {
    /// The byte or scale count does not match the shape and grid.
    Length {
        /// What was short or long.
        what: &'static str,
        /// Expected count.
        expected: usize,
        /// Given count.
        actual: usize,
    },
    /// The shape is not one [`Fp8Matrix`] stores (`in` a multiple of 64, `out` of 16).
    Shape([usize; 2]),
}

impl std::fmt::Display for Fp8Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Length { what, expected, actual } => {
                write!(f, "{actual} {what} given where the shape needs {expected}")
            }
            Self::Shape([out, inp]) => write!(
                f,
                "an FP8 matrix of [{out}, {inp}] is not stored on the device (in must be a multiple of \
                 64 and out of 16)"
            ),
        }
    }
}

impl std::error::Error for Fp8Error {}

/// An `[out, in]` e4m3 weight and its scales on a device (see the module documentation).
#[derive(Debug, Clone)]
pub struct Fp8Matrix {
    /// `[out, in / 4]` i32: four bytes per word, in kernel order.
    pub(crate) words: Tensor<2, Int>,
    /// f32 scales, `grid.len(out, in)` of them.
    pub(crate) scales: Tensor<1>,
    pub(crate) out: usize,
    pub(crate) inp: usize,
    pub(crate) grid: ScaleGrid,
}

impl Fp8Matrix {
    /// Whether an `[out, in]` matrix can be stored (the kernel's tiling: `in` a multiple of 64,
    /// `out` of 16; every Qwen3 and DSpark projection and LM head).
    pub fn shape_supported(out: usize, inp: usize) -> bool {
        out > 0 && inp > 0 && inp.is_multiple_of(64) && out.is_multiple_of(16)
    }

    /// The rows `ids` of a matrix with one scale per row, in that order (a draft's LM-head rows
    /// for a restricted vocabulary); `None` for block scales, whose blocks span 128 rows, or when
    /// the row count is not one [`Fp8Matrix::shape_supported`] takes. The new matrix is allocated
    /// as persistent memory, as uploads are.
    pub fn select_rows(&self, ids: Tensor<1, Int>) -> Option<Self> {
        let out = ids.dims()[0];
        if self.grid != ScaleGrid::PerRow || !Self::shape_supported(out, self.inp) {
            return None;
        }
        let device = self.words.device();
        let parts = (self.words.clone(), self.scales.clone(), ids);
        let (words, scales) = device
            .memory_persistent_allocations(parts, |(w, s, ids)| (w.select(0, ids.clone()), s.select(0, ids)));
        Some(Self { words, scales, out, inp: self.inp, grid: ScaleGrid::PerRow })
    }

    /// Put row-major e4m3 `bytes` (`[out, in]`) and their `scales` on `device`.
    ///
    /// # Errors
    /// [`Fp8Error::Shape`] when [`Fp8Matrix::shape_supported`] says no; [`Fp8Error::Length`] when
    /// the byte or scale count does not match.
    pub fn upload(
        bytes: &[u8],
        scales: &[f32],
        [out, inp]: [usize; 2],
        grid: ScaleGrid,
        device: &Device,
    ) -> Result<Self, Fp8Error> {
        if !Self::shape_supported(out, inp) {
            return Err(Fp8Error::Shape([out, inp]));
        }
        if bytes.len() != out * inp {
            return Err(Fp8Error::Length { what: "bytes", expected: out * inp, actual: bytes.len() });
        }
        let n_scales = grid.len(out, inp);
        if scales.len() != n_scales {
            return Err(Fp8Error::Length { what: "scales", expected: n_scales, actual: scales.len() });
        }
        let words: Vec<i32> =
            bytes.chunks_exact(4).map(|g| i32::from_le_bytes([g[0], g[2], g[1], g[3]])).collect();
        // Weights live as long as the model: allocated as persistent memory (exact-size slices),
        // not from the pools sized for activations, where one LM-head-sized buffer was measured
        // to hold twice its bytes on the H200.
        let data = (TensorData::new(words, [out, inp / 4]), TensorData::new(scales.to_vec(), [n_scales]));
        let (words, scales) = device.memory_persistent_allocations((data, device.clone()), |((w, s), d)| {
            let int = TensorCreationOptions::new(d.clone()).with_dtype(DType::I32);
            let float = TensorCreationOptions::new(d).with_dtype(DType::F32);
            (Tensor::<2, Int>::from_data(w, int), Tensor::<1>::from_data(s, float))
        });
        Ok(Self { words, scales, out, inp, grid })
    }

    /// `[out, in]`.
    pub fn dims(&self) -> [usize; 2] {
        [self.out, self.inp]
    }

    /// How the scales apply.
    pub fn grid(&self) -> ScaleGrid {
        self.grid
    }

    /// Device bytes: one per weight plus four per scale.
    pub fn bytes(&self) -> usize {
        self.out * self.inp + 4 * self.grid.len(self.out, self.inp)
    }

    /// The device holding the matrix.
    pub fn device(&self) -> Device {
        self.words.device()
    }

    /// The matrices stacked along their output rows (`[q; k; v]`), or `None` when they cannot
    /// be: different `in` or grids, or a block grid whose parts (all but the last) do not end
    /// on a 128-row boundary.
    pub fn cat_rows(parts: &[Self]) -> Option<Self> {
        let first = parts.first()?;
        let aligned = |m: &Self| m.grid == ScaleGrid::PerRow || m.out.is_multiple_of(BLOCK);
        if parts.iter().any(|m| m.inp != first.inp || m.grid != first.grid)
            || !parts[..parts.len() - 1].iter().all(aligned)
        {
            return None;
        }
        Some(Self {
            words: Tensor::cat(parts.iter().map(|m| m.words.clone()).collect(), 0),
            scales: Tensor::cat(parts.iter().map(|m| m.scales.clone()).collect(), 0),
            out: parts.iter().map(|m| m.out).sum(),
            inp: first.inp,
            grid: first.grid,
        })
    }

    /// Gate and up weights with per-row scales paired as [`crate::pair_gate_up`] pairs dense
    /// ones (16-row block `b`: gate rows `8b .. 8b + 8`, then up rows `8b .. 8b + 8`, each row
    /// with its scale) for [`linear_fp8_swiglu`]; `None` for block scales (a 16-row block would
    /// mix two matrices' 128-row blocks) or shapes that differ or do not pair (`out` a multiple
    /// of 8). The new matrix is allocated as persistent memory, as uploads are.
    pub fn pair_gate_up(gate: &Self, up: &Self) -> Option<Self> {
        let [inter, inp] = gate.dims();
        if gate.grid != ScaleGrid::PerRow
            || up.grid != ScaleGrid::PerRow
            || up.dims() != [inter, inp]
            || !inter.is_multiple_of(8)
            || !Self::shape_supported(2 * inter, inp)
        {
            return None;
        }
        let device = gate.words.device();
        let parts = (gate.words.clone(), up.words.clone(), gate.scales.clone(), up.scales.clone());
        let (words, scales) = device.memory_persistent_allocations(parts, |(gw, uw, gs, us)| {
            let blocks = inter / 8;
            let w = |t: Tensor<2, Int>| t.reshape([blocks, 8, inp / 4]);
            let sc = |t: Tensor<1>| t.reshape([blocks, 8]);
            (
                Tensor::cat(vec![w(gw), w(uw)], 1).reshape([2 * inter, inp / 4]),
                Tensor::cat(vec![sc(gs), sc(us)], 1).reshape([2 * inter]),
            )
        });
        Some(Self { words, scales, out: 2 * inter, inp, grid: ScaleGrid::PerRow })
    }

    /// Output rows `start..start + len`, or `None` when a block grid would be cut inside a
    /// block (or the range is empty, out of bounds or not a multiple of 16 rows).
    pub fn narrow_rows(&self, start: usize, len: usize) -> Option<Self> {
        if len == 0
            || start + len > self.out
            || !Self::shape_supported(len, self.inp)
            || !start.is_multiple_of(16)
        {
            return None;
        }
        let scales = match self.grid {
            ScaleGrid::PerRow => self.scales.clone().narrow(0, start, len),
            ScaleGrid::Blocks => {
                if !start.is_multiple_of(BLOCK) || !(len.is_multiple_of(BLOCK) || start + len == self.out) {
                    return None;
                }
                let per = self.inp.div_ceil(BLOCK);
                self.scales.clone().narrow(0, start / BLOCK * per, len.div_ceil(BLOCK) * per)
            }
        };
        Some(Self {
            words: self.words.clone().narrow(0, start, len),
            scales,
            out: len,
            inp: self.inp,
            grid: self.grid,
        })
    }
}

/// `x · Wᵀ` for an FP8 weight, as the module documentation describes.
///
/// On CUDA with bf16 `x` it is one kernel: the skinny GEMM's tiling (16 weight rows per cube, up
/// to 64 activation rows per launch, a reduction order that depends only on `in`), each 16-byte
/// load carrying 16 weights that become exact bf16 values in registers. Elsewhere it is
/// [`reference::linear_fp8`](crate::reference::linear_fp8).
///
/// # Shapes
/// `x`: `[rows, in]` → `[rows, out]`, in the dtype of `x`.
pub fn linear_fp8(x: Tensor<2>, weight: &Fp8Matrix) -> Tensor<2> {
    #[cfg(feature = "cuda")]
    if crate::kernels_enabled() && crate::cuda::gemm_fp8::takes(&x, weight) {
        return crate::cuda::gemm_fp8::linear(x, weight);
    }
    crate::reference::linear_fp8(x, weight)
}

/// `silu(x·Gᵀ)·(x·Uᵀ)` for FP8 gate and up weights paired by [`Fp8Matrix::pair_gate_up`], as
/// [`linear_fp8`] then [`crate::swiglu_cols`] compute it (the same bits). On CUDA, where the
/// product does not cut the reduction (a Qwen3-8B-shaped draft's gate/up pair), the SwiGLU is the
/// product's epilogue: one launch, and no `[rows, 2·inter]` intermediate.
///
/// # Shapes
/// `x`: `[rows, in]`, `paired`: `[2·inter, in]` → `[rows, inter]`.
pub fn linear_fp8_swiglu(x: Tensor<2>, paired: &Fp8Matrix) -> Tensor<2> {
    #[cfg(feature = "cuda")]
    if crate::kernels_enabled() && crate::cuda::gemm_fp8::takes_swiglu(&x, paired) {
        return crate::cuda::gemm_fp8::linear_swiglu(x, paired);
    }
    let rows = x.dims()[0];
    let inter = paired.out / 2;
    let y = linear_fp8(x, paired).reshape([rows, inter / 8, 2, 8]);
    let gate = y.clone().narrow(2, 0, 1).reshape([rows, inter]);
    let up = y.narrow(2, 1, 1).reshape([rows, inter]);
    crate::swiglu_cols(gate, up, 0, 0, inter)
}

/// [`crate::linear_add_rms_norm`] for an FP8 weight: `(s, RMSNorm(s)·norm)` with
/// `s = x + linear_fp8(a, W)`, the same bits as [`linear_fp8`] then [`crate::add_rms_norm`];
/// on CUDA a split product's combine, the residual add and the norm are one kernel.
pub fn linear_fp8_add_rms_norm(
    x: Tensor<2>,
    a: Tensor<2>,
    weight: &Fp8Matrix,
    norm: &Tensor<1>,
    eps: f64,
) -> (Tensor<2>, Tensor<2>) {
    #[cfg(feature = "cuda")]
    if crate::kernels_enabled()
        && x.dims() == [a.dims()[0], weight.out]
        && x.dtype() == a.dtype()
        && crate::cuda::gemm_fp8::takes(&a, weight)
        && crate::cuda::fused::takes_norm(&x, norm)
    {
        return crate::cuda::fused::linear_fp8_add_rms_norm(x, a, weight, norm, eps);
    }
    crate::add_rms_norm(x, linear_fp8(a, weight), norm, eps)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpu() -> Device {
        Device::default()
    }

    /// Deterministic bytes covering every finite code (NaN codes replaced by zero).
    fn bytes(n: usize, seed: u32) -> Vec<u8> {
        (0..n)
            .map(|i| {
                let b = ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8;
                if b & 0x7F == 0x7F { 0 } else { b }
            })
            .collect()
    }

    fn host(t: Tensor<2>) -> Vec<f32> {
        t.into_data().convert::<f32>().try_into_vec::<f32>().expect("f32 data")
    }

    #[test]
    fn dequantisation_round_trips_both_grids() {
        let (out, inp) = (144, 192);
        let b = bytes(out * inp, 7);
        for grid in [ScaleGrid::PerRow, ScaleGrid::Blocks] {
            let scales: Vec<f32> = (0..grid.len(out, inp)).map(|i| 0.001 * (i as f32 + 1.0)).collect();
            let m = Fp8Matrix::upload(&b, &scales, [out, inp], grid, &cpu()).expect("supported shape");
            let got = host(crate::reference::dequantize_fp8(&m));
            for r in 0..out {
                for c in 0..inp {
                    let s = match grid {
                        ScaleGrid::PerRow => scales[r],
                        ScaleGrid::Blocks => scales[(r / BLOCK) * inp.div_ceil(BLOCK) + c / BLOCK],
                    };
                    let want = e4m3_to_f32(b[r * inp + c]) * s;
                    assert_eq!(got[r * inp + c].to_bits(), want.to_bits(), "{grid:?} ({r}, {c})");
                }
            }
        }
    }

    #[test]
    fn cat_and_narrow_keep_rows_and_scales_together() {
        let inp = 128;
        let parts: Vec<Fp8Matrix> = [128usize, 256, 128]
            .iter()
            .enumerate()
            .map(|(i, &out)| {
                let scales: Vec<f32> = (0..out).map(|r| (r + 100 * i) as f32 * 1e-3 + 1e-3).collect();
                let b = bytes(out * inp, i as u32);
                Fp8Matrix::upload(&b, &scales, [out, inp], ScaleGrid::PerRow, &cpu()).expect("shape")
            })
            .collect();
        let all = Fp8Matrix::cat_rows(&parts).expect("same in and grid");
        assert_eq!(all.dims(), [512, 128]);
        let whole = host(crate::reference::dequantize_fp8(&all));
        let mid = all.narrow_rows(128, 256).expect("aligned");
        assert_eq!(
            host(crate::reference::dequantize_fp8(&mid)),
            host(crate::reference::dequantize_fp8(&parts[1]))
        );
        assert_eq!(&whole[..128 * inp], &host(crate::reference::dequantize_fp8(&parts[0]))[..]);
        // Block grids are cut on block boundaries only; ragged parts cannot be stacked.
        let blocks = |out: usize| {
            let n = ScaleGrid::Blocks.len(out, inp);
            Fp8Matrix::upload(&bytes(out * inp, 3), &vec![0.5; n], [out, inp], ScaleGrid::Blocks, &cpu())
                .expect("shape")
        };
        assert!(blocks(256).narrow_rows(16, 128).is_none());
        assert!(blocks(256).narrow_rows(128, 128).is_some());
        assert!(Fp8Matrix::cat_rows(&[blocks(144), blocks(128)]).is_none());
        assert!(Fp8Matrix::cat_rows(&[blocks(128), blocks(144)]).is_some());
        assert!(Fp8Matrix::cat_rows(&[parts[0].clone(), blocks(128)]).is_none());
    }

    #[test]
    fn paired_gate_up_rows_keep_their_scales_and_the_swiglu_of_the_products() {
        let (inter, inp, rows) = (32usize, 128usize, 3usize);
        let m = |seed: u32, base: f32| {
            let scales: Vec<f32> = (0..inter).map(|r| base + r as f32 * 1e-3).collect();
            Fp8Matrix::upload(&bytes(inter * inp, seed), &scales, [inter, inp], ScaleGrid::PerRow, &cpu())
                .expect("shape")
        };
        let (gate, up) = (m(1, 0.01), m(2, 0.02));
        let paired = Fp8Matrix::pair_gate_up(&gate, &up).expect("per-row scales pair");
        assert_eq!(paired.dims(), [2 * inter, inp]);
        // Block b of 16 rows: gate rows 8b.., then up rows 8b.., each with its own scale.
        let (p, g, u) = (
            host(crate::reference::dequantize_fp8(&paired)),
            host(crate::reference::dequantize_fp8(&gate)),
            host(crate::reference::dequantize_fp8(&up)),
        );
        for r in 0..2 * inter {
            let (b, i) = (r / 16, r % 16);
            let src = if i < 8 { &g } else { &u };
            let row = 8 * b + i % 8;
            assert_eq!(&p[r * inp..(r + 1) * inp], &src[row * inp..(row + 1) * inp], "paired row {r}");
        }
        // The product with the SwiGLU: as the two products and the SwiGLU kernel's body.
        let x = Tensor::<2>::random([rows, inp], burn::tensor::Distribution::Normal(0.0, 1.0), &cpu());
        let got = host(linear_fp8_swiglu(x.clone(), &paired));
        let want = host(crate::swiglu_cols(linear_fp8(x.clone(), &gate), linear_fp8(x, &up), 0, 0, inter));
        assert_eq!(got.len(), rows * inter);
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "element {i}: {a} vs {b}");
        }
        // Block scales do not pair; nor do shapes that differ.
        let blocks = Fp8Matrix::upload(
            &bytes(inter * inp, 3),
            &vec![0.5; ScaleGrid::Blocks.len(inter, inp)],
            [inter, inp],
            ScaleGrid::Blocks,
            &cpu(),
        )
        .expect("shape");
        assert!(Fp8Matrix::pair_gate_up(&blocks, &blocks).is_none());
        let wider = Fp8Matrix::upload(&bytes(48 * inp, 4), &[0.1; 48], [48, inp], ScaleGrid::PerRow, &cpu())
            .expect("shape");
        assert!(Fp8Matrix::pair_gate_up(&gate, &wider).is_none());
    }

    #[test]
    fn upload_refuses_bad_lengths_and_shapes() {
        let d = cpu();
        assert_eq!(
            Fp8Matrix::upload(&[0; 16 * 64], &[1.0; 16], [16, 96], ScaleGrid::PerRow, &d).err(),
            Some(Fp8Error::Shape([16, 96]))
        );
        assert!(matches!(
            Fp8Matrix::upload(&[0; 100], &[1.0; 16], [16, 64], ScaleGrid::PerRow, &d),
            Err(Fp8Error::Length { what: "bytes", .. })
        ));
        assert!(matches!(
            Fp8Matrix::upload(&[0; 16 * 64], &[1.0; 2], [16, 64], ScaleGrid::Blocks, &d),
            Err(Fp8Error::Length { what: "scales", expected: 1, actual: 2 })
        ));
    }

    #[test]
    fn reference_product_matches_float64() {
        let (out, inp, rows) = (32, 256, 3);
        let b = bytes(out * inp, 11);
        let scales: Vec<f32> = (0..out).map(|r| 0.01 + r as f32 * 1e-4).collect();
        let m = Fp8Matrix::upload(&b, &scales, [out, inp], ScaleGrid::PerRow, &cpu()).expect("shape");
        let xs: Vec<f32> = (0..rows * inp).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
        let x = Tensor::<2>::from_data(TensorData::new(xs.clone(), [rows, inp]), &cpu());
        let y = host(linear_fp8(x, &m));
        for r in 0..rows {
            for o in 0..out {
                let want: f64 = (0..inp)
                    .map(|k| {
                        f64::from(xs[r * inp + k])
                            * f64::from(e4m3_to_f32(b[o * inp + k]))
                            * f64::from(scales[o])
                    })
                    .sum();
                let got = f64::from(y[r * out + o]);
                assert!((got - want).abs() <= 1e-4 * (1.0 + want.abs()), "({r}, {o}): {got} vs {want}");
            }
        }
    }
}

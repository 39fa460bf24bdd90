//! FP8 (e4m3) draft weights: decoding, per-output-channel quantisation, and loading FP8
//! checkpoints into the compute dtype.
//!
//! # Element format
//! `float8_e4m3fn` (OCP "8-bit Floating Point Specification (OFP8)", rev. 1.0, 2023, the E4M3
//! encoding; the same as `torch.float8_e4m3fn` and safetensors' `F8_E4M3`): 1 sign bit, a 4-bit
//! exponent with bias 7, a 3-bit mantissa. Exponent 0 holds subnormals `m/8 · 2^-6`; the
//! all-ones pattern `S.1111.111` (0x7F, 0xFF) is NaN; there are no infinities, so exponent 15
//! with mantissa 0..=6 is an ordinary number and ±448 is the largest finite value.
//!
//! # Checkpoint layouts
//! A projection `<name>.weight` stored as `F8_E4M3` with shape `[out, in]` carries a scale
//! tensor `<name>.weight_scale_inv` or `<name>.weight_scale` (f32, bf16 or f16; `_scale_inv`
//! is preferred when both exist). Both names mean the same thing: the *dequantisation* factor,
//! `W = fp8 × scale`. This follows the DeepSeek-V3 FP8 release (`README_WEIGHTS.md` in
//! deepseek-ai/DeepSeek-V3, "Dequantization Method": `(128x128 weight block) * weight_scale_inv`,
//! `quantization_config.weight_block_size = [128, 128]`, blocks at the ragged edge are partial)
//! and the compressed-tensors / vLLM `weight_scale` convention (`x = x_q · scale`). The scale's
//! shape selects the layout:
//! - `[ceil(out/128), ceil(in/128)]`: 128×128 blocks, block `(i, j)` scales rows
//!   `128i..128(i+1)` and columns `128j..128(j+1)`;
//! - `[out]` or `[out, 1]`: one scale per output channel (row).
//!
//! Anything else (another scale shape, a missing scale, another FP8 flavour such as `F8_E5M2`
//! or the `FNUZ` variants) is refused with a typed [`Error`] naming the tensor. The Markov
//! head's matrices (`markov_w1`, `markov_w2`, the gated and rnn projections) and the confidence
//! head's weight may be stored the same way; they are dequantised to f32 at load (the heads
//! run on the host, or from their host copy).
//!
//! Where the CUDA kernels run in bf16 ([`dspark_kernels::fp8::fp8_weights_run`]), the bytes and
//! scales stay FP8 on the device ([`dspark_kernels::Fp8Matrix`], half the bytes of bf16) and
//! every product with them is [`dspark_kernels::linear_fp8`]: exact e4m3 weights, f32 sums, the
//! scales applied to the sums. Elsewhere (the CPU reference path) the weights are dequantised at
//! load to the compute dtype (`decode(byte) × scale`, one f32 product per element, then rounded
//! to the compute dtype). Either way the draft computes exactly the proposal distribution it
//! samples from, which is all speculative decoding's exactness needs.

use std::path::Path;

use burn::tensor::Device;
use dspark_kernels::fp8::{Fp8Matrix, ScaleGrid};
use safetensors::Dtype;

use super::layer::Weight;

use crate::device::ComputeDtype;
use crate::error::{Error, Result};
use crate::weights::{Checkpoint, host_f32_tensor};

pub use dspark_kernels::fp8::{BLOCK, E4M3_MAX, e4m3_to_f32};

/// Round `x` to the nearest e4m3fn value, ties to even, saturating at ±448; NaN gives 0x7F.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    if a < f32::from_bits(0x3C80_0000) {
        // Below 2^-6: subnormal grid of step 2^-9. a · 512 is exact; round half to even.
        // A result of 8 is the byte of 2^-6, the smallest normal.
        let q = (a * 512.0).round_ties_even() as u8;
        return sign | q;
    }
    let bits = a.to_bits();
    let exp = (bits >> 23) as i32 - 127;
    let man = bits & 0x7F_FFFF;
    let kept = man >> 20;
    let rest = man & 0xF_FFFF;
    let up = rest > 0x8_0000 || (rest == 0x8_0000 && kept & 1 == 1);
    // Exponent and mantissa side by side: a carry out of the mantissa bumps the exponent.
    let code = (((exp + 7) as u32) << 3 | kept) + u32::from(up);
    sign | code.min(0x7E) as u8
}

/// How an FP8 projection was stored or made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Layout {
    /// `F8_E4M3` with 128×128 block scales in the checkpoint.
    BlockScaled,
    /// `F8_E4M3` with one scale per output channel in the checkpoint.
    PerChannel,
    /// A bf16/f16/f32 weight quantised to e4m3 at load ([`DraftQuant`]).
    QuantizedAtLoad,
}

/// Quantisation applied to a draft's projection weights at load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DraftQuant {
    /// e4m3 with one scale per output channel: `scale = max|row| / 448`, values rounded to
    /// nearest (ties to even) and saturated at ±448; a zero row gets scale 1.
    Fp8PerChannel,
}

/// How many of a draft's projections are FP8, by layout.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fp8Counts {
    /// Stored block-scaled.
    pub block_scaled: usize,
    /// Stored with per-channel scales.
    pub per_channel: usize,
    /// Quantised at load.
    pub quantized_at_load: usize,
}

impl Fp8Counts {
    pub(crate) fn add(&mut self, layout: Option<Fp8Layout>) {
        match layout {
            Some(Fp8Layout::BlockScaled) => self.block_scaled += 1,
            Some(Fp8Layout::PerChannel) => self.per_channel += 1,
            Some(Fp8Layout::QuantizedAtLoad) => self.quantized_at_load += 1,
            None => {}
        }
    }

    /// All FP8 projections.
    pub fn total(&self) -> usize {
        self.block_scaled + self.per_channel + self.quantized_at_load
    }
}

/// A `[rows, cols]` matrix quantised to e4m3 with one scale per row.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizedRows {
    /// e4m3 bytes, row-major `[rows, cols]`.
    pub bytes: Vec<u8>,
    /// Dequantisation scale per row: `W[r, c] ≈ e4m3_to_f32(bytes[r·cols + c]) · scales[r]`.
    pub scales: Vec<f32>,
}

/// Quantise a row-major `[rows, cols]` matrix to e4m3 with per-row scales (see
/// [`DraftQuant::Fp8PerChannel`]).
///
/// # Errors
/// [`Error::InvalidInput`] when `w` does not hold `rows · cols` values or holds a non-finite one.
pub fn quantize_per_channel(w: &[f32], rows: usize, cols: usize) -> Result<QuantizedRows> {
    use rayon::prelude::*;
    if rows.checked_mul(cols) != Some(w.len()) {
        return Err(Error::InvalidInput(format!("{} values are not a [{rows}, {cols}] matrix", w.len())));
    }
    if let Some(i) = w.par_iter().position_first(|v| !v.is_finite()) {
        return Err(Error::InvalidInput(format!(
            "element ({}, {}) is {}: only finite weights can be quantised",
            i / cols.max(1),
            i % cols.max(1),
            w[i]
        )));
    }
    if cols == 0 {
        return Ok(QuantizedRows { bytes: Vec::new(), scales: Vec::new() });
    }
    // Rows are independent: quantising a draft at load (1.2 GB for an 8B-sized LM head) runs on
    // every core, each row exactly as alone.
    let mut bytes = vec![0u8; w.len()];
    let mut scales = vec![0.0f32; rows];
    bytes.par_chunks_mut(cols).zip(scales.par_iter_mut()).zip(w.par_chunks(cols)).for_each(
        |((out, scale), row)| {
            let max = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            *scale = if max > 0.0 { max / E4M3_MAX } else { 1.0 };
            for (b, &v) in out.iter_mut().zip(row) {
                *b = f32_to_e4m3(v / *scale);
            }
        },
    );
    Ok(QuantizedRows { bytes, scales })
}

/// `decode(bytes[r, c]) · scales[r]`, row-major `[scales.len(), cols]`.
pub fn dequantize_per_channel(bytes: &[u8], scales: &[f32], cols: usize) -> Vec<f32> {
    bytes
        .chunks_exact(cols.max(1))
        .zip(scales)
        .flat_map(|(row, &s)| row.iter().map(move |&b| e4m3_to_f32(b) * s))
        .collect()
}

/// `decode(bytes[r, c]) · scales[r / 128, c / 128]` for `[rows, cols]` bytes and
/// `[ceil(rows/128), ceil(cols/128)]` scales, row-major.
pub fn dequantize_blocks(bytes: &[u8], scales: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let blocks_per_row = cols.div_ceil(BLOCK);
    let mut out = Vec::with_capacity(rows * cols);
    for (r, row) in bytes.chunks_exact(cols.max(1)).take(rows).enumerate() {
        let line = &scales[(r / BLOCK) * blocks_per_row..(r / BLOCK + 1) * blocks_per_row];
        out.extend(row.iter().enumerate().map(|(c, &b)| e4m3_to_f32(b) * line[c / BLOCK]));
    }
    out
}

/// The stored parts of an `F8_E4M3` projection: its bytes (row-major `[out, in]`), its f32
/// scales and their grid, checked as [`read_matrix`] describes; `None` when `name` is not stored
/// as `F8_E4M3`.
type Fp8Parts<'a> = (&'a [u8], Vec<f32>, ScaleGrid, Fp8Layout);

fn read_fp8<'a>(ckpt: &'a Checkpoint, name: &str, shape: [usize; 2]) -> Result<Option<Fp8Parts<'a>>> {
    let raw = ckpt.raw(name)?;
    if raw.dtype != Dtype::F8_E4M3 {
        return Ok(None);
    }
    let [rows, cols] = shape;
    if raw.shape != shape {
        return Err(Error::TensorShape {
            path: raw.path.to_path_buf(),
            tensor: name.to_owned(),
            expected: shape.to_vec(),
            actual: raw.shape.to_vec(),
        });
    }
    if raw.bytes.iter().any(|&b| b & 0x7F == 0x7F) {
        return Err(nan_error(raw.path, name, "holds NaN e4m3 values (0x7F/0xFF)"));
    }
    let scale_name = [format!("{name}_scale_inv"), format!("{name}_scale")]
        .into_iter()
        .find(|n| ckpt.contains(n))
        .ok_or_else(|| Error::MissingTensor {
            dir: ckpt.dir().to_path_buf(),
            tensor: format!("{name}_scale_inv (or {name}_scale), the scale of F8_E4M3 tensor {name}"),
        })?;
    let scale_raw = ckpt.raw(&scale_name)?;
    let scale_shape = scale_raw.shape.to_vec();
    let blocks = vec![rows.div_ceil(BLOCK), cols.div_ceil(BLOCK)];
    let per_channel = scale_shape == [rows] || scale_shape == [rows, 1];
    if !per_channel && scale_shape != blocks {
        return Err(Error::TensorShape {
            path: scale_raw.path.to_path_buf(),
            tensor: scale_name,
            expected: blocks,
            actual: scale_shape,
        });
    }
    let scales = ckpt
        .read(&scale_name, &scale_shape, ComputeDtype::F32)?
        .try_into_vec::<f32>()
        .map_err(|e| Error::Backend(format!("{e:?}")))?;
    if scales.iter().any(|s| !s.is_finite()) {
        return Err(nan_error(scale_raw.path, &scale_name, "holds non-finite scales"));
    }
    Ok(Some(if per_channel {
        (raw.bytes, scales, ScaleGrid::PerRow, Fp8Layout::PerChannel)
    } else {
        (raw.bytes, scales, ScaleGrid::Blocks, Fp8Layout::BlockScaled)
    }))
}

/// Read the `[out, in]` projection `name` as host f32 values: dequantised when stored as
/// `F8_E4M3` (with its layout), converted when stored as f32/bf16/f16.
///
/// # Errors
/// [`Error::MissingTensor`] for a missing weight or scale; [`Error::TensorShape`] for a weight or
/// scale of the wrong shape; [`Error::TensorDtype`] for an unsupported weight or scale dtype;
/// [`Error::Safetensors`] for NaN FP8 values or non-finite scales. All name the tensor.
pub fn read_matrix(
    ckpt: &Checkpoint,
    name: &str,
    shape: [usize; 2],
) -> Result<(Vec<f32>, Option<Fp8Layout>)> {
    let [rows, cols] = shape;
    match read_fp8(ckpt, name, shape)? {
        None => {
            let data = ckpt.read(name, &shape, ComputeDtype::F32)?;
            let values = data.try_into_vec::<f32>().map_err(|e| Error::Backend(format!("{e:?}")))?;
            Ok((values, None))
        }
        Some((bytes, scales, ScaleGrid::PerRow, layout)) => {
            Ok((dequantize_per_channel(bytes, &scales, cols), Some(layout)))
        }
        Some((bytes, scales, ScaleGrid::Blocks, layout)) => {
            Ok((dequantize_blocks(bytes, &scales, rows, cols), Some(layout)))
        }
    }
}

/// An FP8 weight where the device keeps FP8 ([`dspark_kernels::fp8::fp8_weights_run`] and a
/// supported shape): `None` elsewhere.
fn device_fp8(
    bytes: &[u8],
    scales: &[f32],
    shape: [usize; 2],
    grid: ScaleGrid,
    dtype: ComputeDtype,
    device: &Device,
    name: &str,
) -> Result<Option<Weight>> {
    let [rows, cols] = shape;
    if !dspark_kernels::fp8::fp8_weights_run(device, dtype.dtype()) || !Fp8Matrix::shape_supported(rows, cols)
    {
        return Ok(None);
    }
    Fp8Matrix::upload(bytes, scales, shape, grid, device)
        .map(|m| Some(Weight::Fp8(m)))
        .map_err(|e| Error::InvalidInput(format!("tensor {name}: {e}")))
}

/// A per-channel quantised `[out, in]` matrix as a projection weight: kept as FP8 where the
/// device does that, else dequantised to `dtype`.
pub(crate) fn per_channel_weight(
    q: &QuantizedRows,
    shape: [usize; 2],
    dtype: ComputeDtype,
    device: &Device,
    name: &str,
) -> Result<Weight> {
    if let Some(w) = device_fp8(&q.bytes, &q.scales, shape, ScaleGrid::PerRow, dtype, device, name)? {
        return Ok(w);
    }
    let values = dequantize_per_channel(&q.bytes, &q.scales, shape[1]);
    Ok(Weight::Dense(host_f32_tensor(&values, shape, dtype, device)))
}

fn nan_error(path: &Path, tensor: &str, what: &str) -> Error {
    Error::Safetensors { path: path.to_path_buf(), message: format!("tensor {tensor} {what}") }
}

/// Load the `[out, in]` projection `name` on `device` in `dtype`: FP8 checkpoints kept as FP8
/// where the device runs FP8 products (else dequantised), other weights as stored or, with
/// `quant`, quantised to e4m3 (kept as FP8 or dequantised likewise). Weights already stored in
/// FP8 are used as stored, never quantised again.
pub(crate) fn load_projection(
    ckpt: &Checkpoint,
    name: &str,
    shape: [usize; 2],
    dtype: ComputeDtype,
    device: &Device,
    quant: Option<DraftQuant>,
) -> Result<(Weight, Option<Fp8Layout>)> {
    if let Some((bytes, scales, grid, layout)) = read_fp8(ckpt, name, shape)? {
        if let Some(w) = device_fp8(bytes, &scales, shape, grid, dtype, device, name)? {
            return Ok((w, Some(layout)));
        }
        let values = match grid {
            ScaleGrid::PerRow => dequantize_per_channel(bytes, &scales, shape[1]),
            ScaleGrid::Blocks => dequantize_blocks(bytes, &scales, shape[0], shape[1]),
        };
        return Ok((Weight::Dense(host_f32_tensor(&values, shape, dtype, device)), Some(layout)));
    }
    if quant.is_none() {
        return Ok((Weight::Dense(ckpt.load(name, shape, dtype, device)?), None));
    }
    let (values, _) = read_matrix(ckpt, name, shape)?;
    let [rows, cols] = shape;
    let q = quantize_per_channel(&values, rows, cols).map_err(|e| match e {
        Error::InvalidInput(m) => {
            Error::InvalidInput(format!("tensor {name} in {}: {m}", ckpt.dir().display()))
        }
        other => other,
    })?;
    Ok((per_channel_weight(&q, shape, dtype, device, name)?, Some(Fp8Layout::QuantizedAtLoad)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of an e4m3fn byte from the format's definition, in f64.
    fn reference(byte: u8) -> f64 {
        let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = i32::from((byte >> 3) & 0xF);
        let m = f64::from(byte & 7);
        if e == 15 && m == 7.0 {
            return f64::NAN;
        }
        if e == 0 { sign * m / 8.0 * 2f64.powi(-6) } else { sign * (1.0 + m / 8.0) * 2f64.powi(e - 7) }
    }

    #[test]
    fn every_byte_decodes_to_its_defined_value() {
        for b in 0..=255u8 {
            let (got, want) = (e4m3_to_f32(b), reference(b));
            if want.is_nan() {
                assert!(got.is_nan(), "{b:#04x}: {got}");
            } else {
                assert_eq!(f64::from(got), want, "{b:#04x}");
                assert_eq!(got.is_sign_negative(), b & 0x80 != 0, "{b:#04x} sign");
            }
        }
        // Landmarks of the format.
        let known = [
            (0x00, 0.0),
            (0x01, 2f32.powi(-9)),
            (0x07, 7.0 * 2f32.powi(-9)),
            (0x08, 2f32.powi(-6)),
            (0x38, 1.0),
            (0x3C, 1.5),
            (0x40, 2.0),
            (0x77, 240.0),
            (0x78, 256.0),
            (0x7E, 448.0),
            (0xB8, -1.0),
            (0xFE, -448.0),
        ];
        for (b, v) in known {
            assert_eq!(e4m3_to_f32(b), v, "{b:#04x}");
        }
        assert!(e4m3_to_f32(0x7F).is_nan() && e4m3_to_f32(0xFF).is_nan());
    }

    /// Nearest finite e4m3 value by exhaustive search, ties to the even code, saturating.
    fn nearest(x: f64) -> u8 {
        let mut best = 0u8;
        for b in 0..=0x7Eu8 {
            let (d, db) = ((reference(b) - x.abs()).abs(), (reference(best) - x.abs()).abs());
            if d < db || (d == db && b & 1 == 0) {
                best = b;
            }
        }
        best | if x < 0.0 { 0x80 } else { 0 }
    }

    #[test]
    fn encoding_rounds_to_nearest_even_and_saturates() {
        let mut xs = vec![0.0f32, 1e-30, 448.0, 460.0, 464.0, 500.0, 1e30, -3.3, 2f32.powi(-10)];
        for b in 0..0x7Eu8 {
            let (lo, hi) = (reference(b), reference(b + 1));
            let mid = (lo + hi) / 2.0;
            xs.extend([lo as f32, mid as f32, (mid * (1.0 + 1e-6)) as f32, (mid * (1.0 - 1e-6)) as f32]);
        }
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..20_000 {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let u = (state >> 11) as f64 / (1u64 << 53) as f64;
            xs.push(((u * 40.0 - 22.0).exp2() * if state & 1 == 0 { 1.0 } else { -1.0 }) as f32);
        }
        for x in xs.iter().flat_map(|&x| [x, -x]) {
            let got = f32_to_e4m3(x);
            let want = nearest(f64::from(x));
            // -0.0 and +0.0 differ in sign only.
            let same = got == want || (got & 0x7F == 0 && want & 0x7F == 0);
            assert!(same, "{x:e}: got {got:#04x} want {want:#04x}");
        }
        for b in (0..=255u8).filter(|b| b & 0x7F != 0x7F) {
            assert_eq!(f32_to_e4m3(e4m3_to_f32(b)), b, "round trip {b:#04x}");
        }
        assert_eq!(f32_to_e4m3(f32::NAN), 0x7F);
    }

    #[test]
    fn per_channel_quantisation_error_is_bounded_and_zero_rows_survive() -> Result<()> {
        let (rows, cols) = (5, 300);
        let mut w: Vec<f32> =
            (0..rows * cols).map(|i| ((i as f32 * 0.7311).sin() * 3.0).powi(3) * 0.01).collect();
        w[2 * cols..3 * cols].fill(0.0);
        w[4 * cols + 7] = 1e-12; // a tiny value in a row with a large maximum
        let q = quantize_per_channel(&w, rows, cols)?;
        assert_eq!(q.scales[2], 1.0);
        let deq = dequantize_per_channel(&q.bytes, &q.scales, cols);
        for r in 0..rows {
            let scale = q.scales[r];
            for c in 0..cols {
                let i = r * cols + c;
                let scaled = w[i] / scale;
                let err = (f64::from(e4m3_to_f32(q.bytes[i])) - f64::from(scaled)).abs();
                // Half a step: 2^-4 relative for normals (3 mantissa bits), 2^-10 absolute below 2^-6.
                let bound = if scaled.abs() >= 2f32.powi(-6) {
                    f64::from(scaled.abs()) * 2f64.powi(-4)
                } else {
                    2f64.powi(-10)
                };
                assert!(err <= bound, "({r}, {c}): |{scaled} − q| = {err} > {bound}");
                assert!(scaled.abs() <= E4M3_MAX * (1.0 + f32::EPSILON));
                assert_eq!(deq[i], e4m3_to_f32(q.bytes[i]) * scale);
            }
        }
        assert!(deq[2 * cols..3 * cols].iter().all(|&v| v == 0.0));
        // Each row's scale is its own largest magnitude over the e4m3 maximum, whichever core
        // quantised it.
        for (r, row) in w.chunks(cols).enumerate().filter(|&(r, _)| r != 2) {
            let max = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert_eq!(q.scales[r], max / E4M3_MAX, "row {r}");
        }
        assert!(quantize_per_channel(&[f32::NAN], 1, 1).is_err());
        // The first non-finite element is the one named.
        let mut bad = vec![0.5f32; 4 * 5];
        bad[2 * 5 + 3] = f32::INFINITY;
        bad[3 * 5 + 1] = f32::NAN;
        let err = quantize_per_channel(&bad, 4, 5).expect_err("an infinite weight").to_string();
        assert!(err.contains("element (2, 3) is inf"), "{err}");
        assert_eq!(quantize_per_channel(&[], 3, 0)?, QuantizedRows { bytes: vec![], scales: vec![] });
        assert!(quantize_per_channel(&[1.0; 3], 2, 2).is_err());
        Ok(())
    }

    #[test]
    fn block_dequantisation_applies_each_blocks_scale() {
        let (rows, cols) = (130, 260);
        let bytes: Vec<u8> = (0..rows * cols).map(|i| (i % 0x7F) as u8).collect();
        let scales: Vec<f32> = (0..2 * 3).map(|i| 1.0 + i as f32).collect();
        let out = dequantize_blocks(&bytes, &scales, rows, cols);
        for (r, c) in [(0, 0), (127, 127), (128, 0), (0, 128), (129, 259), (5, 256)] {
            let s = scales[(r / 128) * 3 + c / 128];
            assert_eq!(out[r * cols + c], e4m3_to_f32(bytes[r * cols + c]) * s, "({r}, {c})");
        }
    }
}

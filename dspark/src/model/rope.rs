//! Rotary tables for given positions.

use burn::tensor::{Device, Tensor, TensorData};

use crate::device::ComputeDtype;

/// Rotary embedding frequencies of one model.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f64>,
    head_dim: usize,
}

impl Rope {
    /// Frequencies `theta^(-2i/head_dim)` for `i < head_dim/2`.
    pub fn new(theta: f64, head_dim: usize) -> Self {
        let inv_freq =
            (0..head_dim / 2).map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64)).collect();
        Self { inv_freq, head_dim }
    }

    /// `cos` and `sin` tables for `positions`, computed in f64 and stored as `dtype`.
    ///
    /// # Shapes
    /// returns two `[positions.len(), head_dim]` tensors (each half repeated).
    pub fn tables(
        &self,
        positions: &[usize],
        dtype: ComputeDtype,
        device: &Device,
    ) -> (Tensor<2>, Tensor<2>) {
        let n = positions.len();
        let mut cos = Vec::with_capacity(n * self.head_dim);
        let mut sin = Vec::with_capacity(n * self.head_dim);
        for &p in positions {
            for _ in 0..2 {
                for f in &self.inv_freq {
                    let angle = p as f64 * f;
                    cos.push(angle.cos() as f32);
                    sin.push(angle.sin() as f32);
                }
            }
        }
        // Rounded to the compute dtype on the host: no f32 copy on the device (which, for the
        // persistent table of every position, would stay reserved after the cast).
        let make = |values: Vec<f32>| {
            let data = TensorData::new(values, [n, self.head_dim]);
            let data = data.clone().try_cast(dtype.dtype()).unwrap_or(data);
            let options = burn::tensor::TensorCreationOptions::new(device.clone()).with_dtype(dtype.dtype());
            Tensor::<2>::from_data(data, options)
        };
        (make(cos), make(sin))
    }

    /// The tables of positions `0..positions`, for forwards that pick their rows on the device
    /// (recorded forwards): row `p` equals row 0 of `tables(&[p])`, bit for bit.
    pub fn full_tables(
        &self,
        positions: usize,
        dtype: ComputeDtype,
        device: &Device,
    ) -> (Tensor<2>, Tensor<2>) {
        let all: Vec<usize> = (0..positions).collect();
        crate::device::persistent(device, (), |()| self.tables(&all, dtype, device))
    }
}

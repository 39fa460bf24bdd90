//! FP8 checkpoints for the FP8 tests: the tiny golden draft with its projections stored in
//! e4m3 (128×128 block or per-channel scales), quantised here independently of the library.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::Path;

use burn::tensor::Tensor;
use safetensors::{Dtype, tensor::TensorView};

use super::{copy_model, golden};
use dspark::model::fp8::{self, DraftQuant};
use dspark::{DSparkDraft, DraftCacheConfig, LoadOptions, Qwen3, Speculator};

/// The value of an e4m3fn byte from the format's definition (independent of the library's
/// bit-level decoder).
pub fn e4m3(byte: u8) -> f32 {
    let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = i32::from((byte >> 3) & 0xF);
    let m = f64::from(byte & 7);
    assert!(!(e == 15 && m == 7.0), "NaN byte");
    let v = if e == 0 { m / 8.0 * 2f64.powi(-6) } else { (1.0 + m / 8.0) * 2f64.powi(e - 7) };
    (sign * v) as f32
}

/// A tensor as (dtype, shape, bytes).
pub type Stored = (Dtype, Vec<usize>, Vec<u8>);

pub fn read_all(path: &Path) -> BTreeMap<String, Stored> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors().into_iter().map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec()))).collect()
}

pub fn write_all(path: &Path, tensors: &BTreeMap<String, Stored>) {
    let views = tensors.iter().map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()));
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

pub fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

pub fn bytes_of(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The draft's projection weights: `fc` and each layer's seven.
pub fn projections(tensors: &BTreeMap<String, Stored>) -> Vec<String> {
    let suffixes = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];
    tensors
        .keys()
        .filter(|n| *n == "fc.weight" || suffixes.iter().any(|s| n.ends_with(&format!("{s}.weight"))))
        .cloned()
        .collect()
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Layout {
    Blocks,
    PerChannel,
}

/// Quantise `[rows, cols]` with the layout's scales (scale = max|group| / 448). Returns the
/// bytes, the scale tensor (shape, values) and the dequantised weight the loader must produce.
pub fn quantise(
    w: &[f32],
    rows: usize,
    cols: usize,
    layout: Layout,
) -> (Vec<u8>, Vec<usize>, Vec<f32>, Vec<f32>) {
    let (br, bc) = match layout {
        Layout::Blocks => (128, 128),
        Layout::PerChannel => (1, cols),
    };
    let (gr, gc) = (rows.div_ceil(br), cols.div_ceil(bc));
    let mut scales = vec![0.0f32; gr * gc];
    for r in 0..rows {
        for c in 0..cols {
            let s = &mut scales[(r / br) * gc + c / bc];
            *s = s.max(w[r * cols + c].abs() / 448.0);
        }
    }
    for s in &mut scales {
        if *s == 0.0 {
            *s = 1.0;
        }
    }
    let scale_of = |r: usize, c: usize| scales[(r / br) * gc + c / bc];
    let mut bytes = Vec::with_capacity(w.len());
    let mut deq = Vec::with_capacity(w.len());
    for r in 0..rows {
        for c in 0..cols {
            let b = fp8::f32_to_e4m3(w[r * cols + c] / scale_of(r, c));
            bytes.push(b);
            deq.push(e4m3(b) * scale_of(r, c));
        }
    }
    let shape = match layout {
        Layout::Blocks => vec![gr, gc],
        Layout::PerChannel => vec![rows, 1],
    };
    (bytes, shape, scales, deq)
}

/// A copy of the tiny golden draft with its projections stored in FP8 (`layout`), and a copy
/// with the dequantised weights stored in f32; plus the dequantised weights by name.
pub fn fp8_checkpoint(layout: Layout) -> (tempfile::TempDir, tempfile::TempDir, BTreeMap<String, Vec<f32>>) {
    let fp8_dir = copy_model("tiny-dspark");
    let ref_dir = copy_model("tiny-dspark");
    let file = fp8_dir.path().join("model.safetensors");
    let mut tensors = read_all(&file);
    let mut reference = tensors.clone();
    let mut expected = BTreeMap::new();
    for name in projections(&tensors) {
        let (dtype, shape, bytes) = tensors[&name].clone();
        assert_eq!(dtype, Dtype::F32);
        let (bytes, scale_shape, scales, deq) = quantise(&f32s(&bytes), shape[0], shape[1], layout);
        tensors.insert(name.clone(), (Dtype::F8_E4M3, shape.clone(), bytes));
        let scale_name = match layout {
            Layout::Blocks => format!("{name}_scale_inv"),
            Layout::PerChannel => format!("{name}_scale"),
        };
        tensors.insert(scale_name, (Dtype::F32, scale_shape, bytes_of(&scales)));
        reference.insert(name.clone(), (Dtype::F32, shape, bytes_of(&deq)));
        expected.insert(name, deq);
    }
    assert_eq!(expected.len(), 15);
    write_all(&file, &tensors);
    write_all(&ref_dir.path().join("model.safetensors"), &reference);
    (fp8_dir, ref_dir, expected)
}

pub fn target() -> Qwen3 {
    Qwen3::load(&golden().join("tiny-qwen3"), LoadOptions::default()).unwrap()
}

pub fn load(dir: &Path, target: &Qwen3) -> dspark::Result<DSparkDraft> {
    DSparkDraft::load(dir, target, LoadOptions::default(), &DraftCacheConfig::default())
}

pub fn quantised(dir: &Path, target: &Qwen3) -> DSparkDraft {
    DSparkDraft::load_quantized(
        dir,
        target,
        LoadOptions::default(),
        &DraftCacheConfig::default(),
        DraftQuant::Fp8PerChannel,
    )
    .unwrap()
}

/// The draft's block forward (hidden and base logits, f32) on fixed features.
pub fn block_outputs(draft: &mut DSparkDraft, target: &Qwen3) -> (Vec<f32>, Vec<f32>) {
    let seq = draft.begin();
    let width = draft.layer_ids().len() * 64;
    let values: Vec<f32> = (0..7 * width).map(|i| (i as f32 * 0.37).sin()).collect();
    let features = Tensor::<2>::from_data(burn::tensor::TensorData::new(values, [7, width]), target.device());
    draft.extend_context(seq, features).unwrap();
    let (h, l) = draft.block_forward(&[(seq, 11)]).unwrap();
    draft.end(seq).unwrap();
    (h.into_data().try_to_vec::<f32>().unwrap(), l.into_data().try_to_vec::<f32>().unwrap())
}

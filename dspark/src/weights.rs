//! Reading Hugging Face safetensors checkpoints (single file or sharded) into burn tensors.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use burn::tensor::{Device, Tensor, TensorData};
use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;

use crate::config::read_json;
use crate::device::ComputeDtype;
use crate::error::{Error, Result};

/// Progress of a long load: `(bytes done, bytes in all)`.
pub type ProgressFn<'a> = &'a (dyn Fn(u64, u64) + Sync);

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: BTreeMap<String, String>,
}

/// One memory-mapped safetensors file with its parsed header.
struct Shard {
    path: PathBuf,
    map: Mmap,
    /// name -> (dtype, shape, byte range within `map`)
    tensors: HashMap<String, (Dtype, Vec<usize>, std::ops::Range<usize>)>,
}

impl Shard {
    fn open(path: PathBuf) -> Result<Self> {
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        // SAFETY: the file is opened read-only and only read through this map; a checkpoint
        // that is modified while it is loaded is outside the supported use.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
        let parsed = SafeTensors::deserialize(&map)
            .map_err(|e| Error::Safetensors { path: path.clone(), message: e.to_string() })?;
        let base = map.as_ptr() as usize;
        let mut tensors = HashMap::new();
        for (name, view) in parsed.tensors() {
            let data = view.data();
            let start = data.as_ptr() as usize - base;
            tensors.insert(name, (view.dtype(), view.shape().to_vec(), start..start + data.len()));
        }
        drop(parsed);
        Ok(Self { path, map, tensors })
    }
}

/// A checkpoint folder: `model.safetensors`, or shards listed in `model.safetensors.index.json`.
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    /// tensor name -> shard index
    index: HashMap<String, usize>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("shards", &self.shards.len())
            .field("tensors", &self.index.len())
            .finish()
    }
}

impl Checkpoint {
    /// Open every weights file of `dir` and parse the headers (no tensor data is read yet).
    ///
    /// # Errors
    /// [`Error::Io`] for a missing file, [`Error::Json`] for a bad index,
    /// [`Error::Safetensors`] for a truncated or corrupt file.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let mut shards = Vec::new();
        let mut index = HashMap::new();
        if index_path.exists() {
            let shard_index: ShardIndex = read_json(&index_path)?;
            let mut file_ids: BTreeMap<String, usize> = BTreeMap::new();
            for file in shard_index.weight_map.values() {
                if !file_ids.contains_key(file) {
                    file_ids.insert(file.clone(), shards.len());
                    shards.push(Shard::open(dir.join(file))?);
                }
            }
            for (name, file) in &shard_index.weight_map {
                let id = file_ids[file];
                if !shards[id].tensors.contains_key(name) {
                    return Err(Error::Safetensors {
                        path: shards[id].path.clone(),
                        message: format!(
                            "tensor {name} is listed in {} but absent from the file",
                            index_path.display()
                        ),
                    });
                }
                index.insert(name.clone(), id);
            }
        } else {
            let shard = Shard::open(dir.join("model.safetensors"))?;
            for name in shard.tensors.keys() {
                index.insert(name.clone(), 0);
            }
            shards.push(shard);
        }
        Ok(Self { dir: dir.to_path_buf(), shards, index })
    }

    /// Whether the checkpoint holds `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Shape of tensor `name`, when present.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.index.get(name).and_then(|&i| self.shards[i].tensors.get(name)).map(|(_, s, _)| s.clone())
    }

    /// Stored element type of tensor `name`, when present.
    pub fn dtype(&self, name: &str) -> Option<Dtype> {
        self.index.get(name).and_then(|&i| self.shards[i].tensors.get(name)).map(|(d, _, _)| *d)
    }

    /// The checkpoint folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Tensor `name` as stored: dtype, shape, little-endian bytes and the file holding it.
    ///
    /// # Errors
    /// [`Error::MissingTensor`] when absent.
    pub(crate) fn raw(&self, name: &str) -> Result<RawTensor<'_>> {
        let shard = self
            .index
            .get(name)
            .map(|&i| &self.shards[i])
            .ok_or_else(|| Error::MissingTensor { dir: self.dir.clone(), tensor: name.to_owned() })?;
        let (dtype, shape, range) = &shard.tensors[name];
        Ok(RawTensor { dtype: *dtype, shape, bytes: &shard.map[range.clone()], path: &shard.path })
    }

    /// Total bytes of tensor data in the checkpoint.
    pub fn total_bytes(&self) -> u64 {
        self.shards.iter().flat_map(|s| s.tensors.values()).map(|(_, _, r)| r.len() as u64).sum()
    }

    /// A callback to run after each tensor is loaded: adds its bytes and reports
    /// `(bytes loaded, bytes in all)` to `progress`.
    pub fn reporter<'a>(&'a self, progress: Option<ProgressFn<'a>>) -> impl Fn(&str) + 'a {
        let total = self.total_bytes();
        let done = std::cell::Cell::new(0u64);
        move |name: &str| {
            done.set(done.get() + self.tensor_bytes(name));
            if let Some(progress) = progress {
                progress(done.get(), total);
            }
        }
    }

    /// Bytes of one tensor's data (0 when absent).
    pub fn tensor_bytes(&self, name: &str) -> u64 {
        self.index
            .get(name)
            .and_then(|&i| self.shards[i].tensors.get(name))
            .map_or(0, |(_, _, r)| r.len() as u64)
    }

    /// Read tensor `name`, check it has `shape`, convert it to `dtype` and place it on `device`.
    ///
    /// # Errors
    /// [`Error::MissingTensor`], [`Error::TensorShape`] or [`Error::TensorDtype`], naming the
    /// tensor and its file.
    pub fn load<const D: usize>(
        &self,
        name: &str,
        shape: [usize; D],
        dtype: ComputeDtype,
        device: &Device,
    ) -> Result<Tensor<D>> {
        let data = self.read(name, &shape, dtype)?;
        // The dtype must be explicit: without it burn converts to the device's default float.
        let options = burn::tensor::TensorCreationOptions::new(device.clone()).with_dtype(dtype.dtype());
        Ok(crate::device::persistent(device, data, |data| Tensor::from_data(data, options.clone())))
    }

    /// Read tensor `name` into host memory as `dtype`, checking its shape.
    ///
    /// # Errors
    /// As [`Checkpoint::load`].
    pub fn read(&self, name: &str, shape: &[usize], dtype: ComputeDtype) -> Result<TensorData> {
        let shard = self
            .index
            .get(name)
            .map(|&i| &self.shards[i])
            .ok_or_else(|| Error::MissingTensor { dir: self.dir.clone(), tensor: name.to_owned() })?;
        let (src, actual, range) = &shard.tensors[name];
        if actual.as_slice() != shape {
            return Err(Error::TensorShape {
                path: shard.path.clone(),
                tensor: name.to_owned(),
                expected: shape.to_vec(),
                actual: actual.clone(),
            });
        }
        let bytes = &shard.map[range.clone()];
        let values = convert(bytes, *src, dtype).ok_or_else(|| Error::TensorDtype {
            path: shard.path.clone(),
            tensor: name.to_owned(),
            dtype: format!("{src:?}"),
        })?;
        Ok(TensorData::from_bytes_vec(values, shape.to_vec(), dtype.dtype()))
    }
}

/// One tensor as stored in a checkpoint (see [`Checkpoint::raw`]).
pub(crate) struct RawTensor<'a> {
    /// Stored element type.
    pub dtype: Dtype,
    /// Stored shape.
    pub shape: &'a [usize],
    /// Little-endian element bytes.
    pub bytes: &'a [u8],
    /// The file holding the tensor.
    pub path: &'a Path,
}

/// A tensor on `device` in `dtype` from host f32 values in row-major `shape`.
pub(crate) fn host_f32_tensor<const D: usize>(
    values: &[f32],
    shape: [usize; D],
    dtype: ComputeDtype,
    device: &Device,
) -> Tensor<D> {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    // f32 is always convertible to a compute dtype.
    let bytes = convert(&bytes, Dtype::F32, dtype).unwrap_or_default();
    let data = TensorData::from_bytes_vec(bytes, shape.to_vec(), dtype.dtype());
    let options = burn::tensor::TensorCreationOptions::new(device.clone()).with_dtype(dtype.dtype());
    crate::device::persistent(device, data, |data| Tensor::from_data(data, options.clone()))
}

/// Convert little-endian `bytes` of `src` to the little-endian bytes of `dst`.
/// `None` when `src` is not a float type dspark reads.
fn convert(bytes: &[u8], src: Dtype, dst: ComputeDtype) -> Option<Vec<u8>> {
    let same = matches!(
        (src, dst),
        (Dtype::F32, ComputeDtype::F32) | (Dtype::BF16, ComputeDtype::Bf16) | (Dtype::F16, ComputeDtype::F16)
    );
    if same {
        return Some(bytes.to_vec());
    }
    let to_f32: fn(&[u8]) -> f32 = match src {
        Dtype::F32 => |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        Dtype::BF16 => |b| bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        Dtype::F16 => |b| f16::from_le_bytes([b[0], b[1]]).to_f32(),
        _ => return None,
    };
    let width = match src {
        Dtype::F32 => 4,
        _ => 2,
    };
    let values = bytes.chunks_exact(width).map(to_f32);
    Some(match dst {
        ComputeDtype::F32 => values.flat_map(f32::to_le_bytes).collect(),
        ComputeDtype::Bf16 => values.flat_map(|v| bf16::from_f32(v).to_le_bytes()).collect(),
        ComputeDtype::F16 => values.flat_map(|v| f16::from_f32(v).to_le_bytes()).collect(),
    })
}

/// A `[rows, cols]` tensor on `device` in `dst`, from a caller's host buffer of little-endian
/// `src` values (e.g. a serving engine's own copy of a weight).
///
/// # Errors
/// [`Error::InvalidInput`] naming `what` when the buffer does not hold `rows · cols` values.
pub fn host_matrix(
    what: &str,
    bytes: &[u8],
    src: ComputeDtype,
    [rows, cols]: [usize; 2],
    dst: ComputeDtype,
    device: &Device,
) -> Result<Tensor<2>> {
    let want = rows.checked_mul(cols).and_then(|n| n.checked_mul(src.size()));
    if want != Some(bytes.len()) {
        return Err(Error::InvalidInput(format!(
            "{what}: {} bytes do not hold a [{rows}, {cols}] {src} matrix",
            bytes.len()
        )));
    }
    let st = match src {
        ComputeDtype::F32 => Dtype::F32,
        ComputeDtype::Bf16 => Dtype::BF16,
        ComputeDtype::F16 => Dtype::F16,
    };
    let values =
        convert(bytes, st, dst).ok_or_else(|| Error::InvalidInput(format!("{what}: dtype {src}")))?;
    let data = TensorData::from_bytes_vec(values, vec![rows, cols], dst.dtype());
    let options = burn::tensor::TensorCreationOptions::new(device.clone()).with_dtype(dst.dtype());
    Ok(crate::device::persistent(device, data, |data| Tensor::from_data(data, options.clone())))
}

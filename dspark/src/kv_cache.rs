//! Paged key/value storage shared by many sequences, with a byte budget fixed at construction.
//!
//! The pool holds `num_pages` pages of `page_size` rows for every layer, K and V. A sequence owns
//! a list of pages (its page table); its row `pos` lives at physical row
//! `pages[pos / page_size] * page_size + pos % page_size`. Growing a sequence takes pages from
//! the free list (all or nothing); truncating it forgets rows and returns whole pages. Nothing is
//! ever compacted or copied when rows are rejected.

use std::collections::HashMap;
use std::ops::Range;

use burn::tensor::{Device, Int, Tensor, TensorData};

use crate::device::ComputeDtype;
use crate::error::{Error, Result};

/// Identifies one sequence in a cache.
pub type SeqId = u64;

/// The shape of one cache: what a row of K (or V) holds in every layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// Layers with their own K/V.
    pub layers: usize,
    /// Key/value heads per layer.
    pub kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// Element type of the stored rows.
    pub dtype: ComputeDtype,
    /// Rows per page.
    pub page_size: usize,
}

impl KvLayout {
    /// Bytes of one token row across all layers, K and V.
    pub fn row_bytes(&self) -> usize {
        2 * self.layers * self.kv_heads * self.head_dim * self.dtype.size()
    }

    /// Bytes of one page across all layers, K and V.
    pub fn page_bytes(&self) -> usize {
        self.row_bytes() * self.page_size
    }
}

/// Occupancy of a page pool, for admission control.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolState {
    /// Rows per page.
    pub page_size: usize,
    /// Pages not held by any sequence.
    pub free_pages: usize,
    /// Pages in the pool.
    pub total_pages: usize,
    /// Bytes per page (all layers, K and V).
    pub page_bytes: usize,
    /// The byte budget fixed at construction.
    pub budget_bytes: usize,
}

impl PoolState {
    /// Pages that `rows` rows occupy.
    pub fn pages_for(&self, rows: usize) -> usize {
        rows.div_ceil(self.page_size)
    }
}

/// Key/value storage for many sequences.
///
/// The model drives it in three steps per forward: [`KvCache::reserve`] the new rows of every
/// sequence in the batch (all or nothing, before any compute), then per layer
/// [`KvCache::write`] the new rows and [`KvCache::read`] the whole context.
pub trait KvCache {
    /// The cache's geometry.
    fn layout(&self) -> KvLayout;

    /// Start an empty sequence.
    fn allocate(&mut self) -> SeqId;

    /// Drop a sequence and return its pages.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`].
    fn free(&mut self, seq: SeqId) -> Result<()>;

    /// Committed rows of `seq`.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`].
    fn len(&self, seq: SeqId) -> Result<usize>;

    /// Grow each listed sequence by its row count, taking pages as needed. All or nothing: on
    /// error no sequence changes. Returns the new rows' positions per sequence.
    ///
    /// # Errors
    /// [`Error::KvCacheFull`] when the pool lacks pages, [`Error::UnknownSequence`].
    fn reserve(&mut self, grow: &[(SeqId, usize)]) -> Result<Vec<Range<usize>>>;

    /// Shorten `seq` to `len` rows, forgetting the rest and returning whole unused pages.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`], or [`Error::InvalidInput`] when `len` exceeds the length.
    fn truncate(&mut self, seq: SeqId, len: usize) -> Result<()>;

    /// Store rows `start..start + k.dims()[0]` of `seq` for `layer`.
    ///
    /// # Shapes
    /// `k`, `v`: `[rows, kv_heads, head_dim]`.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when the rows were not reserved.
    fn write(&mut self, layer: usize, seq: SeqId, start: usize, k: Tensor<3>, v: Tensor<3>) -> Result<()>;

    /// Store the rows of a whole batch at once, at the physical rows `rows` (taken from
    /// [`KvCache::physical_rows`] of reserved positions, one per row of `k`): one operation per
    /// tensor whatever the number of sequences.
    ///
    /// # Shapes
    /// `rows`: `[n]`, `k`, `v`: `[n, kv_heads, head_dim]`.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a layer out of range or a row count that differs from `k`'s.
    fn write_rows(&mut self, layer: usize, rows: &Tensor<1, Int>, k: Tensor<3>, v: Tensor<3>) -> Result<()>;

    /// Physical row indices of positions `0..len` of `seq`, to pass to [`KvCache::read`] for
    /// every layer of one forward.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`], [`Error::InvalidInput`] when `len` exceeds the length.
    fn gather_index(&self, seq: SeqId, len: usize) -> Result<Tensor<1, Int>>;

    /// The same physical rows as [`KvCache::gather_index`], on the host.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`], [`Error::InvalidInput`] when `len` exceeds the length.
    fn physical_rows(&self, seq: SeqId, len: usize) -> Result<Vec<i64>>;

    /// The whole K and V pools of `layer`, for kernels that read rows through page tables
    /// ([`KvCache::physical_rows`]); `None` when this cache keeps no such pool.
    ///
    /// # Shapes
    /// `([pool_rows, kv_heads, head_dim], [pool_rows, kv_heads, head_dim])`.
    fn pools(&self, layer: usize) -> Option<(Tensor<3>, Tensor<3>)> {
        let _ = layer;
        None
    }

    /// The K and V pools of `layer` to update in place (kernels that store rows themselves,
    /// e.g. [`dspark_kernels::qkv_norm_rope_store`]); `None` when this cache keeps no such pool.
    fn pools_mut(&mut self, layer: usize) -> Option<(&mut Tensor<3>, &mut Tensor<3>)> {
        let _ = layer;
        None
    }

    /// K and V of the rows named by `index` for `layer`.
    ///
    /// # Shapes
    /// returns `([rows, kv_heads, head_dim], [rows, kv_heads, head_dim])`.
    fn read(&self, layer: usize, index: &Tensor<1, Int>) -> (Tensor<3>, Tensor<3>);

    /// Bytes held by sequences' pages now.
    fn bytes_used(&self) -> usize;

    /// Bytes the rows of live sequences occupy (without page rounding).
    fn bytes_in_rows(&self) -> usize;

    /// The budget fixed at construction.
    fn budget_bytes(&self) -> usize;

    /// Pages not held by any sequence.
    fn free_pages(&self) -> usize;

    /// An identity for device graphs recorded against this cache's pools, unique in the process
    /// and fixed for the cache's life (its pools never move); `None` when forwards through this
    /// cache are not recorded.
    fn graph_id(&self) -> Option<u64> {
        None
    }

    /// A physical row no sequence owns, where padding rows of a recorded forward write their
    /// K/V (nothing reads them); `None` when this cache has none to give.
    fn scratch_row(&mut self) -> Option<usize> {
        None
    }
}

#[derive(Debug, Default)]
struct SeqState {
    len: usize,
    pages: Vec<usize>,
}

/// A [`KvCache`] whose pool is allocated once on the device.
#[derive(Debug)]
pub struct PagedKvCache {
    layout: KvLayout,
    budget_bytes: usize,
    num_pages: usize,
    device: Device,
    /// Per layer: `[(num_pages + 1) * page_size, kv_heads, head_dim]` (the last page is scratch).
    k: Vec<Tensor<3>>,
    v: Vec<Tensor<3>>,
    free: Vec<usize>,
    seqs: HashMap<SeqId, SeqState>,
    next_id: SeqId,
    /// See [`KvCache::graph_id`].
    graph_id: u64,
}

/// Source of [`PagedKvCache`] graph identities.
static NEXT_CACHE_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl PagedKvCache {
    /// A pool of `floor(budget_bytes / page_bytes)` pages on `device`, and one scratch page
    /// past them that no sequence ever holds: padding rows of recorded forwards write their K/V
    /// there ([`KvCache::scratch_row`]). It is outside the budget's page count (one page more
    /// device memory).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when the budget holds no page or the layout has a zero extent.
    pub fn new(layout: KvLayout, budget_bytes: usize, device: &Device) -> Result<Self> {
        if layout.layers == 0 || layout.kv_heads == 0 || layout.head_dim == 0 || layout.page_size == 0 {
            return Err(Error::InvalidInput(format!("KV layout has a zero extent: {layout:?}")));
        }
        let num_pages = budget_bytes / layout.page_bytes();
        if num_pages == 0 {
            return Err(Error::InvalidInput(format!(
                "KV budget of {budget_bytes} bytes holds no page of {} bytes",
                layout.page_bytes()
            )));
        }
        let rows = (num_pages + 1) * layout.page_size;
        let make = || {
            (0..layout.layers)
                .map(|_| {
                    crate::device::persistent(device, (), |()| {
                        Tensor::zeros(
                            [rows, layout.kv_heads, layout.head_dim],
                            burn::tensor::TensorCreationOptions::new(device.clone())
                                .with_dtype(layout.dtype.dtype()),
                        )
                    })
                })
                .collect::<Vec<_>>()
        };
        Ok(Self {
            layout,
            budget_bytes,
            num_pages,
            device: device.clone(),
            k: make(),
            v: make(),
            // Pop from the back: hand out low pages first.
            free: (0..num_pages).rev().collect(),
            seqs: HashMap::new(),
            next_id: 0,
            graph_id: NEXT_CACHE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        })
    }

    /// Occupancy of the pool now.
    pub fn pool_state(&self) -> PoolState {
        PoolState {
            page_size: self.layout.page_size,
            free_pages: self.free.len(),
            total_pages: self.num_pages,
            page_bytes: self.layout.page_bytes(),
            budget_bytes: self.budget_bytes,
        }
    }

    /// Pages in the pool.
    pub fn total_pages(&self) -> usize {
        self.num_pages
    }

    /// Live sequences.
    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    fn seq(&self, seq: SeqId) -> Result<&SeqState> {
        self.seqs.get(&seq).ok_or(Error::UnknownSequence(seq))
    }

    fn pages_for(&self, rows: usize) -> usize {
        rows.div_ceil(self.layout.page_size)
    }
}

impl KvCache for PagedKvCache {
    fn layout(&self) -> KvLayout {
        self.layout
    }

    fn allocate(&mut self) -> SeqId {
        let id = self.next_id;
        self.next_id += 1;
        self.seqs.insert(id, SeqState::default());
        id
    }

    fn free(&mut self, seq: SeqId) -> Result<()> {
        let state = self.seqs.remove(&seq).ok_or(Error::UnknownSequence(seq))?;
        self.free.extend(state.pages.into_iter().rev());
        Ok(())
    }

    fn len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seq(seq)?.len)
    }

    fn reserve(&mut self, grow: &[(SeqId, usize)]) -> Result<Vec<Range<usize>>> {
        // First pass: check everything, change nothing.
        let mut needed = 0;
        let mut seen = std::collections::HashSet::new();
        for &(seq, rows) in grow {
            if !seen.insert(seq) {
                return Err(Error::InvalidInput(format!("sequence {seq} listed twice in one reserve")));
            }
            let state = self.seq(seq)?;
            needed += self.pages_for(state.len + rows).saturating_sub(state.pages.len());
        }
        if needed > self.free.len() {
            return Err(Error::KvCacheFull {
                needed_pages: needed - self.free.len(),
                free_pages: self.free.len(),
                total_pages: self.num_pages,
                page_bytes: self.layout.page_bytes(),
                budget_bytes: self.budget_bytes,
            });
        }
        let mut ranges = Vec::with_capacity(grow.len());
        for &(seq, rows) in grow {
            let want = self.pages_for(self.seq(seq)?.len + rows);
            let state = self.seqs.get_mut(&seq).ok_or(Error::UnknownSequence(seq))?;
            while state.pages.len() < want {
                // Checked above: enough pages are free.
                let Some(page) = self.free.pop() else {
                    return Err(Error::Backend("KV free list ran dry after the check".into()));
                };
                state.pages.push(page);
            }
            ranges.push(state.len..state.len + rows);
            state.len += rows;
        }
        Ok(ranges)
    }

    fn truncate(&mut self, seq: SeqId, len: usize) -> Result<()> {
        let page_size = self.layout.page_size;
        let state = self.seqs.get_mut(&seq).ok_or(Error::UnknownSequence(seq))?;
        if len > state.len {
            return Err(Error::InvalidInput(format!(
                "cannot truncate sequence {seq} of length {} to {len}",
                state.len
            )));
        }
        state.len = len;
        let keep = len.div_ceil(page_size);
        let released: Vec<usize> = state.pages.drain(keep..).collect();
        self.free.extend(released.into_iter().rev());
        Ok(())
    }

    fn write(&mut self, layer: usize, seq: SeqId, start: usize, k: Tensor<3>, v: Tensor<3>) -> Result<()> {
        let rows = k.dims()[0];
        let page_size = self.layout.page_size;
        let state = self.seq(seq)?;
        if start + rows > state.len || layer >= self.layout.layers {
            return Err(Error::InvalidInput(format!(
                "write of rows {start}..{} to layer {layer} of sequence {seq} (length {})",
                start + rows,
                state.len
            )));
        }
        // Split the rows into runs that stay inside one page, and store each run.
        let mut runs = Vec::new();
        let mut pos = start;
        while pos < start + rows {
            let page = state.pages[pos / page_size];
            let offset = pos % page_size;
            let n = (page_size - offset).min(start + rows - pos);
            runs.push((pos - start, page * page_size + offset, n));
            pos += n;
        }
        for (src, dst, n) in runs {
            let (k_run, v_run) = if n == rows {
                (k.clone(), v.clone())
            } else {
                (k.clone().narrow(0, src, n), v.clone().narrow(0, src, n))
            };
            self.k[layer].inplace(|t| t.slice_assign(dst..dst + n, k_run));
            self.v[layer].inplace(|t| t.slice_assign(dst..dst + n, v_run));
        }
        Ok(())
    }

    fn write_rows(&mut self, layer: usize, rows: &Tensor<1, Int>, k: Tensor<3>, v: Tensor<3>) -> Result<()> {
        let n = rows.dims()[0];
        if layer >= self.layout.layers || k.dims()[0] != n || v.dims()[0] != n {
            return Err(Error::InvalidInput(format!(
                "write of {n} rows (k {:?}, v {:?}) to layer {layer} of {}",
                k.dims(),
                v.dims(),
                self.layout.layers
            )));
        }
        let assign = burn::tensor::IndexingUpdateOp::Assign;
        self.k[layer].inplace(|t| t.select_assign(0, rows.clone(), k, assign));
        self.v[layer].inplace(|t| t.select_assign(0, rows.clone(), v, assign));
        Ok(())
    }

    fn gather_index(&self, seq: SeqId, len: usize) -> Result<Tensor<1, Int>> {
        let rows = self.physical_rows(seq, len)?;
        Ok(Tensor::from_data(TensorData::new(rows, [len]), &self.device))
    }

    fn physical_rows(&self, seq: SeqId, len: usize) -> Result<Vec<i64>> {
        let state = self.seq(seq)?;
        if len > state.len {
            return Err(Error::InvalidInput(format!(
                "read of {len} rows from sequence {seq} of length {}",
                state.len
            )));
        }
        let page_size = self.layout.page_size;
        Ok((0..len).map(|p| (state.pages[p / page_size] * page_size + p % page_size) as i64).collect())
    }

    fn pools(&self, layer: usize) -> Option<(Tensor<3>, Tensor<3>)> {
        Some((self.k.get(layer)?.clone(), self.v.get(layer)?.clone()))
    }

    fn pools_mut(&mut self, layer: usize) -> Option<(&mut Tensor<3>, &mut Tensor<3>)> {
        Some((self.k.get_mut(layer)?, self.v.get_mut(layer)?))
    }

    fn read(&self, layer: usize, index: &Tensor<1, Int>) -> (Tensor<3>, Tensor<3>) {
        (self.k[layer].clone().select(0, index.clone()), self.v[layer].clone().select(0, index.clone()))
    }

    fn bytes_used(&self) -> usize {
        (self.num_pages - self.free.len()) * self.layout.page_bytes()
    }

    fn bytes_in_rows(&self) -> usize {
        self.seqs.values().map(|s| s.len).sum::<usize>() * self.layout.row_bytes()
    }

    fn budget_bytes(&self) -> usize {
        self.budget_bytes
    }

    fn free_pages(&self) -> usize {
        self.free.len()
    }

    fn graph_id(&self) -> Option<u64> {
        Some(self.graph_id)
    }

    /// The first row of the page past the pool's last (see [`PagedKvCache::new`]).
    fn scratch_row(&mut self) -> Option<usize> {
        Some(self.num_pages * self.layout.page_size)
    }
}

#[cfg(all(test, feature = "cpu"))]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn layout() -> KvLayout {
        KvLayout { layers: 2, kv_heads: 1, head_dim: 2, dtype: ComputeDtype::F32, page_size: 4 }
    }

    fn rows(values: &[f32]) -> Tensor<3> {
        Tensor::from_data(TensorData::new(values.to_vec(), [values.len() / 2, 1, 2]), &Device::flex())
    }

    #[test]
    fn accounting_is_exact_and_pages_come_back() {
        let l = layout();
        assert_eq!(l.row_bytes(), 2 * 2 * 2 * 4);
        let mut cache = PagedKvCache::new(l, 3 * l.page_bytes() + 1, &Device::flex()).unwrap();
        assert_eq!((cache.total_pages(), cache.free_pages()), (3, 3));
        let a = cache.allocate();
        let b = cache.allocate();
        assert_eq!(cache.reserve(&[(a, 5), (b, 1)]).unwrap(), vec![0..5, 0..1]);
        assert_eq!(cache.bytes_used(), 3 * l.page_bytes());
        assert_eq!(cache.bytes_in_rows(), 6 * l.row_bytes());
        // Full: 3 more rows for b fit its page; a 9th row for a and a 5th for b need a page each.
        cache.reserve(&[(b, 3)]).unwrap();
        let err = cache.reserve(&[(a, 4), (b, 1)]).unwrap_err();
        assert!(matches!(err, Error::KvCacheFull { needed_pages: 2, free_pages: 0, total_pages: 3, .. }));
        assert_eq!((cache.len(a).unwrap(), cache.len(b).unwrap()), (5, 4), "nothing changed");
        cache.truncate(a, 4).unwrap();
        assert_eq!(cache.free_pages(), 1);
        assert!(cache.truncate(a, 5).is_err());
        cache.free(b).unwrap();
        assert_eq!(cache.free_pages(), 2);
        assert!(matches!(cache.free(b), Err(Error::UnknownSequence(_))));
        assert!(cache.reserve(&[(a, 1), (a, 1)]).is_err());
    }

    #[test]
    fn a_batch_written_at_once_reads_back_as_written_row_by_row() {
        let l = layout();
        let mut by_seq = PagedKvCache::new(l, 8 * l.page_bytes(), &Device::flex()).unwrap();
        let mut at_once = PagedKvCache::new(l, 8 * l.page_bytes(), &Device::flex()).unwrap();
        let values: Vec<f32> = (0..14).map(|i| i as f32).collect();
        let (k, v) = (rows(&values), rows(&values).mul_scalar(-1.0));
        // Two sequences, 3 then 4 new rows, the second spilling into a second page.
        let mut batch_rows = Vec::new();
        for cache in [&mut by_seq, &mut at_once] {
            let (a, b) = (cache.allocate(), cache.allocate());
            cache.reserve(&[(a, 2), (b, 1)]).unwrap();
            cache.reserve(&[(a, 3), (b, 4)]).unwrap();
            batch_rows = [(a, 2..5), (b, 1..5)]
                .into_iter()
                .flat_map(|(s, r)| cache.physical_rows(s, r.end).unwrap()[r].to_vec())
                .collect();
        }
        let (a, b) = (0, 1);
        by_seq.write(1, a, 2, k.clone().narrow(0, 0, 3), v.clone().narrow(0, 0, 3)).unwrap();
        by_seq.write(1, b, 1, k.clone().narrow(0, 3, 4), v.clone().narrow(0, 3, 4)).unwrap();
        let n = batch_rows.len();
        let idx = Tensor::<1, Int>::from_data(TensorData::new(batch_rows, [n]), &Device::flex());
        at_once.write_rows(1, &idx, k.clone().narrow(0, 0, 7), v.clone().narrow(0, 0, 7)).unwrap();
        for seq in [a, b] {
            let index = by_seq.gather_index(seq, 5).unwrap();
            let (k1, v1) = by_seq.read(1, &index);
            let (k2, v2) = at_once.read(1, &at_once.gather_index(seq, 5).unwrap());
            k1.into_data().assert_eq(&k2.into_data(), true);
            v1.into_data().assert_eq(&v2.into_data(), true);
        }
        assert!(at_once.write_rows(2, &idx, k.clone().narrow(0, 0, 7), v.clone().narrow(0, 0, 7)).is_err());
        assert!(at_once.write_rows(1, &idx, k.clone().narrow(0, 0, 6), v.narrow(0, 0, 6)).is_err());
    }

    #[test]
    fn rows_written_across_pages_read_back_in_order() {
        let l = layout();
        let mut cache = PagedKvCache::new(l, 4 * l.page_bytes(), &Device::flex()).unwrap();
        let a = cache.allocate();
        let b = cache.allocate();
        // Interleave so a's pages are not contiguous.
        cache.reserve(&[(a, 3)]).unwrap();
        cache.reserve(&[(b, 4)]).unwrap();
        cache.reserve(&[(a, 4)]).unwrap();
        let k: Vec<f32> = (0..14).map(|v| v as f32).collect();
        let v: Vec<f32> = (0..14).map(|v| -(v as f32)).collect();
        cache.write(1, a, 0, rows(&k[..6]), rows(&v[..6])).unwrap();
        cache.write(1, a, 3, rows(&k[6..]), rows(&v[6..])).unwrap();
        let index = cache.gather_index(a, 7).unwrap();
        let (rk, rv) = cache.read(1, &index);
        assert_eq!(rk.into_data().try_to_vec::<f32>().unwrap(), k);
        assert_eq!(rv.into_data().try_to_vec::<f32>().unwrap(), v);
        assert!(cache.write(1, a, 6, rows(&k[..4]), rows(&v[..4])).is_err(), "rows past the length");
    }
}

//! Recorded forwards: the device inputs a captured forward reads, and the graphs of one model
//! per launch shape (see [`dspark_kernels::graph`]).
//!
//! A model that records its forwards keeps two input buffers on the device, written in place
//! before every replay: `ints` (burn's index dtype: token ids, positions, K/V rows, picked
//! rows) and `tables` (i32: `[first, len]` per query row, the attention's zeroed counters, then
//! the page table of every row's keys).
//! Their lengths are fixed when the first graph is recorded (the page table holds every row of
//! the cache's pool, which bounds the keys of any batch), so every graph of the model reads the
//! same buffers, each through views of the lengths its shape needs.
//!
//! Graphs are kept per shape and bound to one cache (its pools are what they write): a forward
//! through another cache drops them all and records anew. A shape is recorded the second time
//! it is seen, and a model keeps at most [`MAX_GRAPHS`]; other shapes run op by op. A shape whose
//! recording fails is tried again on later calls, up to three times in all, then runs op by op
//! for good; each failure is logged.

use std::collections::HashMap;

use burn::tensor::{DType, Device, Int, Tensor, TensorCreationOptions};
use dspark_kernels::{DeviceGraph, GraphError, InputBuffer};

use super::layer::AttnPlan;

/// The largest number of rows a recorded forward has: verify windows and draft rounds of up to
/// 16 lanes at γ = 7 (128 and 112 rows). Wider ones run op by op.
pub(crate) const MAX_GRAPH_ROWS: usize = 128;

/// i32 counters in `tables` after the per-row `[first, len]` pairs, zeroed by every write of the
/// tables (the kernels leave them zero too): the attention's, enough for 64 rows of a launch
/// over 16 K/V heads (see [`dspark_kernels::attention_sync_words`]; models with more K/V heads
/// merge their splits apart), then [`TAIL_SYNC`] for the layer tails. Multiples of
/// [`dspark_kernels::INT_VIEW_ALIGN`], so each view, and the keys after them, start aligned.
const SYNC_CAP: usize = 1024;
/// The layer tails' counters ([`dspark_kernels::LAYER_TAIL_SYNC_WORDS`], aligned).
const TAIL_SYNC: usize = dspark_kernels::INT_VIEW_ALIGN;

/// Where the page table of the keys starts in `tables`.
const KEYS_AT: usize = 2 * MAX_GRAPH_ROWS + SYNC_CAP + TAIL_SYNC;
const _: () = assert!(
    SYNC_CAP.is_multiple_of(dspark_kernels::INT_VIEW_ALIGN)
        && KEYS_AT.is_multiple_of(dspark_kernels::INT_VIEW_ALIGN)
        && TAIL_SYNC >= dspark_kernels::LAYER_TAIL_SYNC_WORDS
);

/// Index-dtype inputs a recorded forward may have: up to seven sections of at most
/// [`MAX_GRAPH_ROWS`] values, each starting at a multiple of [`dspark_kernels::INT_VIEW_ALIGN`]
/// (see [`int_section`]).
const INTS_CAP: usize = 8 * MAX_GRAPH_ROWS;

/// The stride between the sections of a recorded forward's index-dtype inputs that hold `len`
/// values each: `len` rounded up to [`dspark_kernels::INT_VIEW_ALIGN`], so that every section
/// starts aligned and its view ([`DeviceInputs::ints`]) shares the input buffer instead of
/// launching a copy (one per section and forward: 4–5 launches of about 3 µs each per target
/// step and per draft round on the H100).
pub(crate) fn int_section(len: usize) -> usize {
    len.div_ceil(dspark_kernels::INT_VIEW_ALIGN) * dspark_kernels::INT_VIEW_ALIGN
}

/// The largest number of rows of a recorded forward that is not a window of query rows (a
/// prefill chunk, a context extension). Wider ones run op by op, where launch costs are small
/// beside the work; and they would record one graph per prompt length.
pub(crate) const MAX_SPAN_ROWS: usize = 64;

/// Most graphs one model keeps. Each holds the pages its launches touched for its life (45–105
/// MiB each for Qwen3-8B shapes on the H200, measured), so a many-lane workload whose row counts
/// vary from round to round would otherwise record one graph per count; shapes past the limit
/// run op by op.
pub(crate) const MAX_GRAPHS: usize = 16;

/// The row count a recorded forward of `rows` rows runs at where the cache has a scratch row for
/// the padding: 1, 2, 4, 8, then multiples of 8 up to 64, then of 16 (at most
/// [`MAX_GRAPH_ROWS`]). With many lanes the rows of a step or an extension change from round to
/// round; padded, a handful of graphs serve them all.
pub(crate) fn padded_rows(rows: usize) -> usize {
    let padded = match rows {
        0..=8 => rows.next_power_of_two(),
        9..=64 => rows.div_ceil(8) * 8,
        _ => rows.div_ceil(16) * 16,
    };
    padded.min(MAX_GRAPH_ROWS).max(rows)
}

/// A shape is recorded the second time it is seen: one-off shapes (a prefill tail, a lane
/// leaving) do not take a graph's memory.
const RECORD_AFTER: u32 = 2;

/// Host values of one forward's device inputs, laid out as the recorded body reads them.
#[derive(Debug, Default)]
pub(crate) struct HostInputs {
    /// Index-dtype values: sections in the order the body reads them.
    pub ints: Vec<i64>,
    /// i32 page table of the keys (at most the pool's rows).
    pub keys: Vec<i32>,
    /// i32 `[first, len]` per query row.
    pub meta: Vec<i32>,
    /// A float input already on the device (`[rows, width]`, the model's dtype), copied into
    /// the shared float buffer.
    pub floats: Option<Tensor<2>>,
    /// How many leading outputs are logits the body leaves in the model's dtype: they are
    /// handed out widened to f32 (exact), and the widening is their copy. The recorded graph
    /// then holds no f32 logits (39 MB for a 64-row verify window of Qwen3-8B).
    pub widen: usize,
}

/// The device inputs of one forward, as views of the shared buffers.
#[derive(Debug, Clone)]
pub(crate) struct DeviceInputs {
    ints: Tensor<1, Int>,
    tables: Tensor<1, Int>,
    keys_cap: usize,
    floats: Option<Tensor<1>>,
}

impl DeviceInputs {
    /// `len` index-dtype values from `offset`: with `dspark_kernels::set_int_views` on (the
    /// default), a view of the input buffer where `offset` is a multiple of
    /// [`dspark_kernels::INT_VIEW_ALIGN`] (see [`int_section`]); else a copy.
    pub fn ints(&self, offset: usize, len: usize) -> Tensor<1, Int> {
        dspark_kernels::int_view(self.ints.clone(), offset, len)
    }

    /// The float input as `[rows, width]`.
    pub fn floats(&self, rows: usize, width: usize) -> Option<Tensor<2>> {
        self.floats.as_ref().map(|f| f.clone().narrow(0, 0, rows * width).reshape([rows, width]))
    }

    /// The page tables of `rows` query rows, and `new_rows` (index dtype, at `offset` of
    /// `ints`, `rows` of them) where their K/V go.
    /// `group` as in [`AttnPlan`].
    pub fn plan(&self, rows: usize, new_rows_offset: usize, group: usize) -> AttnPlan {
        AttnPlan {
            keys: dspark_kernels::int_view(self.tables.clone(), KEYS_AT, self.keys_cap),
            meta: dspark_kernels::int_view(self.tables.clone(), 0, 2 * rows).reshape([rows, 2]),
            new_rows: self.ints(new_rows_offset, rows),
            group,
            // Blocks of several rows never fold (see `paged_attention_synced`): no view for them.
            sync: (group == 1)
                .then(|| dspark_kernels::int_view(self.tables.clone(), 2 * MAX_GRAPH_ROWS, SYNC_CAP)),
            tail_sync: Some(dspark_kernels::int_view(
                self.tables.clone(),
                2 * MAX_GRAPH_ROWS + SYNC_CAP,
                TAIL_SYNC,
            )),
        }
    }
}

/// The launch shape of a recorded forward (its input lengths and output choices).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct ShapeKey {
    /// Query rows.
    pub rows: usize,
    /// Index-dtype inputs used.
    pub ints: usize,
    /// Whatever else fixes the launches (logit rows, captured layers, the draft's lanes…).
    pub detail: Vec<usize>,
}

enum Entry {
    Ready {
        graph: DeviceGraph,
        outputs: Vec<Tensor<2>>,
    },
    /// Admitted where graphs are only emulated: the body runs on every call, and the shape
    /// counts toward [`MAX_GRAPHS`] as a graph would.
    Emulated,
    /// Recording failed `attempts` times; tried again on later calls until
    /// [`RECORD_ATTEMPTS`], then run op by op for good.
    Failed {
        attempts: u32,
    },
}

/// Recordings of one shape tried before it runs op by op for good. A recording failed
/// intermittently on the H200 (the one-lane draft round, in about half the processes: a small
/// allocation the warm-ups had not left free). The spare slices `dspark_kernels` leaves before
/// each recording fixed that (0 failures in 9 processes since); the retry stays as a safety net.
const RECORD_ATTEMPTS: u32 = 3;

impl Entry {
    /// Whether this shape holds a graph's place.
    fn recorded(&self) -> bool {
        matches!(self, Entry::Ready { .. } | Entry::Emulated)
    }
}

struct Bound {
    cache: u64,
    ints: InputBuffer,
    tables: InputBuffer,
    ints_cap: usize,
    keys_cap: usize,
    /// The float input buffer, `[MAX_GRAPH_ROWS · width]`, made for the first float input.
    floats: Option<Tensor<1>>,
    graphs: HashMap<ShapeKey, Entry>,
    /// Times each shape not yet recorded was seen.
    seen: HashMap<ShapeKey, u32>,
}

/// The recorded forwards of one model.
#[derive(Default)]
pub(crate) struct Graphs {
    bound: std::sync::Mutex<Option<Bound>>,
}

impl std::fmt::Debug for Graphs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let count = self.bound.lock().map(|b| b.as_ref().map_or(0, |b| b.graphs.len())).unwrap_or(0);
        f.debug_struct("Graphs").field("shapes", &count).finish()
    }
}

/// What [`Graphs::run`] did.
pub(crate) enum Ran<E> {
    /// The outputs of the replay (copies, so a later replay does not overwrite them).
    Replayed(Vec<Tensor<2>>),
    /// This shape is not recorded (recording failed earlier, or graphs are off): run op by op.
    NotRecorded,
    /// The body failed during the recording's warm-up.
    Failed(E),
}

/// Whether forwards on `device` take the recorded path: graphs run there, or are emulated
/// (see [`dspark_kernels::set_graph_emulation`]).
pub(crate) fn recording(device: &Device) -> bool {
    dspark_kernels::graphs_available(device) || dspark_kernels::graph_emulation()
}

impl Graphs {
    /// Shapes recorded for the bound cache (emulated ones included).
    pub fn recorded(&self) -> usize {
        self.bound
            .lock()
            .map_or(0, |b| b.as_ref().map_or(0, |b| b.graphs.values().filter(|e| e.recorded()).count()))
    }

    /// Write `host` into the device inputs and run the recorded forward of `key` (recording it
    /// first when new): `body` computes the forward from the device inputs and returns its
    /// outputs. `cache` is the identity of the cache the body writes, `pool_rows` its rows.
    ///
    /// # Safety contract (kept here)
    /// Graphs live as long as the model; the buffers they read are the model's weights, the
    /// inputs held here, and the pools of the bound cache, which the cache never moves. A
    /// forward through another cache drops the graphs first.
    pub fn run<E>(
        &self,
        device: &Device,
        cache: u64,
        pool_rows: usize,
        key: ShapeKey,
        host: HostInputs,
        mut body: impl FnMut(&DeviceInputs) -> Result<Vec<Tensor<2>>, E>,
    ) -> Ran<E> {
        if !recording(device) || key.rows > MAX_GRAPH_ROWS || key.ints > INTS_CAP {
            return Ran::NotRecorded;
        }
        let Ok(mut guard) = self.bound.lock() else {
            return Ran::NotRecorded;
        };
        if guard.as_ref().is_none_or(|b| b.cache != cache || b.keys_cap < pool_rows) {
            // New inputs and no graphs: the old graphs (and the pages they hold) go first.
            *guard = None;
            let ints_cap = INTS_CAP;
            let keys_cap = pool_rows;
            let i32s = TensorCreationOptions::new(device.clone()).with_dtype(DType::I32);
            let (ints, tables) = crate::device::persistent(device, (), |()| {
                let ints = Tensor::zeros([ints_cap], device);
                (ints, Tensor::zeros([keys_cap + KEYS_AT], i32s.clone()))
            });
            *guard = Some(Bound {
                cache,
                ints: InputBuffer::new(ints),
                tables: InputBuffer::new(tables),
                ints_cap,
                keys_cap,
                floats: None,
                graphs: HashMap::new(),
                seen: HashMap::new(),
            });
        }
        let Some(bound) = guard.as_mut() else {
            return Ran::NotRecorded;
        };
        if !bound.graphs.contains_key(&key) {
            let seen = bound.seen.entry(key.clone()).or_insert(0);
            *seen += 1;
            let ready = bound.graphs.values().filter(|e| e.recorded()).count();
            if *seen < RECORD_AFTER || ready >= MAX_GRAPHS {
                return Ran::NotRecorded;
            }
            bound.seen.remove(&key);
        }
        let failed = match bound.graphs.get(&key) {
            Some(Entry::Failed { attempts }) => Some(*attempts),
            _ => None,
        };
        if failed.is_some_and(|a| a >= RECORD_ATTEMPTS)
            || host.ints.len() > bound.ints_cap
            || host.keys.len() > bound.keys_cap
            || host.meta.len() > 2 * MAX_GRAPH_ROWS
        {
            return Ran::NotRecorded;
        }
        // 1. the inputs, in place.
        let inputs_span = tracing::debug_span!("graph_inputs").entered();
        // Each buffer's values in one write (on CUDA one host-to-device copy). The replay below
        // is what reads them, so the next call's writes come after it.
        bound.ints.write(&host.ints);
        // The counters as zeros, and only the keys in use; the rest of the table is never read.
        let mut table = host.meta;
        table.resize(KEYS_AT, 0);
        table.extend_from_slice(&host.keys);
        bound.tables.write(&table);
        if let Some(f) = host.floats {
            let [rows, width] = f.dims();
            let buffer = bound.floats.get_or_insert_with(|| {
                let opts = TensorCreationOptions::new(device.clone()).with_dtype(f.dtype());
                crate::device::persistent(device, (), |()| {
                    Tensor::zeros([MAX_GRAPH_ROWS * width], opts.clone())
                })
            });
            if rows * width > buffer.dims()[0] || buffer.dtype() != f.dtype() {
                return Ran::NotRecorded;
            }
            *buffer = dspark_kernels::write_floats_into(buffer.clone(), f.reshape([rows * width]));
        }
        let inputs = DeviceInputs {
            ints: bound.ints.tensor(),
            tables: bound.tables.tensor(),
            keys_cap: bound.keys_cap,
            floats: bound.floats.clone(),
        };
        drop(inputs_span);
        // 2. the graph: replay, or record and replay (emulated: the body, every time).
        if !dspark_kernels::graphs_available(device) {
            bound.graphs.entry(key).or_insert(Entry::Emulated);
            let widen = host.widen;
            return match body(&inputs) {
                Ok(outputs) => Ran::Replayed(detach(outputs, widen, false)),
                Err(e) => Ran::Failed(e),
            };
        }
        if !bound.graphs.contains_key(&key) || failed.is_some() {
            match DeviceGraph::capture(device, || body(&inputs)) {
                Ok(Ok((graph, outputs))) => {
                    tracing::debug!(?key, "recorded a device graph");
                    bound.graphs.insert(key.clone(), Entry::Ready { graph, outputs });
                }
                Ok(Err(e)) => return Ran::Failed(e),
                Err(GraphError::Unsupported) => return Ran::NotRecorded,
                Err(e) => {
                    let attempts = failed.unwrap_or(0) + 1;
                    if attempts < RECORD_ATTEMPTS {
                        tracing::warn!(?key, attempts, error = %e, "could not record this forward; trying again on a later call");
                    } else {
                        tracing::warn!(?key, attempts, error = %e, "could not record this forward; it runs op by op");
                    }
                    bound.graphs.insert(key, Entry::Failed { attempts });
                    return Ran::NotRecorded;
                }
            }
        }
        let Some(Entry::Ready { graph, outputs }) = bound.graphs.get(&key) else {
            return Ran::NotRecorded;
        };
        // SAFETY: see this function's safety contract: every buffer the graph touches is held
        // by the model, by `bound`, or by the bound cache, and the inputs were written on this
        // device's stream just above.
        let replayed = tracing::debug_span!("graph_replay").in_scope(|| unsafe { graph.replay() });
        if let Err(e) = replayed {
            tracing::warn!(?key, error = %e, "a device graph would not replay; this forward runs op by op");
            bound.graphs.insert(key, Entry::Failed { attempts: RECORD_ATTEMPTS });
            return Ran::NotRecorded;
        }
        let _outputs = tracing::debug_span!("graph_outputs").entered();
        Ran::Replayed(detach(outputs.clone(), host.widen, true))
    }
}

/// A forward's outputs as handed out: the first `widen` widened to f32 (a new buffer), the
/// rest copied out of the graph's buffers when `copy` (a later replay overwrites them).
fn detach(outputs: Vec<Tensor<2>>, widen: usize, copy: bool) -> Vec<Tensor<2>> {
    outputs
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            if i < widen && t.dtype() != DType::F32 {
                t.cast(DType::F32)
            } else if copy {
                dspark_kernels::graph::fresh_copy(t)
            } else {
                t
            }
        })
        .collect()
}

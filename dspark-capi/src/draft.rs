//! Speculator-only calls, for a serving engine that runs its own target and uses dspark only to
//! draft: create a DSpark draft bound to the target's embedding and LM-head weights (host
//! buffers), begin a sequence with the prompt's features, propose a block, commit the features
//! of the committed rows, end the sequence. The engine verifies with its own target and decides
//! acceptance with [`crate::dspark_accept_greedy`] or [`crate::dspark_accept_chain`].
//!
//! Thread safety: a draft handle may be used from any thread; calls on one draft are serialised
//! by an internal lock. Sequences are identified by the ids [`dspark_draft_begin`] returns.

use std::ffi::{c_char, c_void};
use std::path::Path;
use std::sync::Mutex;

use dspark::{
    ComputeDtype, DSparkDraft, DeviceKind, DraftCacheConfig, LoadOptions, ProposeLane, Speculator,
    TargetBinding,
};

use crate::{DsparkSamplingParams, DsparkStatus, fail, guard, invalid, sampling_arg, slice_arg, str_arg};

/// The target weights a draft borrows (a DSpark draft has no embedding or LM head of its own).
/// Both matrices are `[vocab_size, hidden_size]`, row-major, little-endian values of `dtype`.
/// The buffers are copied during [`dspark_draft_create`] and may be released after it returns.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DsparkTargetWeights {
    /// The target's input embedding.
    pub embed_tokens: *const c_void,
    /// The target's output head; null when the target ties it to the embedding.
    pub lm_head: *const c_void,
    /// Element type of both buffers: `"f32"`, `"bf16"` or `"f16"`; null means `"f32"`.
    pub dtype: *const c_char,
    /// Rows of both matrices.
    pub vocab_size: usize,
    /// Columns of both matrices.
    pub hidden_size: usize,
    /// Decoder layers of the target (the draft's feature layers are checked against it).
    pub num_hidden_layers: usize,
}

/// Settings of [`dspark_draft_create`]. Start from [`dspark_draft_default_params`].
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DsparkDraftParams {
    /// `"cpu"`, `"cuda"` or `"cuda:N"`; null means `"cpu"`.
    pub device: *const c_char,
    /// Compute dtype: `"f32"`, `"bf16"` or `"f16"`; null means `"f32"`.
    pub dtype: *const c_char,
    /// Byte budget of the draft's context K/V, in MiB, shared by all its sequences.
    pub kv_budget_mib: usize,
    /// The draft's weights: 0 as stored; 1 its projections quantised to FP8 (e4m3, per-row
    /// scales) at load, kept as FP8 on CUDA in bf16; 2 also an FP8 copy of the target's LM head
    /// for the draft's base logits.
    pub fp8: u32,
}

/// Shape facts of a loaded draft.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct DsparkDraftInfo {
    /// γ: tokens per proposal.
    pub block_size: usize,
    /// How many target layers feed the draft (see [`dspark_draft_feature_layers`]).
    pub num_feature_layers: usize,
    /// Floats per feature row: `num_feature_layers · hidden_size`.
    pub feature_width: usize,
    /// The vocabulary size (length of each proposal distribution row).
    pub vocab_size: usize,
    /// Whether proposals carry per-position confidences.
    pub has_confidence: bool,
}

/// A DSpark draft bound to a target's weights. Opaque.
#[derive(Debug)]
pub struct DsparkDraft {
    inner: Mutex<DSparkDraft>,
    feature_width: usize,
    vocab_size: usize,
}

/// Default draft settings: CPU, f32, 64 MiB of context K/V.
#[unsafe(no_mangle)]
pub extern "C" fn dspark_draft_default_params() -> DsparkDraftParams {
    DsparkDraftParams { device: std::ptr::null(), dtype: std::ptr::null(), kv_budget_mib: 64, fp8: 0 }
}

/// Load a draft with `load` as an FP8 setting asks (0, 1 or 2; see [`DsparkDraftParams::fp8`]).
pub(crate) fn load_with_fp8(
    fp8: u32,
    load: impl FnOnce(Option<dspark::model::fp8::DraftQuant>) -> dspark::Result<DSparkDraft>,
) -> dspark::Result<DSparkDraft> {
    let quant = match fp8 {
        0 => None,
        1 | 2 => Some(dspark::model::fp8::DraftQuant::Fp8PerChannel),
        other => {
            return Err(dspark::Error::InvalidInput(format!(
                "draft FP8 setting {other}: expected 0 (as stored), 1 (FP8 projections) or 2 (and an FP8 LM head)"
            )));
        }
    };
    let mut draft = load(quant)?;
    if fp8 == 2 {
        draft.quantize_lm_head()?;
    }
    Ok(draft)
}

fn draft_ref<'a>(draft: *mut DsparkDraft) -> Result<&'a DsparkDraft, (DsparkStatus, String)> {
    // SAFETY: the caller of the entry point promises a live handle or null.
    unsafe { draft.as_ref() }.ok_or_else(|| invalid("draft is null"))
}

fn lock(draft: &DsparkDraft) -> Result<std::sync::MutexGuard<'_, DSparkDraft>, (DsparkStatus, String)> {
    draft.inner.lock().map_err(|_| (DsparkStatus::Internal, "draft lock poisoned".into()))
}

/// Load a DSpark draft folder (released or SpecForge layout) bound to the given target weights.
/// The draft is checked against the target (hidden size, vocabulary, feature layers, mask id)
/// before any compute. On success `*out` owns a new handle; free it with [`dspark_draft_free`].
///
/// # Safety
/// `draft_dir` is a NUL-terminated string; `weights` is valid and its buffers hold
/// `vocab_size · hidden_size` values each; `params` is null (defaults) or valid; `out` is valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dspark_draft_create(
    draft_dir: *const c_char,
    weights: *const DsparkTargetWeights,
    params: *const DsparkDraftParams,
    out: *mut *mut DsparkDraft,
) -> DsparkStatus {
    guard(|| {
        if out.is_null() {
            return Err(invalid("out is null"));
        }
        // SAFETY: per this function's contract.
        let dir = unsafe { str_arg(draft_dir, "draft_dir") }?.ok_or_else(|| invalid("draft_dir is null"))?;
        // SAFETY: weights is null or valid.
        let w = unsafe { weights.as_ref() }.ok_or_else(|| invalid("weights is null"))?;
        // SAFETY: params is null or valid.
        let p = if params.is_null() { dspark_draft_default_params() } else { unsafe { *params } };
        // SAFETY: the strings are null or NUL-terminated.
        let device: DeviceKind =
            unsafe { str_arg(p.device, "device") }?.unwrap_or("cpu").parse().map_err(fail)?;
        // SAFETY: as above.
        let dtype: ComputeDtype =
            unsafe { str_arg(p.dtype, "dtype") }?.unwrap_or("f32").parse().map_err(fail)?;
        // SAFETY: as above.
        let src: ComputeDtype =
            unsafe { str_arg(w.dtype, "weights.dtype") }?.unwrap_or("f32").parse().map_err(fail)?;
        let bytes = w
            .vocab_size
            .checked_mul(w.hidden_size)
            .and_then(|n| n.checked_mul(src.size()))
            .ok_or_else(|| invalid("vocab_size · hidden_size overflows"))?;
        // SAFETY: the buffers hold vocab_size · hidden_size values of `src`.
        let embed = unsafe { slice_arg(w.embed_tokens.cast::<u8>(), bytes, "weights.embed_tokens") }?;
        let head = if w.lm_head.is_null() {
            None
        } else {
            // SAFETY: as above.
            Some(unsafe { slice_arg(w.lm_head.cast::<u8>(), bytes, "weights.lm_head") }?)
        };
        let options = LoadOptions { device, dtype, progress: None };
        let binding = TargetBinding::from_host(
            embed,
            head,
            src,
            [w.vocab_size, w.hidden_size],
            w.num_hidden_layers,
            options,
        )
        .map_err(fail)?;
        let cache =
            DraftCacheConfig { kv_budget_bytes: p.kv_budget_mib << 20, ..DraftCacheConfig::default() };
        let draft = load_with_fp8(p.fp8, |quant| match quant {
            Some(q) => DSparkDraft::load_bound_quantized(Path::new(dir), binding.clone(), None, &cache, q),
            None => DSparkDraft::load_bound(Path::new(dir), binding.clone(), None, &cache),
        })
        .map_err(fail)?;
        let feature_width = draft.layer_ids().len() * w.hidden_size;
        let handle =
            Box::new(DsparkDraft { inner: Mutex::new(draft), feature_width, vocab_size: w.vocab_size });
        // SAFETY: out is valid (checked non-null above).
        unsafe { *out = Box::into_raw(handle) };
        Ok(())
    })
}

/// Release a draft and every sequence it holds. Null is ignored.
///
/// # Safety
/// `draft` is null or a handle from [`dspark_draft_create`] not freed before.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dspark_draft_free(draft: *mut DsparkDraft) {
    if !draft.is_null() {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: per this function's contract, the handle came from Box::into_raw.
            drop(unsafe { Box::from_raw(draft) });
        }));
    }
}

/// Write the draft's shape facts to `*out`.
///
/// # Safety
/// `draft` is a live handle; `out` is valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dspark_draft_info(
    draft: *mut DsparkDraft,
    out: *mut DsparkDraftInfo,
) -> DsparkStatus {
    guard(|| {
        let d = draft_ref(draft)?;
        if out.is_null() {
            return Err(invalid("out is null"));
        }
        let inner = lock(d)?;
        let info = DsparkDraftInfo {
            block_size: inner.block_size(),
            num_feature_layers: inner.feature_layers().len(),
            feature_width: d.feature_width,
            vocab_size: d.vocab_size,
            has_confidence: inner.has_confidence(),
        };
        // SAFETY: out is valid (checked non-null).
        unsafe { *out = info };
        Ok(())
    })
}

/// The target layers whose residual outputs (Hugging Face `hidden_states[l + 1]`) feed the
/// draft, in the order their features are concatenated in a feature row. Writes
/// `num_feature_layers` ids to `out_ids` (which holds `out_capacity`).
///
/// # Safety
/// `draft` is a live handle; `out_ids` holds `out_capacity` values.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dspark_draft_feature_layers(
    draft: *mut DsparkDraft,
    out_ids: *mut usize,
    out_capacity: usize,
) -> DsparkStatus {
    guard(|| {
        let inner = lock(draft_ref(draft)?)?;
        let ids = inner.feature_layers();
        if ids.len() > out_capacity {
            return Err((
                DsparkStatus::BufferTooSmall,
                format!("{} feature layers, out_capacity is {out_capacity}", ids.len()),
            ));
        }
        if out_ids.is_null() {
            return Err(invalid("out_ids is null"));
        }
        // SAFETY: out_ids holds out_capacity >= len values.
        unsafe { std::ptr::copy_nonoverlapping(ids.as_ptr(), out_ids, ids.len()) };
        Ok(())
    })
}

fn features_tensor(
    d: &DsparkDraft,
    inner: &DSparkDraft,
    features: *const f32,
    rows: usize,
) -> Result<burn::tensor::Tensor<2>, (DsparkStatus, String)> {
    let n = rows.checked_mul(d.feature_width).ok_or_else(|| invalid("rows · feature_width overflows"))?;
    // SAFETY: the caller of the entry point promises `rows · feature_width` readable floats.
    let values = unsafe { slice_arg(features, n, "features") }?;
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    dspark::weights::host_matrix(
        "features",
        &bytes,
        ComputeDtype::F32,
        [rows, d.feature_width],
        inner.dtype(),
        inner.device(),
    )
    .map_err(fail)
}

/// Begin a sequence whose committed prefix (the prompt) has `rows` feature rows: the target's
/// captured features of prompt positions `0..rows`, `rows × feature_width` floats. The anchor
/// of the first proposal is then the token at position `rows` (the target's first generated
/// token). Writes the new sequence id to `*out_seq`. On failure no sequence is created.
///
/// # Safety
/// `draft` is a live handle; `features` holds `rows · feature_width` floats; `out_seq` is valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dspark_draft_begin(
    draft: *mut DsparkDraft,
    features: *const f32,
    rows: usize,
    out_seq: *mut u64,
) -> DsparkStatus {
    guard(|| {
        let d = draft_ref(draft)?;
        if out_seq.is_null() {
            return Err(invalid("out_seq is null"));
        }
        let mut inner = lock(d)?;
        let f = features_tensor(d, &inner, features, rows)?;
        let seq = inner.begin();
        if rows > 0
            && let Err(e) = inner.extend_context(seq, f)
        {
            let _ = inner.end(seq);
            return Err(fail(e));
        }
        // SAFETY: out_seq is valid (checked non-null).
        unsafe { *out_seq = seq };
        Ok(())
    })
}

/// Propose `block_size` tokens after `anchor` (the last committed token, not yet in the draft's
/// context) for sequence `seq`. Greedy when `params.temperature` is 0; otherwise each token is
/// sampled from the temperature-scaled full-vocabulary distribution, with coins from
/// `(params.seed, position)` so results do not depend on other sequences. Writes the tokens to
/// `out_tokens` (`block_size` ids). `out_q` (may be null) receives, when sampling, the
/// `block_size × vocab_size` distributions the tokens were drawn from, ready for
/// [`crate::dspark_accept_chain`]; when greedy it is left untouched. `out_confidence` (may be
/// null) receives `block_size` per-position acceptance estimates when the draft has a
/// confidence head.
///
/// # Safety
/// `draft` is a live handle; `params` null or valid; the output arrays null or of the sizes stated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dspark_draft_propose(
    draft: *mut DsparkDraft,
    seq: u64,
    anchor: u32,
    params: *const DsparkSamplingParams,
    out_tokens: *mut u32,
    out_q: *mut f32,
    out_confidence: *mut f32,
) -> DsparkStatus {
    guard(|| {
        let d = draft_ref(draft)?;
        if out_tokens.is_null() {
            return Err(invalid("out_tokens is null"));
        }
        // SAFETY: params is null or valid, its stop-token array readable.
        let params = unsafe { sampling_arg(params) }?;
        if anchor as usize >= d.vocab_size {
            return Err(fail(dspark::Error::TokenOutOfRange { token: anchor, vocab: d.vocab_size }));
        }
        let mut inner = lock(d)?;
        let proposal =
            inner.propose(&[ProposeLane { seq, anchor, params: &params }]).map_err(fail)?.remove(0);
        let gamma = proposal.tokens.len();
        // SAFETY: out_tokens holds block_size ids.
        unsafe { std::ptr::copy_nonoverlapping(proposal.tokens.as_ptr(), out_tokens, gamma) };
        if let (Some(q), false) = (&proposal.q, out_q.is_null()) {
            for (k, row) in q.iter().enumerate() {
                for (v, &x) in row.iter().enumerate() {
                    // SAFETY: out_q holds block_size · vocab_size floats.
                    unsafe { *out_q.add(k * d.vocab_size + v) = x as f32 };
                }
            }
        }
        if let (Some(c), false) = (&proposal.confidence, out_confidence.is_null()) {
            // SAFETY: out_confidence holds block_size floats.
            unsafe { std::ptr::copy_nonoverlapping(c.as_ptr(), out_confidence, gamma) };
        }
        Ok(())
    })
}

/// Commit `rows` rows to sequence `seq`: the target's captured features of the newly
/// committed positions (the previous anchor and the accepted draft tokens; the bonus token
/// becomes the next anchor), `rows × feature_width` floats. All or nothing: on failure (e.g.
/// `DSPARK_STATUS_KV_CACHE_FULL`) the sequence is unchanged.
///
/// # Safety
/// `draft` is a live handle; `features` holds `rows · feature_width` floats.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dspark_draft_commit(
    draft: *mut DsparkDraft,
    seq: u64,
    features: *const f32,
    rows: usize,
) -> DsparkStatus {
    guard(|| {
        let d = draft_ref(draft)?;
        let mut inner = lock(d)?;
        if rows == 0 {
            return inner.context_len(seq).map(|_| ()).map_err(fail);
        }
        let f = features_tensor(d, &inner, features, rows)?;
        inner.extend_context(seq, f).map_err(fail)
    })
}

/// Committed length (feature rows) of sequence `seq`, written to `*out_len`.
///
/// # Safety
/// `draft` is a live handle; `out_len` is valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dspark_draft_context_len(
    draft: *mut DsparkDraft,
    seq: u64,
    out_len: *mut usize,
) -> DsparkStatus {
    guard(|| {
        let d = draft_ref(draft)?;
        if out_len.is_null() {
            return Err(invalid("out_len is null"));
        }
        let n = lock(d)?.context_len(seq).map_err(fail)?;
        // SAFETY: out_len is valid (checked non-null).
        unsafe { *out_len = n };
        Ok(())
    })
}

/// Let the draft propose only the `n_ids` tokens of `ids` (a draft vocabulary; see
/// `DSparkDraft::restrict_vocab` in the Rust crate): it then reads only their LM-head and Markov
/// rows. The set is sorted, repeats dropped, and filled up to a multiple of 64 with the lowest
/// ids it lacks. Proposal distributions still span the whole vocabulary (zero outside the set),
/// so acceptance is unchanged and exact; acceptance rates may fall. Once per draft, before
/// proposing.
///
/// # Safety
/// `draft` is a live handle; `ids` holds `n_ids` values.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dspark_draft_restrict_vocab(
    draft: *mut DsparkDraft,
    ids: *const u32,
    n_ids: usize,
) -> DsparkStatus {
    guard(|| {
        let d = draft_ref(draft)?;
        // SAFETY: ids holds n_ids values, per this function's contract.
        let ids = unsafe { slice_arg(ids, n_ids, "ids") }?;
        let vocab = dspark::DraftVocab::new(ids.iter().copied(), d.vocab_size).map_err(fail)?;
        lock(d)?.restrict_vocab(vocab).map(|_| ()).map_err(fail)
    })
}

/// End sequence `seq` and free its context K/V.
///
/// # Safety
/// `draft` is a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dspark_draft_end(draft: *mut DsparkDraft, seq: u64) -> DsparkStatus {
    guard(|| {
        let d = draft_ref(draft)?;
        lock(d)?.end(seq).map_err(fail)
    })
}

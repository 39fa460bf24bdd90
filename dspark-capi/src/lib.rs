//! C ABI for dspark (`libdspark_capi`, header `include/dspark.h`).
//!
//! Conventions: opaque handles; `dspark_<object>_<verb>` names; every function returns a
//! [`DsparkStatus`] (or a plain value that cannot fail) and, on failure, leaves a message for
//! [`dspark_last_error_message`] on the calling thread. No panic crosses the boundary: each entry
//! point runs behind one `catch_unwind` and reports `DSPARK_STATUS_PANIC` instead.
//!
//! Ownership: strings and arrays passed in are borrowed for the duration of the call; handles
//! returned through out-pointers are owned by the caller and released with their `_free`
//! function; output arrays are caller-allocated.
//!
//! Thread safety: an engine handle may be used from any thread; calls on one engine are
//! serialised by an internal lock.

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::{Mutex, OnceLock};

mod draft;
mod serving;
pub use draft::*;
pub use serving::*;

use dspark::{
    ComputeDtype, DSparkDraft, DeviceKind, DraftCacheConfig, Engine, EngineConfig, Error, FinishReason,
    LoadOptions, Qwen3, Request, SamplingParams, VerifyPolicy,
};

/// Result of every fallible call.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DsparkStatus {
    /// Success.
    Ok = 0,
    /// A null pointer, a bad UTF-8 string, an out-of-range parameter or an unknown sequence id.
    InvalidArgument = 1,
    /// A file could not be read.
    Io = 2,
    /// A checkpoint or config is malformed, or a draft does not fit its target.
    Checkpoint = 3,
    /// A token id is not in the vocabulary.
    TokenOutOfRange = 4,
    /// The KV cache budget cannot hold the request.
    KvCacheFull = 5,
    /// The device or dtype is not available in this build.
    Unsupported = 6,
    /// An output buffer is too small; the needed length was written to the length out-pointer.
    BufferTooSmall = 7,
    /// A backend or internal failure.
    Internal = 8,
    /// A Rust panic was caught at the boundary.
    Panic = 9,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_error(message: &str) {
    let clean = message.replace('\0', " ");
    LAST_ERROR.with(|e| *e.borrow_mut() = CString::new(clean).unwrap_or_default());
}

fn status_of(error: &Error) -> DsparkStatus {
    match error {
        Error::Io { .. } => DsparkStatus::Io,
        Error::Json { .. }
        | Error::Config { .. }
        | Error::Safetensors { .. }
        | Error::MissingTensor { .. }
        | Error::TensorShape { .. }
        | Error::TensorDtype { .. } => DsparkStatus::Checkpoint,
        Error::TokenOutOfRange { .. } => DsparkStatus::TokenOutOfRange,
        Error::KvCacheFull { .. } => DsparkStatus::KvCacheFull,
        Error::Unsupported(_) => DsparkStatus::Unsupported,
        Error::InvalidInput(_) | Error::InvalidSampling(_) | Error::UnknownSequence(_) => {
            DsparkStatus::InvalidArgument
        }
        _ => DsparkStatus::Internal,
    }
}

/// Run `body` behind the panic boundary, turning errors into a status and a message.
pub(crate) fn guard(body: impl FnOnce() -> Result<(), (DsparkStatus, String)>) -> DsparkStatus {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => {
            set_error("");
            DsparkStatus::Ok
        }
        Ok(Err((status, message))) => {
            set_error(&message);
            status
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_error(&format!("internal panic: {what}"));
            DsparkStatus::Panic
        }
    }
}

pub(crate) fn fail(error: Error) -> (DsparkStatus, String) {
    (status_of(&error), error.to_string())
}

pub(crate) fn invalid(message: impl Into<String>) -> (DsparkStatus, String) {
    (DsparkStatus::InvalidArgument, message.into())
}

/// # Safety
/// `ptr` is null or a valid NUL-terminated string.
unsafe fn str_arg<'a>(ptr: *const c_char, what: &str) -> Result<Option<&'a str>, (DsparkStatus, String)> {
    if ptr.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller promises a valid NUL-terminated string.
    unsafe { CStr::from_ptr(ptr) }.to_str().map(Some).map_err(|_| invalid(format!("{what} is not UTF-8")))
}

/// # Safety
/// `ptr` is null (then `len` must be 0) or points to `len` readable elements.
pub(crate) unsafe fn slice_arg<'a, T>(
    ptr: *const T,
    len: usize,
    what: &str,
) -> Result<&'a [T], (DsparkStatus, String)> {
    match (ptr.is_null(), len) {
        (_, 0) => Ok(&[]),
        (true, _) => Err(invalid(format!("{what} is null with length {len}"))),
        // SAFETY: the caller promises `len` readable elements.
        (false, _) => Ok(unsafe { std::slice::from_raw_parts(ptr, len) }),
    }
}

/// The Rust sampling settings of a C parameter block (null: the defaults).
///
/// # Safety
/// `params` is null or valid, and its stop-token array readable for its length.
pub(crate) unsafe fn sampling_arg(
    params: *const DsparkSamplingParams,
) -> Result<SamplingParams, (DsparkStatus, String)> {
    // SAFETY: params is null or valid.
    let p = if params.is_null() { dspark_sampling_default_params() } else { unsafe { *params } };
    // SAFETY: the stop-token array is readable for its length.
    let stop = unsafe { slice_arg(p.stop_token_ids, p.num_stop_token_ids, "stop_token_ids") }?.to_vec();
    Ok(SamplingParams {
        temperature: p.temperature,
        top_k: p.top_k as usize,
        top_p: p.top_p,
        seed: p.seed,
        stop_token_ids: stop,
        max_new_tokens: p.max_new_tokens,
    })
}

/// Settings of [`dspark_engine_create`]. Start from [`dspark_engine_default_params`].
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DsparkEngineParams {
    /// `"cpu"`, `"cuda"` or `"cuda:N"`; null means `"cpu"`.
    pub device: *const c_char,
    /// `"f32"`, `"bf16"` or `"f16"`; null means `"f32"`.
    pub dtype: *const c_char,
    /// Target KV cache budget in MiB.
    pub kv_budget_mib: usize,
    /// Verify width in rows (anchor + drafts), `1..=γ+1`; 0 verifies all γ drafts.
    pub verify_width: usize,
    /// Verify the drafts before the first whose confidence is below this; negative disables.
    pub confidence_threshold: f32,
    /// The draft's weights: 0 as stored; 1 its projections quantised to FP8 (e4m3, per-row
    /// scales) at load, kept as FP8 on CUDA in bf16; 2 also an FP8 copy of the LM head for its
    /// base logits. Outputs keep the target's distribution either way.
    pub draft_fp8: u32,
}

/// Per-request sampling settings. Start from [`dspark_sampling_default_params`].
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DsparkSamplingParams {
    /// Softmax temperature; 0 is greedy.
    pub temperature: f32,
    /// Top-k filter; 0 disables.
    pub top_k: u32,
    /// Top-p filter; 1 disables.
    pub top_p: f32,
    /// Seed of the request's random coins.
    pub seed: u64,
    /// Upper bound on generated tokens.
    pub max_new_tokens: usize,
    /// Stop token ids (borrowed for the call); may be null when `num_stop_token_ids` is 0.
    pub stop_token_ids: *const u32,
    /// Number of stop token ids.
    pub num_stop_token_ids: usize,
}

/// Statistics of one generation.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct DsparkGenerationStats {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub generated_tokens: usize,
    /// Target passes after prefill (decode steps or verify rounds).
    pub rounds: usize,
    /// Draft tokens sent to verification.
    pub drafted: usize,
    /// Draft tokens accepted.
    pub accepted: usize,
    /// Tokens committed per round after the first token.
    pub tau: f64,
    /// 0: none (max_new_tokens was 0), 1: a stop token, 2: max_new_tokens reached.
    pub finish_reason: i32,
    /// The stop token when `finish_reason` is 1.
    pub stop_token: u32,
}

/// An engine: a Qwen3 target, optionally with a DSpark draft. Opaque.
#[derive(Debug)]
pub struct DsparkEngine {
    inner: Mutex<Engine>,
    /// Requests of the serving calls (`dspark_engine_submit` / `_step`), by id.
    served: Mutex<serving::Served>,
}

/// Default engine settings: CPU, f32, 1024 MiB of KV, full verify width, no threshold.
#[unsafe(no_mangle)]
pub extern "C" fn dspark_engine_default_params() -> DsparkEngineParams {
    DsparkEngineParams {
        device: std::ptr::null(),
        dtype: std::ptr::null(),
        kv_budget_mib: 1024,
        verify_width: 0,
        confidence_threshold: -1.0,
        draft_fp8: 0,
    }
}

/// Default sampling settings: greedy, 64 new tokens, seed 0, no stop tokens.
#[unsafe(no_mangle)]
pub extern "C" fn dspark_sampling_default_params() -> DsparkSamplingParams {
    DsparkSamplingParams {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
        max_new_tokens: 64,
        stop_token_ids: std::ptr::null(),
        num_stop_token_ids: 0,
    }
}

/// Load a target checkpoint folder (and, when `draft_dir` is not null, a DSpark draft) and
/// create an engine. On success `*out` owns a new handle; free it with [`dspark_engine_free`].
///
/// # Safety
/// `target_dir` and `draft_dir` are null or NUL-terminated strings; `params` is null (defaults)
/// or valid; `out` is a valid pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dspark_engine_create(
    target_dir: *const c_char,
    draft_dir: *const c_char,
    params: *const DsparkEngineParams,
    out: *mut *mut DsparkEngine,
) -> DsparkStatus {
    guard(|| {
        if out.is_null() {
            return Err(invalid("out is null"));
        }
        // SAFETY: per this function's contract.
        let target =
            unsafe { str_arg(target_dir, "target_dir") }?.ok_or_else(|| invalid("target_dir is null"))?;
        // SAFETY: per this function's contract.
        let draft = unsafe { str_arg(draft_dir, "draft_dir") }?;
        // SAFETY: params is null or valid.
        let p = if params.is_null() { dspark_engine_default_params() } else { unsafe { *params } };
        // SAFETY: the params' strings are null or NUL-terminated.
        let device: DeviceKind =
            unsafe { str_arg(p.device, "device") }?.unwrap_or("cpu").parse().map_err(fail)?;
        // SAFETY: as above.
        let dtype: ComputeDtype =
            unsafe { str_arg(p.dtype, "dtype") }?.unwrap_or("f32").parse().map_err(fail)?;
        let verify = match (p.verify_width, p.confidence_threshold) {
            (0, t) if t >= 0.0 => VerifyPolicy::Threshold(t),
            (0, _) => VerifyPolicy::Full,
            (w, _) => VerifyPolicy::Fixed(w),
        };
        let config =
            EngineConfig { kv_budget_bytes: p.kv_budget_mib << 20, verify, ..EngineConfig::default() };
        let options = LoadOptions { device, dtype, progress: None };
        let engine = match draft {
            None => Engine::load(Path::new(target), options, &config),
            Some(draft) => Qwen3::load(Path::new(target), options).and_then(|t| {
                let cache = DraftCacheConfig::default();
                let d = draft::load_with_fp8(p.draft_fp8, |quant| match quant {
                    Some(q) => DSparkDraft::load_quantized(Path::new(draft), &t, options, &cache, q),
                    None => DSparkDraft::load(Path::new(draft), &t, options, &cache),
                })?;
                Engine::with_draft(t, Box::new(d), &config)
            }),
        }
        .map_err(fail)?;
        let handle = Box::new(DsparkEngine { inner: Mutex::new(engine), served: Mutex::default() });
        // SAFETY: out is valid (checked non-null above).
        unsafe { *out = Box::into_raw(handle) };
        Ok(())
    })
}

/// Release an engine. Null is ignored.
///
/// # Safety
/// `engine` is null or a handle from [`dspark_engine_create`] not freed before.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dspark_engine_free(engine: *mut DsparkEngine) {
    if !engine.is_null() {
        let _ = catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: per this function's contract, the handle came from Box::into_raw.
            drop(unsafe { Box::from_raw(engine) });
        }));
    }
}

pub(crate) fn engine_ref<'a>(engine: *mut DsparkEngine) -> Result<&'a DsparkEngine, (DsparkStatus, String)> {
    // SAFETY: the caller of the entry point promises a live handle or null.
    unsafe { engine.as_ref() }.ok_or_else(|| invalid("engine is null"))
}

/// Generate a continuation of `prompt` (token ids). Writes the generated ids to
/// `out_tokens[0..*out_len]`; when `out_capacity` is too small, returns
/// `DSPARK_STATUS_BUFFER_TOO_SMALL` with the needed length in `*out_len`. `stats` may be null.
///
/// # Safety
/// `engine` is a live handle; `prompt` points to `prompt_len` ids; `params` is null (defaults)
/// or valid, its stop-token array readable; `out_tokens` holds `out_capacity` ids; `out_len` is
/// valid; `stats` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dspark_engine_generate(
    engine: *mut DsparkEngine,
    prompt: *const u32,
    prompt_len: usize,
    params: *const DsparkSamplingParams,
    out_tokens: *mut u32,
    out_capacity: usize,
    out_len: *mut usize,
    stats: *mut DsparkGenerationStats,
) -> DsparkStatus {
    guard(|| {
        let engine = engine_ref(engine)?;
        if out_len.is_null() {
            return Err(invalid("out_len is null"));
        }
        // SAFETY: per this function's contract.
        let prompt = unsafe { slice_arg(prompt, prompt_len, "prompt") }?.to_vec();
        // SAFETY: params is null or valid, its stop-token array readable.
        let params = unsafe { sampling_arg(params) }?;
        let mut engine =
            engine.inner.lock().map_err(|_| (DsparkStatus::Internal, "engine lock poisoned".into()))?;
        let g = engine.generate(&[Request { prompt, params }]).map_err(fail)?.remove(0);
        // SAFETY: out_len is valid (checked non-null).
        unsafe { *out_len = g.tokens.len() };
        if !stats.is_null() {
            let (finish_reason, stop_token) = match g.finish {
                Some(FinishReason::Stop(t)) => (1, t),
                Some(FinishReason::Length) => (2, 0),
                _ => (0, 0),
            };
            let s = DsparkGenerationStats {
                prompt_tokens: g.stats.prompt_tokens,
                generated_tokens: g.stats.generated_tokens,
                rounds: g.stats.rounds,
                drafted: g.stats.drafted,
                accepted: g.stats.accepted,
                tau: g.stats.tau,
                finish_reason,
                stop_token,
            };
            // SAFETY: stats is valid when non-null.
            unsafe { *stats = s };
        }
        if g.tokens.len() > out_capacity {
            return Err((
                DsparkStatus::BufferTooSmall,
                format!("{} tokens generated, out_capacity is {out_capacity}", g.tokens.len()),
            ));
        }
        if !g.tokens.is_empty() {
            if out_tokens.is_null() {
                return Err(invalid("out_tokens is null"));
            }
            // SAFETY: out_tokens holds out_capacity >= len ids.
            unsafe { std::ptr::copy_nonoverlapping(g.tokens.as_ptr(), out_tokens, g.tokens.len()) };
        }
        Ok(())
    })
}

/// Log-probability of every token of `tokens` after the first, given the tokens before it:
/// writes `tokens_len − 1` floats to `out_logprobs` (which holds `out_capacity`).
///
/// # Safety
/// `engine` is a live handle; `tokens` points to `tokens_len` ids; `out_logprobs` holds
/// `out_capacity` floats.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dspark_engine_score(
    engine: *mut DsparkEngine,
    tokens: *const u32,
    tokens_len: usize,
    out_logprobs: *mut f32,
    out_capacity: usize,
) -> DsparkStatus {
    guard(|| {
        let engine = engine_ref(engine)?;
        // SAFETY: per this function's contract.
        let tokens = unsafe { slice_arg(tokens, tokens_len, "tokens") }?;
        let mut engine =
            engine.inner.lock().map_err(|_| (DsparkStatus::Internal, "engine lock poisoned".into()))?;
        let scores = engine.score(tokens).map_err(fail)?;
        if scores.len() > out_capacity || out_logprobs.is_null() {
            return Err((
                DsparkStatus::BufferTooSmall,
                format!("{} scores, out_capacity is {out_capacity}", scores.len()),
            ));
        }
        // SAFETY: out_logprobs holds out_capacity >= len floats.
        unsafe { std::ptr::copy_nonoverlapping(scores.as_ptr(), out_logprobs, scores.len()) };
        Ok(())
    })
}

/// The message of the last failed call on this thread (empty after a success). The pointer is
/// valid until the next dspark call on the same thread; do not free it.
#[unsafe(no_mangle)]
pub extern "C" fn dspark_last_error_message() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// The library version, a static NUL-terminated string.
#[unsafe(no_mangle)]
pub extern "C" fn dspark_version() -> *const c_char {
    static VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");
    VERSION.as_ptr().cast()
}

/// Record forwards as CUDA graphs and replay them (`enabled` non-zero, the default) or run them
/// op by op (`0`); the output is the same either way. Process-wide, from the next forward.
#[unsafe(no_mangle)]
pub extern "C" fn dspark_set_graphs_enabled(enabled: i32) {
    dspark::set_graphs_enabled(enabled != 0);
}

/// Whether forwards are recorded as CUDA graphs: 1 or 0.
#[unsafe(no_mangle)]
pub extern "C" fn dspark_graphs_enabled() -> i32 {
    i32::from(dspark::graphs_enabled())
}

/// A log sink: `level` is 1 (error) to 5 (trace); `message` is valid during the call only.
pub type DsparkLogCallback =
    Option<unsafe extern "C" fn(level: i32, message: *const c_char, user: *mut c_void)>;

struct Sink {
    callback: DsparkLogCallback,
    user: usize,
}

fn sink() -> &'static Mutex<Sink> {
    static SINK: OnceLock<Mutex<Sink>> = OnceLock::new();
    SINK.get_or_init(|| Mutex::new(Sink { callback: None, user: 0 }))
}

/// One formatted log record, sent to the callback when dropped.
struct Record {
    level: i32,
    buffer: Vec<u8>,
}

impl std::io::Write for Record {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buffer.extend_from_slice(data);
        Ok(data.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        let text = String::from_utf8_lossy(&self.buffer).trim_end().replace('\0', " ");
        if text.is_empty() {
            return;
        }
        if let Ok(sink) = sink().lock()
            && let (Some(cb), Ok(message)) = (sink.callback, CString::new(text))
        {
            // SAFETY: the callback was registered by the host for exactly this use.
            unsafe { cb(self.level, message.as_ptr(), sink.user as *mut c_void) };
        }
    }
}

struct Records;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Records {
    type Writer = Record;
    fn make_writer(&'a self) -> Record {
        Record { level: 3, buffer: Vec::new() }
    }
    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> Record {
        let level = match *meta.level() {
            tracing::Level::ERROR => 1,
            tracing::Level::WARN => 2,
            tracing::Level::INFO => 3,
            tracing::Level::DEBUG => 4,
            tracing::Level::TRACE => 5,
        };
        Record { level, buffer: Vec::new() }
    }
}

/// Route the library's log to `callback` (null stops it), for records at `max_level` (1 error
/// … 5 trace) and more severe. The first call installs the process-wide log subscriber; it
/// fails with `DSPARK_STATUS_INTERNAL` if the host process already installed another one.
///
/// # Safety
/// `callback` stays callable, and `user` valid for it, until it is replaced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dspark_set_log_callback(
    callback: DsparkLogCallback,
    user: *mut c_void,
    max_level: i32,
) -> DsparkStatus {
    guard(|| {
        static INSTALLED: OnceLock<bool> = OnceLock::new();
        let level = match max_level {
            i32::MIN..=1 => tracing::Level::ERROR,
            2 => tracing::Level::WARN,
            3 => tracing::Level::INFO,
            4 => tracing::Level::DEBUG,
            _ => tracing::Level::TRACE,
        };
        let installed = *INSTALLED.get_or_init(|| {
            tracing_subscriber::fmt()
                .with_max_level(level)
                .with_ansi(false)
                .without_time()
                .with_writer(Records)
                .try_init()
                .is_ok()
        });
        if !installed {
            return Err((
                DsparkStatus::Internal,
                "another log subscriber is installed in this process".into(),
            ));
        }
        let mut s = sink().lock().map_err(|_| (DsparkStatus::Internal, "log sink lock poisoned".into()))?;
        *s = Sink { callback, user: user as usize };
        Ok(())
    })
}

/// Write a verdict's committed tokens and accepted count to the caller's buffers.
fn write_verdict(
    verdict: &dspark::accept::Verdict,
    out_committed: *mut u32,
    out_capacity: usize,
    out_len: *mut usize,
    out_accepted: *mut usize,
) -> Result<(), (DsparkStatus, String)> {
    if out_len.is_null() || out_accepted.is_null() {
        return Err(invalid("out_len or out_accepted is null"));
    }
    // SAFETY: both checked non-null; the caller promises they are valid.
    unsafe {
        *out_len = verdict.committed.len();
        *out_accepted = verdict.accepted;
    }
    if verdict.committed.len() > out_capacity || out_committed.is_null() {
        return Err((
            DsparkStatus::BufferTooSmall,
            format!("{} committed tokens, out_capacity is {out_capacity}", verdict.committed.len()),
        ));
    }
    // SAFETY: out_committed holds out_capacity >= len ids.
    unsafe {
        std::ptr::copy_nonoverlapping(verdict.committed.as_ptr(), out_committed, verdict.committed.len())
    };
    Ok(())
}

/// Greedy acceptance for an engine that owns its target: accept the longest prefix of `drafts`
/// equal to the target's argmax rows, then the target's token at the first mismatch (or at the
/// extra row). `target_argmax` has `num_drafts + 1` entries. Writes the committed tokens
/// (accepted drafts + bonus) and the accepted count.
///
/// # Safety
/// `drafts` holds `num_drafts` ids, `target_argmax` `num_drafts + 1`; `out_committed` holds
/// `out_capacity` ids (`num_drafts + 1` always suffices); `out_len` and `out_accepted` are valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dspark_accept_greedy(
    drafts: *const u32,
    num_drafts: usize,
    target_argmax: *const u32,
    out_committed: *mut u32,
    out_capacity: usize,
    out_len: *mut usize,
    out_accepted: *mut usize,
) -> DsparkStatus {
    guard(|| {
        // SAFETY: per this function's contract.
        let drafts = unsafe { slice_arg(drafts, num_drafts, "drafts") }?;
        // SAFETY: per this function's contract.
        let argmax = unsafe { slice_arg(target_argmax, num_drafts + 1, "target_argmax") }?;
        let verdict = dspark::accept::greedy_verify(drafts, argmax, None).map_err(fail)?;
        write_verdict(&verdict, out_committed, out_capacity, out_len, out_accepted)
    })
}

/// Sampled acceptance (chain rejection with the `max(0, p − q)` residual) for an engine that
/// owns its target. `p` is `(num_drafts + 1) × vocab` target probabilities (after temperature,
/// top-k, top-p), `q` is `num_drafts × vocab`: the distributions the drafts were drawn from.
/// Coins come from `(seed, absolute position)`, `first_position` being the position of
/// `drafts[0]`, so the result does not depend on batching. Writes the committed tokens and the
/// accepted count.
///
/// # Safety
/// The arrays hold the lengths stated; `out_committed` holds `out_capacity` ids; `out_len` and
/// `out_accepted` are valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dspark_accept_chain(
    drafts: *const u32,
    num_drafts: usize,
    p: *const f32,
    q: *const f32,
    vocab: usize,
    seed: u64,
    first_position: usize,
    out_committed: *mut u32,
    out_capacity: usize,
    out_len: *mut usize,
    out_accepted: *mut usize,
) -> DsparkStatus {
    guard(|| {
        if vocab == 0 {
            return Err(invalid("vocab is 0"));
        }
        // SAFETY: per this function's contract.
        let drafts = unsafe { slice_arg(drafts, num_drafts, "drafts") }?;
        // SAFETY: per this function's contract.
        let p = unsafe { slice_arg(p, (num_drafts + 1) * vocab, "p") }?;
        // SAFETY: per this function's contract.
        let q = unsafe { slice_arg(q, num_drafts * vocab, "q") }?;
        let widen = |rows: &[f32]| -> Vec<Vec<f64>> {
            rows.chunks_exact(vocab).map(|r| r.iter().map(|&x| f64::from(x)).collect()).collect()
        };
        let (p, q) = (widen(p), widen(q));
        let p_rows: Vec<&[f64]> = p.iter().map(Vec::as_slice).collect();
        let q_rows: Vec<&[f64]> = q.iter().map(Vec::as_slice).collect();
        let verdict =
            dspark::accept::chain_verify_seeded(drafts, &p_rows, &q_rows, seed, first_position, None)
                .map_err(fail)?;
        write_verdict(&verdict, out_committed, out_capacity, out_len, out_accepted)
    })
}

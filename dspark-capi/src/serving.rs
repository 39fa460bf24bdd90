//! Serving calls: requests join and leave between rounds. `dspark_engine_submit` queues a
//! request, `dspark_engine_step` admits what fits the KV budgets and runs one round over every
//! running request, `dspark_engine_request_tokens` reads a request's tokens so far and its state,
//! `dspark_engine_cancel` stops one and frees its KV at once, `dspark_engine_release` forgets a
//! finished one. The engine queues, preempts and resumes under KV pressure; see the Rust
//! `Engine::step` documentation.

use std::collections::HashMap;

use dspark::{FinishReason, Generation, Request, RequestId};

use crate::{DsparkEngine, DsparkStatus, engine_ref, fail, guard, invalid, sampling_arg, slice_arg};

/// The request is still queued or running (`finish_reason` of [`dspark_engine_request_tokens`]).
pub const DSPARK_FINISH_NONE_YET: i32 = -1;
/// Finished without tokens: `max_new_tokens` was 0.
pub const DSPARK_FINISH_EMPTY: i32 = 0;
/// Finished at a stop token (the last token).
pub const DSPARK_FINISH_STOP: i32 = 1;
/// Finished at `max_new_tokens`.
pub const DSPARK_FINISH_LENGTH: i32 = 2;
/// Stopped by [`dspark_engine_cancel`].
pub const DSPARK_FINISH_CANCELLED: i32 = 3;

/// A request submitted through the serving calls.
#[derive(Debug, Default)]
pub(crate) struct Tracked {
    tokens: Vec<u32>,
    /// `None` while unfinished; then the engine's finish reason.
    finish: Option<Option<FinishReason>>,
}

/// Requests of one engine's serving calls, by id.
pub(crate) type Served = HashMap<RequestId, Tracked>;

fn finish_code(finish: Option<Option<FinishReason>>) -> (i32, u32) {
    match finish {
        None => (DSPARK_FINISH_NONE_YET, 0),
        Some(Some(FinishReason::Stop(t))) => (DSPARK_FINISH_STOP, t),
        Some(Some(FinishReason::Length)) => (DSPARK_FINISH_LENGTH, 0),
        Some(Some(FinishReason::Cancelled)) => (DSPARK_FINISH_CANCELLED, 0),
        Some(_) => (DSPARK_FINISH_EMPTY, 0),
    }
}

fn record(served: &mut Served, id: RequestId, g: Generation) {
    let t = served.entry(id).or_default();
    t.tokens = g.tokens;
    t.finish = Some(g.finish);
}

/// Queue a request (the prompt is copied). It starts at a later [`dspark_engine_step`] when it
/// fits the KV budgets; `*out_id` receives its id. A request that could never fit, even alone,
/// is refused with `DSPARK_STATUS_KV_CACHE_FULL`.
///
/// # Safety
/// `engine` is a live handle; `prompt` points to `prompt_len` ids; `params` is null (defaults)
/// or valid, its stop-token array readable; `out_id` is valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dspark_engine_submit(
    engine: *mut DsparkEngine,
    prompt: *const u32,
    prompt_len: usize,
    params: *const crate::DsparkSamplingParams,
    out_id: *mut u64,
) -> DsparkStatus {
    guard(|| {
        let handle = engine_ref(engine)?;
        if out_id.is_null() {
            return Err(invalid("out_id is null"));
        }
        // SAFETY: per this function's contract.
        let prompt = unsafe { slice_arg(prompt, prompt_len, "prompt") }?.to_vec();
        // SAFETY: params is null or valid, its stop-token array readable.
        let params = unsafe { sampling_arg(params) }?;
        let mut e =
            handle.inner.lock().map_err(|_| (DsparkStatus::Internal, "engine lock poisoned".into()))?;
        let id = e.submit(Request { prompt, params }).map_err(fail)?;
        let mut served =
            handle.served.lock().map_err(|_| (DsparkStatus::Internal, "engine lock poisoned".into()))?;
        served.insert(id, Tracked::default());
        // SAFETY: out_id is valid (checked non-null).
        unsafe { *out_id = id };
        Ok(())
    })
}

/// Run one step: admit queued requests that fit, then one round (a decode step, or draft →
/// verify → accept) over every running request. Each out-pointer may be null; otherwise it
/// receives, after the step, the requests running, the requests waiting, and how many finished
/// in this step. On error every unfinished request is dropped (its KV freed) and reported as
/// cancelled.
///
/// # Safety
/// `engine` is a live handle; each out-pointer is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dspark_engine_step(
    engine: *mut DsparkEngine,
    out_running: *mut usize,
    out_waiting: *mut usize,
    out_finished: *mut usize,
) -> DsparkStatus {
    guard(|| {
        let handle = engine_ref(engine)?;
        let mut e =
            handle.inner.lock().map_err(|_| (DsparkStatus::Internal, "engine lock poisoned".into()))?;
        let mut served =
            handle.served.lock().map_err(|_| (DsparkStatus::Internal, "engine lock poisoned".into()))?;
        let step = match e.step() {
            Ok(step) => step,
            Err(err) => {
                for t in served.values_mut().filter(|t| t.finish.is_none()) {
                    t.finish = Some(Some(FinishReason::Cancelled));
                }
                return Err(fail(err));
            }
        };
        for ev in step.events {
            // Requests submitted through the Rust API of a shared engine are not tracked here.
            if let Some(t) = served.get_mut(&ev.id) {
                t.tokens.extend(ev.tokens);
            }
        }
        let finished = step.finished.len();
        for (id, g) in step.finished {
            if served.contains_key(&id) {
                record(&mut served, id, g);
            }
        }
        for (ptr, value) in
            [(out_running, e.num_running()), (out_waiting, e.num_waiting()), (out_finished, finished)]
        {
            if !ptr.is_null() {
                // SAFETY: the caller promises a valid pointer when non-null.
                unsafe { *ptr = value };
            }
        }
        Ok(())
    })
}

/// A submitted request's tokens so far and its state. Writes the tokens to
/// `out_tokens[0..*out_len]`; when `out_capacity` is too small, returns
/// `DSPARK_STATUS_BUFFER_TOO_SMALL` with the needed length in `*out_len`. `out_finish_reason`
/// (may be null) receives one of the `DSPARK_FINISH_*` codes, `out_stop_token` (may be null) the
/// stop token when the code is `DSPARK_FINISH_STOP`.
///
/// # Safety
/// `engine` is a live handle; `out_tokens` holds `out_capacity` ids (may be null when
/// `out_capacity` is 0); `out_len` is valid; the other out-pointers are null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dspark_engine_request_tokens(
    engine: *mut DsparkEngine,
    id: u64,
    out_tokens: *mut u32,
    out_capacity: usize,
    out_len: *mut usize,
    out_finish_reason: *mut i32,
    out_stop_token: *mut u32,
) -> DsparkStatus {
    guard(|| {
        let handle = engine_ref(engine)?;
        if out_len.is_null() {
            return Err(invalid("out_len is null"));
        }
        let served =
            handle.served.lock().map_err(|_| (DsparkStatus::Internal, "engine lock poisoned".into()))?;
        let t = served.get(&id).ok_or_else(|| invalid(format!("no submitted request with id {id}")))?;
        let (code, stop) = finish_code(t.finish);
        // SAFETY: out_len is valid; the others are valid when non-null.
        unsafe {
            *out_len = t.tokens.len();
            if !out_finish_reason.is_null() {
                *out_finish_reason = code;
            }
            if !out_stop_token.is_null() {
                *out_stop_token = stop;
            }
        }
        if t.tokens.len() > out_capacity {
            return Err((
                DsparkStatus::BufferTooSmall,
                format!("{} tokens so far, out_capacity is {out_capacity}", t.tokens.len()),
            ));
        }
        if !t.tokens.is_empty() {
            if out_tokens.is_null() {
                return Err(invalid("out_tokens is null"));
            }
            // SAFETY: out_tokens holds out_capacity >= len ids.
            unsafe { std::ptr::copy_nonoverlapping(t.tokens.as_ptr(), out_tokens, t.tokens.len()) };
        }
        Ok(())
    })
}

/// Stop a submitted, unfinished request now and free its KV at once. Its tokens so far stay
/// readable (finish code `DSPARK_FINISH_CANCELLED`) until [`dspark_engine_release`].
///
/// # Safety
/// `engine` is a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dspark_engine_cancel(engine: *mut DsparkEngine, id: u64) -> DsparkStatus {
    guard(|| {
        let handle = engine_ref(engine)?;
        let mut e =
            handle.inner.lock().map_err(|_| (DsparkStatus::Internal, "engine lock poisoned".into()))?;
        let mut served =
            handle.served.lock().map_err(|_| (DsparkStatus::Internal, "engine lock poisoned".into()))?;
        if !served.contains_key(&id) {
            return Err(invalid(format!("no submitted request with id {id}")));
        }
        let g = e.cancel(id).map_err(fail)?;
        record(&mut served, id, g);
        Ok(())
    })
}

/// Forget a finished request (its tokens are no longer readable).
///
/// # Safety
/// `engine` is a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dspark_engine_release(engine: *mut DsparkEngine, id: u64) -> DsparkStatus {
    guard(|| {
        let handle = engine_ref(engine)?;
        let mut served =
            handle.served.lock().map_err(|_| (DsparkStatus::Internal, "engine lock poisoned".into()))?;
        match served.get(&id).map(|t| t.finish.is_some()) {
            None => Err(invalid(format!("no submitted request with id {id}"))),
            Some(false) => Err(invalid(format!("request {id} has not finished; cancel it first"))),
            Some(true) => {
                served.remove(&id);
                Ok(())
            }
        }
    })
}

//! The serving C calls (submit / step / request_tokens / cancel / release) on the golden tiny
//! models: requests submitted at different times, joining a running batch, reproduce, token
//! for token, what `dspark_engine_generate` gives for each alone; cancellation and bad input
//! come back as status codes.
#![allow(clippy::unwrap_used)]

use std::ffi::CString;
use std::path::PathBuf;

use dspark_capi::*;

fn golden() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../dspark/tests/fixtures/golden")
}

fn create(draft: bool, kv_budget_mib: usize) -> *mut DsparkEngine {
    let target = CString::new(golden().join("tiny-qwen3").to_str().unwrap()).unwrap();
    let draft_dir = CString::new(golden().join("tiny-dspark").to_str().unwrap()).unwrap();
    let mut params = dspark_engine_default_params();
    params.kv_budget_mib = kv_budget_mib;
    let mut engine = std::ptr::null_mut();
    let d = if draft { draft_dir.as_ptr() } else { std::ptr::null() };
    // SAFETY: valid strings and out-pointer.
    let status = unsafe { dspark_engine_create(target.as_ptr(), d, &params, &mut engine) };
    assert_eq!(status, DsparkStatus::Ok);
    engine
}

fn prompts() -> Vec<Vec<u32>> {
    vec![vec![37, 35, 253, 491, 331], vec![220, 79, 107, 117, 73, 108, 120, 305], vec![12, 400, 9]]
}

fn sampling(i: usize) -> DsparkSamplingParams {
    let mut s = dspark_sampling_default_params();
    s.max_new_tokens = 20 + i;
    if i == 1 {
        s.temperature = 0.8;
        s.seed = 7;
    }
    s
}

fn alone(engine: *mut DsparkEngine, prompt: &[u32], params: &DsparkSamplingParams) -> Vec<u32> {
    let mut out = vec![0u32; 64];
    let mut len = 0;
    // SAFETY: live handle, valid buffers.
    let status = unsafe {
        dspark_engine_generate(
            engine,
            prompt.as_ptr(),
            prompt.len(),
            params,
            out.as_mut_ptr(),
            out.len(),
            &mut len,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(status, DsparkStatus::Ok);
    out.truncate(len);
    out
}

fn tokens_of(engine: *mut DsparkEngine, id: u64) -> (Vec<u32>, i32) {
    let (mut len, mut code, mut stop) = (0usize, 0i32, 0u32);
    // Ask for the length first: a zero-capacity buffer reports it.
    // SAFETY: live handle, valid out-pointers.
    let status = unsafe {
        dspark_engine_request_tokens(engine, id, std::ptr::null_mut(), 0, &mut len, &mut code, &mut stop)
    };
    assert!(status == DsparkStatus::Ok || status == DsparkStatus::BufferTooSmall);
    let mut out = vec![0u32; len];
    // SAFETY: as above, `out` holds `len` ids.
    let status = unsafe {
        dspark_engine_request_tokens(engine, id, out.as_mut_ptr(), out.len(), &mut len, &mut code, &mut stop)
    };
    assert_eq!(status, DsparkStatus::Ok);
    (out, code)
}

#[test]
fn requests_joining_a_running_batch_reproduce_generate() {
    for draft in [false, true] {
        let reference = create(draft, 64);
        let expected: Vec<Vec<u32>> =
            prompts().iter().enumerate().map(|(i, p)| alone(reference, p, &sampling(i))).collect();
        // SAFETY: handle from dspark_engine_create.
        unsafe { dspark_engine_free(reference) };

        let engine = create(draft, 1);
        let mut ids = Vec::new();
        let (mut running, mut waiting, mut finished) = (0usize, 0usize, 0usize);
        for (i, p) in prompts().iter().enumerate() {
            let mut id = 0;
            // SAFETY: live handle, valid prompt and out-pointer.
            let status = unsafe { dspark_engine_submit(engine, p.as_ptr(), p.len(), &sampling(i), &mut id) };
            assert_eq!(status, DsparkStatus::Ok);
            ids.push(id);
            // One step between submissions: requests join a running batch.
            // SAFETY: live handle, valid out-pointers.
            let status = unsafe { dspark_engine_step(engine, &mut running, &mut waiting, &mut finished) };
            assert_eq!(status, DsparkStatus::Ok);
            assert_eq!(tokens_of(engine, id).1, DSPARK_FINISH_NONE_YET);
        }
        let mut steps = 0;
        while running + waiting > 0 {
            // SAFETY: as above.
            let status = unsafe { dspark_engine_step(engine, &mut running, &mut waiting, &mut finished) };
            assert_eq!(status, DsparkStatus::Ok);
            steps += 1;
            assert!(steps < 1000);
        }
        for (i, &id) in ids.iter().enumerate() {
            let (tokens, code) = tokens_of(engine, id);
            assert_eq!(tokens, expected[i], "draft={draft} request {i}");
            assert_eq!(code, DSPARK_FINISH_LENGTH);
            // SAFETY: live handle.
            assert_eq!(unsafe { dspark_engine_release(engine, id) }, DsparkStatus::Ok);
            // SAFETY: live handle.
            assert_eq!(unsafe { dspark_engine_release(engine, id) }, DsparkStatus::InvalidArgument);
        }
        // SAFETY: handle from dspark_engine_create.
        unsafe { dspark_engine_free(engine) };
    }
}

#[test]
fn cancel_and_bad_input_are_status_codes() {
    let engine = create(true, 64);
    let p = &prompts()[0];
    let mut id = 0;
    // SAFETY: live handle, valid arguments throughout.
    unsafe {
        assert_eq!(
            dspark_engine_submit(engine, p.as_ptr(), p.len(), &sampling(0), &mut id),
            DsparkStatus::Ok
        );
        assert_eq!(
            dspark_engine_step(engine, std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut()),
            DsparkStatus::Ok
        );
        assert_eq!(dspark_engine_release(engine, id), DsparkStatus::InvalidArgument, "unfinished");
        assert_eq!(dspark_engine_cancel(engine, id), DsparkStatus::Ok);
        assert_eq!(dspark_engine_cancel(engine, id), DsparkStatus::InvalidArgument, "already finished");
    }
    let (tokens, code) = tokens_of(engine, id);
    assert_eq!(code, DSPARK_FINISH_CANCELLED);
    assert!(!tokens.is_empty() && tokens.len() < 20);
    let mut len = 0;
    // SAFETY: live handle, valid arguments; each call is malformed on purpose.
    unsafe {
        assert_eq!(dspark_engine_cancel(engine, 999), DsparkStatus::InvalidArgument);
        assert_eq!(
            dspark_engine_request_tokens(
                engine,
                999,
                std::ptr::null_mut(),
                0,
                &mut len,
                std::ptr::null_mut(),
                std::ptr::null_mut()
            ),
            DsparkStatus::InvalidArgument
        );
        assert_eq!(
            dspark_engine_submit(engine, std::ptr::null(), 3, &sampling(0), &mut id),
            DsparkStatus::InvalidArgument
        );
        assert_eq!(
            dspark_engine_submit(engine, p.as_ptr(), p.len(), &sampling(0), std::ptr::null_mut()),
            DsparkStatus::InvalidArgument
        );
        let bad = [600u32];
        assert_eq!(
            dspark_engine_submit(engine, bad.as_ptr(), 1, &sampling(0), &mut id),
            DsparkStatus::TokenOutOfRange
        );
        assert_eq!(
            dspark_engine_step(
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut()
            ),
            DsparkStatus::InvalidArgument
        );
        dspark_engine_free(engine);
    }
}

#[test]
fn the_graph_switch_round_trips() {
    // Process-wide; every other test here runs on the CPU, where no graph is recorded, so the
    // switch changes nothing for them.
    assert_eq!(dspark_graphs_enabled(), 1);
    dspark_set_graphs_enabled(0);
    assert_eq!(dspark_graphs_enabled(), 0);
    dspark_set_graphs_enabled(7);
    assert_eq!(dspark_graphs_enabled(), 1);
}

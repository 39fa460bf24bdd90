//! The speculator-only C calls driven the way a serving engine that owns its target would drive
//! them: dspark's own Qwen3 stands in for "the engine's target" (prefill and verify with feature
//! capture, its own KV cache), the draft lives behind the C ABI, bound to the target's weights
//! passed as host buffers, and acceptance goes through `dspark_accept_greedy`. The result must
//! equal the reference implementation's speculative greedy run (tokens and accepted count per
//! round) and dspark's target-only greedy output.
#![allow(clippy::unwrap_used)]

use std::ffi::CString;
use std::path::PathBuf;

use burn::tensor::{Int, Tensor};
use dspark::weights::Checkpoint;
use dspark::{
    ComputeDtype, Engine, EngineConfig, KvCache, LoadOptions, LogitRows, PagedKvCache, Qwen3, Request,
    SamplingParams, SeqChunk,
};
use dspark_capi::*;
use serde_json::Value;

fn golden() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../dspark/tests/fixtures/golden")
}

fn cases(kind: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(golden().join("cases.json")).unwrap();
    let all: Value = serde_json::from_str(&text).unwrap();
    all["sets"][0]["cases"].as_array().unwrap().iter().filter(|c| c["kind"] == kind).cloned().collect()
}

fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

fn host_f32(t: Tensor<2>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
}

fn argmax_rows(logits: Tensor<2>) -> Vec<u32> {
    let ids: Tensor<2, Int> = logits.argmax(1);
    ids.into_data().convert::<i64>().try_to_vec::<i64>().unwrap().iter().map(|&i| i as u32).collect()
}

/// The target's embedding and LM head as little-endian f32 bytes, read from its checkpoint.
fn target_weights(dir: &std::path::Path) -> (Vec<u8>, Vec<u8>) {
    let ckpt = Checkpoint::open(dir).unwrap();
    let read = |name: &str| ckpt.read(name, &[512, 64], ComputeDtype::F32).unwrap().as_bytes().to_vec();
    (read("model.embed_tokens.weight"), read("lm_head.weight"))
}

fn create_draft(layout: &str, embed: &[u8], head: &[u8]) -> *mut DsparkDraft {
    let (status, draft) = create_draft_with(layout, embed, head, None);
    assert_eq!(status, DsparkStatus::Ok);
    draft
}

fn create_draft_with(
    layout: &str,
    embed: &[u8],
    head: &[u8],
    params: Option<&DsparkDraftParams>,
) -> (DsparkStatus, *mut DsparkDraft) {
    let dir = CString::new(golden().join(layout).to_str().unwrap()).unwrap();
    let weights = DsparkTargetWeights {
        embed_tokens: embed.as_ptr().cast(),
        lm_head: head.as_ptr().cast(),
        dtype: c"f32".as_ptr(),
        vocab_size: 512,
        hidden_size: 64,
        num_hidden_layers: 6,
    };
    let mut draft = std::ptr::null_mut();
    let params = params.map_or(std::ptr::null(), |p| p as *const DsparkDraftParams);
    // SAFETY: valid strings, buffers of 512·64 f32 each, params null or valid, valid out-pointer.
    let status = unsafe { dspark_draft_create(dir.as_ptr(), &weights, params, &mut draft) };
    (status, draft)
}

/// One greedy speculative generation of `max_new` tokens; returns (tokens, accepted per round).
fn generate(
    target: &Qwen3,
    draft: *mut DsparkDraft,
    prompt: &[u32],
    max_new: usize,
) -> (Vec<u32>, Vec<usize>) {
    let mut info = DsparkDraftInfo::default();
    // SAFETY: live handle, valid out-pointer.
    assert_eq!(unsafe { dspark_draft_info(draft, &mut info) }, DsparkStatus::Ok);
    let mut layers = vec![0usize; info.num_feature_layers];
    // SAFETY: `layers` holds num_feature_layers values.
    assert_eq!(
        unsafe { dspark_draft_feature_layers(draft, layers.as_mut_ptr(), layers.len()) },
        DsparkStatus::Ok
    );
    let gamma = info.block_size;
    let mut cache = PagedKvCache::new(target.kv_layout(16), 8 << 20, target.device()).unwrap();
    let tseq = cache.allocate();

    // Prefill: features of the prompt rows, and the first token.
    let out = target
        .forward(&[SeqChunk { seq: tseq, tokens: prompt, logits: LogitRows::Last }], &layers, &mut cache)
        .unwrap();
    let features = host_f32(out.features.unwrap());
    assert_eq!(features.len(), prompt.len() * info.feature_width);
    let mut anchor = argmax_rows(out.logits.unwrap())[0];
    let mut seq = 0u64;
    // SAFETY: `features` holds prompt.len() rows of feature_width floats.
    let status = unsafe { dspark_draft_begin(draft, features.as_ptr(), prompt.len(), &mut seq) };
    assert_eq!(status, DsparkStatus::Ok);

    let mut tokens = vec![anchor];
    let mut rounds = Vec::new();
    let params = dspark_sampling_default_params();
    while tokens.len() < max_new {
        let mut drafts = vec![0u32; gamma];
        let mut confidence = vec![-1.0f32; gamma];
        // SAFETY: live handle, outputs of block_size values, q not wanted (greedy).
        let status = unsafe {
            dspark_draft_propose(
                draft,
                seq,
                anchor,
                &params,
                drafts.as_mut_ptr(),
                std::ptr::null_mut(),
                confidence.as_mut_ptr(),
            )
        };
        assert_eq!(status, DsparkStatus::Ok);
        assert!(confidence.iter().all(|c| (0.0..=1.0).contains(c)), "{confidence:?}");
        // Verify [anchor, d_1..d_γ] with the target, capturing features.
        let mut window = vec![anchor];
        window.extend(&drafts);
        let start = cache.len(tseq).unwrap();
        let out = target
            .forward(&[SeqChunk { seq: tseq, tokens: &window, logits: LogitRows::All }], &layers, &mut cache)
            .unwrap();
        let argmax = argmax_rows(out.logits.unwrap());
        let mut committed = vec![0u32; gamma + 1];
        let (mut len, mut accepted) = (0usize, 0usize);
        // SAFETY: drafts of γ, argmax of γ + 1, output of γ + 1 ids, valid out-pointers.
        let status = unsafe {
            dspark_accept_greedy(
                drafts.as_ptr(),
                gamma,
                argmax.as_ptr(),
                committed.as_mut_ptr(),
                committed.len(),
                &mut len,
                &mut accepted,
            )
        };
        assert_eq!(status, DsparkStatus::Ok);
        assert_eq!(len, accepted + 1);
        rounds.push(accepted);
        // The anchor and the accepted drafts are now committed rows; the bonus is the next anchor.
        cache.truncate(tseq, start + accepted + 1).unwrap();
        let features = host_f32(out.features.unwrap());
        // SAFETY: the first accepted + 1 feature rows.
        let status = unsafe { dspark_draft_commit(draft, seq, features.as_ptr(), accepted + 1) };
        assert_eq!(status, DsparkStatus::Ok);
        let mut context = 0usize;
        // SAFETY: live handle, valid out-pointer.
        assert_eq!(unsafe { dspark_draft_context_len(draft, seq, &mut context) }, DsparkStatus::Ok);
        assert_eq!(context, cache.len(tseq).unwrap());
        tokens.extend(&committed[..len]);
        anchor = committed[len - 1];
    }
    tokens.truncate(max_new);
    // SAFETY: live handle.
    assert_eq!(unsafe { dspark_draft_end(draft, seq) }, DsparkStatus::Ok);
    (tokens, rounds)
}

/// Every golden greedy case through the C calls with `draft` equals target-only output.
fn assert_greedy_like_target_only(target: &Qwen3, plain: &mut Engine, draft: *mut DsparkDraft, what: &str) {
    for case in cases("spec_greedy") {
        let prompt = ids(&case["input_ids"]);
        let (tokens, _) = generate(target, draft, &prompt, 24);
        let reference = plain
            .generate(&[Request { prompt: prompt.clone(), params: SamplingParams::greedy(24) }])
            .unwrap()
            .remove(0);
        assert_eq!(tokens, reference.tokens, "{what}, {}", case["id"]);
    }
}

#[test]
fn speculator_calls_reproduce_the_reference_greedy_run_for_both_layouts() {
    let dir = golden().join("tiny-qwen3");
    let target = Qwen3::load(&dir, LoadOptions::default()).unwrap();
    let mut plain =
        Engine::new(Qwen3::load(&dir, LoadOptions::default()).unwrap(), &EngineConfig::default()).unwrap();
    let (embed, head) = target_weights(&dir);
    for layout in ["tiny-dspark", "tiny-dspark-specforge"] {
        let draft = create_draft(layout, &embed, &head);
        for case in cases("spec_greedy") {
            let prompt = ids(&case["input_ids"]);
            let (tokens, rounds) = generate(&target, draft, &prompt, 24);
            let expected = ids(&case["expected"]["output_tokens"]);
            assert_eq!(tokens, expected[..24], "{layout} {}", case["id"]);
            let reference = plain
                .generate(&[Request { prompt: prompt.clone(), params: SamplingParams::greedy(24) }])
                .unwrap()
                .remove(0);
            assert_eq!(tokens, reference.tokens, "{layout} {}: target-only", case["id"]);
            // Rounds whose anchor lies before the 24-token cut match the reference's counts.
            let exp: Vec<usize> = case["expected"]["rounds"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|r| (r["anchor_position"].as_u64().unwrap() as usize) < prompt.len() + 23)
                .map(|r| r["accepted"].as_u64().unwrap() as usize)
                .collect();
            assert_eq!(&rounds[..exp.len()], &exp[..], "{layout} {}", case["id"]);
        }
        // SAFETY: handle from dspark_draft_create, freed once.
        unsafe { dspark_draft_free(draft) };
    }
}

#[test]
fn an_fp8_draft_behind_the_c_calls_keeps_greedy_output() {
    let dir = golden().join("tiny-qwen3");
    let target = Qwen3::load(&dir, LoadOptions::default()).unwrap();
    let mut plain =
        Engine::new(Qwen3::load(&dir, LoadOptions::default()).unwrap(), &EngineConfig::default()).unwrap();
    let (embed, head) = target_weights(&dir);
    for fp8 in [1, 2] {
        let params = DsparkDraftParams { fp8, ..dspark_draft_default_params() };
        let (status, draft) = create_draft_with("tiny-dspark", &embed, &head, Some(&params));
        assert_eq!(status, DsparkStatus::Ok);
        assert_greedy_like_target_only(&target, &mut plain, draft, &format!("fp8 setting {fp8}"));
        // SAFETY: handle from dspark_draft_create, freed once.
        unsafe { dspark_draft_free(draft) };
    }
    let params = DsparkDraftParams { fp8: 3, ..dspark_draft_default_params() };
    let (status, draft) = create_draft_with("tiny-dspark", &embed, &head, Some(&params));
    assert_eq!(status, DsparkStatus::InvalidArgument);
    assert!(draft.is_null());
}

#[test]
fn a_restricted_draft_behind_the_c_calls_keeps_greedy_output() {
    let dir = golden().join("tiny-qwen3");
    let target = Qwen3::load(&dir, LoadOptions::default()).unwrap();
    let mut plain =
        Engine::new(Qwen3::load(&dir, LoadOptions::default()).unwrap(), &EngineConfig::default()).unwrap();
    let (embed, head) = target_weights(&dir);
    let draft = create_draft("tiny-dspark", &embed, &head);
    // Bad sets first: nothing, an id outside the vocabulary, null with a length.
    for (bad, n) in [(&[][..], 0), (&[7u32, 512][..], 2)] {
        // SAFETY: live handle, `bad` holds `n` values.
        let status = unsafe { dspark_draft_restrict_vocab(draft, bad.as_ptr(), n) };
        assert_eq!(status, DsparkStatus::InvalidArgument, "{bad:?}");
    }
    // SAFETY: live handle; a null pointer with a length must be refused, not read.
    assert_eq!(
        unsafe { dspark_draft_restrict_vocab(draft, std::ptr::null(), 4) },
        DsparkStatus::InvalidArgument
    );
    let keep: Vec<u32> = (0..512).filter(|t| t % 2 == 0).collect();
    // SAFETY: live handle, `keep` holds its length.
    assert_eq!(unsafe { dspark_draft_restrict_vocab(draft, keep.as_ptr(), keep.len()) }, DsparkStatus::Ok);
    // SAFETY: as above; a second restriction is refused.
    assert_eq!(
        unsafe { dspark_draft_restrict_vocab(draft, keep.as_ptr(), keep.len()) },
        DsparkStatus::InvalidArgument
    );
    assert_greedy_like_target_only(&target, &mut plain, draft, "restricted draft");
    // SAFETY: handle from dspark_draft_create, freed once.
    unsafe { dspark_draft_free(draft) };
}

#[test]
fn speculator_calls_report_bad_input_as_status_codes() {
    let dir = golden().join("tiny-qwen3");
    let (embed, head) = target_weights(&dir);
    let draft_dir = CString::new(golden().join("tiny-dspark").to_str().unwrap()).unwrap();
    let mut draft = std::ptr::null_mut();
    // A target with a different depth: feature layer 3 would still fit, but the draft records
    // num_target_layers 6, so a 4-layer target is refused before any compute.
    let mut weights = DsparkTargetWeights {
        embed_tokens: embed.as_ptr().cast(),
        lm_head: head.as_ptr().cast(),
        dtype: c"f32".as_ptr(),
        vocab_size: 512,
        hidden_size: 64,
        num_hidden_layers: 4,
    };
    // SAFETY: valid arguments throughout; the calls must fail cleanly.
    unsafe {
        assert_eq!(
            dspark_draft_create(draft_dir.as_ptr(), &weights, std::ptr::null(), &mut draft),
            DsparkStatus::Checkpoint
        );
        assert!(draft.is_null());
        // A buffer shorter than vocab · hidden is caught by length, never read past.
        weights.num_hidden_layers = 6;
        weights.hidden_size = 32;
        assert_eq!(
            dspark_draft_create(draft_dir.as_ptr(), &weights, std::ptr::null(), &mut draft),
            DsparkStatus::Checkpoint,
            "hidden size mismatch against the draft's config"
        );
        weights.hidden_size = 64;
        // A dtype dspark does not read (same status as an unknown dtype for an engine).
        weights.dtype = c"int8".as_ptr();
        assert_eq!(
            dspark_draft_create(draft_dir.as_ptr(), &weights, std::ptr::null(), &mut draft),
            DsparkStatus::Unsupported
        );
        weights.dtype = c"f32".as_ptr();
        assert_eq!(
            dspark_draft_create(draft_dir.as_ptr(), &weights, std::ptr::null(), &mut draft),
            DsparkStatus::Ok
        );

        let mut seq = 0u64;
        // Features of the wrong count: null with rows > 0.
        assert_eq!(dspark_draft_begin(draft, std::ptr::null(), 3, &mut seq), DsparkStatus::InvalidArgument);
        // An empty begin is allowed; proposing then works from the anchor alone.
        assert_eq!(dspark_draft_begin(draft, std::ptr::null(), 0, &mut seq), DsparkStatus::Ok);
        let params = dspark_sampling_default_params();
        let mut out = [0u32; 4];
        let null = std::ptr::null_mut();
        assert_eq!(
            dspark_draft_propose(draft, seq, 512, &params, out.as_mut_ptr(), null, null),
            DsparkStatus::TokenOutOfRange
        );
        assert_eq!(
            dspark_draft_propose(draft, seq + 99, 5, &params, out.as_mut_ptr(), null, null),
            DsparkStatus::InvalidArgument
        );
        assert!(!std::ffi::CStr::from_ptr(dspark_last_error_message()).to_bytes().is_empty());
        assert_eq!(
            dspark_draft_propose(draft, seq, 5, &params, out.as_mut_ptr(), null, null),
            DsparkStatus::Ok
        );
        assert_eq!(dspark_draft_end(draft, seq), DsparkStatus::Ok);
        assert_eq!(dspark_draft_end(draft, seq), DsparkStatus::InvalidArgument, "ended twice");
        dspark_draft_free(draft);
        dspark_draft_free(std::ptr::null_mut());
    }
}

#[test]
fn sampled_proposals_return_their_distributions() {
    let dir = golden().join("tiny-qwen3");
    let (embed, head) = target_weights(&dir);
    let draft = create_draft("tiny-dspark", &embed, &head);
    let mut params = dspark_sampling_default_params();
    params.temperature = 1.0;
    params.seed = 7;
    // SAFETY: valid handle and buffers of the documented sizes.
    unsafe {
        let mut seq = 0u64;
        assert_eq!(dspark_draft_begin(draft, std::ptr::null(), 0, &mut seq), DsparkStatus::Ok);
        let mut tokens = [0u32; 4];
        let mut q = vec![-1.0f32; 4 * 512];
        let status = dspark_draft_propose(
            draft,
            seq,
            5,
            &params,
            tokens.as_mut_ptr(),
            q.as_mut_ptr(),
            std::ptr::null_mut(),
        );
        assert_eq!(status, DsparkStatus::Ok);
        for (k, row) in q.chunks_exact(512).enumerate() {
            let sum: f32 = row.iter().sum();
            assert!((sum - 1.0).abs() < 1e-4, "row {k} sums to {sum}");
            assert!(row[tokens[k] as usize] > 0.0, "token {k} has zero proposal probability");
        }
        // Same seed and position: the same proposal.
        let mut again = [0u32; 4];
        let null = std::ptr::null_mut();
        assert_eq!(
            dspark_draft_propose(draft, seq, 5, &params, again.as_mut_ptr(), null, null),
            DsparkStatus::Ok
        );
        assert_eq!(tokens, again);
        dspark_draft_free(draft);
    }
}

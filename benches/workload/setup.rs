//! Command line, prompts, models and KV budgets: everything both modes must agree on.

use std::path::{Path, PathBuf};

use clap::Parser;
use dspark::text::{ChatMessage, ChatOptions, Tokenizer};
use dspark::{
    ComputeDtype, DSparkConfig, DSparkDraft, DeviceKind, DraftCacheConfig, Engine, EngineConfig, KvLayout,
    LoadOptions, Qwen3, Qwen3Config, TargetBinding, VerifyPolicy,
};

pub type BoxError = Box<dyn std::error::Error>;

#[derive(Parser, Debug, Clone)]
#[command(name = "bench-workload", about = "Speculative vs target-only on the solo, team and busy workloads")]
pub struct Args {
    /// Target checkpoint folder (Hugging Face Qwen3 layout); not used with a random --shape.
    #[arg(long)]
    pub target: Option<PathBuf>,
    /// DSpark draft folder; not used with a random --shape.
    #[arg(long)]
    pub draft: Option<PathBuf>,
    /// `trained` (load --target and --draft), or random weights at `qwen3-8b` or `tiny` shapes.
    #[arg(long, default_value = "trained")]
    pub shape: String,
    /// Tokenizer folder for the prompts (default: --target; with a random shape
    /// models/tiny-code-qwen3, its ids taken modulo the random model's vocabulary).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// JSONL prompt files (`{"turns": [...]}`, first turn used) or folders of them, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    pub prompts: Vec<PathBuf>,
    /// At most this many prompts from each file (files are interleaved).
    #[arg(long)]
    pub prompts_per_file: Option<usize>,
    /// Prompts longer than this keep their last tokens (the assistant header stays).
    #[arg(long, default_value_t = 512)]
    pub max_prompt_tokens: usize,
    /// Upper bound on generated tokens per request.
    #[arg(long)]
    pub max_new_tokens: usize,
    /// Do not stop at the tokenizer's end-of-sequence ids (random shapes never stop early).
    #[arg(long)]
    pub ignore_eos: bool,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Workloads to run, comma-separated: solo, team, busy.
    #[arg(long, value_delimiter = ',', default_value = "solo,team,busy")]
    pub workloads: Vec<String>,
    /// Requests run one at a time in the solo workload.
    #[arg(long, default_value_t = 8)]
    pub solo_requests: usize,
    /// Concurrent requests per generate call in the team workload (and for the sampled runs).
    #[arg(long, default_value_t = 16)]
    pub team_lanes: usize,
    /// Requests in the team workload (run team_lanes at a time).
    #[arg(long)]
    pub team_requests: Option<usize>,
    /// Concurrent requests in the busy workload (one generate call).
    #[arg(long)]
    pub busy_lanes: Option<usize>,
    /// Share of the busy KV pool the busy requests need at their longest (verify rows included).
    #[arg(long, default_value_t = 0.95)]
    pub busy_fill: f64,
    /// KV budget of the solo and team workloads in MiB (default: what team_lanes of the longest
    /// prompts need at their longest, plus one page per lane).
    #[arg(long)]
    pub kv_budget_mib: Option<usize>,
    /// Rows per KV page.
    #[arg(long, default_value_t = 16)]
    pub page_size: usize,
    /// Verify policy: full, fixed:W (rows), threshold:T, or throughput:FILE (the throughput
    /// scheduler on a cost table written by bench-cost-table).
    #[arg(long, default_value = "full")]
    pub verify: String,
    /// `full`: run each workload once untimed before timing it (every CUDA shape compiled);
    /// `short`: one request with 8 tokens. Default: full on CUDA, short on CPU.
    #[arg(long)]
    pub warmup: Option<String>,
    /// Seeds per prompt of the sampled runs (0 skips the sampled rows of the gate).
    #[arg(long, default_value_t = 4)]
    pub sample_seeds: usize,
    /// Prompts of the sampled runs.
    #[arg(long, default_value_t = 16)]
    pub sample_prompts: usize,
    /// Temperature of the sampled runs.
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    /// Fixed texts (prompt token sequences) whose log-probabilities are compared.
    #[arg(long, default_value_t = 3)]
    pub gate_texts: usize,
    /// Longest fixed text in tokens.
    #[arg(long, default_value_t = 96)]
    pub gate_text_tokens: usize,
    /// Largest |Δ log p| per token that passes (0 = bit-exact, the batch-invariance goal of
    /// DESIGN §6). Default: 1e-4 in f32 (reduction-order rounding), 1e-2 in bf16/f16.
    #[arg(long)]
    pub logprob_limit: Option<f64>,
    /// Seed of the random weights (random shapes).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Draft projections in FP8 (e4m3, per-channel scales, quantised on the host at load; kept
    /// as FP8 where the CUDA kernels run).
    #[arg(long)]
    pub draft_fp8: bool,
    /// With `--draft-fp8`: also an FP8 copy of the target's LM head for the draft's base logits
    /// (its bytes count toward the speculative engine's memory).
    #[arg(long, requires = "draft_fp8")]
    pub draft_fp8_head: bool,
    /// Markdown report.
    #[arg(long)]
    pub out_md: Option<PathBuf>,
    /// JSON report.
    #[arg(long)]
    pub out_json: Option<PathBuf>,
    /// Run every phase in this process instead of one child process each: kernels compiled by
    /// the first phase serve the others (on CUDA each new process pays NVRTC compilation again).
    /// Peak-memory readings then include earlier phases' pools and are not comparable.
    #[arg(long)]
    pub in_process: bool,
    /// Internal: run one phase (`target:solo`, `spec:gate`, ...) and write its result here.
    #[arg(long, hide = true, requires = "child_out")]
    pub child: Option<String>,
    #[arg(long, hide = true)]
    pub child_out: Option<PathBuf>,
}

impl Args {
    pub fn team_requests(&self) -> usize {
        self.team_requests.unwrap_or(2 * self.team_lanes)
    }

    pub fn busy_lanes(&self) -> usize {
        self.busy_lanes.unwrap_or(2 * self.team_lanes)
    }

    pub fn logprob_limit(&self) -> f64 {
        self.logprob_limit.unwrap_or(if self.dtype == "f32" { 1e-4 } else { 1e-2 })
    }

    pub fn random(&self) -> bool {
        self.shape != "trained"
    }

    pub fn full_warmup(&self) -> bool {
        match self.warmup.as_deref() {
            Some(w) => w == "full",
            None => self.device != "cpu",
        }
    }

    pub fn verify_policy(&self) -> Result<VerifyPolicy, BoxError> {
        let v = self.verify.as_str();
        Ok(if v == "full" {
            VerifyPolicy::Full
        } else if let Some(w) = v.strip_prefix("fixed:") {
            VerifyPolicy::Fixed(w.parse().map_err(|_| format!("--verify {v}: bad width"))?)
        } else if let Some(t) = v.strip_prefix("threshold:") {
            VerifyPolicy::Threshold(t.parse().map_err(|_| format!("--verify {v}: bad threshold"))?)
        } else if v.starts_with("throughput:") {
            VerifyPolicy::Throughput
        } else {
            return Err(
                format!("--verify {v}: expected full, fixed:W, threshold:T or throughput:FILE").into()
            );
        })
    }

    /// The cost table of `--verify throughput:FILE`.
    pub fn cost_table(
        &self,
    ) -> Result<Option<std::sync::Arc<dspark::engine::schedule::CostTable>>, BoxError> {
        match self.verify.strip_prefix("throughput:") {
            Some(file) => {
                Ok(Some(std::sync::Arc::new(dspark::engine::schedule::CostTable::load(file.as_ref())?)))
            }
            None => Ok(None),
        }
    }

    /// Check what the parent can check before starting any child.
    pub fn validate(&self) -> Result<(), BoxError> {
        match self.shape.as_str() {
            "trained" => {
                if self.target.is_none() || self.draft.is_none() {
                    return Err("--target and --draft are needed (or a random --shape qwen3-8b|tiny)".into());
                }
            }
            "qwen3-8b" | "tiny" => {}
            s => return Err(format!("--shape {s}: expected trained, qwen3-8b or tiny").into()),
        }
        for w in &self.workloads {
            if !["solo", "team", "busy"].contains(&w.as_str()) {
                return Err(format!("--workloads: unknown workload {w:?} (solo, team, busy)").into());
            }
        }
        if self.max_new_tokens == 0 || self.team_lanes == 0 || self.solo_requests == 0 {
            return Err("--max-new-tokens, --team-lanes and --solo-requests must be positive".into());
        }
        if !(self.busy_fill > 0.0 && self.busy_fill <= 1.0) {
            return Err("--busy-fill must be in (0, 1]".into());
        }
        self.verify_policy()?;
        let _: DeviceKind = self.device.parse()?;
        let _: ComputeDtype = self.dtype.parse()?;
        Ok(())
    }
}

/// The shapes that define the workloads (identical in every child).
#[derive(Debug, Clone)]
pub struct Plan {
    /// Prompt token ids, interleaved across files.
    pub prompts: Vec<Vec<u32>>,
    /// Stop tokens of every request.
    pub stop: Vec<u32>,
    /// Target model shape.
    pub target: Qwen3Config,
    /// Draft shape (γ, layers).
    pub draft: DSparkConfig,
    /// Notes for the report.
    pub notes: Vec<String>,
}

impl Plan {
    pub fn gamma(&self) -> usize {
        self.draft.block_size
    }
}

/// First turns of the prompt files, interleaved file by file.
fn read_turns(args: &Args) -> Result<Vec<String>, BoxError> {
    let mut files = Vec::new();
    for p in &args.prompts {
        if p.is_dir() {
            let mut found: Vec<PathBuf> = std::fs::read_dir(p)
                .map_err(|e| format!("{}: {e}", p.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
                .collect();
            found.sort();
            files.extend(found);
        } else {
            files.push(p.clone());
        }
    }
    let mut per_file = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
        let mut turns = Vec::new();
        for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let v: serde_json::Value =
                serde_json::from_str(line).map_err(|e| format!("{}:{}: {e}", f.display(), n + 1))?;
            let first = v["turns"]
                .as_array()
                .and_then(|t| t.first())
                .and_then(|t| t.as_str())
                .ok_or_else(|| format!("{}:{}: expected {{\"turns\": [\"...\"]}}", f.display(), n + 1))?;
            turns.push(first.to_string());
            if args.prompts_per_file.is_some_and(|k| turns.len() >= k) {
                break;
            }
        }
        per_file.push(turns);
    }
    let longest = per_file.iter().map(Vec::len).max().unwrap_or(0);
    let out: Vec<String> =
        (0..longest).flat_map(|i| per_file.iter().filter_map(move |f| f.get(i).cloned())).collect();
    if out.is_empty() {
        return Err("no prompts found in --prompts".into());
    }
    Ok(out)
}

/// Read the prompts, render them with the chat template and tokenize; resolve the shapes.
pub fn plan(args: &Args) -> Result<Plan, BoxError> {
    let mut notes = Vec::new();
    let (target, draft) = if args.random() {
        let t = crate::shapes::qwen3(&args.shape)?;
        let d = crate::shapes::dspark(&args.shape, &t);
        notes.push(format!(
            "random weights at {} shapes (target and draft): acceptance, tau and the speedup are meaningless; \
             round costs are real",
            args.shape
        ));
        (t, d)
    } else {
        let (t, d) = (args.target.as_deref(), args.draft.as_deref());
        let (t, d) = (t.ok_or("--target is needed")?, d.ok_or("--draft is needed")?);
        (Qwen3Config::from_dir(t)?, DSparkConfig::from_dir(d)?)
    };
    let tok_dir = match (&args.tokenizer, &args.target, args.random()) {
        (Some(dir), _, _) => dir.clone(),
        (None, Some(dir), false) => dir.clone(),
        _ => PathBuf::from("models/tiny-code-qwen3"),
    };
    let tokenizer =
        Tokenizer::from_dir(&tok_dir).map_err(|e| format!("tokenizer {}: {e}", tok_dir.display()))?;
    let opts = ChatOptions { add_generation_prompt: true, enable_thinking: None };
    let chat = tokenizer.chat_template().is_some();
    if !chat {
        notes.push(format!("{} has no chat template: prompts are plain text", tok_dir.display()));
    }
    let vocab = target.vocab_size as u32;
    let mut prompts = Vec::new();
    for turn in read_turns(args)? {
        let text =
            if chat { tokenizer.apply_chat_template(&[ChatMessage::user(turn)], &opts)? } else { turn };
        let mut ids = tokenizer.encode(&text, false)?;
        if ids.len() > args.max_prompt_tokens {
            ids.drain(..ids.len() - args.max_prompt_tokens);
        }
        if args.random() {
            ids.iter_mut().for_each(|t| *t %= vocab);
        }
        if !ids.is_empty() {
            prompts.push(ids);
        }
    }
    if args.random() {
        notes.push(format!(
            "prompts tokenized with {} (chat template applied), ids modulo the vocabulary ({vocab})",
            tok_dir.display()
        ));
    }
    let stop = if args.ignore_eos || args.random() {
        Vec::new()
    } else {
        let mut s = tokenizer.eos_token_ids().to_vec();
        s.extend(target.eos_ids());
        s.sort_unstable();
        s.dedup();
        s
    };
    Ok(Plan { prompts, stop, target, draft, notes })
}

/// KV layouts of target and draft at `page` rows per page.
pub fn layouts(plan: &Plan, dtype: ComputeDtype, page: usize) -> (KvLayout, KvLayout) {
    let layout = |c: &Qwen3Config| KvLayout {
        layers: c.num_hidden_layers,
        kv_heads: c.num_key_value_heads,
        head_dim: c.head_dim(),
        dtype,
        page_size: page,
    };
    (layout(&plan.target), layout(&plan.draft.base))
}

/// Bytes that `prompts` need at their longest: target rows `p + max_new + γ + 1` (a verify
/// window sits in the cache before rejected rows are dropped), draft rows `p + max_new + 1`,
/// whole pages per sequence; divided by `fill`, rounded up to whole pages.
pub fn kv_bytes(
    plan: &Plan,
    args: &Args,
    prompts: &[&Vec<u32>],
    fill: f64,
) -> Result<(usize, usize), BoxError> {
    let dtype: ComputeDtype = args.dtype.parse()?;
    let (t, d) = layouts(plan, dtype, args.page_size);
    let page = args.page_size;
    let pages = |extra: usize| -> usize { prompts.iter().map(|p| (p.len() + extra).div_ceil(page)).sum() };
    let t_pages = pages(args.max_new_tokens + plan.gamma() + 1);
    let d_pages = pages(args.max_new_tokens + 1);
    let scale = |n: usize| (n as f64 / fill).ceil() as usize;
    Ok((scale(t_pages) * t.page_bytes(), scale(d_pages) * d.page_bytes()))
}

/// Build the engine of one mode. Random weights come from the device's generator seeded with
/// `--seed`, target first, so both modes get the same target.
pub fn build_engine(
    args: &Args,
    plan: &Plan,
    speculative: bool,
    kv: usize,
    draft_kv: usize,
) -> Result<Engine, BoxError> {
    let kind: DeviceKind = args.device.parse()?;
    let dtype: ComputeDtype = args.dtype.parse()?;
    let config = EngineConfig {
        kv_budget_bytes: kv,
        page_size: args.page_size,
        verify: args.verify_policy()?,
        cost_table: args.cost_table()?,
        ..EngineConfig::default()
    };
    let cache = DraftCacheConfig { kv_budget_bytes: draft_kv, page_size: args.page_size };
    let options = LoadOptions { device: kind, dtype, progress: None };
    let target = if args.random() {
        kind.device()?.seed(args.seed);
        Qwen3::random(plan.target.clone(), dtype, kind)?
    } else {
        Qwen3::load(need(&args.target, "--target")?, options)?
    };
    if !speculative {
        return Ok(Engine::new(target, &config)?);
    }
    // FP8 drafts are quantised on the host (from the checkpoint, or drawn there): no bf16 copy
    // of the draft reaches the device, as when an FP8 checkpoint is loaded.
    let quant = args.draft_fp8.then_some(dspark::model::fp8::DraftQuant::Fp8PerChannel);
    let bound = || TargetBinding::of(&target);
    let mut draft = match (args.random(), quant) {
        (true, None) => DSparkDraft::random(plan.draft.clone(), bound(), &cache)?,
        (true, Some(q)) => DSparkDraft::random_quantized(plan.draft.clone(), bound(), &cache, q, args.seed)?,
        (false, None) => DSparkDraft::load(need(&args.draft, "--draft")?, &target, options, &cache)?,
        (false, Some(q)) => {
            DSparkDraft::load_quantized(need(&args.draft, "--draft")?, &target, options, &cache, q)?
        }
    };
    if quant.is_some() {
        let head = if args.draft_fp8_head { draft.quantize_lm_head()? } else { 0 };
        eprintln!(
            "draft in FP8: {} projections kept as FP8, {:.0} MiB of draft weights with a {:.0} MiB FP8 LM head",
            draft.fp8_on_device(),
            draft.weight_bytes() as f64 / (1 << 20) as f64,
            head as f64 / (1 << 20) as f64
        );
    }
    Ok(Engine::with_draft(target, Box::new(draft), &config)?)
}

fn need<'a>(p: &'a Option<PathBuf>, flag: &str) -> Result<&'a Path, BoxError> {
    p.as_deref().ok_or_else(|| format!("{flag} is needed").into())
}

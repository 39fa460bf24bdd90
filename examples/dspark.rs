//! `dspark`: the command-line front end.
//!
//! ```text
//! dspark demo                                  # speculative vs target-only, embedded trained pair
//! dspark generate --target DIR --prompt "..."  # text in, text out (needs tokenizer.json)
//! dspark generate --target DIR --prompt-ids 1,2,3 --json
//! dspark score --target DIR --token-ids 1,2,3 --json
//! dspark draft-vocab --target DIR --corpus TEXTS --tokens 32768 > vocab.txt
//! dspark generate --target DIR --draft DRAFT --draft-vocab-ids vocab.txt --prompt "..."
//! ```

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::{Args, Parser, Subcommand};
use dspark::text::{ChatMessage, ChatOptions, StreamDecoder, Tokenizer};
use dspark::{
    ComputeDtype, DSparkDraft, DeviceKind, DraftCacheConfig, Engine, EngineConfig, LoadOptions, Qwen3,
    Request, SamplingParams, VerifyPolicy,
};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

#[derive(Parser)]
#[command(name = "dspark", version, about = "Lossless speculative decoding for Qwen3 models")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of a prompt.
    Generate(Box<GenerateArgs>),
    /// Print the log-probability of every token of a sequence given the tokens before it.
    Score(ScoreArgs),
    /// Speculative vs target-only greedy generation with the small trained pair embedded in this
    /// binary (no download, CPU).
    Demo(DemoArgs),
    /// Rank a corpus's tokens and print the K most frequent ids, one line, comma-separated: a
    /// draft vocabulary for `generate --draft-vocab-ids`, counted once.
    DraftVocab(DraftVocabArgs),
}

#[derive(Args)]
struct DraftVocabArgs {
    /// Target checkpoint folder (its tokenizer.json and config.json).
    #[arg(long)]
    target: PathBuf,
    /// A text file, or a folder read recursively (files that are not UTF-8 are skipped).
    #[arg(long)]
    corpus: PathBuf,
    /// How many tokens.
    #[arg(long)]
    tokens: usize,
}

#[derive(Args)]
struct DemoArgs {
    /// Prompt text (default: the start of a Python script).
    #[arg(long)]
    prompt: Option<String>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ModelArgs {
    /// Target checkpoint folder (Hugging Face Qwen3 layout).
    #[arg(long)]
    target: PathBuf,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Compute dtype: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// KV cache budget in MiB.
    #[arg(long, default_value_t = 1024)]
    kv_budget_mib: usize,
    /// Run every forward op by op instead of replaying recorded CUDA graphs (same output).
    #[arg(long)]
    no_graphs: bool,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt text (needs tokenizer.json in the target folder).
    #[arg(long, conflicts_with = "prompt_ids", required_unless_present = "prompt_ids")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Render --prompt as a user message with the checkpoint's chat template.
    #[arg(long, requires = "prompt")]
    chat: bool,
    /// With --chat: render Qwen3's thinking switch (false gives the empty think block).
    #[arg(long)]
    enable_thinking: Option<bool>,
    /// Upper bound on generated tokens.
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Softmax temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Top-k filter; 0 disables.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Top-p (nucleus) filter; 1 disables.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Seed of the sampling coins.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Extra stop token ids, comma-separated.
    #[arg(long, value_delimiter = ',')]
    stop_token_ids: Vec<u32>,
    /// Do not stop at the checkpoint's end-of-sequence ids.
    #[arg(long)]
    ignore_eos: bool,
    /// DSpark draft folder: speculative decoding (output distribution unchanged).
    #[arg(long)]
    draft: Option<PathBuf>,
    /// Quantise the draft's projections to FP8 (e4m3, per-row scales) at load; on CUDA in bf16
    /// they stay FP8 on the device. Output distribution unchanged.
    #[arg(long, requires = "draft")]
    draft_fp8: bool,
    /// Also an FP8 copy of the LM head for the draft's base logits.
    #[arg(long, requires = "draft_fp8")]
    draft_fp8_head: bool,
    /// Let the draft propose only K tokens (a draft vocabulary: its LM-head and Markov rows are
    /// read for those only; output distribution unchanged, acceptance may fall): the K most
    /// frequent in --draft-vocab-corpus, else the first K ids.
    #[arg(long, requires = "draft")]
    draft_vocab: Option<usize>,
    /// A text file, or a folder read recursively, whose tokens rank the draft vocabulary
    /// (files that are not UTF-8 are skipped).
    #[arg(long, requires = "draft_vocab")]
    draft_vocab_corpus: Option<PathBuf>,
    /// The draft vocabulary's token ids, from a file (separated by commas or white space; the
    /// output of `dspark draft-vocab`).
    #[arg(long, requires = "draft", conflicts_with = "draft_vocab")]
    draft_vocab_ids: Option<PathBuf>,
    /// Verify width in rows (anchor + drafts), 1..=γ+1; default: all γ drafts.
    #[arg(long, requires = "draft", conflicts_with = "confidence_threshold")]
    verify_width: Option<usize>,
    /// Verify the drafts before the first whose confidence is below this value.
    #[arg(long, requires = "draft", conflicts_with = "cost_table")]
    confidence_threshold: Option<f32>,
    /// Throughput scheduler: choose each round's verify rows from this measured cost table
    /// (JSON written by `bench-cost-table`, e.g. benches/results/cost-tables/cpu-tiny-code.json)
    /// and the draft's confidences.
    #[arg(long, requires = "draft", conflicts_with = "verify_width")]
    cost_table: Option<PathBuf>,
    /// Print one JSON object `{"tokens", "text", "stats"}` instead of streaming text.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ScoreArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The sequence as comma-separated token ids.
    #[arg(long, value_delimiter = ',', required = true)]
    token_ids: Vec<u32>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => generate(*args),
        Command::Score(args) => score(args),
        Command::Demo(args) => demo(args),
        Command::DraftVocab(args) => draft_vocab_command(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Every error's message already names its cause (file, tensor, key).
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn load_engine(model: &ModelArgs, quiet: bool) -> dspark::Result<Engine> {
    load_speculative(model, None, VerifyPolicy::Full, None, quiet)
}

/// A draft to load: its folder and whether to run it in FP8 (with an FP8 LM-head copy).
struct DraftSpec<'a> {
    dir: &'a Path,
    fp8: bool,
    fp8_head: bool,
    /// The draft vocabulary, if restricted.
    vocab: Option<VocabSource<'a>>,
}

/// Where a restricted draft vocabulary comes from.
enum VocabSource<'a> {
    /// The K most frequent tokens of a corpus, else the first K ids.
    Count(usize, Option<&'a Path>),
    /// A file of ids.
    Ids(&'a Path),
}

/// The ids of a `--draft-vocab-ids` file.
fn read_ids(path: &Path) -> dspark::Result<Vec<u32>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| dspark::Error::InvalidInput(format!("{}: {e}", path.display())))?;
    text.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<u32>().map_err(|e| {
                dspark::Error::InvalidInput(format!("{}: {s:?} is not a token id: {e}", path.display()))
            })
        })
        .collect()
}

fn draft_vocab_command(args: DraftVocabArgs) -> dspark::Result<()> {
    let config = dspark::Qwen3Config::from_dir(&args.target)?;
    let vocab = draft_vocab(args.tokens, Some(&args.corpus), &args.target, config.vocab_size)?;
    let ids: Vec<String> = vocab.ids().iter().map(u32::to_string).collect();
    println!("{}", ids.join(","));
    Ok(())
}

/// The draft vocabulary of `--draft-vocab K [--draft-vocab-corpus PATH]` for a target of
/// `vocab` tokens whose tokenizer is in `target_dir`.
fn draft_vocab(
    tokens: usize,
    corpus: Option<&Path>,
    target_dir: &Path,
    vocab: usize,
) -> dspark::Result<dspark::DraftVocab> {
    let Some(corpus) = corpus else { return dspark::DraftVocab::leading(tokens, vocab) };
    let tokenizer = Tokenizer::from_dir(target_dir).map_err(|e| {
        dspark::Error::InvalidInput(format!("--draft-vocab-corpus needs the target's tokenizer: {e}"))
    })?;
    let (counts, files) = tokenizer
        .corpus_counts(corpus, vocab)
        .map_err(|e| dspark::Error::InvalidInput(format!("--draft-vocab-corpus: {e}")))?;
    tracing::info!(files, tokens = counts.iter().sum::<u64>(), "draft vocabulary ranked");
    dspark::DraftVocab::most_frequent(&counts, tokens)
}

fn load_speculative(
    model: &ModelArgs,
    draft: Option<DraftSpec<'_>>,
    verify: VerifyPolicy,
    cost_table: Option<&Path>,
    quiet: bool,
) -> dspark::Result<Engine> {
    let cost_table = cost_table.map(dspark::engine::schedule::CostTable::load).transpose()?;
    dspark::set_graphs_enabled(!model.no_graphs);
    let device: DeviceKind = model.device.parse()?;
    let dtype: ComputeDtype = model.dtype.parse()?;
    let bar = ProgressBar::new(0);
    if quiet {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    bar.set_style(
        ProgressStyle::with_template("loading {msg} [{bar:40}] {bytes}/{total_bytes} ({eta})")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_message(model.target.display().to_string());
    let progress = |done: u64, total: u64| {
        bar.set_length(total);
        bar.set_position(done);
    };
    let options = LoadOptions { device, dtype, progress: Some(&progress) };
    let config = EngineConfig {
        kv_budget_bytes: model.kv_budget_mib << 20,
        verify,
        cost_table: cost_table.map(std::sync::Arc::new),
        ..EngineConfig::default()
    };
    let engine = match draft {
        None => Engine::load(&model.target, options, &config),
        Some(spec) => Qwen3::load(&model.target, options).and_then(|target| {
            bar.set_message(spec.dir.display().to_string());
            let cache = DraftCacheConfig::default();
            let mut draft = if spec.fp8 {
                let fp8 = dspark::model::fp8::DraftQuant::Fp8PerChannel;
                DSparkDraft::load_quantized(spec.dir, &target, options, &cache, fp8)?
            } else {
                DSparkDraft::load(spec.dir, &target, options, &cache)?
            };
            if spec.fp8_head {
                bar.set_message("FP8 copy of the LM head");
                draft.quantize_lm_head()?;
            }
            if let Some(source) = spec.vocab {
                bar.set_message("draft vocabulary");
                let v = target.config().vocab_size;
                let vocab = match source {
                    VocabSource::Count(tokens, corpus) => draft_vocab(tokens, corpus, &model.target, v)?,
                    VocabSource::Ids(path) => dspark::DraftVocab::new(read_ids(path)?, v)?,
                };
                draft.restrict_vocab(vocab)?;
            }
            Engine::with_draft(target, Box::new(draft), &config)
        }),
    };
    bar.finish_and_clear();
    engine
}

fn tokenizer_in(dir: &Path) -> Option<Tokenizer> {
    if dir.join("tokenizer.json").exists() { Tokenizer::from_dir(dir).ok() } else { None }
}

fn generate(args: GenerateArgs) -> dspark::Result<()> {
    let tokenizer = tokenizer_in(&args.model.target);
    let prompt = match (&args.prompt, &args.prompt_ids) {
        (_, Some(ids)) => ids.clone(),
        (Some(text), None) => {
            let tok = tokenizer.as_ref().ok_or_else(|| {
                dspark::Error::InvalidInput(format!(
                    "--prompt needs {}; use --prompt-ids otherwise",
                    args.model.target.join("tokenizer.json").display()
                ))
            })?;
            if args.chat {
                let template = tok.chat_template().ok_or_else(|| {
                    dspark::Error::InvalidInput("the checkpoint has no chat template".into())
                })?;
                let messages = [ChatMessage { role: "user".into(), content: text.clone() }];
                let opts = ChatOptions { add_generation_prompt: true, enable_thinking: args.enable_thinking };
                tok.encode(&template.render(&messages, &opts)?, false)?
            } else {
                tok.encode(text, false)?
            }
        }
        (None, None) => return Err(dspark::Error::InvalidInput("give --prompt or --prompt-ids".into())),
    };
    let verify = match (args.verify_width, args.confidence_threshold, &args.cost_table) {
        (Some(w), _, _) => VerifyPolicy::Fixed(w),
        (None, Some(t), _) => VerifyPolicy::Threshold(t),
        (None, None, Some(_)) => VerifyPolicy::Throughput,
        (None, None, None) => VerifyPolicy::Full,
    };
    let draft = args.draft.as_deref().map(|dir| DraftSpec {
        dir,
        fp8: args.draft_fp8,
        fp8_head: args.draft_fp8_head,
        vocab: match (args.draft_vocab, &args.draft_vocab_ids) {
            (Some(k), _) => Some(VocabSource::Count(k, args.draft_vocab_corpus.as_deref())),
            (None, Some(path)) => Some(VocabSource::Ids(path)),
            (None, None) => None,
        },
    });
    let mut engine = load_speculative(&args.model, draft, verify, args.cost_table.as_deref(), args.json)?;
    let mut stop = args.stop_token_ids.clone();
    if !args.ignore_eos {
        stop.extend(engine.target().config().eos_ids());
        if let Some(tok) = &tokenizer {
            stop.extend(tok.eos_token_ids());
        }
    }
    stop.sort_unstable();
    stop.dedup();
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
        stop_token_ids: stop,
        max_new_tokens: args.max_new_tokens,
    };
    let started = Instant::now();
    let mut decoder = tokenizer.as_ref().map(|t| StreamDecoder::new(t, true));
    let mut stdout = std::io::stdout();
    let out = engine.generate_stream(&[Request { prompt: prompt.clone(), params }], &mut |ev| {
        if args.json {
            return;
        }
        match &mut decoder {
            Some(d) => {
                for &t in ev.tokens {
                    if let Ok(Some(piece)) = d.step(t) {
                        let _ = write!(stdout, "{piece}");
                    }
                }
            }
            _ => {
                for t in ev.tokens {
                    let _ = write!(stdout, "{t} ");
                }
            }
        }
        let _ = stdout.flush();
    })?;
    if let (false, Some(d)) = (args.json, &mut decoder)
        && let Ok(Some(rest)) = d.flush()
    {
        print!("{rest}");
    }
    let elapsed = started.elapsed();
    let g = &out[0];
    let batch = engine.last_stats();
    let text = match &tokenizer {
        Some(tok) => Some(tok.decode(&g.tokens, true)?),
        None => None,
    };
    let stats = json!({
        "prompt_tokens": g.stats.prompt_tokens,
        "generated_tokens": g.stats.generated_tokens,
        "rounds": g.stats.rounds,
        "tau": g.stats.tau,
        "finish": match g.finish {
            Some(dspark::FinishReason::Stop(t)) => json!({"stop": t}),
            Some(dspark::FinishReason::Length) => json!("length"),
            _ => serde_json::Value::Null,
        },
        "prefill_ms": batch.prefill_time.as_secs_f64() * 1e3,
        "decode_ms": batch.decode_time.as_secs_f64() * 1e3,
        "decode_tokens_per_second": batch.decode_tokens_per_second(),
        "total_ms": elapsed.as_secs_f64() * 1e3,
        "speculative": engine.is_speculative(),
        "drafted": g.stats.drafted,
        "accepted": g.stats.accepted,
        "accepted_per_position": g.stats.accepted_per_position,
        "drafted_per_position": g.stats.drafted_per_position,
        "device": args.model.device,
        "dtype": args.model.dtype,
    });
    if args.json {
        let mut object = json!({ "tokens": g.tokens, "text": text, "stats": stats });
        if engine.is_speculative() {
            object["rounds"] = g
                .stats
                .round_log
                .iter()
                .map(|r| json!({ "position": r.position, "drafted": r.drafted, "accepted": r.accepted }))
                .collect();
        }
        println!("{object}");
    } else {
        println!();
        eprintln!(
            "[{} prompt tokens, {} generated in {} rounds (tau {:.2}), {:.1} tok/s decode]",
            g.stats.prompt_tokens,
            g.stats.generated_tokens,
            g.stats.rounds,
            g.stats.tau,
            batch.decode_tokens_per_second()
        );
    }
    Ok(())
}

fn score(args: ScoreArgs) -> dspark::Result<()> {
    let mut engine = load_engine(&args.model, args.json)?;
    let scores = engine.score(&args.token_ids)?;
    if args.json {
        let rows: Vec<_> = args.token_ids[1..]
            .iter()
            .zip(&scores)
            .map(|(t, s)| json!({ "token": t, "logprob": s }))
            .collect();
        let total: f64 = scores.iter().map(|&s| f64::from(s)).sum();
        println!("{}", json!({ "first_token": args.token_ids[0], "scores": rows, "total_logprob": total }));
    } else {
        for (t, s) in args.token_ids[1..].iter().zip(&scores) {
            println!("{t}\t{s:.6}");
        }
    }
    Ok(())
}

/// The small trained pair of `models/` (a code model and its DSpark draft, see
/// `models/README.md`), embedded so the demo needs no files and no download.
const DEMO_FILES: [(&str, &str, &[u8]); 7] = [
    ("target", "config.json", include_bytes!("../models/tiny-code-qwen3/config.json")),
    ("target", "model.safetensors", include_bytes!("../models/tiny-code-qwen3/model.safetensors")),
    ("target", "tokenizer.json", include_bytes!("../models/tiny-code-qwen3/tokenizer.json")),
    ("target", "tokenizer_config.json", include_bytes!("../models/tiny-code-qwen3/tokenizer_config.json")),
    ("target", "generation_config.json", include_bytes!("../models/tiny-code-qwen3/generation_config.json")),
    ("draft", "config.json", include_bytes!("../models/tiny-code-dspark/config.json")),
    ("draft", "model.safetensors", include_bytes!("../models/tiny-code-dspark/model.safetensors")),
];
const DEMO_PROMPT: &str =
    "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the command line and run.\"\"\"\n";

fn demo(args: DemoArgs) -> dspark::Result<()> {
    let root = std::env::temp_dir().join(format!("dspark-demo-{}", std::process::id()));
    let loaded = (|| {
        for (dir, name, bytes) in DEMO_FILES {
            let path = root.join(dir).join(name);
            std::fs::create_dir_all(root.join(dir))
                .and_then(|()| std::fs::write(&path, bytes))
                .map_err(|e| dspark::Error::Io { path, source: e })?;
        }
        let tokenizer = Tokenizer::from_dir(&root.join("target"))?;
        let plain = Engine::load(&root.join("target"), LoadOptions::default(), &EngineConfig::default())?;
        let target = Qwen3::load(&root.join("target"), LoadOptions::default())?;
        let draft = DSparkDraft::load(
            &root.join("draft"),
            &target,
            LoadOptions::default(),
            &DraftCacheConfig::default(),
        )?;
        let spec = Engine::with_draft(target, Box::new(draft), &EngineConfig::default())?;
        Ok::<_, dspark::Error>((tokenizer, plain, spec))
    })();
    let _ = std::fs::remove_dir_all(&root);
    let (tokenizer, mut plain, mut spec) = loaded?;
    let prompt_text = args.prompt.as_deref().unwrap_or(DEMO_PROMPT);
    let prompt = tokenizer.encode(prompt_text, false)?;
    let mut params = SamplingParams::greedy(args.max_new_tokens);
    params.stop_token_ids = tokenizer.eos_token_ids().to_vec();
    let request = Request { prompt: prompt.clone(), params };
    // Warm up once, then time each mode over the same request.
    plain.generate(std::slice::from_ref(&request))?;
    spec.generate(std::slice::from_ref(&request))?;
    let reps = 3;
    let time = |engine: &mut Engine| -> dspark::Result<(Vec<dspark::Generation>, f64)> {
        let started = Instant::now();
        let mut out = Vec::new();
        for _ in 0..reps {
            out = engine.generate(std::slice::from_ref(&request))?;
        }
        let tokens = reps as f64 * out.first().map_or(0, |g| g.tokens.len()) as f64;
        Ok((out, tokens / started.elapsed().as_secs_f64()))
    };
    let (base, base_tps) = time(&mut plain)?;
    let (fast, spec_tps) = time(&mut spec)?;
    let (b, g) = (&base[0], &fast[0]);
    let identical = b.tokens == g.tokens;
    let text = tokenizer.decode(&g.tokens, true)?;
    if args.json {
        println!(
            "{}",
            json!({"prompt": prompt_text, "prompt_ids": prompt, "tokens": g.tokens, "text": text,
                "identical_to_target_only": identical,
                "stats": {"generated_tokens": g.stats.generated_tokens, "rounds": g.stats.rounds,
                "drafted": g.stats.drafted, "accepted": g.stats.accepted, "tau": g.stats.tau,
                "speculative_tokens_per_second": spec_tps, "target_only_tokens_per_second": base_tps,
                "speedup": spec_tps / base_tps}})
        );
    } else {
        println!(
            "dspark demo: tiny-code-qwen3 (8 layers, hidden 256, 7.3M parameters) + tiny-code-dspark \
             (2 layers, block 8), trained on code; greedy, CPU, f32, embedded weights"
        );
        println!("----- prompt -----\n{prompt_text}----- speculative continuation -----\n{text}\n-----");
        println!("target-only    : {}", if identical { "identical, token for token" } else { "DIFFERENT" });
        println!(
            "tau            : {:.2} tokens per verify round ({} rounds, {} of {} drafts accepted)",
            g.stats.tau, g.stats.rounds, g.stats.accepted, g.stats.drafted
        );
        println!(
            "tokens/s       : speculative {spec_tps:.0} vs target-only {base_tps:.0} ({:.2}x)",
            spec_tps / base_tps
        );
        let s = spec.last_stats();
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3 / g.stats.rounds.max(1) as f64;
        println!(
            "per round      : draft {:.2} ms, verify {:.2} ms, accept+commit {:.2} ms; target-only step {:.2} ms",
            ms(s.draft_time),
            ms(s.verify_time),
            ms(s.commit_time),
            plain.last_stats().decode_time.as_secs_f64() * 1e3 / b.stats.rounds.max(1) as f64
        );
    }
    if identical {
        Ok(())
    } else {
        Err(dspark::Error::Backend("speculative output differs from target-only output".into()))
    }
}

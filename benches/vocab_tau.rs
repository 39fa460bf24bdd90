//! Acceptance with a draft vocabulary (`DSparkDraft::restrict_vocab`): τ of the trained pair
//! (`models/`) on its held-out prompts, for each size of draft vocabulary, ranked by the
//! tokenizer's id order (`DraftVocab::leading`) and, given a corpus, by the corpus's token counts
//! (`DraftVocab::most_frequent`). A restricted draft can never propose a token outside its
//! vocabulary, so τ can only fall; this measures by how much. CPU, f32; the output is a
//! markdown table on stdout.
//!
//! ```text
//! bench-vocab-tau --corpus DIR --tokens 1024,2048,3072
//! ```

use std::path::PathBuf;

use clap::Parser;
use dspark::text::Tokenizer;
use dspark::{
    DSparkDraft, DraftCacheConfig, DraftVocab, Engine, EngineConfig, Generation, LoadOptions, Qwen3, Request,
    SamplingParams,
};

#[derive(Parser)]
#[command(name = "bench-vocab-tau", about = "τ of the trained pair with restricted draft vocabularies")]
struct Args {
    /// The trained pair's folder (`tiny-code-qwen3`, `tiny-code-dspark`, `report.json`).
    #[arg(long, default_value = "models")]
    models: PathBuf,
    /// A text file or folder whose token counts rank the draft vocabulary; without it only the
    /// id order is measured.
    #[arg(long)]
    corpus: Option<PathBuf>,
    /// Draft vocabulary sizes.
    #[arg(long, value_delimiter = ',', default_value = "1024,2048,3072")]
    tokens: Vec<usize>,
    /// Tokens generated per prompt.
    #[arg(long, default_value_t = 96)]
    max_new_tokens: usize,
    /// Sampled runs at T = 1 (seeds 0..N per prompt) beside the greedy one.
    #[arg(long, default_value_t = 4)]
    seeds: u64,
}

fn tau(out: &[Generation]) -> f64 {
    let generated: usize = out.iter().map(|g| g.tokens.len() - 1).sum();
    let rounds: usize = out.iter().map(|g| g.stats.rounds).sum();
    generated as f64 / rounds as f64
}

fn main() -> dspark::Result<()> {
    let args = Args::parse();
    let text = std::fs::read_to_string(args.models.join("report.json"))
        .map_err(|e| dspark::Error::InvalidInput(format!("report.json: {e}")))?;
    let report: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| dspark::Error::InvalidInput(format!("report.json: {e}")))?;
    let prompts: Vec<Vec<u32>> = report["draft"]["eval"]["rust_crosscheck_T0"]
        .as_array()
        .map(|cases| {
            cases.iter().filter_map(|c| serde_json::from_value(c["prompt_ids"].clone()).ok()).collect()
        })
        .unwrap_or_default();
    if prompts.is_empty() {
        return Err(dspark::Error::InvalidInput("report.json holds no held-out prompts".into()));
    }
    let target_dir = args.models.join("tiny-code-qwen3");
    let load = || Qwen3::load(&target_dir, LoadOptions::default());
    let vocab = load()?.config().vocab_size;
    let ranked = match &args.corpus {
        Some(corpus) => {
            let tokenizer = Tokenizer::from_dir(&target_dir)
                .map_err(|e| dspark::Error::InvalidInput(format!("tokenizer: {e}")))?;
            let (counts, files) = tokenizer
                .corpus_counts(corpus, vocab)
                .map_err(|e| dspark::Error::InvalidInput(format!("corpus: {e}")))?;
            eprintln!("corpus: {files} files, {} tokens", counts.iter().sum::<u64>());
            Some(counts)
        }
        None => None,
    };
    let greedy: Vec<Request> = prompts
        .iter()
        .map(|p| Request { prompt: p.clone(), params: SamplingParams::greedy(args.max_new_tokens) })
        .collect();
    let sampled: Vec<Request> = prompts
        .iter()
        .flat_map(|p| {
            (0..args.seeds).map(|seed| Request {
                prompt: p.clone(),
                params: SamplingParams {
                    temperature: 1.0,
                    seed,
                    ..SamplingParams::greedy(args.max_new_tokens)
                },
            })
        })
        .collect();
    let reference = Engine::new(load()?, &EngineConfig::default())?.generate(&greedy)?;
    let run = |restrict: Option<DraftVocab>| -> dspark::Result<(f64, f64)> {
        let target = load()?;
        let mut draft = DSparkDraft::load(
            &args.models.join("tiny-code-dspark"),
            &target,
            LoadOptions::default(),
            &DraftCacheConfig::default(),
        )?;
        if let Some(v) = restrict {
            draft.restrict_vocab(v)?;
        }
        let mut engine = Engine::with_draft(target, Box::new(draft), &EngineConfig::default())?;
        let out = engine.generate(&greedy)?;
        if out.iter().zip(&reference).any(|(a, b)| a.tokens != b.tokens) {
            return Err(dspark::Error::InvalidInput(
                "speculative greedy output differs from target-only".into(),
            ));
        }
        Ok((tau(&out), tau(&engine.generate(&sampled)?)))
    };
    // The share of the target's greedy continuations a vocabulary holds.
    let generated: Vec<u32> = reference.iter().flat_map(|g| g.tokens.iter().copied()).collect();
    let share =
        |v: &DraftVocab| generated.iter().filter(|&&t| v.contains(t)).count() as f64 / generated.len() as f64;
    println!(
        "| draft vocabulary | tokens | share of the target's greedy tokens | τ greedy | × whole | τ T=1 | × whole |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let (whole_greedy, whole_sampled) = run(None)?;
    println!("| whole | {vocab} | 1.000 | {whole_greedy:.3} | 1.000 | {whole_sampled:.3} | 1.000 |");
    for &k in &args.tokens {
        let mut kinds = vec![("first ids", DraftVocab::leading(k, vocab)?)];
        if let Some(counts) = &ranked {
            kinds.push(("corpus counts", DraftVocab::most_frequent(counts, k)?));
        }
        for (kind, v) in kinds {
            let s = share(&v);
            let (g, t) = run(Some(v))?;
            println!(
                "| {kind} | {k} | {s:.3} | {g:.3} | {:.3} | {t:.3} | {:.3} |",
                g / whole_greedy,
                t / whole_sampled
            );
        }
    }
    eprintln!(
        "{} prompts × {} tokens; T = 1 with {} seeds each",
        prompts.len(),
        args.max_new_tokens,
        args.seeds
    );
    Ok(())
}

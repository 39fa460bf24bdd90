#!/usr/bin/env python3
"""Write the model card (`models/README.md`) of the trained pair from `train.py`'s `report.json`.

Every number in the card is read from the report of the real run; nothing is filled in by hand.

Usage: `python3 scripts/pair/model_card.py --report DIR/report.json [--corpus out/pair/corpus]
[--out models/README.md]`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    root = Path(__file__).resolve().parents[2]
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", type=Path, required=True)
    ap.add_argument("--corpus", type=Path, default=root / "out" / "pair" / "corpus")
    ap.add_argument("--out", type=Path, default=root / "models" / "README.md")
    ap.add_argument(
        "--repro",
        type=Path,
        action="append",
        default=[],
        help="report.json of a rerun of the same command, for the reproducibility table",
    )
    args = ap.parse_args()
    r = json.loads(args.report.read_text())
    meta = json.loads((args.corpus / "meta.json").read_text()) if (args.corpus / "meta.json").exists() else {}
    t, d = r["target"], r["draft"]
    tc, dc = t["config"], d["config"]
    ev = d["eval"]
    crates = meta.get("sources", {}).get("crates_used_under", {})
    lic_count: dict[str, int] = {}
    for lic in crates.values():
        lic_count[lic] = lic_count.get(lic, 0) + 1
    sizes = r.get("files_bytes", {})
    total_mb = sum(sizes.values()) / 1e6

    def hist(h):
        return ", ".join(f"{k}: {v}" for k, v in enumerate(h))

    lines = [
        "# tiny-code-qwen3 and tiny-code-dspark",
        "",
        "A small Qwen3-architecture code model and a DSpark draft for it, trained from scratch so that",
        "speculative decoding can be measured end to end (τ, speedup) without downloading anything.",
        "They are test and benchmark fixtures, not useful language models.",
        "Made by `scripts/pair/` (see its README); every number below comes from the run's `report.json`.",
        "",
        "## Data",
        "",
        f"- Python standard library sources (CPython {meta.get('python', '?')}, PSF licence; `site-packages` excluded) "
        f"and Rust crate sources from a local Cargo registry ({len(crates)} crates, newest version of each; used under: "
        + ", ".join(f"{k} ({v})" for k, v in sorted(lic_count.items())) + "; crates of generated bindings left out).",
        f"- Deduplicated by content hash; {meta.get('heldout_permille', '?')}‰ of files held out by hash: "
        f"{meta.get('train_files', '?')} training files ({meta.get('train_tokens', 0):,} tokens), "
        f"{meta.get('heldout_files', '?')} held-out files ({meta.get('heldout_tokens', 0):,} tokens).",
        f"- Byte-level BPE tokenizer, {meta.get('tokenizer_size', '?')} tokens, special tokens "
        + ", ".join(f"`{k}` = {v}" for k, v in meta.get("special_token_ids", {}).items()) + ".",
        "",
        "## Target: `tiny-code-qwen3`",
        "",
        f"- Qwen3, {tc['layers']} layers, hidden {tc['hidden']}, {tc['heads']} query / {tc['kv_heads']} KV heads of "
        f"{tc['head_dim']}, MLP {tc['intermediate']}, tied embeddings, {t['params'] / 1e6:.2f}M parameters, bf16.",
        f"- Trained {t['train_seconds']:.0f} s on {t['device']}: {t['steps']} steps of {tc['batch']} × {tc['seq']} tokens "
        f"({t['train_tokens_seen'] / 1e6:.1f}M tokens), AdamW, peak lr {tc['lr']}, cosine.",
        f"- Held-out loss **{t['heldout_loss']:.4f}** nats/token (perplexity {t['heldout_ppl']:.2f}) over "
        f"{t['heldout_tokens_evaluated']:,} held-out tokens; last training loss {t['train_loss_last']:.4f}.",
        "",
        "## Draft: `tiny-code-dspark`",
        "",
        f"- DSpark, {dc['draft_layers']} layers, block size {dc['block_size']}, features of target layers "
        f"{d['target_layer_ids']}, mask token {d['mask_token_id']}, vanilla Markov head of rank {dc['markov_rank']}, "
        f"confidence head reading the Markov embedding; {d['trainable_params'] / 1e6:.2f}M trained parameters "
        "(embedding and LM head are the target's).",
        f"- Trained {d['train_seconds']:.0f} s ({d['steps']} steps) on the target's greedy continuations "
        f"({d.get('continuations', {}).get('sequences', '?')} sequences of {dc['gen_tokens']} generated tokens) of "
        f"training-split prefixes of {dc['gen_prompt_lens']} tokens: {dc['num_anchors']} "
        f"anchors per sequence, {dc['draft_batch']} sequences per step, loss {dc['ce_alpha']}·CE + {dc['l1_alpha']}·L1 "
        f"(draft vs target distribution) + {dc['conf_alpha']}·confidence BCE (target: distribution overlap), "
        f"weights exp(−k/{dc['decay_gamma']}) along the block.",
        "",
        "## Acceptance on held-out code",
        "",
        f"{ev['prompts']} held-out prompts of {ev['prompt_len']} tokens, {ev['max_new_tokens']} new tokens, full verify "
        "width, no stop tokens; τ = (generated − 1) / verify rounds, as the engine reports it; measured by "
        "`scripts/pair/spec_sim.py` (PyTorch, float32, the bf16 weights as shipped).",
        "",
        "| temperature | τ | accepted drafts per round (count: rounds) | acceptance at draft position k |",
        "| --- | --- | --- | --- |",
    ]
    for key in ("T0", "T1"):
        e = ev[key]
        lines.append(f"| {key[1:]} | **{e['tau']:.3f}** | {hist(e['accept_hist'])} | "
                     + ", ".join(f"{a:.2f}" for a in e["accept_rate_at"]) + " |")
    lines += [
        "",
    ]
    if args.repro:
        runs = [("shipped", r)] + [(f"rerun {i + 1}", json.loads(p.read_text())) for i, p in enumerate(args.repro)]
        lines += [
            "## Reproducibility",
            "",
            "The same command (`bash scripts/pair/gpu_run.sh all`) run again on the same corpus. Training is "
            "bounded by time, not steps, so step counts and results vary a little between runs.",
            "",
            "| run | target steps | held-out loss | draft steps | τ at T=0 | τ at T=1 |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for name, x in runs:
            e = x["draft"]["eval"]
            lines.append(
                f"| {name} | {x['target']['steps']} | {x['target']['heldout_loss']:.4f} | {x['draft']['steps']} "
                f"| {e['T0']['tau']:.3f} | {e['T1']['tau']:.3f} |"
            )
        lines.append("")
    lines += [
        "## Files",
        "",
        f"Both folders together: {total_mb:.1f} MB.",
        "",
        "- `tiny-code-qwen3/`: Hugging Face Qwen3 layout (`config.json`, `model.safetensors`, `generation_config.json`, "
        "`tokenizer.json`, `tokenizer_config.json` with a ChatML template).",
        "- `tiny-code-dspark/`: DSpark layout with top-level keys (`config.json`, `model.safetensors`).",
        "",
        "Licence of the weights: derived from PSF-, MIT- and Apache-2.0-licensed sources; see the data section.",
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Train the small code target (Qwen3) and its DSpark draft, evaluate, and export (issue 7).

Stages (each bounded by wall-clock seconds, so the whole run fits a device command):

* ``target`` (stage A): train a Qwen3ForCausalLM from scratch on ``train.bin.xz`` (random windows,
  AdamW, cosine schedule over the time budget, bf16 autocast on CUDA), measure the held-out
  loss, save ``OUT/target`` (Hugging Face folder, bf16, tied embeddings, tokenizer files) and
  ``OUT/target_report.json``.
* ``draft`` (stage B): load ``OUT/target``; generate the target's greedy continuations of random
  prompt prefixes of the training split (batched, KV cache); train the DSpark draft on them
  against the frozen target's features (anchors in the generated part, block labels = the
  greedy continuation, loss = weighted CE + L1 between draft and target distributions + a
  confidence head trained on the distribution overlap, weights decaying along the block);
  save ``OUT/draft``; measure τ on held-out prompts with ``spec_sim.simulate`` at temperature 0
  and 1; write ``OUT/report.json``.
* ``all``: both.

Example (GPU): ``python3 scripts/pair/train.py --corpus out/pair/corpus --out out/pair/run``.
CPU smoke test: add ``--tiny``.
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dspark_torch import (  # noqa: E402
    DSparkDraft,
    default_target_layer_ids,
    draft_config,
    save_draft,
    target_features,
)
from spec_sim import greedy_generate, simulate  # noqa: E402

T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


# ---- data ------------------------------------------------------------------------------------
def load_stream(path: Path, device) -> torch.Tensor:
    with lzma.open(path, "rb") as f:
        data = np.frombuffer(f.read(), dtype="<u2")
    return torch.from_numpy(data.astype(np.int64)).to(device)


def windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length, (batch,), generator=gen, device="cpu").to(stream.device)
    return stream[starts.unsqueeze(1) + torch.arange(length, device=stream.device)]


def lr_at(step: int, progress: float, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then cosine from `peak` to `floor·peak` over the time
    budget (`progress` = elapsed / budget)."""
    w = min(1.0, (step + 1) / max(1, warmup))
    c = floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return peak * w * c


def autocast(device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


# ---- target -----------------------------------------------------------------------------------
def build_target(args, meta):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    eot = meta["eot_token_id"]
    cfg = Qwen3Config(
        vocab_size=meta["vocab_size"],
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_positions,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_bias=False,
        use_sliding_window=False,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(cfg)


def load_target(path: Path, device, dtype=torch.float32):
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(path), attn_implementation="sdpa")
    return model.to(device=device, dtype=dtype).eval()


@torch.no_grad()
def heldout_loss(model, stream, device, seq: int, max_windows: int, batch: int) -> float:
    model.eval()
    n = min(max_windows, (stream.numel() - 1) // seq)
    total, count = 0.0, 0
    for i in range(0, n, batch):
        idx = torch.arange(i, min(n, i + batch), device=stream.device) * seq
        x = stream[idx.unsqueeze(1) + torch.arange(seq + 1, device=stream.device)]
        with autocast(device):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += x[:, 1:].numel()
    model.train()
    return total / max(1, count)


def save_target(model, corpus: Path, out: Path, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(out))
    # The layout our loader reads: config.json, model.safetensors, generation_config.json,
    # tokenizer.json, tokenizer_config.json; nothing else.
    for f in out.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            f.unlink()
    eot = meta["eot_token_id"]
    im_end = meta["special_token_ids"]["<|im_end|>"]
    gen = {"bos_token_id": eot, "eos_token_id": [eot, im_end], "pad_token_id": eot, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(corpus / name, out / name)


def stage_target(args, meta, device) -> dict:
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    train = load_stream(args.corpus / "train.bin.xz", device)
    held = load_stream(args.corpus / "heldout.bin.xz", device)
    log(f"target: train {train.numel():,} tokens, held-out {held.numel():,}")
    model = build_target(args, meta).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"target: {n_params / 1e6:.2f}M parameters; {args.layers} layers, hidden {args.hidden}")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if device.type == "cuda" else {}),
    )
    fwd = model
    if args.compile:
        try:
            fwd = torch.compile(model)
        except Exception as e:  # noqa: BLE001
            log(f"torch.compile unavailable ({e}); eager")
    model.train()
    step, tokens, start = 0, 0, time.time()
    losses = []
    while True:
        elapsed = time.time() - start
        if elapsed >= args.target_seconds or (args.target_steps and step >= args.target_steps):
            break
        lr = lr_at(step, elapsed / args.target_seconds, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        x = windows(train, args.batch, args.seq + 1, gen)
        try:
            with autocast(device):
                logits = fwd(input_ids=x[:, :-1]).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        except Exception as e:  # noqa: BLE001
            if fwd is model:
                raise
            log(f"compiled step failed ({type(e).__name__}: {e}); falling back to eager")
            fwd = model
            continue
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x[:, :-1].numel()
        if step % args.log_every == 0 or step == 1:
            losses.append((step, loss.item()))
            rate = tokens / max(1e-9, time.time() - start)
            log(f"target step {step} loss {loss.item():.4f} lr {lr:.2e} {rate / 1e3:.1f}k tok/s")
    train_seconds = time.time() - start
    final_train = loss.item() if step else float("nan")
    hl = heldout_loss(model, held, device, args.seq, args.eval_windows, args.batch)
    log(f"target: {step} steps, {tokens / 1e6:.1f}M tokens in {train_seconds:.0f}s; "
        f"train loss {final_train:.4f}, held-out loss {hl:.4f} (ppl {math.exp(hl):.2f})")
    save_target(model, args.corpus, args.out / "target", meta)
    report = {
        "params": n_params,
        "config": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads", "head_dim",
                                                 "intermediate", "seq", "batch", "lr", "warmup",
                                                 "weight_decay", "target_seconds", "compile")},
        "steps": step,
        "train_tokens_seen": tokens,
        "train_seconds": round(train_seconds, 1),
        "train_loss_last": final_train,
        "loss_curve": losses,
        "heldout_loss": hl,
        "heldout_ppl": math.exp(hl),
        "heldout_tokens_evaluated": min(args.eval_windows, (held.numel() - 1) // args.seq) * args.seq,
        "corpus": {k: meta[k] for k in ("train_tokens", "heldout_tokens", "train_files", "heldout_files")},
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }
    (args.out / "target_report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


# ---- draft -----------------------------------------------------------------------------------
@torch.no_grad()
def generate_continuations(target, train, args, device) -> list[tuple[int, torch.Tensor]]:
    """Greedy continuations of random training-split prefixes: list of (prompt_len, `[B, P+G]`)."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    chunks, total, start, i = [], 0, time.time(), 0
    limit = min(args.gen_seconds, args.deadline - (time.time() - T0) - args.eval_reserve - 30)
    while (time.time() - start < limit and total < args.gen_max_tokens) or not chunks:
        p = args.gen_prompt_lens[i % len(args.gen_prompt_lens)]
        prompts = windows(train, args.gen_batch, p, gen)
        with autocast(device):
            seqs = greedy_generate(target, prompts, args.gen_tokens)
        chunks.append((p, seqs))
        total += seqs.shape[0] * args.gen_tokens
        i += 1
        if i == 1 or i % 5 == 0:
            log(f"generation: {i} batches, {total / 1e6:.2f}M generated tokens")
    log(f"generation: {len(chunks)} batches, {total / 1e6:.2f}M tokens in {time.time() - start:.0f}s")
    return chunks


def draft_loss(draft: DSparkDraft, target, x: torch.Tensor, p: int, args, gen: torch.Generator):
    """One draft training batch over sequences `x` `[B, S]` whose positions `>= p` are the target's
    greedy continuation."""
    b, s = x.shape
    g = draft.block_size
    dev = x.device
    with torch.no_grad():
        out = target(input_ids=x, output_hidden_states=True, use_cache=False, logits_to_keep=1)
        feats = target_features(out.hidden_states, draft.layer_ids)
        last = out.hidden_states[-1]  # post final norm
    # anchors: positions p .. s-2 (the anchor and its first label are generated tokens)
    n_cand = s - 1 - p
    a_n = min(args.num_anchors, n_cand)
    order = torch.rand(b, n_cand, generator=gen, device="cpu").argsort(1)[:, :a_n].to(dev)
    anchors = order + p  # [B, A]
    anchor_tok = x.gather(1, anchors)
    hidden = draft.block_hidden(feats, anchors, anchor_tok)  # [B, A, γ, H]
    k = torch.arange(g, device=dev)
    label_pos = anchors.unsqueeze(-1) + 1 + k  # [B, A, γ]
    valid = label_pos < s
    safe = label_pos.clamp(max=s - 1)
    labels = x.gather(1, safe.reshape(b, -1)).reshape(b, a_n, g)
    prev = torch.cat([anchor_tok.unsqueeze(-1), labels[..., :-1]], -1)
    logits = draft.markov_logits(draft.base_logits(hidden), prev).float()
    with torch.no_grad():
        t_hidden = last.gather(1, (safe - 1).reshape(b, -1, 1).expand(-1, -1, last.shape[-1]))
        t_logits = draft.lm_head(t_hidden.to(draft.lm_head.weight.dtype)).float().reshape(b, a_n, g, -1)
    w = valid.float() * torch.exp(-k.float() / args.decay_gamma)
    wsum = w.sum().clamp_min(1e-6)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    ce = (ce.reshape(w.shape) * w).sum() / wsum
    pd = torch.softmax(logits, -1)
    pt = torch.softmax(t_logits, -1)
    l1_tok = (pd - pt).abs().sum(-1)
    l1 = (l1_tok * w).sum() / wsum
    overlap = (1 - 0.5 * l1_tok).clamp(0, 1).detach()
    conf = draft.confidence_logits(hidden, prev).float()
    bce = (F.binary_cross_entropy_with_logits(conf, overlap, reduction="none") * w).sum() / wsum
    loss = args.ce_alpha * ce + args.l1_alpha * l1 + args.conf_alpha * bce
    with torch.no_grad():
        acc = (logits.argmax(-1) == labels).float()
        # expected tokens per round at T=1 from the teacher-forced overlaps (DeepSpec's tau_probabilistic)
        tau_p = 1 + (overlap * valid).cumprod(-1).sum(-1).mean()
        acc_prefix = 1 + (acc * valid).cumprod(-1).sum(-1).mean()
    return loss, {"ce": ce.item(), "l1": l1.item(), "conf_bce": bce.item(),
                  "tau_teacher_forced_T0": acc_prefix.item(), "tau_teacher_forced_T1": tau_p.item()}


def eval_prompts(held: torch.Tensor, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, held.numel() - length - 1, (n,), generator=g)
    return [held[s : s + length].tolist() for s in starts.tolist()]


def evaluate_tau(target, draft, held, args, device) -> dict:
    cuda_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = eval_prompts(held.cpu(), args.eval_prompts, args.eval_prompt_len, args.seed + 7)
    res = {"prompts": len(prompts), "prompt_len": args.eval_prompt_len, "max_new_tokens": args.eval_new_tokens}
    crosscheck = []
    for temp in (0.0, 1.0):
        t = time.time()
        r = simulate(target, draft, prompts, args.eval_new_tokens, temp, seed=args.seed, pad_id=0)
        key = f"T{temp:g}"
        res[key] = {
            "tau": r["tau_total"],
            "tau_mean_per_prompt": float(np.mean(r["tau"])),
            "accept_hist": r["accept_hist"],
            "accept_rate_at": [round(a, 4) for a in r["accept_rate_at"]],
            "seconds": round(time.time() - t, 1),
        }
        log(f"eval {key}: tau {r['tau_total']:.3f} (mean per prompt {np.mean(r['tau']):.3f}), "
            f"accepted-count histogram {r['accept_hist']}")
        if temp == 0.0:
            for i in range(min(args.crosscheck_prompts, len(prompts))):
                crosscheck.append({"prompt_ids": prompts[i], "tokens": r["tokens"][i], "rounds": r["rounds"][i],
                                   "tau": r["tau"][i], "accepted": r["accepted"][i]})
    torch.backends.cuda.matmul.allow_tf32 = cuda_tf32
    res["rust_crosscheck_T0"] = crosscheck
    return res


def stage_draft(args, meta, device) -> dict:
    torch.manual_seed(args.seed + 2)
    gen = torch.Generator().manual_seed(args.seed + 2)
    tdir = args.out / "target"
    tcfg = json.loads((tdir / "config.json").read_text())
    # The shipped (bf16) target; bf16 for features during training, f32 for evaluation.
    target = load_target(tdir, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    for p_ in target.parameters():
        p_.requires_grad_(False)
    train = load_stream(args.corpus / "train.bin.xz", device)
    held = load_stream(args.corpus / "heldout.bin.xz", device)
    t_gen = time.time()
    chunks = generate_continuations(target, train, args, device)
    gen_info = {"sequences": sum(c.shape[0] for _, c in chunks),
                "generated_tokens": sum(c.shape[0] for _, c in chunks) * args.gen_tokens,
                "seconds": round(time.time() - t_gen, 1)}
    del train

    layer_ids = args.target_layer_ids or default_target_layer_ids(tcfg["num_hidden_layers"], args.num_feature_layers)
    if len(set(layer_ids)) != len(layer_ids) or max(layer_ids) >= tcfg["num_hidden_layers"] - 1:
        raise SystemExit(f"bad target_layer_ids {layer_ids} for a {tcfg['num_hidden_layers']}-layer target")
    dcfg = draft_config(tcfg, num_layers=args.draft_layers, block_size=args.block_size, target_layer_ids=layer_ids,
                        mask_token_id=meta["mask_token_id"], markov_rank=args.markov_rank,
                        num_anchors=args.num_anchors)
    draft = DSparkDraft(dcfg).to(device)
    draft.init_weights()
    draft.tie_to_target(target.model.embed_tokens.weight.float(), target.get_output_embeddings().weight.float())
    trainable = [p_ for p_ in draft.parameters() if p_.requires_grad]
    n_train = sum(p_.numel() for p_ in trainable)
    log(f"draft: {n_train / 1e6:.2f}M trainable parameters, layers {layer_ids} of the target, "
        f"block {args.block_size}, Markov rank {args.markov_rank}")
    opt = torch.optim.AdamW(trainable, lr=args.draft_lr, betas=(0.9, 0.95), weight_decay=0.0,
                            **({"fused": True} if device.type == "cuda" else {}))
    # Keep the whole command inside --deadline: shorten draft training if earlier parts overran.
    budget = min(args.draft_seconds, args.deadline - (time.time() - T0) - args.eval_reserve)
    if budget < args.draft_seconds:
        log(f"draft: {budget:.0f}s left before the deadline (asked {args.draft_seconds:.0f}s)")
    budget = max(budget, 10.0)
    step, start, curve = 0, time.time(), []
    stats = {}
    while True:
        elapsed = time.time() - start
        if elapsed >= budget or (args.draft_steps and step >= args.draft_steps):
            break
        lr = lr_at(step, elapsed / budget, args.draft_lr, args.draft_warmup)
        for g_ in opt.param_groups:
            g_["lr"] = lr
        p, seqs = chunks[int(torch.randint(len(chunks), (1,), generator=gen))]
        rows = torch.randint(seqs.shape[0], (min(args.draft_batch, seqs.shape[0]),), generator=gen).to(device)
        with autocast(device):
            loss, stats = draft_loss(draft, target, seqs[rows], p, args, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        step += 1
        if step % args.log_every == 0 or step == 1:
            curve.append({"step": step, "loss": loss.item(), **stats})
            log(f"draft step {step} loss {loss.item():.4f} ce {stats['ce']:.3f} l1 {stats['l1']:.3f} "
                f"conf {stats['conf_bce']:.3f} tf-tau T0 {stats['tau_teacher_forced_T0']:.2f} "
                f"T1 {stats['tau_teacher_forced_T1']:.2f} lr {lr:.2e}")
    train_seconds = time.time() - start
    log(f"draft: {step} steps in {train_seconds:.0f}s")
    del chunks
    save_draft(draft, args.out / "draft", torch.bfloat16)

    # Evaluate exactly what ships: both models from the bf16 files, in float32.
    from dspark_torch import load_draft

    target = load_target(tdir, device, torch.float32)
    draft = load_draft(args.out / "draft", device, torch.float32).eval()
    draft.tie_to_target(target.model.embed_tokens.weight, target.get_output_embeddings().weight)
    tau = evaluate_tau(target, draft, held, args, device)
    return {
        "config": {k: getattr(args, k) for k in (
            "draft_layers", "block_size", "markov_rank", "num_anchors", "draft_batch", "draft_lr",
            "draft_warmup", "ce_alpha", "l1_alpha", "conf_alpha", "decay_gamma", "draft_seconds",
            "gen_seconds", "gen_batch", "gen_tokens", "gen_prompt_lens")},
        "target_layer_ids": layer_ids,
        "mask_token_id": meta["mask_token_id"],
        "trainable_params": n_train,
        "continuations": gen_info,
        "steps": step,
        "train_seconds": round(train_seconds, 1),
        "train_budget_seconds": round(budget, 1),
        "last_stats": stats,
        "curve": curve,
        "eval": tau,
    }


# ---- main ------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stage", choices=("all", "target", "draft"), default="all")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="tiny dimensions and budgets for a CPU smoke test")
    ap.add_argument("--log-every", type=int, default=50)
    # target
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--max-positions", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--target-seconds", type=float, default=210)
    ap.add_argument("--target-steps", type=int, default=0, help="stop after this many steps (0: time only)")
    ap.add_argument("--eval-windows", type=int, default=512)
    ap.add_argument("--compile", action="store_true", help="torch.compile the target (falls back to eager)")
    # continuations
    ap.add_argument("--gen-seconds", type=float, default=45)
    ap.add_argument("--gen-max-tokens", type=int, default=30_000_000)
    ap.add_argument("--gen-batch", type=int, default=4096)
    ap.add_argument("--gen-tokens", type=int, default=192)
    ap.add_argument("--gen-prompt-lens", type=int, nargs="+", default=[32, 64, 128, 256])
    # draft
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--markov-rank", type=int, default=32)
    ap.add_argument("--num-feature-layers", type=int, default=3)
    ap.add_argument("--target-layer-ids", type=int, nargs="*", default=None)
    ap.add_argument("--num-anchors", type=int, default=64)
    ap.add_argument("--draft-batch", type=int, default=128)
    ap.add_argument("--draft-lr", type=float, default=1e-3)
    ap.add_argument("--draft-warmup", type=int, default=50)
    ap.add_argument("--ce-alpha", type=float, default=0.5)
    ap.add_argument("--l1-alpha", type=float, default=0.5)
    ap.add_argument("--conf-alpha", type=float, default=1.0)
    ap.add_argument("--decay-gamma", type=float, default=4.0)
    ap.add_argument("--draft-seconds", type=float, default=170)
    ap.add_argument("--deadline", type=float, default=540,
                    help="seconds since start by which draft training must end, less --eval-reserve")
    ap.add_argument("--eval-reserve", type=float, default=45, help="seconds kept for evaluation and export")
    ap.add_argument("--draft-steps", type=int, default=0)
    # evaluation
    ap.add_argument("--eval-prompts", type=int, default=256)
    ap.add_argument("--eval-prompt-len", type=int, default=128)
    ap.add_argument("--eval-new-tokens", type=int, default=128)
    ap.add_argument("--crosscheck-prompts", type=int, default=8)
    args = ap.parse_args(argv)
    if args.tiny:
        args.layers, args.hidden, args.heads, args.kv_heads, args.head_dim, args.intermediate = 6, 64, 4, 2, 16, 128
        args.seq, args.batch, args.eval_windows, args.log_every = 64, 8, 16, 10
        args.gen_batch, args.gen_tokens, args.gen_prompt_lens = 16, 48, [8, 16]
        args.num_anchors, args.draft_batch, args.markov_rank = 16, 8, 8
        args.eval_prompts, args.eval_prompt_len, args.eval_new_tokens = 8, 16, 32
        args.max_positions = 512
        args.deadline = 1e9
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    args.out.mkdir(parents=True, exist_ok=True)
    meta = json.loads((args.corpus / "meta.json").read_text())
    log(f"torch {torch.__version__}, device {device}; stage {args.stage}")
    report_path = args.out / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    report["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    if args.stage in ("all", "target"):
        report["target"] = stage_target(args, meta, device)
        report_path.write_text(json.dumps(report, indent=1) + "\n")
    if args.stage in ("all", "draft"):
        if "target" not in report and (args.out / "target_report.json").exists():
            report["target"] = json.loads((args.out / "target_report.json").read_text())
        report["draft"] = stage_draft(args, meta, device)
        report_path.write_text(json.dumps(report, indent=1) + "\n")
    sizes = {f"{d}/{f.name}": f.stat().st_size for d in ("target", "draft") if (args.out / d).is_dir()
             for f in sorted((args.out / d).iterdir())}
    report["files_bytes"] = sizes
    report["total_seconds"] = round(time.time() - T0, 1)
    report_path.write_text(json.dumps(report, indent=1) + "\n")
    log(f"done: {report_path}; model files {sum(sizes.values()) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()

"""A batched simulation of the speculative loop (DESIGN.md §1, §4) in PyTorch, for measuring τ.

One round per lane: the draft proposes γ tokens from the context features of the committed
positions `< L` and the anchor at `L`; the target runs over the committed tokens plus the drafts
(a full forward, no KV cache: the tiny target makes that cheap, and causality makes the committed
rows' features exact); greedy acceptance is the prefix match with the bonus at the first mismatch,
sampled acceptance is chain rejection sampling (accept `d` iff `u·q(d) < p(d)`, on rejection draw
from `max(0, p − q)` renormalised, after full acceptance draw from the next target row). Commit
`accepted + 1` tokens, cut by the `max_new_tokens` budget. No stop tokens (like `--ignore-eos`).

τ is reported as the Rust engine does: `(generated − 1) / rounds` (the first token comes from
prefill and is not a round).
"""

from __future__ import annotations

import torch

from dspark_torch import DSparkDraft, target_features


@torch.no_grad()
def target_forward(target, ids: torch.Tensor, layer_ids):
    """HF Qwen3ForCausalLM over `ids` `[B, S]` → (features `[B, S, n·H]`, logits float32 `[B, S, V]`)."""
    out = target(input_ids=ids, output_hidden_states=True, use_cache=False)
    return target_features(out.hidden_states, layer_ids), out.logits.float()


def _first_index(weights: torch.Tensor, generator) -> torch.Tensor:
    return torch.multinomial(weights, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def simulate(target, draft: DSparkDraft, prompts: list[list[int]], max_new_tokens: int,
             temperature: float = 0.0, seed: int = 0, pad_id: int = 0, record: bool = False):
    """Run the speculative loop for every prompt (lanes of any lengths). Returns a dict with
    per-lane `tokens`, `rounds`, `tau`, `accepted` (per round), and the totals; with `record`,
    per-lane round logs (`anchor_position`, `anchor`, `drafted`, `accepted`)."""
    dev = next(draft.parameters()).device
    gamma = draft.block_size
    b = len(prompts)
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    greedy = temperature <= 0
    plen = torch.tensor([len(p) for p in prompts], device=dev)
    s_max = int(plen.max()) + max_new_tokens + gamma + 2
    seq = torch.full((b, s_max), pad_id, dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        seq[i, : len(p)] = torch.tensor(p, device=dev)
    lanes = torch.arange(b, device=dev)

    # Prefill: the first token comes from the last prompt row.
    feats, logits = target_forward(target, seq[:, : int(plen.max())], draft.layer_ids)
    last = logits[lanes, plen - 1]
    first = last.argmax(-1) if greedy else _first_index(torch.softmax(last / temperature, -1), gen)
    seq[lanes, plen] = first
    ctx = plen.clone()  # L: context rows; the anchor sits at position L
    generated = torch.ones(b, dtype=torch.long, device=dev)
    rounds = torch.zeros(b, dtype=torch.long, device=dev)
    accepted_log: list[list[int]] = [[] for _ in range(b)]
    round_log: list[list[dict]] = [[] for _ in range(b)]

    while bool((generated < max_new_tokens).any()):
        active = generated < max_new_tokens
        # 1. draft block over the committed context (< L) from the last target forward.
        anchor = seq[lanes, ctx]
        dtype = draft.fc.weight.dtype
        hidden = draft.block_hidden(feats[:, : int(ctx.max())].to(dtype), ctx.unsqueeze(1), anchor.unsqueeze(1))
        drafts, _, q, _ = draft.propose(hidden[:, 0], anchor, temperature, gen)
        # 2. target over committed tokens + drafts.
        buf = seq.clone()
        pos = ctx.unsqueeze(1) + 1 + torch.arange(gamma, device=dev)
        buf.scatter_(1, pos, drafts)
        feats, logits = target_forward(target, buf[:, : int(ctx.max()) + gamma + 1], draft.layer_ids)
        rows = logits.gather(1, (ctx.unsqueeze(1) + torch.arange(gamma + 1, device=dev)).unsqueeze(-1)
                             .expand(-1, -1, logits.shape[-1]))  # [B, γ+1, V]: row j predicts L+j+1
        # 3. acceptance.
        if greedy:
            t = rows.argmax(-1)
            match = (drafts == t[:, :gamma]).long().cumprod(1)
            acc = match.sum(1)
            bonus = t.gather(1, acc.unsqueeze(1)).squeeze(1)
        else:
            p = torch.softmax(rows / temperature, -1)
            pd = p[:, :gamma].gather(2, drafts.unsqueeze(-1)).squeeze(-1)
            qd = q.gather(2, drafts.unsqueeze(-1)).squeeze(-1)
            u = torch.rand(drafts.shape, generator=gen, device=dev)
            ok = (u * qd < pd).long().cumprod(1)
            acc = ok.sum(1)
            p_at = p.gather(1, acc.view(-1, 1, 1).expand(-1, 1, p.shape[-1])).squeeze(1)
            q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], 1)
            q_at = q_pad.gather(1, acc.view(-1, 1, 1).expand(-1, 1, q.shape[-1])).squeeze(1)
            resid = (p_at - q_at).clamp_min(0)
            mass = resid.sum(-1, keepdim=True)
            resid = torch.where(mass > 1e-8, resid, p_at)
            bonus = _first_index(resid, gen)
        # 4. commit accepted drafts + bonus, cut by the budget.
        commit = torch.cat([drafts, torch.zeros_like(drafts[:, :1])], 1)
        commit.scatter_(1, acc.unsqueeze(1), bonus.unsqueeze(1))
        m = torch.minimum(acc + 1, max_new_tokens - generated).clamp_min(0)
        m = torch.where(active, m, torch.zeros_like(m))
        keep = torch.arange(gamma + 1, device=dev).unsqueeze(0) < m.unsqueeze(1)
        cpos = ctx.unsqueeze(1) + 1 + torch.arange(gamma + 1, device=dev)
        cur = seq.gather(1, cpos)
        seq.scatter_(1, cpos, torch.where(keep, commit, cur))
        acc_h, active_h = acc.tolist(), active.tolist()
        if record:
            ctx_h, anchor_h, drafts_h = ctx.tolist(), anchor.tolist(), drafts.tolist()
        for i in range(b):
            if not active_h[i]:
                continue
            accepted_log[i].append(acc_h[i])
            if record:
                round_log[i].append({"anchor_position": ctx_h[i], "anchor": anchor_h[i],
                                     "drafted": drafts_h[i], "accepted": acc_h[i]})
        rounds += active.long()
        generated += m
        ctx += m

    tokens = [seq[i, int(plen[i]) : int(plen[i]) + max_new_tokens].tolist() for i in range(b)]
    r = rounds.tolist()
    tau = [(max_new_tokens - 1) / ri if ri else 0.0 for ri in r]
    total_rounds = sum(r)
    acc_all = [a for lane in accepted_log for a in lane]
    hist = [0] * (gamma + 1)
    for a in acc_all:
        hist[a] += 1
    out = {
        "tokens": tokens,
        "rounds": r,
        "tau": tau,
        "accepted": accepted_log,
        "tau_total": (b * (max_new_tokens - 1)) / total_rounds if total_rounds else 0.0,
        "accept_hist": hist,
        # acceptance rate at draft position k among rounds that reached k (full width)
        "accept_rate_at": [
            sum(1 for a in acc_all if a > k) / max(1, sum(1 for a in acc_all if a >= k)) for k in range(gamma)
        ],
    }
    if record:
        out["round_log"] = round_log
    return out


@torch.no_grad()
def greedy_generate(target, prompts: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Target-only greedy continuation of equal-length `prompts` `[B, P]` with a KV cache.
    Returns `[B, P + max_new_tokens]`."""
    out = target(input_ids=prompts, use_cache=True, logits_to_keep=1)
    past = out.past_key_values
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    toks = [prompts, nxt]
    for _ in range(max_new_tokens - 1):
        out = target(input_ids=nxt, past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        toks.append(nxt)
    return torch.cat(toks, dim=1)

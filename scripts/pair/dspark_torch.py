"""A PyTorch DSpark draft that computes what the Rust draft (`dspark/src/model/dspark_draft.rs`,
`layer.rs`, `markov.rs`) computes, for training and for simulating the verify loop.

Written from the project's design notes (DESIGN.md §4); checked against the golden vectors by
`check_dspark_torch.py`. Conventions:

* features: for each id `l` of `target_layer_ids`, the residual output of target layer `l`
  (Hugging Face `hidden_states[l + 1]`), concatenated → `[.., n·H]`;
* context: `c = hidden_norm(fc(features))`; per draft layer `K = RoPE(k_norm(k_proj c))`,
  `V = v_proj c` at the context positions (no input norm on `c`);
* block: ids `[anchor, MASK × (γ−1)]` embedded with the target's table at positions
  `L .. L+γ−1` (L = anchor position = committed context length); Qwen3 pre-norm layers whose
  attention sees context keys `< L` and all γ keys of its own block; final norm; the target's
  LM head. Row k predicts position `L + k + 1`;
* vanilla Markov head: `logits_k = base_k + W2 · W1[prev_k]`, `prev_0` = anchor;
* confidence: `σ(w · [h_k ; W1[prev_k]] + b)`.

Tensor names follow the released DSpark layout (top-level keys, no `model.` prefix).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

DRAFT_TENSOR_PREFIXES = (
    "layers.",
    "norm.weight",
    "fc.weight",
    "hidden_norm.weight",
    "markov_head.",
    "confidence_head.",
    "embed_tokens.weight",
    "lm_head.weight",
)


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalise in float32, cast back, then scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_theta(config: dict) -> float:
    if "rope_theta" in config and config["rope_theta"] is not None:
        return float(config["rope_theta"])
    params = config.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin `[..., head_dim]` for integer `positions` (computed in float64, each half repeated)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim))
    angle = positions.to(torch.float64).unsqueeze(-1) * inv
    angle = torch.cat([angle, angle], dim=-1)
    return angle.cos().to(dtype), angle.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` `[B, heads, T, hd]`, `cos`/`sin` `[B, T, hd]`."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(h, cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(h, cfg["intermediate_size"])

    def forward(self, x, c, blk_rope, ctx_rope, mask):
        """`x` `[B, Q, H]` block rows; `c` `[B, S, H]` context projection; `mask` `[B, 1, Q, S+Q]`
        (True = attend)."""
        a = self.self_attn
        b, q_len, _ = x.shape
        s_len = c.shape[1]
        h = self.input_layernorm(x)
        q = a.q_norm(a.q_proj(h).view(b, q_len, a.heads, a.head_dim)).transpose(1, 2)
        k_blk = a.k_norm(a.k_proj(h).view(b, q_len, a.kv_heads, a.head_dim)).transpose(1, 2)
        v_blk = a.v_proj(h).view(b, q_len, a.kv_heads, a.head_dim).transpose(1, 2)
        k_ctx = a.k_norm(a.k_proj(c).view(b, s_len, a.kv_heads, a.head_dim)).transpose(1, 2)
        v_ctx = a.v_proj(c).view(b, s_len, a.kv_heads, a.head_dim).transpose(1, 2)
        q = apply_rope(q, *blk_rope)
        k_blk = apply_rope(k_blk, *blk_rope)
        k_ctx = apply_rope(k_ctx, *ctx_rope)
        k = torch.cat([k_ctx, k_blk], dim=2)
        v = torch.cat([v_ctx, v_blk], dim=2)
        groups = a.heads // a.kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=a.head_dim**-0.5)
        x = x + a.o_proj(attn.transpose(1, 2).reshape(b, q_len, a.heads * a.head_dim))
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """The vanilla Markov head: `markov_w1` `[V, r]` (embedding), `markov_w2` `[V, r]` (r → V)."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)

    def bias(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(prev))


class ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)


class DSparkDraft(nn.Module):
    """The draft. `embed_tokens` and `lm_head` are the target's (frozen, exported as copies)."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = cfg
        h, v = cfg["hidden_size"], cfg["vocab_size"]
        self.block_size = int(cfg["block_size"])
        self.mask_token_id = int(cfg["mask_token_id"])
        self.layer_ids = list(cfg["target_layer_ids"])
        self.head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
        self.theta = rope_theta(cfg)
        self.embed_tokens = nn.Embedding(v, h)
        self.lm_head = nn.Linear(h, v, bias=False)
        self.fc = nn.Linear(len(self.layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.layers = nn.ModuleList([DraftLayer(cfg) for _ in range(cfg["num_hidden_layers"])])
        self.norm = RMSNorm(h, cfg["rms_norm_eps"])
        rank = int(cfg.get("markov_rank", 0))
        if rank > 0 and str(cfg.get("markov_head_type", "vanilla")).lower() != "vanilla":
            raise ValueError("only the vanilla Markov head is implemented here")
        self.markov_head = MarkovHead(v, rank) if rank > 0 else None
        self.with_markov = bool(cfg.get("enable_confidence_head")) and bool(cfg.get("confidence_head_with_markov"))
        self.confidence_head = (
            ConfidenceHead(h + (rank if self.with_markov else 0)) if cfg.get("enable_confidence_head") else None
        )

    # ---- initialisation and the target's tables -------------------------------------------
    def init_weights(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def tie_to_target(self, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        """Copy the target's embedding and LM head and freeze them."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed)
            self.lm_head.weight.copy_(lm_head)
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)

    # ---- forward ---------------------------------------------------------------------------
    def context_projection(self, features: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(features))

    def block_hidden(self, features: torch.Tensor, anchor_pos: torch.Tensor, anchor_tok: torch.Tensor):
        """Final-normed hidden of the blocks at `anchor_pos` `[B, A]` with anchor tokens
        `anchor_tok` `[B, A]`, over context `features` `[B, S, n·H]` (row j = position j; each
        block sees rows `< anchor_pos`). Returns `[B, A, γ, H]`."""
        b, s_len, _ = features.shape
        a_n, g = anchor_pos.shape[1], self.block_size
        dev = features.device
        c = self.context_projection(features)
        ids = torch.full((b, a_n, g), self.mask_token_id, dtype=torch.long, device=dev)
        ids[:, :, 0] = anchor_tok
        x = self.embed_tokens(ids).reshape(b, a_n * g, -1).to(c.dtype)
        offs = torch.arange(g, device=dev)
        blk_pos = (anchor_pos.unsqueeze(-1) + offs).reshape(b, a_n * g)
        ctx_pos = torch.arange(s_len, device=dev).unsqueeze(0).expand(b, -1)
        blk_rope = rope_tables(blk_pos, self.head_dim, self.theta, c.dtype)
        ctx_rope = rope_tables(ctx_pos, self.head_dim, self.theta, c.dtype)
        # mask [B, 1, A·γ, S + A·γ]: context keys j < anchor, block keys of the same block.
        q_anchor = anchor_pos.repeat_interleave(g, dim=1)  # [B, A·γ]
        ctx_mask = torch.arange(s_len, device=dev).view(1, 1, -1) < q_anchor.unsqueeze(-1)
        blk_id = torch.arange(a_n, device=dev).repeat_interleave(g)
        blk_mask = (blk_id.view(-1, 1) == blk_id.view(1, -1)).unsqueeze(0).expand(b, -1, -1)
        mask = torch.cat([ctx_mask, blk_mask], dim=-1).unsqueeze(1)
        for layer in self.layers:
            x = layer(x, c, blk_rope, ctx_rope, mask)
        return self.norm(x).reshape(b, a_n, g, -1)

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def markov_logits(self, base: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Teacher-forced corrected logits: `base` `[..., V]`, `prev` `[...]` token ids."""
        if self.markov_head is None:
            return base
        return base + self.markov_head.bias(prev).to(base.dtype)

    def confidence_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        if self.confidence_head is None:
            return None
        feats = hidden
        if self.with_markov:
            feats = torch.cat([hidden, self.markov_head.markov_w1(prev).to(hidden.dtype)], dim=-1)
        return self.confidence_head.proj(feats).squeeze(-1)

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, anchor: torch.Tensor, temperature: float = 0.0,
                generator: torch.Generator | None = None):
        """Sequential Markov pass over blocks: `hidden` `[N, γ, H]`, `anchor` `[N]`. Returns draft
        tokens `[N, γ]`, corrected logits `[N, γ, V]` (float32), `q` `[N, γ, V]` (softmax at
        `temperature`, None when greedy) and confidence logits `[N, γ]` (or None)."""
        base = self.base_logits(hidden).float()
        prev = anchor.long()
        tokens, rows, qs, confs = [], [], [], []
        for k in range(hidden.shape[1]):
            logits = self.markov_logits(base[:, k], prev)
            conf = self.confidence_logits(hidden[:, k], prev)
            if conf is not None:
                confs.append(conf.float())
            if temperature <= 0:
                tok = logits.argmax(dim=-1)
            else:
                q = torch.softmax(logits / temperature, dim=-1)
                qs.append(q)
                tok = torch.multinomial(q, 1, generator=generator).squeeze(-1)
            rows.append(logits)
            tokens.append(tok)
            prev = tok
        return (
            torch.stack(tokens, 1),
            torch.stack(rows, 1),
            torch.stack(qs, 1) if qs else None,
            torch.stack(confs, 1) if confs else None,
        )


# ---- checkpoints ---------------------------------------------------------------------------
def draft_config(target_cfg: dict, *, num_layers: int, block_size: int, target_layer_ids: list[int],
                 mask_token_id: int, markov_rank: int, num_anchors: int) -> dict:
    """The draft's `config.json`: the target's keys plus the DSpark keys (released layout)."""
    cfg = {k: v for k, v in target_cfg.items() if not k.startswith("_")}
    cfg.update(
        architectures=["Qwen3DSparkModel"],
        num_target_layers=int(target_cfg["num_hidden_layers"]),
        num_hidden_layers=int(num_layers),
        block_size=int(block_size),
        tie_word_embeddings=False,
        layer_types=["full_attention"] * int(num_layers),
        mask_token_id=int(mask_token_id),
        target_layer_ids=[int(i) for i in target_layer_ids],
        num_anchors=int(num_anchors),
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        markov_rank=int(markov_rank),
        markov_head_type="vanilla",
    )
    cfg.pop("max_window_layers", None)
    cfg["max_window_layers"] = int(num_layers)
    return cfg


def save_draft(model: DSparkDraft, out_dir: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    assert all(k.startswith(DRAFT_TENSOR_PREFIXES) for k in state), sorted(state)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(model.cfg)
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def load_draft(dir_: Path, device="cpu", dtype: torch.dtype = torch.float32) -> DSparkDraft:
    from safetensors.torch import load_file

    cfg = json.loads((Path(dir_) / "config.json").read_text())
    model = DSparkDraft(cfg)
    state = load_file(str(Path(dir_) / "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # The draft's embedding and LM head may be absent: callers then copy the target's.
    missing = [m for m in missing if m not in ("embed_tokens.weight", "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"draft tensors: missing {missing}, unexpected {unexpected}")
    return model.to(device=device, dtype=dtype)


def default_target_layer_ids(depth: int, n: int) -> list[int]:
    """`round(1 + i·(depth − 4)/(n − 1))` (half to even), as DESIGN.md §4."""
    if n <= 1:
        return [depth // 2]
    return [int(round(1 + i * (depth - 4) / (n - 1))) for i in range(n)]


def target_features(hidden_states, layer_ids) -> torch.Tensor:
    """Concatenate HF `hidden_states[l + 1]` for `l` in `layer_ids`."""
    return torch.cat([hidden_states[l + 1] for l in layer_ids], dim=-1)


__all__ = [
    "DSparkDraft",
    "draft_config",
    "save_draft",
    "load_draft",
    "default_target_layer_ids",
    "target_features",
    "rope_tables",
]

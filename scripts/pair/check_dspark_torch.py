#!/usr/bin/env python3
"""Check `dspark_torch.py` (and the loop in `spec_sim.py`) against the golden vectors.

Loads `dspark/tests/fixtures/golden/{tiny-qwen3,tiny-dspark}` and reproduces, in float32 on the
CPU:

1. `target_prefill`: features (`hidden_states[l + 1]` for `target_layer_ids`) and logits of the
   Hugging Face Qwen3 target;
2. `draft_block` for every prompt: context projection, block hidden, base and Markov-corrected
   logits, greedy draft tokens, confidence logits and probabilities (context = the golden
   features, anchor at position T, as in `dspark/tests/golden_draft.rs`);
3. `markov_teacher_forced`: the head on the golden base logits / block hidden with explicit
   previous tokens (both variants);
4. `spec_greedy`: every round's block hidden and confidence recomputed in ONE multi-anchor pass
   (the training-path mask) over the full-forward features of prompt + output, and the whole
   speculative loop of `spec_sim.simulate` (output tokens and accepted count of every round).

Prints the max absolute difference of each quantity against the tolerance suggested by the
golden README, and exits non-zero on any failure.

Usage: `python3 scripts/pair/check_dspark_torch.py [--golden DIR]` (needs torch, transformers,
safetensors).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dspark_torch import load_draft, target_features  # noqa: E402
from spec_sim import simulate  # noqa: E402

FAILURES: list[str] = []


def report(name: str, got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    got, want = got.detach().float().reshape(-1), want.float().reshape(-1)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    diff = (got - want).abs().max().item() if got.numel() else 0.0
    ok = diff <= atol
    print(f"{'ok  ' if ok else 'FAIL'} {name:48s} max|diff| {diff:.3e}  (atol {atol:.0e})")
    if not ok:
        FAILURES.append(name)


def same(name: str, got, want) -> None:
    ok = list(got) == list(want)
    print(f"{'ok  ' if ok else 'FAIL'} {name:48s} {'equal' if ok else f'{list(got)} != {list(want)}'}")
    if not ok:
        FAILURES.append(name)


def load_target(path: Path):
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(path), attn_implementation="sdpa")
    return model.float().eval()


def main() -> int:
    root = Path(__file__).resolve().parents[2]
    ap = argparse.ArgumentParser()
    ap.add_argument("--golden", type=Path, default=root / "dspark" / "tests" / "fixtures" / "golden")
    args = ap.parse_args()
    torch.manual_seed(0)
    g = args.golden
    cases = json.loads((g / "cases.json").read_text())["sets"][0]
    by_id = {c["id"]: c for c in cases["cases"]}
    vec = {name: load_file(str(g / "vectors" / f"{name}.safetensors"))
           for name in ("target_prefill", "draft_block", "markov_teacher_forced", "spec_greedy")}

    def tensor(ref: dict) -> torch.Tensor:
        if "from" in ref:
            return tensor(by_id[ref["from"]]["expected"][ref["tensor"]])
        return vec[Path(ref["file"]).stem][ref["tensor"]]

    target = load_target(g / "tiny-qwen3")
    draft = load_draft(g / "tiny-dspark").eval()
    # The engine uses the target's embedding and LM head.
    draft.tie_to_target(target.model.embed_tokens.weight, target.get_output_embeddings().weight)
    ids = draft.layer_ids
    prompts = cases["prompts"]

    print("== target_prefill")
    for i, p in enumerate(prompts):
        with torch.no_grad():
            out = target(input_ids=torch.tensor([p]), output_hidden_states=True, use_cache=False)
        report(f"p{i}.features", target_features(out.hidden_states, ids)[0], vec["target_prefill"][f"p{i}.features"], 1e-2)
        report(f"p{i}.logits", out.logits[0], vec["target_prefill"][f"p{i}.logits"], 5e-4)

    print("== draft_block")
    for c in (c for c in cases["cases"] if c["kind"] == "draft_block"):
        i = c["prompt"]
        e = c["expected"]
        feats = vec["target_prefill"][f"p{i}.features"].unsqueeze(0)
        t = feats.shape[1]
        assert c["anchor_position"] == t
        with torch.no_grad():
            report(f"p{i}.context_projection", draft.context_projection(feats)[0], tensor(e["context_projection"]), 2e-4)
            anchor = torch.tensor([c["anchor"]])
            hidden = draft.block_hidden(feats, torch.tensor([[t]]), anchor.unsqueeze(1))[:, 0]
            report(f"p{i}.block_hidden", hidden[0], tensor(e["block_hidden"]), 2e-4)
            report(f"p{i}.base_logits", draft.base_logits(hidden)[0], tensor(e["base_logits"]), 5e-4)
            toks, corrected, _, conf = draft.propose(hidden, anchor, 0.0)
        same(f"p{i}.draft_tokens", toks[0].tolist(), e["draft_tokens"])
        report(f"p{i}.corrected_logits", corrected[0], tensor(e["corrected_logits"]), 5e-4)
        report(f"p{i}.confidence_logits", conf[0], tensor(e["confidence_logits"]), 5e-5)
        report(f"p{i}.confidence", conf[0].sigmoid(), tensor(e["confidence"]), 2e-5)

    print("== markov_teacher_forced")
    for c in (c for c in cases["cases"] if c["kind"] == "markov_teacher_forced"):
        base = tensor(c["inputs"]["base_logits"])
        for v in c["variants"]:
            prev = torch.tensor(v["prev_token_ids"])
            with torch.no_grad():
                got = draft.markov_logits(base, prev)
            report(f"p{c['prompt']}.{v['name']}", got, tensor(v["expected"]["corrected_logits"]), 5e-4)

    print("== spec_greedy (multi-anchor training-path pass, and the simulated loop)")
    for c in (c for c in cases["cases"] if c["kind"] == "spec_greedy"):
        i = c["prompt"]
        e = c["expected"]
        full = torch.tensor([c["input_ids"] + e["output_tokens"]])
        rounds = e["rounds"]
        with torch.no_grad():
            out = target(input_ids=full, output_hidden_states=True, use_cache=False)
            feats = target_features(out.hidden_states, ids)
            pos = torch.tensor([[r["anchor_position"] for r in rounds]])
            anc = torch.tensor([[r["anchor"] for r in rounds]])
            hidden = draft.block_hidden(feats, pos, anc)[0]  # [R, γ, H]
            # confidence with prev = [anchor, drafts...] of each round
            prev = torch.tensor([[r["anchor"]] + r["draft_tokens"][:-1] for r in rounds])
            conf = draft.confidence_logits(hidden, prev).sigmoid()
        report(f"p{i}.round_block_hidden ({len(rounds)} anchors)", hidden, tensor(e["round_block_hidden"]), 2e-4)
        report(f"p{i}.round_confidence", conf, tensor(e["round_confidence"]), 2e-5)
        sim = simulate(target, draft, [c["input_ids"]], c["max_new_tokens"], 0.0, record=True)
        same(f"p{i}.simulated output_tokens", sim["tokens"][0], e["output_tokens"])
        n = len(sim["round_log"][0])
        same(f"p{i}.simulated accepted per round ({n} rounds)", [r["accepted"] for r in sim["round_log"][0]],
             [r["accepted"] for r in rounds[:n]])
        same(f"p{i}.simulated drafts per round", [r["drafted"] for r in sim["round_log"][0]],
             [r["draft_tokens"] for r in rounds[:n]])

    print(f"\n{'ALL PASSED' if not FAILURES else 'FAILED: ' + ', '.join(FAILURES)}")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())

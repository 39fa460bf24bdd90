#!/usr/bin/env python3
"""Compare the Rust engine with the PyTorch simulation on a trained pair (issue 7).

Reads `report.json` written by `train.py` (its `draft.eval.rust_crosscheck_T0` list: held-out
prompts with the simulated greedy tokens, rounds and accepted counts), runs our CLI on the same
prompts with `--draft` (speculative, greedy, full width, `--ignore-eos`) and without it
(target-only), and checks:

* speculative output == target-only output (lossless greedy);
* Rust tokens == simulated tokens, and the accepted count of every round equal;
* τ per prompt and over all prompts, Rust vs simulation.

Usage: `python3 scripts/pair/crosscheck_rust.py --run DIR [--target DIR --draft DIR]
[--bin target/release/dspark] [--device cpu --dtype f32]`. Exits non-zero when outputs differ.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def run_cli(binary: str, target: Path, draft: Path | None, prompt: list[int], n: int, device: str, dtype: str,
            temperature: float = 0.0, seed: int = 0):
    cmd = [binary, "generate", "--target", str(target), "--prompt-ids", ",".join(map(str, prompt)),
           "--max-new-tokens", str(n), "--ignore-eos", "--json", "--device", device, "--dtype", dtype,
           "--temperature", str(temperature), "--seed", str(seed)]
    if draft is not None:
        cmd += ["--draft", str(draft)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out[out.index("{"):])


def main() -> int:
    root = Path(__file__).resolve().parents[2]
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", type=Path, required=True, help="train.py --out folder (report.json)")
    ap.add_argument("--target", type=Path, default=None)
    ap.add_argument("--draft", type=Path, default=None)
    ap.add_argument("--bin", default=str(root / "target" / "release" / "dspark"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="f32")
    ap.add_argument("--sampled-seeds", type=int, default=4, help="T=1 runs per prompt for the statistical check")
    args = ap.parse_args()
    report = json.loads((args.run / "report.json").read_text())
    target = args.target or args.run / "target"
    draft = args.draft or args.run / "draft"
    ev = report["draft"]["eval"]
    n = ev["max_new_tokens"]
    bad = 0
    sim_rounds = rust_rounds = 0
    for i, case in enumerate(ev["rust_crosscheck_T0"]):
        spec = run_cli(args.bin, target, draft, case["prompt_ids"], n, args.device, args.dtype)
        plain = run_cli(args.bin, target, None, case["prompt_ids"], n, args.device, args.dtype)
        lossless = spec["tokens"] == plain["tokens"]
        same_tokens = spec["tokens"] == case["tokens"]
        rust_acc = [r["accepted"] for r in spec.get("rounds", [])]
        same_rounds = rust_acc == case["accepted"]
        sim_rounds += case["rounds"]
        rust_rounds += spec["stats"]["rounds"]
        ok = lossless and same_tokens and same_rounds
        bad += not ok
        print(f"prompt {i}: tau rust {spec['stats']['tau']:.3f} sim {case['tau']:.3f}; rounds {spec['stats']['rounds']} "
              f"vs {case['rounds']}; spec==target-only {lossless}; tokens==sim {same_tokens}; "
              f"accepted per round equal {same_rounds}")
        if not same_rounds:
            print(f"   rust accepted {rust_acc}\n   sim  accepted {case['accepted']}")
        if not same_tokens:
            first = next((k for k, (a, b) in enumerate(zip(spec["tokens"], case["tokens"])) if a != b), None)
            print(f"   first differing token at {first}")
    cases = len(ev["rust_crosscheck_T0"])
    if cases:
        print(f"overall tau: rust {cases * (n - 1) / max(1, rust_rounds):.3f}, "
              f"sim {cases * (n - 1) / max(1, sim_rounds):.3f} over {cases} prompts")
    if args.sampled_seeds and cases:
        # T = 1: only a statistical comparison (the engine's coins differ from torch's).
        rounds = runs = 0
        for i, case in enumerate(ev["rust_crosscheck_T0"]):
            for seed in range(args.sampled_seeds):
                out = run_cli(args.bin, target, draft, case["prompt_ids"], n, args.device, args.dtype, 1.0, seed)
                rounds += out["stats"]["rounds"]
                runs += 1
        print(f"T=1: rust tau {runs * (n - 1) / max(1, rounds):.3f} over {runs} runs "
              f"({cases} prompts x {args.sampled_seeds} seeds); simulation tau {ev['T1']['tau']:.3f} "
              f"over {ev['prompts']} prompts (statistical comparison only)")
    print("ALL AGREE" if not bad else f"{bad} of {cases} prompts differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

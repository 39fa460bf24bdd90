"""Speculative generation from Python, checked against target-only generation.

    python examples/python/generate.py TARGET_DIR [DRAFT_DIR] [--prompt TEXT | --prompt-ids 1,2,3]

With no arguments it runs on the tiny golden models of the repository (random weights, token ids
only): greedy speculative output must equal greedy target-only output, token for token.
"""

import argparse
import sys
from pathlib import Path

import dspark

GOLDEN = Path(__file__).resolve().parents[2] / "dspark" / "tests" / "fixtures" / "golden"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", nargs="?", default=GOLDEN / "tiny-qwen3", type=Path)
    parser.add_argument("draft", nargs="?", default=GOLDEN / "tiny-dspark", type=Path)
    parser.add_argument("--prompt", help="prompt text, sent as a chat message (needs tokenizer.json)")
    parser.add_argument("--prompt-ids", default="37,35,253,491,331", help="prompt token ids, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="f32")
    args = parser.parse_args()

    target = dspark.Engine(args.target, device=args.device, dtype=args.dtype)
    spec = dspark.Engine(args.target, draft=args.draft, device=args.device, dtype=args.dtype)
    if args.prompt is not None:
        prompt = [{"role": "user", "content": args.prompt}]
    else:
        prompt = [int(t) for t in args.prompt_ids.split(",")]
    params = dspark.SamplingParams(args.max_new_tokens)

    # Stream the speculative run; each chunk is what one verify round committed.
    print("speculative:", end=" ", flush=True)
    stream = spec.stream(prompt, params, enable_thinking=False)
    for chunk in stream:
        print(chunk.text if chunk.text is not None else chunk.token_ids, end=" ", flush=True)
    print()
    out = stream.results[0]
    baseline = target.generate(prompt, params, enable_thinking=False)

    s = out.stats
    print(f"{s.generated_tokens} tokens in {s.rounds} rounds, tau {s.tau:.2f}, "
          f"accepted {s.accepted}/{s.drafted} drafts, per position {s.accepted_per_position}")
    print(f"target-only: {target.last_stats.decode_tokens_per_second:.1f} tok/s, "
          f"speculative: {spec.last_stats.decode_tokens_per_second:.1f} tok/s")
    if out.token_ids != baseline.token_ids:
        print("MISMATCH: speculative", out.token_ids, "target-only", baseline.token_ids, file=sys.stderr)
        return 1
    print("greedy speculative output == greedy target-only output")
    return 0


if __name__ == "__main__":
    sys.exit(main())

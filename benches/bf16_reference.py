"""How far does a bf16 run of the golden target drift from the f32 golden logits in PyTorch?

The yardstick for dspark's stated bf16 tolerance: the same relative measures as the Rust golden
checks (max |diff| over the largest |golden value|, for logits), and the first greedy divergence,
computed with transformers in bf16 on the GPU. Reads the committed fixtures only.
"""
import json
import os

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

root = os.environ.get("DSPARK_GOLDEN", "dspark/tests/fixtures/golden")
cases = json.load(open(os.path.join(root, "cases.json")))["sets"][0]["cases"]
vectors = load_file(os.path.join(root, "vectors/target_prefill.safetensors"))
for dtype in (torch.float32, torch.bfloat16):
    model = AutoModelForCausalLM.from_pretrained(os.path.join(root, "tiny-qwen3"), dtype=dtype).cuda().eval()
    worst = 0.0
    for case in cases:
        if case["kind"] != "target_prefill":
            continue
        ids = torch.tensor([case["input_ids"]], device="cuda")
        with torch.no_grad():
            logits = model(ids).logits[0].float().cpu()
        golden = vectors[case["expected"]["logits"]["tensor"]]
        worst = max(worst, ((logits - golden).abs().max() / golden.abs().max()).item())
    divergences = []
    for case in cases:
        if case["kind"] != "target_greedy":
            continue
        ids = torch.tensor([case["input_ids"]], device="cuda")
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
        expected = case["expected"]["tokens"]
        divergences.append(next((i for i, (a, b) in enumerate(zip(out, expected)) if a != b), None))
    print(f"transformers {dtype}: logits max rel diff {worst:.4f}; first greedy divergence per prompt {divergences}")

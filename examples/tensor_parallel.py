"""Generate under a preset with the model split over several GPUs (or CPU processes).

transformers shards the checkpoint with its tensor-parallel plan; every rank's cache keeps
the rank's own KV heads, and the decisions that combine heads (which tokens a row keeps,
thought classes, K-means, shared blocks) are all-reduced over the ranks, so all of them
keep the same tokens. Rank 0 prints the texts and the memory report, whose last lines give
the bytes of every rank together.

    torchrun --nproc-per-node 2 examples/tensor_parallel.py --model PATH --preset rkv "Prove that ..."

``PATH`` is a Hugging Face checkpoint directory with its tokenizer, whose attention and
KV heads divide by the number of ranks. On GPUs each rank takes GPU ``LOCAL_RANK``; on a
machine without one, the ranks run on the CPU over gloo.
"""

from __future__ import annotations

import argparse
import os

import torch

from kvcompose import Policy
from kvcompose.hf import load_tensor_parallel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (weights, config and tokenizer)")
    ap.add_argument("--preset", default="rkv")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    ap.add_argument("prompts", nargs="*", default=["Explain step by step why the sum of two odd numbers is even."])
    args = ap.parse_args()

    from transformers import AutoTokenizer

    model = load_tensor_parallel(args.model, dtype=getattr(torch, args.dtype))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    out = Policy.from_preset(args.preset).generate(model, tokenizer, args.prompts, max_new_tokens=args.max_new_tokens)
    if int(os.environ.get("RANK", "0")) == 0:
        for prompt, text in zip(args.prompts, out.texts):
            print(f"--- {prompt}\n{text}\n")
        print(out.report)


if __name__ == "__main__":
    main()

"""Error of every storage format x {grouped per token, grouped per channel} x {plain, rotated} on real keys and values.

Where the error of a low-bit KV cache comes from, and what grouping and rotation do
about it. On the embedded SmolLM2-135M-Instruct (CPU, float32), ``measure_format_error``'s
capture (a greedy answer to each of four packaged reasoning prompts, then one forward of
prompt + answer through a ``fullkv`` cache) records each layer's post-RoPE keys and values
and the queries of the last ``--queries`` positions. Each format then quantizes one
layer's keys (or values) four ways:

- *per token*: as the store does, groups (blocks of 16 or 32 channels) along each token's
  channels;
- *per channel*: groups along tokens, each channel on its own (as KIVI groups keys); the
  tokens after the last whole group stay in full precision, as a recent buffer holds them;
- *rotated*: after the Hadamard rotation with random signs per layer and KV head that the
  ``hadamard`` rotation component applies (the queries rotated alike, so the exact
  attention is unchanged).

The quantizer runs on its own (``Quantizer.quantize`` / ``dequantize``, torch reference), its
per-head scale taken from all tokens. Reported per (format, grouping, rotation), for keys
quantized alone and for values quantized alone: the relative error of the attention
output ``softmax(q K^T * scaling) V`` of the last positions (each attending causally to the
tokens up to itself), over all query heads, per layer, averaged over prompts, then the
mean over layers.

    python benchmarks/tools/measure_format_grid.py     # adds a run to benchmarks/results/format_grid_smollm2.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.results import append_run, result_path  # noqa: E402
from harness.table import format_table  # noqa: E402
from measure_format_error import PROMPT_IDS, capture, packaged_prompts  # noqa: E402

from kvcompose import models, registry  # noqa: E402
from kvcompose.rotations import rotate  # noqa: E402

FORMATS = {  # name -> (quantizer spec, channels or tokens per group)
    "fp8": ({"name": "fp8"}, 1),
    "nvfp4": ({"name": "nvfp4"}, 16),
    "ternary": ({"name": "ternary"}, 16),
    "int8-g32": ({"name": "int", "bits": 8, "group_size": 32}, 32),
    "int4-g32": ({"name": "int", "bits": 4, "group_size": 32}, 32),
    "int2-g32": ({"name": "int", "bits": 2, "group_size": 32}, 32),
}
GROUPINGS = ("per_token", "per_channel")
ROTATIONS = ("plain", "hadamard")


def roundtrip(q, x: torch.Tensor, role: str) -> torch.Tensor:
    """``x`` ``[N, H, D]`` through the quantizer alone (its default head scale from all of ``x``)."""
    return q.dequantize(q.quantize(x, role=role, backend="torch"), torch.float32, backend="torch")


def roundtrip_per_channel(q, x: torch.Tensor, role: str, group: int) -> torch.Tensor:
    """Groups along tokens, each channel alone: ``x`` ``[N, H, D]`` quantized as ``[D, H, N']`` with
    ``N'`` the whole groups of tokens; the tokens after them stay as they are."""
    n = (x.shape[0] // max(group, 16)) * max(group, 16)
    out = x.clone()
    if n:
        t = x[:n].permute(2, 1, 0).contiguous()  # [D, H, n]: the quantizer's groups now run along tokens
        out[:n] = roundtrip(q, t, role).permute(2, 1, 0)
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """Outputs ``[Hq, T, D]`` of the last ``T`` positions (queries ``[Hq, T, D]``, keys and values
    ``[H, L, D]``, GQA), each attending to the tokens up to its own position."""
    group = q.shape[0] // k.shape[0]
    k = k.double().repeat_interleave(group, 0)
    v = v.double().repeat_interleave(group, 0)
    T, L = q.shape[1], k.shape[1]
    logits = torch.einsum("htd,hld->htl", q.double(), k) * scaling
    future = torch.arange(L)[None, :] > (L - T + torch.arange(T))[:, None]
    p = torch.softmax(logits.masked_fill(future, float("-inf")), -1)
    return torch.einsum("htl,hld->htd", p, v)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def layer_errors(query, k, v, scaling, matrices) -> dict:
    """``{(format, grouping, rotation, role): relative attention error}`` of one layer (k, v ``[H, L, D]``)."""
    out = {}
    for rotation in ROTATIONS:
        qq, kk, vv = query, k, v
        if rotation == "hadamard":
            qq, kk, vv = (rotate(t[None], matrices)[0] for t in (query, k, v))
        exact = attention(qq, kk, vv, scaling)
        keys, values = kk.transpose(0, 1).contiguous(), vv.transpose(0, 1).contiguous()  # [L, H, D]
        for fname, (spec, group) in FORMATS.items():
            quantizer = registry.build("quantizer", spec)
            for grouping in GROUPINGS:
                if grouping == "per_token":
                    kh, vh = roundtrip(quantizer, keys, "key"), roundtrip(quantizer, values, "value")
                else:
                    kh = roundtrip_per_channel(quantizer, keys, "key", group)
                    vh = roundtrip_per_channel(quantizer, values, "value", group)
                out[fname, grouping, rotation, "key"] = rel(attention(qq, kh.transpose(0, 1), vv, scaling), exact)
                out[fname, grouping, rotation, "value"] = rel(attention(qq, kk, vh.transpose(0, 1), scaling), exact)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(result_path("format_grid_smollm2")), help="history file the run is added to")
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--queries", type=int, default=64, help="last positions whose attention output is compared")
    ap.add_argument("--prompts", default=",".join(PROMPT_IDS), help="ids of packaged reasoning prompts")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, tok = models.load_default()
    model.eval()
    ids = tuple(args.prompts.split(","))
    rotation = registry.build("rotation", "hadamard")
    acc: dict = {}
    runs = []
    for pid, prompt in zip(ids, packaged_prompts(ids)):
        layers, p_len, total = capture(model, tok, prompt, args.new_tokens, queries=args.queries)
        runs.append({"id": pid, "prompt_tokens": p_len, "tokens": total})
        for li in sorted(layers):
            query, k, v, scaling = layers[li]
            matrices = rotation.matrices(li, k.shape[0], k.shape[-1])
            for key, err in layer_errors(query.float(), k.float(), v.float(), scaling, matrices).items():
                acc.setdefault(key, {}).setdefault(li, []).append(err)
        print(f"[{pid}] {p_len} prompt + {total - p_len} generated tokens, done at {time.perf_counter() - start:.0f}s",
              flush=True)
    results = []
    for (fname, grouping, rot, role), per_layer in acc.items():
        means = [sum(v) / len(v) for _, v in sorted(per_layer.items())]
        results.append({"format": fname, "spec": FORMATS[fname][0], "grouping": grouping, "rotation": rot,
                        "quantized": role, "attention_error": sum(means) / len(means), "per_layer": means})
    data = {
        "what": "relative attention-output error of each format x grouping x rotation on SmolLM2-135M-Instruct",
        "method": __doc__.split("\n\n")[1:3],
        "queries": args.queries, "new_tokens": args.new_tokens, "prompts": runs, "results": results,
        "seconds": time.perf_counter() - start,
    }
    path = append_run(args.out, data)
    table = {(r["format"], r["quantized"]): {} for r in results}
    for r in results:
        table[r["format"], r["quantized"]][r["grouping"], r["rotation"]] = r["attention_error"]
    cols = [(g, r) for g in GROUPINGS for r in ROTATIONS]
    rows = [[f, role] + [f"{100 * cells[c]:.1f}%" for c in cols] for (f, role), cells in table.items()]
    print(format_table(["format", "quantized"] + [f"{g}, {r}" for g, r in cols], rows))
    print(f"wrote {path} in {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

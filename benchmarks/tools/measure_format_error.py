"""Error of every storage format on the embedded model's real keys and values.

Loads the embedded SmolLM2-135M-Instruct (CPU, float32; 30 layers, 3 KV heads, head
dim 64), generates a greedy answer (200 new tokens) to four of kvcompose's packaged
reasoning prompts (with the chat template), then runs prompt + answer through one
forward on a fresh ``fullkv`` cache whose observer captures, per layer, the post-RoPE
keys and values of every token and the query of the last token.

Each format quantizes a layer's keys and values exactly as the store does, through
:class:`kvcompose.quantizers.codec.QuantCodec`:

- two-level formats (fp8, nvfp4, ternary): the per-sequence, per-head scale is fixed
  at the row's *first encode*: ``A = scale_headroom (2) * amax`` over the tokens of
  that encode. With the default ``group_size=16, residual=0`` the prefill encodes every
  whole group of 16 prompt tokens at once, so ``A`` is twice the amax over those
  prompt tokens; answer tokens larger than ``A`` saturate (``clipped`` counts them).
  Column ``scale=per-call`` instead uses the format's own default (the head scale
  computed from all tokens of the layer at once, no headroom), for comparison.
- int (per_token and kivi): no head scale; groups are formed by the quantizer.

All tokens are quantized (in the store the newest ``< group_size`` tokens, and
``residual`` more, would still be in the full-precision buffer). Reported per format,
separately for keys and values: relative RMSE ``||x_hat - x|| / ||x||`` per layer
(over tokens, heads, channels), averaged over prompts, then the mean, min and max
over layers; and the relative error of the attention output of the last query,
``softmax(q K^T * scaling) V`` with dequantized K and V against exact K and V
(also with only K or only V quantized), same statistics.

    python benchmarks/tools/measure_format_error.py     # adds a run to benchmarks/results/format_error_smollm2.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
from harness.results import append_run, result_path  # noqa: E402
from harness.table import format_table  # noqa: E402

from kvcompose import Policy, models, registry  # noqa: E402
from kvcompose.eval.prompts import load_prompts  # noqa: E402
from kvcompose.hf.generate import encode_prompts  # noqa: E402
from kvcompose.quantizers.codec import QuantCodec  # noqa: E402

PROMPT_IDS = ("muffins", "reading", "garage", "cyclist")
FORMATS = {
    "fp8": {"name": "fp8"},
    "nvfp4": {"name": "nvfp4"},
    "ternary": {"name": "ternary"},
    "int8": {"name": "int", "bits": 8},
    "int4": {"name": "int", "bits": 4},
    "int2": {"name": "int", "bits": 2},
    "int4-g32": {"name": "int", "bits": 4, "group_size": 32},
    "kivi4": {"name": "int", "bits": 4, "layout": "kivi", "token_group": 32},
    "kivi2": {"name": "int", "bits": 2, "layout": "kivi", "token_group": 32},
}
GROUP = 16  # Policy.group_size default: the store encodes whole groups of 16
HEADROOM = 2.0  # Policy.scale_headroom default


def packaged_prompts(ids):
    import json
    from importlib import resources

    data = json.loads(resources.files("kvcompose").joinpath("data", "reasoning_prompts.json").read_text())
    by_id = {p["id"]: p["prompt"] for p in data["prompts"]}
    missing = [i for i in ids if i not in by_id]
    if missing:  # fall back to the first prompts of the list
        return load_prompts(limit=len(ids))
    return [by_id[i] for i in ids]


class Capture:
    """Cache observer: keys/values of every token and the last query (``[Hq, D]``), or the last
    ``queries`` queries (``[Hq, queries, D]``), per layer."""

    def __init__(self, queries: int = 1):
        self.layers = {}
        self.queries = queries

    def __call__(self, layer_idx, query, view, positions, scaling):
        valid = view.valid[0]
        order = view.positions[0][valid].argsort()
        k = view.keys[0][:, valid][:, order]  # [H, L, D]
        v = view.values[0][:, valid][:, order]
        q = query[0, :, -1] if self.queries == 1 else query[0, :, -self.queries:]
        self.layers[layer_idx] = (q.clone(), k.clone(), v.clone(), scaling)


def capture(model, tok, prompt, new_tokens, queries: int = 1):
    """Greedy answer, then one forward of prompt + answer on a fullkv cache; returns (per-layer captures, P, L).

    The answer is generated with transformers' own SDPA attention and cache (``fullkv``
    reproduces it token for token, and it is much faster on CPU); the capture runs
    through kvcompose's attention and a ``fullkv`` ``KVComposeCache``.
    """
    enc = encode_prompts(tok, [prompt], None)
    prompt_ids = enc["input_ids"]
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    finally:
        model.set_attn_implementation(previous)
    answer = out[0, prompt_ids.shape[1]:]
    eos = (answer == tok.eos_token_id).nonzero()
    if len(eos):  # keep the answer up to and including its first EOS
        answer = answer[: int(eos[0]) + 1]
    ids = torch.cat([prompt_ids[0], answer])[None]
    cap = Capture(queries)
    cache = Policy.from_preset("fullkv").make_cache(model)
    cache.observers.append(cap)
    model.set_attn_implementation("kvcompose")
    try:
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, use_cache=True,
                  logits_to_keep=1)
    finally:
        model.set_attn_implementation(previous)
    return cap.layers, prompt_ids.shape[1], ids.shape[1]


def attention(q, k, v, scaling):
    """Last-query attention output ``[Hq, D]`` for ``q`` ``[Hq, D]`` and ``k``/``v`` ``[Hkv, L, D]`` (GQA)."""
    group = q.shape[0] // k.shape[0]
    k = k.double().repeat_interleave(group, 0)
    v = v.double().repeat_interleave(group, 0)
    p = torch.softmax(torch.einsum("hd,hld->hl", q.double(), k) * scaling, -1)
    return torch.einsum("hl,hld->hd", p, v)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def roundtrip_store(q, k, v, first):
    """Encode/decode ``k``/``v`` ``[N, H, D]`` as the store does: A = headroom * amax of the first ``first`` tokens."""
    n, h, d = k.shape
    codec = QuantCodec(q, h, d, "cpu", headroom=HEADROOM)
    sel = torch.zeros(1, n, dtype=torch.bool)
    sel[0, :first] = True
    scales = codec.init_row_scales(k[None], v[None], sel)
    slots, groups = codec.encode(k, v, {name: t.expand(n, h) for name, t in scales.items()})
    kh, vh = codec.decode({n_: t[None] for n_, t in slots.items()}, {n_: t[None] for n_, t in groups.items()}, scales)
    clipped = {}
    if codec.two_level:
        for name, x in (("k", k), ("v", v)):
            clipped[name] = (x.abs() > scales[name][0][None, :, None]).double().mean().item()
    return kh[0], vh[0], clipped


def roundtrip_call(q, k, v):
    """The quantizer on its own: its default head scale computed from all ``N`` tokens (no headroom)."""
    out = []
    for role, x in (("key", k), ("value", v)):
        out.append(q.dequantize(q.quantize(x, role=role, backend="torch"), torch.float32, backend="torch"))
    return out


def stats(per_layer):
    t = torch.tensor(per_layer, dtype=torch.float64)
    return {"mean": t.mean().item(), "min": t.min().item(), "max": t.max().item(),
            "argmin": int(t.argmin()), "argmax": int(t.argmax())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(result_path("format_error_smollm2")), help="history file the run is added to")
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--prompts", default=",".join(PROMPT_IDS), help="ids of packaged reasoning prompts")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared machine)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, tok = models.load_default()
    model.eval()
    ids = tuple(args.prompts.split(","))
    prompts = packaged_prompts(ids)
    cfg = model.config
    print(f"model loaded ({cfg.num_hidden_layers} layers, {cfg.num_key_value_heads} KV heads, "
          f"head dim {cfg.hidden_size // cfg.num_attention_heads}) in {time.perf_counter() - start:.1f}s", flush=True)

    # per format -> metric -> [prompt][layer]
    names = ["key", "value", "attn", "attn_k_only", "attn_v_only", "key_call", "value_call", "attn_call",
             "clip_k", "clip_v"]
    acc = {f: {m: [] for m in names} for f in FORMATS}
    runs = []
    for pid, prompt in zip(ids, prompts):
        layers, p_len, total = capture(model, tok, prompt, args.new_tokens)
        first = (p_len // GROUP) * GROUP
        runs.append({"id": pid, "prompt": prompt, "prompt_tokens": p_len, "tokens": total,
                     "first_encode_tokens": first})
        print(f"[{pid}] {p_len} prompt + {total - p_len} generated tokens; head scale from the first {first}",
              flush=True)
        for fname, spec in FORMATS.items():
            q = registry.build("quantizer", spec)
            per = {m: [] for m in names}
            for li in sorted(layers):
                query, k, v, scaling = layers[li]
                k, v = k.transpose(0, 1).float().contiguous(), v.transpose(0, 1).float().contiguous()  # [N, H, D]
                kh, vh, clipped = roundtrip_store(q, k, v, first)
                exact = attention(query, k.transpose(0, 1), v.transpose(0, 1), scaling)
                per["key"].append(rel(kh, k))
                per["value"].append(rel(vh, v))
                per["attn"].append(rel(attention(query, kh.transpose(0, 1), vh.transpose(0, 1), scaling), exact))
                per["attn_k_only"].append(rel(attention(query, kh.transpose(0, 1), v.transpose(0, 1), scaling), exact))
                per["attn_v_only"].append(rel(attention(query, k.transpose(0, 1), vh.transpose(0, 1), scaling), exact))
                kc, vc = roundtrip_call(q, k, v)
                per["key_call"].append(rel(kc, k))
                per["value_call"].append(rel(vc, v))
                per["attn_call"].append(rel(attention(query, kc.transpose(0, 1), vc.transpose(0, 1), scaling), exact))
                per["clip_k"].append(clipped.get("k", 0.0))
                per["clip_v"].append(clipped.get("v", 0.0))
            for m in names:
                acc[fname][m].append(per[m])
        print(f"[{pid}] done at {time.perf_counter() - start:.1f}s", flush=True)

    results = {}
    for fname, spec in FORMATS.items():
        q = registry.build("quantizer", spec)
        row = {"spec": spec, "bits_per_value": q.bits_per_value_for(64), "two_level": spec["name"] != "int"}
        for m in names:
            per_layer = torch.tensor(acc[fname][m], dtype=torch.float64).mean(0).tolist()  # mean over prompts
            row[m] = {**stats(per_layer), "per_layer": per_layer}
        results[fname] = row

    data = {
        "what": "relative error of each storage format on SmolLM2-135M-Instruct's post-RoPE keys and values",
        "model": "SmolLM2-135M-Instruct (embedded GGUF, float32, CPU): 30 layers, 3 KV heads, head dim 64",
        "method": {
            "capture": "greedy answer under the fullkv policy, then one forward of prompt + answer through a fresh "
                       "fullkv cache; a cache observer records each layer's keys, values and last query",
            "store_semantics": f"QuantCodec with scale_headroom {HEADROOM}: per-head scale A = headroom * amax over "
                               f"the first encode (the whole groups of {GROUP} prompt tokens); every token quantized",
            "call_semantics": "the quantizer's default per-head scale computed from all tokens (no headroom)",
            "relative_rmse": "||x_hat - x|| / ||x|| per layer over tokens, heads and channels; mean over prompts; "
                             "then mean/min/max over layers",
            "attention": "relative error of softmax(q K^T * scaling) V for the last query (all 9 query heads, GQA)",
            "clipped": "share of values beyond the per-head scale A (saturated by the two-level formats)",
            "backend": "torch reference (bit-identical to the Triton kernels)",
        },
        "prompts": runs,
        "new_tokens": args.new_tokens,
        "results": results,
        "seconds": time.perf_counter() - start,
    }
    path = append_run(args.out, data)

    headers = ["format", "bits", "K rmse", "K min..max", "V rmse", "V min..max", "attn", "attn max",
               "K call", "V call", "clip K", "clip V"]
    rows = []
    for fname, r in results.items():
        rows.append([
            fname, f"{r['bits_per_value']:.3g}",
            f"{r['key']['mean']:.4f}", f"{r['key']['min']:.3f}..{r['key']['max']:.3f}",
            f"{r['value']['mean']:.4f}", f"{r['value']['min']:.3f}..{r['value']['max']:.3f}",
            f"{r['attn']['mean']:.4f}", f"{r['attn']['max']:.3f}",
            f"{r['key_call']['mean']:.4f}", f"{r['value_call']['mean']:.4f}",
            f"{r['clip_k']['mean']:.1e}", f"{r['clip_v']['mean']:.1e}",
        ])
    print(format_table(headers, rows))
    print(f"wrote {path} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Every validated input and its exact message: the table in docs/troubleshooting.md.

Each case below triggers one check the way the table's example says and compares the
message with the table's text (``...`` there matches any run-specific part). The last
tests check that the table and these cases list the same messages, so a reworded
message or a new row fails here until both agree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
import transformers
from packaging.version import Version

from conftest import greedy, left_padded, tiny_model
from kvcompose import Policy, presets, registry
from kvcompose.cli import main
from kvcompose.hf import CacheReuseError, UnsupportedModelError
from kvcompose.registry import ComponentSpecError, UnknownComponentError

DOC = Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md"
SECTION = "## Bad input: every check and its message"

PRESETS = ", ".join(presets())  # every preset, as the unknown-preset message lists them
BUDGET_RKV = ("Policy 'rkv': budget={b} is smaller than this policy needs (9: 0 sinks + 8 protected recent "
              "tokens + 1 for trigger 'buffer'); use budget >= 9")
NAN = ("layer 1: the model produced NaN/inf keys or values; the cache does not store them. Typical causes: fp16 "
       "overflow (run the model in bf16 or fp32), or NaN/inf already in the inputs or weights")
REUSE_POSITIONS = ("layer 0: the cache already holds ... columns, but the new tokens start at position ... (expected "
                   "...). A kvcompose cache serves one generation: make a new one with policy.make_cache(model), "
                   "or call cache.reset() first")
REUSE = ("layer 0: the cache already holds ... columns, but the attention mask covers ... columns for ... new ones "
         "(expected ...). A kvcompose cache serves one generation: make a new one with policy.make_cache(model), "
         "or call cache.reset() first")


def pattern(message: str) -> str:
    """The table's text as a regex: literal, with ``...`` matching anything."""
    return ".*".join(re.escape(part) for part in message.split("..."))


def assert_message(text: str, message: str) -> None:
    assert re.fullmatch(pattern(message), text, re.S), f"\n got: {text}\nwant: {message}"


@dataclass
class Case:
    id: str
    run: Callable  # run(llama) triggers the check
    error: type
    message: str  # as in the table

    def param(self):
        return pytest.param(self, id=self.id)


# ----------------------------------------------------------------- helpers for the examples
def _x(n=4, h=2, d=16):
    return torch.randn(n, h, d, generator=torch.Generator().manual_seed(0))


def _with_nan(shape):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    t.view(-1)[0] = float("nan")
    return t


def _used_cache(model, preset="fullkv"):
    cache = Policy.from_preset(preset).make_cache(model)
    _, ids, mask = left_padded([5])
    model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    return cache


def _forward(model, policy):
    _, ids, mask = left_padded([5, 3])
    model(input_ids=ids, attention_mask=mask, past_key_values=policy.make_cache(model))


def _forward_without_tokens(model):
    _, ids, mask = left_padded([5])
    model(input_ids=ids, attention_mask=mask, past_key_values=Policy.from_preset("reasoncache").make_cache(
        model, tokenizer=object()))


def _fast_text_policy(model):
    from kvcompose.hf.static import fast_generate

    _, ids, mask = left_padded([5])
    fast_generate(model, Policy.from_preset("reasoncache").make_cache(model, tokenizer=object()), ids, mask, 4)


def _sdpa_make_cache(model):
    model.set_attn_implementation("sdpa")
    try:
        Policy.from_preset("fullkv").make_cache(model)
    finally:
        model.set_attn_implementation("kvcompose")


def _cache_without_kvcompose_attention(model):
    cache = Policy.from_preset("fullkv").make_cache(model)
    _, ids, mask = left_padded([5])
    model.set_attn_implementation("sdpa")
    try:
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        model(input_ids=ids[:, :1], attention_mask=torch.ones(1, 6, dtype=torch.long), past_key_values=cache)
    finally:
        model.set_attn_implementation("kvcompose")


def _training_mode(_):
    model = tiny_model()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    _forward(model, Policy.from_preset("fullkv"))


def _second_generate(model):
    _, ids, mask = left_padded([20, 9])
    cache = Policy.from_preset("fullkv").make_cache(model)
    greedy(model, ids, mask, 4, cache=cache)
    greedy(model, ids, mask, 4, cache=cache)


def _second_generate_unpadded(model):
    """A second generate on an unpadded batch: transformers drops the all-ones mask, so the
    positions tell. Releases that keep the mask raise the mask's message (case reuse-generate)."""
    cache = Policy.from_preset("fullkv").make_cache(model)
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(0))
    greedy(model, ids, torch.ones_like(ids), 3, cache=cache)
    try:
        greedy(model, ids, torch.ones_like(ids), 3, cache=cache)
    except CacheReuseError as exc:
        if "the attention mask covers" in str(exc):
            pytest.skip(f"transformers {transformers.__version__} keeps the all-ones mask: case reuse-generate "
                        "covers its message")
        raise


def _positions_restart(model):
    cache = Policy.from_preset("fullkv").make_cache(model)
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, past_key_values=cache)
    model(input_ids=ids[:, :1], position_ids=torch.tensor([[2]]), past_key_values=cache)


def _skipped_columns(model):
    cache = Policy.from_preset("fullkv").make_cache(model)
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, attention_mask=torch.ones(1, 6, dtype=torch.long), past_key_values=cache)
    model(input_ids=ids[:, :1], attention_mask=torch.ones(1, 9, dtype=torch.long), past_key_values=cache)


def _nan_keys(preset):
    def run(_):
        model = tiny_model()
        with torch.no_grad():
            model.model.layers[1].self_attn.k_proj.weight[0, :] = float("nan")
        _, ids, mask = left_padded([12, 7])
        policy = Policy.from_preset(preset, **({"budget": 32} if Policy.from_preset(preset).evictor else {}))
        greedy(model, ids, mask, 3, cache=policy.make_cache(model))
    return run


def _head_dim_24(_):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    model.set_attn_implementation("kvcompose")
    _forward(model, Policy.from_preset("nvfp4"))


def _gemma2(_):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    model.set_attn_implementation("kvcompose")
    Policy.from_preset("fullkv").make_cache(model)


def _deepseek_v3(_):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=32, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=1))
    model.set_attn_implementation("kvcompose")
    Policy.from_preset("fullkv").make_cache(model)


def _t5(_):
    from transformers import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                                num_heads=2))
    Policy.from_preset("fullkv").make_cache(model)


class NotADecoder(torch.nn.Module):
    def __init__(self):
        from transformers import PretrainedConfig

        super().__init__()
        self.config = PretrainedConfig()


def _generate(**kwargs):
    from conftest import char_tokenizer

    prompts = kwargs.pop("prompts", ["hi"])
    kwargs.setdefault("max_new_tokens", 2)
    return lambda model: Policy.from_preset("fullkv").generate(model, char_tokenizer(), prompts, **kwargs)


def _threads_from_env(value):
    import os

    from kvcompose import threads

    old = os.environ.get(threads.ENV)
    os.environ[threads.ENV] = value
    try:
        threads.choose()
    finally:
        os.environ.pop(threads.ENV) if old is None else os.environ.__setitem__(threads.ENV, old)


def _other_model_run(model):
    """thinkv (calibrated for SmolLM2) on a model of another name."""
    from conftest import char_tokenizer

    name = model.config.name_or_path
    model.config.name_or_path = "org/Other-1B"
    try:
        Policy.from_preset("thinkv", classifier={"layers": [0, 1]}).generate(model, char_tokenizer(), ["hi"],
                                                                              max_new_tokens=1)
    finally:
        model.config.name_or_path = name


def _store():
    from kvcompose.paging import LayerStore

    return LayerStore(1, 2, 16, torch.float32, "cpu")


def _dense_source(dtype=torch.float32, table=None):
    from kvcompose.ops.paged_attention import KVOperand, PagedSource

    codes = torch.zeros(8, 2, 16, dtype=dtype)
    table = torch.zeros(1, 1, dtype=torch.int32) if table is None else table
    return [PagedSource(KVOperand("dense", codes), KVOperand("dense", codes.clone()), table, 8,
                        torch.ones(8, dtype=torch.bool))]


def _paged(query, sources=None, **kw):
    from kvcompose.ops.paged_attention import paged_decode_attention

    return lambda _: paged_decode_attention(query, _dense_source() if sources is None else sources, 0.25, **kw)


def _deferred_nan(_):
    from kvcompose.ops.checks import check_flags, new_flags
    from kvcompose.ops.quant_fp8 import fp8_quantize

    flags = new_flags("cpu")
    fp8_quantize(_with_nan((4, 2, 16)), flags=flags)
    check_flags(flags)


def _ops():
    from kvcompose.ops import quant_fp8, quant_int, quant_ternary
    from kvcompose.ops.kmeans import kmeans_select
    from kvcompose.ops.paged_attention import KVOperand
    from kvcompose.ops.sparsity import attention_sparsity

    fp8, int_tokens = quant_fp8.fp8_quantize, quant_int.int_quantize_tokens
    valid8 = torch.ones(1, 8, dtype=torch.bool)
    q = torch.randn(1, 4, 1, 16)
    return [
        Case("op-not-a-tensor", lambda _: fp8([1.0]), TypeError, "fp8: expected a torch.Tensor, got list"),
        Case("op-shape", lambda _: fp8(torch.randn(4, 16)), ValueError,
             "fp8: expected x of shape [N, H, D] (tokens, KV heads, head dim), got shape (4, 16)"),
        Case("op-dtype", lambda _: fp8(torch.ones(4, 2, 16, dtype=torch.int32)), ValueError,
             "fp8: unsupported dtype torch.int32; accepted dtypes: torch.float16, torch.bfloat16, torch.float32"),
        Case("op-head-dim", lambda _: quant_ternary.ternary_quantize(torch.randn(4, 2, 24)), ValueError,
             "ternary: head_dim 24 is not a positive multiple of 16"),
        Case("op-nan", lambda _: fp8(_with_nan((4, 2, 16))), ValueError,
             "fp8: input has 1 NaN/inf value(s) out of 128; cannot quantize"),
        Case("op-nan-torch", lambda _: fp8(_with_nan((4, 2, 16)), backend="torch"), ValueError,
             "fp8: input has 1 NaN/inf value(s) out of 128; cannot quantize"),
        Case("op-nan-deferred", _deferred_nan, ValueError,
             "quantize: a call since the last check got NaN/inf input; its result is not valid"),
        Case("op-flags-tensor", lambda _: fp8(_x(), flags=torch.zeros(1)), ValueError,
             "flags must be a one-element int32 tensor on cpu (see new_flags), got torch.float32 (1,) on cpu"),
        Case("op-head-scale", lambda _: fp8(_x(), scale=torch.tensor([1.0, -1.0])), ValueError,
             "fp8: head scale must be finite and > 0, got [1.0, -1.0]"),
        Case("op-head-scale-shape", lambda _: fp8(_x(), scale=torch.ones(3)), ValueError,
             "fp8: head scale must be a tensor of shape (2,) (one per KV head) or (4, 2) (one per token and head), "
             "got (3,)"),
        Case("op-codes-dtype", lambda _: quant_fp8.fp8_dequantize(torch.zeros(4, 2, 16), torch.ones(2)), ValueError,
             "fp8: codes must be uint8 [N, H, D], got torch.float32 (4, 2, 16)"),
        Case("op-int-bits", lambda _: int_tokens(_x(), 3), ValueError,
             "int: bits=3 is not supported; accepted: 2, 4, 8"),
        Case("op-int-group", lambda _: int_tokens(_x(), 4, group_size=5), ValueError,
             "int4: group_size 5 must divide head_dim 16 and be a multiple of 2 (codes per byte)"),
        Case("op-int-fp16-range", lambda _: int_tokens(torch.full((4, 2, 16), 1e6), 4), ValueError,
             "int4: |x| reaches 1e+06, beyond the float16 range of the stored minimum (65504); "
             "use scale_dtype=torch.float32"),
        Case("op-backend-quant", lambda _: fp8(_x(), backend="cuda"), ValueError,
             "unknown backend 'cuda'; accepted: None (auto), 'triton', 'torch'"),
        Case("op-backend-paged", _paged(q, backend="flash"), ValueError,
             "unknown backend 'flash'; accepted: None (auto), 'triton', 'cuda', 'torch'"),
        Case("op-backend-paged-cuda-on-cpu", _paged(q, backend="cuda"), RuntimeError,
             "backend='cuda' needs CUDA tensors; the query is on cpu"),
        Case("paged-query-shape", _paged(torch.randn(1, 4, 2, 16)), ValueError,
             "decode attention takes one query per row [B, Hq, 1, D]; got shape (1, 4, 2, 16)"),
        Case("paged-query-dtype", _paged(q.double()), ValueError,
             "query dtype torch.float64 not supported; accepted: float16, bfloat16, float32"),
        Case("paged-source-dtype", _paged(q, _dense_source(torch.float16)), ValueError,
             "source 0 keys: dtype torch.float16 differs from the query dtype torch.float32"),
        Case("paged-source-shape", _paged(torch.randn(1, 4, 1, 32)), ValueError,
             "source 0 keys: codes of shape (8, 2, 16) (dense) do not fit queries of shape (1, 4, 1, 32) "
             "(need [slots, H, D / codes per byte] with Hq a multiple of H)"),
        Case("paged-table", _paged(q, _dense_source(table=torch.zeros(2, 1, dtype=torch.int32))), ValueError,
             "source 0: block table of shape (2, 1); expected [1, W]"),
        Case("operand-format", lambda _: KVOperand("fp4", torch.zeros(8, 2, 16)), ValueError,
             "unknown KV storage format 'fp4'; accepted: dense, fp8, nvfp4, ternary, int, int_channel"),
        Case("operand-scales", lambda _: KVOperand("fp8", torch.zeros(8, 2, 16, dtype=torch.uint8)), ValueError,
             "fp8 operand needs head_scale"),
        Case("kmeans-shape", lambda _: kmeans_select(torch.randn(4, 16), torch.ones(4, dtype=torch.bool), 2),
             ValueError, "kmeans_select: keys must be [S, N, F] (segments, tokens, features), got (4, 16)"),
        Case("kmeans-nan",
             lambda _: kmeans_select(_with_nan((1, 4, 16)), torch.ones(1, 4, dtype=torch.bool), 2, backend="torch"),
             ValueError, "kmeans_select: keys (1, 4, 16) contain NaN or inf in live tokens"),
        Case("sparsity-query-shape",
             lambda _: attention_sparsity(torch.randn(1, 4, 1, 16), torch.randn(1, 2, 8, 16), valid8, 0.25),
             ValueError, "attention_sparsity: query must be [B, Hq, D], got shape (1, 4, 1, 16)"),
        Case("sparsity-heads",
             lambda _: attention_sparsity(torch.randn(1, 3, 16), torch.randn(1, 2, 8, 16), valid8, 0.25),
             ValueError, "attention_sparsity: query heads (3) must be a positive multiple of KV heads (2); "
                         "query (1, 3, 16), keys (1, 2, 8, 16)"),
        Case("sparsity-nan",
             lambda _: attention_sparsity(_with_nan((1, 4, 16)), torch.randn(1, 2, 8, 16), valid8, 0.25,
                                          backend="torch"),
             ValueError, "attention_sparsity: query (1, 4, 16) contains NaN or inf"),
    ]


def _smollm2_calibration() -> str:
    from kvcompose.policies.presets import _data_path

    return _data_path("calibration_smollm2.json")


P = Policy
def _assisted(model, transformers_checks: bool):
    """Assisted decoding on a kvcompose cache. transformers >= 5.24 reads the cache's
    ``is_croppable`` (False) after the first forward and raises its own message; older
    versions call ``crop``, which raises ours. Each case runs where its message applies."""
    if (Version(transformers.__version__) >= Version("5.24")) != transformers_checks:
        pytest.skip(f"transformers {transformers.__version__} raises the other message")
    greedy(model, *left_padded([5])[1:], 6, cache=P.from_preset("fullkv").make_cache(model),
           prompt_lookup_num_tokens=2)


CASES = [
    # policies, presets and components
    Case("unknown-preset", lambda _: P.from_preset("snap"), UnknownComponentError,
         f"unknown preset 'snap'; known presets: {PRESETS}"),
    Case("unknown-component", lambda _: P(evictor="kmeans", trigger="over_budget", budget=64), UnknownComponentError,
         "unknown evictor 'kmeans'; known evictors: attention, h2o, rkv, tbe, window"),
    Case("unknown-kind", lambda _: registry.get("scorer", "x"), UnknownComponentError,
         "unknown component kind 'scorer'; known kinds: quantizer, classifier, evictor, pager, trigger, filter, rotation"),
    Case("unknown-component-field", lambda _: P.from_preset("rkv", evictor={"alpha": 1}), ValueError,
         "evictor 'rkv' has no field(s) ['alpha']; accepted fields: ['gqa', 'head_reduce', 'keep_recent_similar', "
         "'lam', 'pool', 'pool_width', 'threshold', 'window', 'window_reduce']"),
    Case("unknown-policy-field", lambda _: P.from_preset("rkv", buget=64), ValueError,
         "unknown policy field(s) ['buget']; accepted fields: ['block_size', 'budget', ...]"),
    Case("component-without-name", lambda _: P(evictor={"window": 8}, trigger="over_budget", budget=64), ValueError,
         "evictor config {'window': 8} has no 'name'; expected one of: attention, h2o, rkv, tbe, window"),
    Case("component-wrong-type", lambda _: P(evictor=5), ComponentSpecError,
         "cannot build an evictor from 5; give a name (attention, h2o, rkv, tbe, window), a dict with 'name', "
         "or an evictor instance"),
    Case("config-not-dict", lambda _: P.from_config(["rkv"]), TypeError, "a policy config must be a dict, got list"),
    Case("evictor-field-type", lambda _: P.from_preset("rkv", evictor={"window": "x"}), ValueError,
         "rkv evictor: window must be an int >= 1, got 'x'"),
    Case("evictor-pool-width", lambda _: P.from_preset("rkv", evictor={"pool_width": 6}), ValueError,
         "rkv evictor: pool_width must be odd (centered window), got 6"),
    Case("tbe-retention", lambda _: P.from_preset("thinkv", evictor={"retention": [4, 8]}), ValueError,
         "tbe evictor: retention must be strictly decreasing positive ints, got [4, 8]"),
    Case("trigger-field", lambda _: P.from_preset("rkv", trigger={"buffer": -1}), ValueError,
         "buffer trigger: buffer must be an int >= 0, got -1"),
    Case("interval-period", lambda _: P.from_preset("rpc", trigger={"period": 2}), ValueError,
         "interval trigger: period (2) must be >= ratio (4) so that each compression keeps at least one token"),
    Case("evictor-without-trigger", lambda _: P(evictor="window", budget=64), ValueError,
         "Policy needs both an evictor and a trigger to compress (or neither for a full cache); "
         "got evictor=..., trigger=None"),
    Case("no-pager", lambda _: P(pager=None), ValueError, "Policy.pager is required; known pagers: ct, gather, share"),
    *[Case(f"policy-name-{value!r}", lambda _, v=value: P(name=v), ValueError,
           "Policy.name must be a non-empty string, got ...") for value in (5, "")],
    Case("ct-hole-limit", lambda _: P.from_preset("thinkv", pager={"max_hole_blocks": 0}), ValueError,
         "ct pager: max_hole_blocks=0; accepted: an integer >= 1, or None to never move tokens"),
    # budgets and the other policy fields
    *[Case(f"budget-{value!r}", lambda _, v=value: P.from_preset("streamingllm", budget=v), ValueError,
           "Policy.budget must be an integer >= 1, got ...") for value in (0, -3, 1.5, "64", True)],
    Case("budget-too-small", lambda _: P.from_preset("rkv", budget=8), ValueError, BUDGET_RKV.format(b=8)),
    Case("budget-missing", lambda _: P.from_preset("streamingllm", budget=None), ValueError,
         "Policy 'streamingllm': trigger 'over_budget' needs a budget (tokens per sequence and layer)"),
    *[Case(f"protect-recent-share-{i}", run, ValueError,
           "Policy.protect_recent=...: a float means a share of the budget and must lie in (0, 1) with a budget "
           "set; use an int for a number of tokens")
      for i, run in enumerate([lambda _: P(protect_recent=0.5), lambda _: P.from_preset("h2o", protect_recent=1.5)])],
    Case("protect-recent-negative", lambda _: P(protect_recent=-1), ValueError,
         "Policy.protect_recent must be an integer >= 0, got -1"),
    Case("sinks", lambda _: P(sinks=-1), ValueError, "Policy.sinks must be an integer >= 0, got -1"),
    Case("block-size", lambda _: P(block_size=0), ValueError, "Policy.block_size must be an integer >= 1, got 0"),
    Case("group-size", lambda _: P(group_size=0), ValueError, "Policy.group_size must be an integer >= 1, got 0"),
    Case("residual", lambda _: P(residual=-1), ValueError, "Policy.residual must be an integer >= 0, got -1"),
    Case("refresh", lambda _: P(refresh=0), ValueError, "Policy.refresh must be an integer >= 1, got 0"),
    Case("protect-prompt", lambda _: P(protect_prompt="yes"), ValueError,
         "Policy.protect_prompt must be true or false, got 'yes'"),
    Case("pool-layout", lambda _: P(pool_layout="heads"), ValueError,
         "Policy.pool_layout='heads'; accepted: 'slot', 'head'"),
    Case("scale-headroom", lambda _: P(scale_headroom=0.5), ValueError,
         "Policy.scale_headroom must be a number >= 1 and finite, got ..."),
    Case("scale-headroom-inf", lambda _: P(scale_headroom=float("inf")), ValueError,
         "Policy.scale_headroom must be a number >= 1 and finite, got ..."),
    Case("budget-without-evictor", lambda _: P.from_preset("fullkv", budget=128), ValueError,
         "Policy 'fullkv' never evicts (it has no evictor), so budget=128 would change nothing; drop the budget, "
         "or choose a preset with an evictor (kvcompose presets lists them)"),
    # precision map, storage formats and thought classes
    *[Case(f"precision-{i}", run, ValueError,
           "Policy.precision must map token classes to formats, e.g. {'all': 'nvfp4'}; got ...")
      for i, run in enumerate([lambda _: P(precision="nvfp4"), lambda _: P(precision={})])],
    Case("precision-unknown-format", lambda _: P(precision={"all": "fp4"}), UnknownComponentError,
         "unknown quantizer 'fp4'; known quantizers: fp8, int, nvfp4, ternary"),
    Case("precision-format-field", lambda _: P(precision={"all": {"name": "nvfp4", "bits": 4}}), ValueError,
         "quantizer 'nvfp4' has no field(s) ['bits']; accepted fields: []"),
    Case("int-bits", lambda _: P(precision={"all": {"name": "int", "bits": 3}}), ValueError,
         "int quantizer: bits=3; accepted: 2, 4, 8"),
    Case("int-layout", lambda _: P(precision={"all": {"name": "int", "layout": "x"}}), ValueError,
         "int quantizer: layout='x'; accepted: per_token, kivi"),
    Case("int-group", lambda _: P(precision={"all": {"name": "int", "bits": 4, "group_size": 3}}), ValueError,
         "int quantizer: group_size=3; accepted: None (the head dim) or a positive multiple of 2 "
         "(2 codes of 4 bits per byte)"),
    Case("kivi-with-evictor",
         lambda _: P.from_preset("kivi2", budget=256, evictor="window", trigger="over_budget"), ValueError,
         "Policy 'kivi2': class 'all' uses int layout 'kivi', whose scales span several tokens; its blocks cannot "
         "be compacted after eviction. Use a slot-local format (fp8, nvfp4, ternary, int per_token) with an "
         "evictor, or no evictor"),
    Case("kivi-groups", lambda _: P.from_preset("kivi4", block_size=16), ValueError,
         "Policy 'kivi4': class 'all' uses int with scales shared by 32 tokens; group_size (32) and block_size (16) "
         "must be multiples of 32"),
    Case("nvfp4-head-dim", _head_dim_24, ValueError, "nvfp4: head_dim 24 is not a positive multiple of 16"),
    Case("classes-unmapped",
         lambda _: P(classifier={"name": "constant", "type": "T"}, precision={"R": None, "E": None}), ValueError,
         "Policy 'custom': classifier 'constant' emits classes ['T'] that Policy.precision does not map; "
         "precision classes: ['R', 'E']"),
    Case("thought-type", lambda _: P(classifier={"name": "constant", "type": "X"}, precision={"R": None}),
         ValueError, "constant classifier: type 'X' is not a thought type; accepted: 'R' (reasoning), "
                     "'E' (execution), 'T' (transition)"),
    Case("thresholds", lambda _: P.from_preset("thinkv", classifier={"thresholds": [0.5, 0.1]}), ValueError,
         "sparsity_kde classifier: thresholds must be strictly ascending, got 0.1 after 0.5 "
         "(thresholds=[0.5, 0.1])"),
    Case("thresholds-range", lambda _: P.from_preset("thinkv", classifier={"thresholds": [-5, 7]}), ValueError,
         "sparsity_kde classifier: threshold -5 lies outside [0, 1], the range of attention sparsity (a share of "
         "negligible weights); thresholds=[-5, 7]"),
    Case("layers", lambda _: P.from_preset("thinkv", classifier={"layers": [-1]}), ValueError,
         "sparsity_kde classifier: layer -1 is not a layer index (an int >= 0); layers=[-1]"),
    Case("calibration-missing",  # relative to the test's working directory, an empty tmp_path
         lambda _: P.from_preset("thinkv", classifier={"name": "sparsity_kde", "calibration": "calib.json"}),
         FileNotFoundError, "calibration 'calib.json' does not exist"),
    Case("calibration-other-model",
         lambda _: P.from_preset("thinkv", classifier={"name": "sparsity_kde", "calibration": _smollm2_calibration(),
                                                       "model": "Other"}),
         ValueError, "sparsity_kde classifier: calibration '...' is for model 'SmolLM2-135M-Instruct', not 'Other'; "
                     "calibrate this model or drop the model field"),
    Case("calibrated-layers-missing",
         lambda m: _forward(m, P(classifier={"name": "sparsity_kde", "thresholds": [0.5], "layers": [5]},
                                 precision={"R": None, "E": None, "T": None})),
         ValueError, "sparsity_kde classifier reads layers [5], but the sparsity has only 2 layers; was it "
                     "calibrated for another model (None)?"),
    Case("text-policy-without-tokenizer",
         lambda m: P(classifier="keyword", precision={"R": None, "E": None, "T": None}).make_cache(m), ValueError,
         "Policy 'custom': classifier 'keyword' reads the generated text; pass tokenizer= to make_cache "
         "(policy.generate passes its own)"),
    Case("text-policy-without-tokens", _forward_without_tokens, ValueError,
         "policy 'reasoncache': filter 'collaborative' reads the generated text, but the ids of columns 0..4 were not "
         "given to the cache: call cache.observe_tokens(input_ids, attention_mask) before each forward, or pass "
         "streamer=cache.token_streamer(attention_mask) to model.generate (policy.generate does it)"),
    Case("tokens-mask-width",
         lambda m: P.from_preset("reasoncache").make_cache(m, tokenizer=object()).observe_tokens(
             torch.ones(1, 4, dtype=torch.long), torch.ones(1, 3)), ValueError,
         "observe_tokens: attention_mask covers 3 columns; expected the 4 new ones or all 4 so far"),
    Case("filter-without-share-pager", lambda _: P(filter="collaborative"), ValueError,
         "Policy 'custom': filter 'collaborative' decides which blocks to share, which needs pager 'share' (got "
         "'gather')"),
    Case("share-pager-several-classes", lambda _: P(pager="share", precision={"R": None, "T": "ternary"}), ValueError,
         "Policy 'custom': pager 'share' works on one token class; precision maps ['R', 'T']. Use one class, e.g. "
         "precision={'all': 'nvfp4'}"),
    Case("filter-thresholds", lambda _: P.from_preset("reasoncache", filter={"tau_soft": 0.95}), ValueError,
         "collaborative filter: tau_soft=0.95 is above tau_strict=0.9; the soft threshold must not exceed the strict "
         "one"),
    Case("filter-percentile", lambda _: P.from_preset("reasoncache", filter={"percentile": 0}), ValueError,
         "collaborative filter: percentile=0; accepted: a number in (0, 100]"),
    Case("random-filter-rate", lambda _: P.from_preset("reasoncache-random", filter={"rate": 2}), ValueError,
         "random filter: rate=2; accepted: a number in [0, 1]"),
    Case("speed-text-policy",
         lambda m: __import__("kvcompose.speed").speed.time_policy(m, P.from_preset("reasoncache"), None, None, 4),
         ValueError, "policy 'reasoncache': its filter 'collaborative' reads the generated text, so it decodes "
                     "eagerly; the speed benchmark times the static-shape path only"),
    Case("fast-text-policy", _fast_text_policy, ValueError,
         "static decode: policy 'reasoncache''s filter 'collaborative' reads the generated text on the host after "
         "every step; decode eagerly (model.generate with streamer=cache.token_streamer(...), or "
         "policy.generate(..., fast=False))"),
    # models
    Case("attn-implementation", _sdpa_make_cache, UnsupportedModelError,
         "LlamaForCausalLM uses attn_implementation='sdpa'; a kvcompose cache needs attn_implementation='kvcompose': "
         "load it with from_pretrained(..., attn_implementation='kvcompose'), call "
         "model.set_attn_implementation('kvcompose'), or use policy.generate(...)"),
    Case("sliding-window", _gemma2, UnsupportedModelError,
         "Gemma2ForCausalLM has layers of type ['sliding_attention']; kvcompose supports models whose layers are all "
         "'full_attention' (no sliding-window, chunked or linear-attention layers)"),
    Case("mla", _deepseek_v3, UnsupportedModelError,
         "DeepseekV3ForCausalLM uses multi-head latent attention (kv_lora_rank=16); kvcompose supports the standard "
         "q/k/v layout (MHA, GQA, MQA)"),
    Case("encoder-decoder", _t5, UnsupportedModelError,
         "T5ForConditionalGeneration is an encoder-decoder model; kvcompose supports decoder-only models"),
    Case("no-config", lambda _: P.from_preset("fullkv").make_cache(torch.nn.Linear(2, 2)), UnsupportedModelError,
         "Linear has no .config; kvcompose needs a Hugging Face transformers model"),
    Case("no-layers", lambda _: P.from_preset("fullkv").make_cache(NotADecoder()), UnsupportedModelError,
         "...'s config has no integer num_hidden_layers; is it a decoder language model?"),
    # attention, cache and generation
    Case("attention-without-cache",
         lambda m: m(input_ids=left_padded([5])[1], attention_mask=left_padded([5])[2], use_cache=False),
         UnsupportedModelError,
         "LlamaAttention called the kvcompose attention with keys that did not come from a kvcompose cache. Pass "
         "cache=policy.make_cache(model) (or use policy.generate); ..."),
    Case("cache-without-attention", _cache_without_kvcompose_attention, UnsupportedModelError,
         "layer 0 was updated twice without the kvcompose attention running in between: load the model with "
         "attn_implementation='kvcompose' (policy.generate does this for you)"),
    Case("mask-4d",
         lambda m: m(input_ids=left_padded([5])[1], attention_mask=torch.ones(1, 1, 5, 5),
                     past_key_values=P.from_preset("fullkv").make_cache(m)),
         ValueError, "kvcompose expects a 2D padding mask, got a 4D attention mask of shape (1, 1, 5, 5); custom 4D "
                     "masks are not supported"),
    Case("dropout", _training_mode, ValueError,
         "kvcompose attention is for inference; got dropout=0.1 (module in training mode?)"),
    Case("beam-search",
         lambda m: greedy(m, *left_padded([5])[1:], 3, cache=P.from_preset("fullkv").make_cache(m), num_beams=2),
         ValueError, "kvcompose caches do not support beam search (use num_beams=1)"),
    Case("assisted-decoding", lambda m: _assisted(m, transformers_checks=False),
         ValueError, "kvcompose caches cannot be cropped (assisted/speculative decoding is not supported)"),
    Case("assisted-decoding-new-transformers", lambda m: _assisted(m, transformers_checks=True), ValueError,
         "Assisted decoding requires a cache that can be cropped to restore the states after draft verification"),
    Case("expand-after-prefill", lambda m: _used_cache(m).batch_repeat_interleave(2), ValueError,
         "kvcompose caches cannot be expanded after prefill; pass one row per sequence"),
    Case("drop-after-prefill", lambda m: _used_cache(m).batch_select_indices(torch.tensor([0])), ValueError,
         "kvcompose caches cannot drop rows after prefill"),
    Case("reuse-generate", _second_generate, CacheReuseError, REUSE),
    Case("reuse-forward", _skipped_columns, CacheReuseError, REUSE),
    Case("reuse-generate-unpadded", _second_generate_unpadded, CacheReuseError, REUSE_POSITIONS),
    Case("reuse-forward-positions", _positions_restart, CacheReuseError, REUSE_POSITIONS),
    Case("nan-fullkv", _nan_keys("fullkv"), ValueError, NAN),
    Case("nan-fp8", _nan_keys("fp8"), ValueError, NAN),
    Case("generate-with-cache", lambda m: _generate(past_key_values=None)(m), ValueError,
         "policy.generate makes its own cache; do not pass cache (or past_key_values)"),
    Case("generate-prompts", lambda m: _generate(prompts=[])(m), ValueError,
         "prompts must be a non-empty list of strings, got []"),
    Case("generate-empty-prompt", lambda m: _generate(prompts=[""], chat=False)(m), ValueError,
         "prompt 0 ('') encodes to no tokens; give each prompt some text (or let the chat template wrap it: "
         "chat=None or True)"),
    Case("generate-max-new-tokens", lambda m: _generate(max_new_tokens="5")(m), ValueError,
         "max_new_tokens must be an integer >= 1, got '5'"),
    Case("threads-env", lambda _: _threads_from_env("x"), ValueError,
         "KVCOMPOSE_THREADS='x': expected a positive integer (a CPU thread count)"),
    Case("generate-fast-sampling", lambda m: _generate(fast=True, do_sample=True)(m), ValueError,
         "fast=True decodes greedily and takes only ['eos_token_id', 'pad_token_id']; got do_sample=True and "
         "options []. Use fast=False (model.generate, eager) for sampling or other generate options"),
    Case("generate-fold-eager", lambda m: _generate(fast=False, fold_rotation=False)(m), ValueError,
         "fold_rotation=False applies to the static-shape path (fast=True); this call decodes eagerly "
         "(model.generate), which keeps the rotation in the cache"),
    Case("store-shape", lambda _: _store().append(torch.randn(2, 2, 3, 16), torch.randn(2, 2, 3, 16)), ValueError,
         "keys of shape (2, 2, 3, 16) do not match the cache (batch 1, 2 KV heads, head dim 16)"),
    Case("store-values", lambda _: _store().append(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 4, 16)), ValueError,
         "values shape (1, 2, 4, 16) differs from keys shape (1, 2, 3, 16)"),
    Case("store-dtype",
         lambda _: _store().append(torch.randn(1, 2, 3, 16).half(), torch.randn(1, 2, 3, 16).half()), ValueError,
         "keys/values dtype torch.float16/torch.float16 differ from the cache dtype torch.float32"),
    *_ops(),
]


@pytest.mark.parametrize("case", [c.param() for c in CASES])
def test_bad_input_raises_the_documented_message(case, llama, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths in the examples name nothing that exists
    with pytest.raises(case.error) as info:
        case.run(llama)
    assert_message(str(info.value), case.message)


def test_component_spec_error_is_a_type_error_and_a_value_error():
    with pytest.raises(TypeError):
        Policy(trigger=[1])
    with pytest.raises(ValueError):
        Policy(trigger=[1])


# --------------------------------------------------------------------------- command line
def _no_model_load(*args, **kwargs):
    raise AssertionError("the model was loaded before the input was checked")


ERR = "kvcompose: error: "
CLI_CASES = [
    # (id, argv, message, the model may be loaded (only to find that it is missing))
    ("model-missing", ["generate", "--model", "/nonexistent", "--quiet", "hi"],
     ERR + "model '/nonexistent' does not exist; give a Hugging Face model directory, a .gguf file or a Hub id "
           "(org/name), or no path for the embedded SmolLM2-135M-Instruct", True),
    ("model-dir-without-config", ["generate", "--model", "{tmp}", "--quiet", "hi"],
     ERR + "model directory '...' has no config.json; expected a Hugging Face model directory (config.json, "
           "weights and tokenizer files) or a .gguf file", True),
    ("compare-unknown-preset", ["compare", "--presets", "nosuch"],
     ERR + f"unknown preset 'nosuch'; known presets: {PRESETS}", False),
    ("generate-unknown-preset", ["generate", "--preset", "snap", "hi"],
     ERR + "unknown preset 'snap'; known presets: ...", False),
    ("bench-unknown-preset", ["bench", "--presets", "nosuch"],
     ERR + "unknown preset 'nosuch'; known presets: ...", False),
    ("bench-text-preset", ["bench", "--presets", "reasoncache"],
     ERR + "preset 'reasoncache' reads the generated text and decodes eagerly; kvcompose bench times the "
           "static-shape path (see kvcompose generate --preset reasoncache)", False),
    ("no-preset", ["compare", "--presets", ","],
     ERR + "--presets names no preset (got ','); list them with: kvcompose presets", False),
    ("generate-budget-too-small", ["generate", "--preset", "rkv", "--budget", "4", "hi"],
     ERR + BUDGET_RKV.format(b=4), False),
    ("compare-budget-too-small", ["compare", "--presets", "rkv", "--budget", "8"], ERR + BUDGET_RKV.format(b=8),
     False),
    ("bench-budget-zero", ["bench", "--presets", "rkv", "--budget", "0"],
     ERR + "Policy.budget must be an integer >= 1, got 0", False),
    ("bench-memory-cap-without-cuda", ["bench", "--presets", "rkv", "--memory-gib", "70"],
     ERR + "--memory-gib 70 measures GPU memory and needs a CUDA device; without one, time a fixed --batch", False),
    ("set-syntax", ["compare", "--set", "foo"],
     ERR + "--set expects PRESET.FIELD[.SUBFIELD]=VALUE (e.g. rpc.trigger.period=64), got 'foo'", False),
    ("set-unknown-field", ["compare", "--presets", "rkv", "--set", "rkv.buget=3"],
     ERR + "unknown policy field(s) ['buget']; accepted fields: ['block_size', 'budget', ...]", False),
    ("set-stray-preset", ["compare", "--presets", "rkv", "--set", "h2o.budget=64"],
     ERR + "--set names preset(s) ['h2o'] that are not being compared (rkv)", False),
    ("set-component-number", ["compare", "--presets", "rkv", "--set", "rkv.evictor=5"],
     ERR + "cannot build an evictor from 5; give a name (attention, h2o, rkv, tbe, window), a dict with 'name', "
           "or an evictor instance", False),
    ("min-new-tokens", ["compare", "--min-new-tokens", "300"],
     ERR + "--min-new-tokens must lie in [0, --max-new-tokens=256], got 300", False),
    ("prompt-file-missing", ["compare", "--prompts", "missing.txt"],
     ERR + "[Errno 2] No such file or directory: 'missing.txt'", False),
    ("generate-budget-never-evicts", ["generate", "--preset", "fp8", "--budget", "64", "hi"],
     ERR + "Policy 'fp8' never evicts (it has no evictor), so budget=64 would change nothing; drop the budget, or "
           "choose a preset with an evictor (kvcompose presets lists them)", False),
    ("prompt-file-not-json", ["compare", "--prompts", "bad.json"],
     ERR + "prompt file 'bad.json' is not valid JSON (Expecting value: line 2 column 1 (char 2)); expected a list "
           "of prompts, or use a file not ending in .json with one prompt per line", False),
    ("num-types", ["calibrate", "--num-types", "5", "--out", "c.json"],
     ERR + "--num-types must be one of [1, 2, 3], got 5", False),
]
ARGPARSE_CASES = [
    ("max-new-tokens", ["generate", "--max-new-tokens", "0", "hi"],
     "kvcompose generate: error: argument --max-new-tokens: expected a positive integer, got '0'"),
    ("budget-not-int", ["generate", "--budget", "abc", "hi"],
     "kvcompose generate: error: argument --budget: invalid int value: 'abc'"),
    ("temperature", ["generate", "--sample", "--temperature", "0", "hi"],
     "kvcompose generate: error: argument --temperature: expected a positive number, got '0'"),
    ("budgets", ["compare", "--budgets", "64,0"],
     "kvcompose compare: error: argument --budgets: expected positive integers, got '64,0'"),
    ("match-memory", ["compare", "--match-memory", "0"],
     "kvcompose compare: error: argument --match-memory: expected a percentage in (0, 100], got '0'"),
    ("threads", ["generate", "--threads", "0", "hi"],
     "kvcompose generate: error: argument --threads: expected a positive integer, got '0'"),
]

# Checks where running on is reasonable: a warning, not an error.
WARNING_CASES = [
    ("calibrated-for-another-model", _other_model_run,
     "policy 'thinkv': classifier 'sparsity_kde' was calibrated for model 'SmolLM2-135M-Instruct', but runs on "
     "'org/Other-1B'; its thresholds and layers may not fit this model. Fit them with kvcompose calibrate "
     "--model ..."),
]


NEEDS_NO_CUDA = {"bench-memory-cap-without-cuda": pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA")}


@pytest.mark.parametrize("argv, message, loads", [pytest.param(*c[1:], id=c[0], marks=NEEDS_NO_CUDA.get(c[0], ()))
                                                  for c in CLI_CASES])
def test_cli_prints_one_line_and_exits_2(argv, message, loads, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.json").write_text("[\n")  # a prompt file cut short
    if not loads:
        monkeypatch.setattr("kvcompose.models.load", _no_model_load)
    code = main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    out, err = capsys.readouterr()
    assert code == 2
    assert "Traceback" not in out + err
    assert_message(err.strip().splitlines()[-1], message)


@pytest.mark.parametrize("argv, message", [pytest.param(*c[1:], id=c[0]) for c in ARGPARSE_CASES])
def test_cli_option_values_are_refused_by_the_parser(argv, message, capsys, monkeypatch):
    monkeypatch.setattr("kvcompose.models.load", _no_model_load)
    with pytest.raises(SystemExit) as info:
        main(argv)
    out, err = capsys.readouterr()
    assert info.value.code == 2
    assert "Traceback" not in out + err
    assert_message(err.strip().splitlines()[-1], message)


@pytest.mark.parametrize("run, message", [pytest.param(*c[1:], id=c[0]) for c in WARNING_CASES])
def test_documented_warnings(run, message, llama):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(llama)
    texts = [str(w.message) for w in caught]
    assert any(re.fullmatch(pattern(message), t, re.S) for t in texts), f"\n got: {texts}\nwant: {message}"


# ----------------------------------------------------------------- the table and the tests agree
def _cells(row: str) -> list[str]:
    """Cells of a markdown table row; a ``|`` inside a code span does not split."""
    cells, cur, code = [], "", False
    for ch in row.strip().strip("|"):
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            cells.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return cells + [cur.strip()]


def table_messages() -> list[str]:
    text = DOC.read_text(encoding="utf-8")
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    messages = []
    for row in rows:
        cells = _cells(row)
        assert len(cells) == 3, f"a row of the bad-input table has {len(cells)} cells: {row}"
        if cells[0] == "input" or set(cells[0]) <= {"-"}:
            continue
        msg = cells[2]
        assert msg.startswith("`") and msg.endswith("`") and msg.count("`") == 2, f"message not one code span: {row}"
        messages.append(msg[1:-1])
    return messages


def test_every_table_row_is_tested_and_every_test_is_in_the_table():
    documented = table_messages()
    assert len(documented) == len(set(documented)), "the table repeats a message"
    tested = ({c.message for c in CASES} | {c[2] for c in CLI_CASES} | {c[2] for c in ARGPARSE_CASES}
              | {c[2] for c in WARNING_CASES})
    assert set(documented) - tested == set(), "rows without a test"
    assert tested - set(documented) == set(), "tests without a row"


# ------------------------------------------------------------------------- the cache across forwards
def test_a_forward_of_another_batch_size_names_the_cache_shape(llama):
    cache = Policy.from_preset("fullkv").make_cache(llama)
    ids = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(0))
    llama(input_ids=ids, past_key_values=cache)
    with pytest.raises(ValueError, match="do not match the cache"):
        llama(input_ids=torch.cat([ids, ids])[:, :1], past_key_values=cache)

"""``policy.generate``: tokenize, pad, run ``model.generate`` on a fresh cache, report."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import threads as cpu_threads
from ..report import Report
from ..validation import check_int
from .attention import ATTENTION_NAME
from .compat import cache_kwargs


@dataclass
class GenerationOutput:
    """Texts and token ids generated per prompt, and the cache's memory report."""

    texts: list[str]
    sequences: list[list[int]]  # generated ids per prompt, up to and including the first EOS
    report: Report
    prompt_lengths: list[int]


class _Progress:
    """A logits processor that only advances a progress bar (works for any batch size)."""

    def __init__(self, total: int, enabled: bool):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="generating", unit="tok", disable=not enabled, leave=False)

    def __call__(self, input_ids, scores):
        self.bar.update(1)
        return scores


def encode_prompts(tokenizer, prompts, chat: bool | None = None) -> dict:
    """Left-padded batch encoding; applies the chat template when the tokenizer has one (unless ``chat=False``)."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompts must be a non-empty list of strings, got {prompts!r}")
    use_chat = getattr(tokenizer, "chat_template", None) is not None if chat is None else chat
    if use_chat:
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=not use_chat)
    finally:
        tokenizer.padding_side = old_side
    empty = [i for i, n in enumerate(enc["attention_mask"].sum(1).tolist()) if n == 0]
    if empty:
        raise ValueError(f"prompt {empty[0]} ({prompts[empty[0]]!r}) encodes to no tokens; give each prompt some text "
                         "(or let the chat template wrap it: chat=None or True)")
    return enc


FAST_KWARGS = {"eos_token_id", "pad_token_id"}  # what the static-shape path takes besides max_new_tokens


def generate(policy, model, tokenizer, prompts, max_new_tokens: int = 256, chat: bool | None = None,
             progress: bool = False, fast: bool | None = None, memory_basis="bfloat16",
             threads: int | None = None, fold_rotation: bool | None = None, **generate_kwargs) -> GenerationOutput:
    """Generate under ``policy`` and return texts, generated ids and the memory report.

    ``fast``: decode through the static-shape path (:func:`kvcompose.hf.static.fast_generate`:
    greedy, CUDA graphs on a GPU). ``None`` picks it on CUDA for greedy decoding with no
    other ``model.generate`` options; ``False`` runs ``model.generate`` eagerly with every
    option. The model's attention implementation is switched to ``kvcompose`` for the
    call and restored afterwards. ``memory_basis``: the full cache's dtype that the report
    states memory against (see :mod:`kvcompose.report`). ``threads``: CPU threads for a
    model on the CPU (default: chosen by :func:`kvcompose.threads.choose`, which keeps a
    busy machine from being oversubscribed; restored afterwards). ``fold_rotation``: on the
    static-shape path, whether a policy's value rotation moves into the projection weights for
    the decode steps (as :func:`~kvcompose.hf.static.fast_generate`; None: it does); the eager
    path never folds, so it refuses the option. Extra keyword arguments go to ``model.generate``.
    """
    if "past_key_values" in generate_kwargs or "cache" in generate_kwargs:
        raise ValueError("policy.generate makes its own cache; do not pass cache (or past_key_values)")
    check_int("max_new_tokens", max_new_tokens, 1, noun="an integer")
    from ..classifiers.model_match import warn_if_calibrated_for_another_model

    warn_if_calibrated_for_another_model(policy, model)
    enc = encode_prompts(tokenizer, prompts, chat).to(model.device)
    greedy = not generate_kwargs.get("do_sample", getattr(model.generation_config, "do_sample", False))
    other = sorted(set(generate_kwargs) - FAST_KWARGS - {"do_sample"})
    if fast is None:
        fast = model.device.type == "cuda" and greedy and not other and not policy.needs_text
    elif fast and policy.needs_text:
        raise ValueError(f"fast=True: policy {policy.name!r}'s {policy.needs_text} reads the generated text on the "
                         "host after every step, which the static-shape path does not; use fast=False")
    elif fast and (other or not greedy):
        raise ValueError(
            f"fast=True decodes greedily and takes only {sorted(FAST_KWARGS)}; got do_sample={not greedy} and "
            f"options {other}. Use fast=False (model.generate, eager) for sampling or other generate options"
        )
    if fold_rotation is not None and not fast:
        raise ValueError(f"fold_rotation={fold_rotation!r} applies to the static-shape path (fast=True); this call "
                         "decodes eagerly (model.generate), which keeps the rotation in the cache")
    n_threads = cpu_threads.choose(threads).threads if model.device.type == "cpu" else torch.get_num_threads()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        cache = policy.make_cache(model, memory_basis=memory_basis, tokenizer=tokenizer)
        with cpu_threads.fixed(n_threads):
            if fast:
                out = _fast(model, tokenizer, cache, enc, max_new_tokens, generate_kwargs,
                            True if fold_rotation is None else fold_rotation)
            else:
                out = _eager(model, tokenizer, cache, enc, max_new_tokens, progress, generate_kwargs)
    finally:
        model.set_attn_implementation(previous)
    new = out[:, enc["input_ids"].shape[1]:]
    eos = _eos_ids(model, tokenizer)
    sequences = [_until_eos(row.tolist(), eos) for row in new]
    texts = [tokenizer.decode(seq, skip_special_tokens=True) for seq in sequences]
    cache.check_errors()
    return GenerationOutput(texts, sequences, cache.report(), enc["attention_mask"].sum(1).tolist())


def _eager(model, tokenizer, cache, enc, max_new_tokens, progress, generate_kwargs):
    from transformers import LogitsProcessorList

    processors = LogitsProcessorList(generate_kwargs.pop("logits_processor", None) or [])
    processors.append(_Progress(max_new_tokens, progress))
    generate_kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
    if cache.policy.needs_text:  # its components read the ids: hand them over before each forward
        generate_kwargs["streamer"] = cache.token_streamer(enc["attention_mask"], then=generate_kwargs.get("streamer"))
    with torch.inference_mode():
        out = model.generate(
            **enc, **cache_kwargs(model, cache), max_new_tokens=max_new_tokens,
            logits_processor=processors, **generate_kwargs,
        )
    processors[-1].bar.close()
    return out


def _fast(model, tokenizer, cache, enc, max_new_tokens, generate_kwargs, fold_rotation: bool):
    from .static import fast_generate

    eos = generate_kwargs.get("eos_token_id", sorted(_eos_ids(model, tokenizer)) or None)
    pad = generate_kwargs.get("pad_token_id", tokenizer.pad_token_id)
    return fast_generate(model, cache, enc["input_ids"], enc["attention_mask"], max_new_tokens,
                         eos_token_id=eos, pad_token_id=pad, fold_rotation=fold_rotation)


def _eos_ids(model, tokenizer) -> set[int]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    return set(ids if isinstance(ids, (list, tuple)) else [ids]) - {None}


def _until_eos(ids: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids

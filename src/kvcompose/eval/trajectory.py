"""The reference text: a greedy decode with full KV and no kvcompose code, every step's logits kept.

Protocol step 1 (design §6). Greedy decoding runs with the model's plain ``sdpa``
attention and a transformers ``DynamicCache``, so the reference owes nothing to the
code it judges. Every step's raw logits are kept. EOS ids are masked from the argmax
until ``min_new_tokens``; the masked ids are recorded so every replay applies the same
rule (otherwise a replay that "prefers EOS" would count as a disagreement it never made).

The forward step and the attention switch live here too: replays must feed tokens
exactly as the trajectory did, so both use the same two helpers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..hf.compat import cache_kwargs, returned_cache

TRAJECTORY_ATTENTION = "sdpa"


@dataclass
class Trajectory:
    """A greedy full-KV decode of a (left-padded) batch, with what its argmax was allowed to pick."""

    input_ids: torch.Tensor  # [B, P] prompt, left padded
    attention_mask: torch.Tensor  # [B, P]
    tokens: torch.Tensor  # [B, T] greedy tokens (pad after a row's EOS)
    logits: torch.Tensor  # [B, T, V] float32 raw full-KV logits of each step
    steps: torch.Tensor  # [B] valid steps per row (up to and including its EOS)
    suppressed_ids: tuple[int, ...]  # ids masked from the argmax ...
    suppress_before: int  # ... at steps t < suppress_before (min_new_tokens)
    suppression_mattered: torch.Tensor  # [B, T] bool: the unmasked argmax was a suppressed id
    attn_implementation: str = TRAJECTORY_ATTENTION

    @property
    def num_steps(self) -> int:
        return self.tokens.shape[1]

    @property
    def valid(self) -> torch.Tensor:
        """``[B, T]`` bool: steps inside each row's trajectory."""
        return torch.arange(self.num_steps)[None, :] < self.steps[:, None]

    def suppress_mask(self, t: int, vocab: int) -> torch.Tensor | None:
        """``[V]`` bool of the ids the argmax may not pick at step ``t`` (``None``: nothing masked)."""
        if t >= self.suppress_before or not self.suppressed_ids:
            return None
        mask = torch.zeros(vocab, dtype=torch.bool, device=self.logits.device)
        mask[list(self.suppressed_ids)] = True
        return mask

    def select(self, row: int) -> "Trajectory":
        """One row alone: padding stripped, cut to its own steps (used to calibrate budgets)."""
        keep = self.attention_mask[row].bool()
        n = int(self.steps[row])
        ids = self.input_ids[row][keep][None]
        return Trajectory(
            ids, torch.ones_like(ids), self.tokens[row : row + 1, :n], self.logits[row : row + 1, :n],
            torch.tensor([n]), self.suppressed_ids, self.suppress_before,
            self.suppression_mattered[row : row + 1, :n], self.attn_implementation,
        )


@contextlib.contextmanager
def attention(model, name: str):
    """Run the model with attention implementation ``name``, restoring the previous one afterwards."""
    previous = model.config._attn_implementation
    if previous != name:
        model.set_attn_implementation(name)
    try:
        yield
    finally:
        if previous != name:
            model.set_attn_implementation(previous)


def forward_step(model, ids: torch.Tensor, mask: torch.Tensor, cache):
    """One forward of the new columns ``ids``; positions count real tokens only (as ``generate`` does)."""
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_kwargs(model, cache),
                use_cache=True, logits_to_keep=1)
    return out.logits[:, -1], returned_cache(out)


def next_input(tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The next step's input: one token column per row, and the mask grown by it."""
    ids = tokens[:, None]
    return ids, torch.cat([mask, torch.ones_like(ids)], dim=1)


def _eos_ids(model, eos_token_id) -> list[int]:
    ids = eos_token_id if eos_token_id is not None else getattr(model.generation_config, "eos_token_id", None)
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]


def greedy_trajectory(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                      max_new_tokens: int, min_new_tokens: int = 0, eos_token_id=None,
                      pad_token_id: int | None = None, attn_implementation: str = TRAJECTORY_ATTENTION,
                      progress=None) -> Trajectory:
    """Greedy full-KV decode of a left-padded batch, keeping each step's raw logits.

    Runs with ``attn_implementation`` (default plain ``sdpa``) and a transformers cache,
    so the reference owes nothing to kvcompose. A row stops at its first EOS once
    ``min_new_tokens`` are out; before that, EOS ids are masked and recorded.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not 0 <= min_new_tokens <= max_new_tokens:
        raise ValueError(f"min_new_tokens must lie in [0, max_new_tokens={max_new_tokens}], got {min_new_tokens}")
    eos = _eos_ids(model, eos_token_id)
    if pad_token_id is None:
        pad_token_id = getattr(model.generation_config, "pad_token_id", None)
        pad_token_id = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    B = input_ids.shape[0]
    eos_t = torch.tensor(eos, dtype=torch.long, device=input_ids.device)
    done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    steps = torch.full((B,), max_new_tokens, dtype=torch.long)
    tokens, logits_all, mattered = [], [], []
    suppressed = tuple(eos) if min_new_tokens > 0 else ()
    ids, cache = input_ids, None
    with attention(model, attn_implementation), torch.inference_mode():
        for t in range(max_new_tokens):
            logits, cache = forward_step(model, ids, mask, cache)
            pick = logits
            if t < min_new_tokens and suppressed:
                pick = logits.clone()
                pick[:, list(suppressed)] = float("-inf")
            tok = pick.argmax(-1)
            mattered.append(logits.argmax(-1) != tok)
            tok = torch.where(done, pad_token_id, tok)
            tokens.append(tok)
            logits_all.append(logits.float())
            if eos:
                ended = ~done & torch.isin(tok, eos_t)
                steps = torch.where(ended.cpu(), t + 1, steps)
                done = done | ended
            if progress is not None:
                progress.update(1)
            if bool(done.all()):
                break
            ids, mask = next_input(tok, mask)
    valid = torch.arange(len(tokens))[None, :] < steps[:, None]
    return Trajectory(
        input_ids, mask[:, : input_ids.shape[1]], torch.stack(tokens, 1), torch.stack(logits_all, 1), steps,
        suppressed, min_new_tokens, torch.stack(mattered, 1).cpu() & valid, attn_implementation,
    )

"""The token ids a cache is fed, for components that read the generated text.

Attention sees keys and values, never token ids. Components that work on text (the
keyword classifier, ReasonCache's sharing filter) get them through
:meth:`KVComposeCache.observe_tokens`, called before the forward pass that appends the
tokens: :func:`kvcompose.hf.generate` does it, ``model.generate`` users pass
:class:`kvcompose.hf.streamer.TokenStreamer` as its ``streamer``, and users who drive ``model(...)`` step by
step call it themselves. Ids live on the host, per row, padding left out; each carries
the column (absolute position) it is stored at, which is how text is tied to blocks.
"""

from __future__ import annotations

import torch

class TokenStream:
    """Per-row token ids and their columns, as observed, with a decoder for their text."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.columns = 0  # columns observed so far (padding included, as the cache counts them)
        self.ids: list[list[int]] | None = None  # per row: real token ids, oldest first
        self.positions: list[list[int]] | None = None  # per row: the column of each id
        self._pieces: dict[int, str] = {}

    def observe(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Record the ids of the next columns (``[B, T]``). ``attention_mask`` marks real tokens
        (0: padding, left out); it may cover just these columns or every column so far."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            raise ValueError(f"observe_tokens: input_ids must be an integer tensor [batch, tokens], got "
                             f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
        B, T = input_ids.shape
        if self.ids is not None and B != len(self.ids):
            raise ValueError(f"observe_tokens: batch of {B} rows, but this cache holds {len(self.ids)}")
        real = self._real(attention_mask, B, T)
        ids, real = input_ids.detach().cpu().tolist(), real.tolist()
        if self.ids is None:
            self.ids, self.positions = [[] for _ in range(B)], [[] for _ in range(B)]
        for b in range(B):
            for t in range(T):
                if real[b][t]:
                    self.ids[b].append(ids[b][t])
                    self.positions[b].append(self.columns + t)
        self.columns += T

    def _real(self, mask: torch.Tensor | None, B: int, T: int) -> torch.Tensor:
        if mask is None:
            return torch.ones(B, T, dtype=torch.bool)
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != B:
            raise ValueError(f"observe_tokens: attention_mask must be [batch={B}, tokens], got "
                             f"{getattr(mask, 'shape', type(mask).__name__)}")
        if mask.shape[1] == self.columns + T:
            mask = mask[:, -T:] if T else mask[:, :0]
        elif mask.shape[1] != T:
            raise ValueError(f"observe_tokens: attention_mask covers {mask.shape[1]} columns; expected the {T} new "
                             f"ones or all {self.columns + T} so far")
        return mask.detach().cpu().bool()

    def check_covers(self, columns: int, who: str) -> None:
        """Raise unless the ids of the first ``columns`` columns were observed."""
        if self.columns < columns:
            raise ValueError(
                f"{who} reads the generated text, but the ids of columns {self.columns}..{columns - 1} were not "
                "given to the cache: call cache.observe_tokens(input_ids, attention_mask) before each forward, or "
                "pass streamer=cache.token_streamer(attention_mask) to model.generate (policy.generate does it)"
            )

    # ----------------------------------------------------------------- text
    def decode(self, ids: list[int]) -> str:
        """The text of some ids (exact: decoded together, not piece by piece)."""
        return self._tokenizer().decode(ids, skip_special_tokens=False)

    def piece(self, token: int) -> str:
        """One token's text, cached: enough to find a delimiter without decoding whole steps."""
        text = self._pieces.get(token)
        if text is None:
            text = self._pieces[token] = self._tokenizer().decode([token], skip_special_tokens=False)
        return text

    def recent_text(self, row: int, tokens: int) -> str:
        """The decoded text of a row's last ``tokens`` real tokens."""
        return self.decode(self.ids[row][-tokens:]) if self.ids else ""

    def _tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("this cache has no tokenizer to decode text with: make it with "
                             "policy.make_cache(model, tokenizer=tokenizer)")
        return self.tokenizer

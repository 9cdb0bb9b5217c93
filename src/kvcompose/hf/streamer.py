"""A transformers streamer that feeds a cache's token stream during ``model.generate``."""

from __future__ import annotations

import torch

try:  # transformers' streamer base class (a plain object with put/end)
    from transformers.generation.streamers import BaseStreamer
except ImportError:  # pragma: no cover - very old transformers
    BaseStreamer = object


class TokenStreamer(BaseStreamer):
    """Wires ``model.generate`` to a cache's token stream: pass it as ``streamer=``.

    ``generate`` hands a streamer the prompt before the prefill and each new token before
    the forward that appends it, which is when the cache must know them. ``attention_mask``:
    the prompt's (padding is left out); ``then``: another streamer to pass everything on to.
    """

    def __init__(self, cache, attention_mask: torch.Tensor | None = None, then=None):
        self.cache = cache
        self.attention_mask = attention_mask
        self.then = then
        self._started = False

    def put(self, value: torch.Tensor) -> None:
        ids = value if value.dim() == 2 else value.reshape(-1, 1)
        if not self._started:
            self.cache.observe_tokens(ids, self.attention_mask)
            self._started = True
        else:
            self.cache.observe_tokens(ids)
        if self.then is not None:
            self.then.put(value)

    def end(self) -> None:
        if self.then is not None:
            self.then.end()

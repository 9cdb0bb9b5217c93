"""Input checks and device error flags of :class:`~kvcompose.paging.store.LayerStore`.

Bad values found while appending are recorded in device flags rather than raised at
once, so a decode step never waits on the device; :meth:`StoreChecks.check_errors`
reads them when the caller chooses to synchronize.
"""

from __future__ import annotations

import torch


class StoreChecks:
    """Shape/dtype checks of new keys and values, and the flags that record bad ones."""

    def check_input(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Refuse new keys/values (``[B, Hkv, T, D]``) whose batch, heads, head dim or dtype
        differ from this store's, naming both."""
        B, H, _, D = keys.shape
        if (B, H, D) != (self.batch_size, self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"keys of shape {tuple(keys.shape)} do not match the cache (batch {self.batch_size}, "
                f"{self.num_kv_heads} KV heads, head dim {self.head_dim})"
            )
        if values.shape != keys.shape:
            raise ValueError(f"values shape {tuple(values.shape)} differs from keys shape {tuple(keys.shape)}")
        if keys.dtype != self.dtype or values.dtype != self.dtype:
            raise ValueError(f"keys/values dtype {keys.dtype}/{values.dtype} differ from the cache dtype {self.dtype}")

    def check_errors(self, where: str = "kvcompose store") -> None:
        """Raise for bad keys/values recorded on the device since the last check: NaN/inf in a
        real token (every format, the same message, naming ``where``), a row that outgrew the
        fixed capacity of static mode, then what encoding recorded (see
        :meth:`SlotCodec.check_errors`). Each error is raised once."""
        if int(self.nonfinite.item()):
            for flag in self.error_flags():  # the codecs saw the same bad values
                flag.zero_()
            raise ValueError(
                f"{where}: the model produced NaN/inf keys or values; the cache does not store them. Typical causes: "
                "fp16 overflow (run the model in bf16 or fp32), or NaN/inf already in the inputs or weights"
            )
        overflow = self._overflow_flags()
        if overflow and int(torch.stack(overflow).amax()):
            for flag in overflow:
                flag.zero_()
            raise ValueError(
                f"{where}: a sequence outgrew the capacity fixed for static decode (the buffer or a region's blocks); "
                "tokens were lost. This is a kvcompose bug: please report it, and decode with fast=False meanwhile"
            )
        for pool in self.pools.values():
            pool.codec.check_errors()

    def _overflow_flags(self) -> list[torch.Tensor]:
        return [self.overflow] + [r.overflow for r in self.regions] if self.static else []

    def error_flags(self) -> list[torch.Tensor]:
        """The device error flags of this layer (non-finite input, static-capacity overflow,
        then its codecs'; see :meth:`SlotCodec.error_flags`), so a caller can test many with
        one synchronization."""
        return [self.nonfinite] + [f.reshape(1) for f in self._overflow_flags()] + [
            f for f in (pool.codec.error_flags() for pool in self.pools.values()) if f is not None]

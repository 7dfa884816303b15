"""ZeRO++-class compressed communication inside ZeRO (the bytes go through ``llmpar/distributed/compressed.py``):

    WeightGather (stage 3)   qwZ: a unit's all-gather sends int8 (or int4) codes + fp32 block scales; every rank,
                             the shard's owner included, computes with the dequantized values.
                             hpZ (``zero_hpz_partition_size`` k): when forward gathers a unit with grad enabled, each
                             rank keeps its 1/k slice of the gathered values (the *secondary shard*, over the k dp
                             ranks of its node); backward re-gathers the unit from the secondary shards inside the
                             node: the same values as forward, no cross-node traffic. Secondaries live until the end
                             of that backward (or the next forward / step / load).
    GradQuantizer (2, 3)     qgZ: a unit's gradients are packed, scaled by 1/dp and quantized in one pass
                             (``pack_quantize``: no unquantized staging bucket), then reduce-scattered as codes through
                             all-to-alls, inside the node first when the dp ranks span nodes; with error feedback
                             each rank adds its previous compression error of that unit before quantizing (reset
                             when a step is skipped for non-finite gradients: ``reset_if_skipped``).
Persistent stage-3 units (small params) are gathered as they are: few bytes, and the norms keep full precision.
"""

from __future__ import annotations

import torch

from llmpar.distributed.collectives import CommCounter, Handle, all_gather_flat
from llmpar.distributed.compressed import NodeSplit, all_gather_quantized, reduce_scatter_quantized
from llmpar.ops.quant import pack_quantize, row_bytes

Key = tuple[int, int]


class WeightGather:
    """The stage-3 all-gather of a unit, quantized (``bits``) and / or from the secondary shards (``hpz``)."""

    def __init__(
        self, *, dp_group, bits: int | None, block: int, hpz: NodeSplit | None, counter: CommCounter | None
    ) -> None:
        self.dp_group, self.bits, self.block, self.hpz, self.counter = dp_group, bits, block, hpz, counter
        self.secondary: dict[Key, torch.Tensor] = {}  # unit -> this rank's [padded / k] slice of the gathered values
        self.keep: set[Key] = set()  # units whose forward gather in flight will leave a secondary shard
        self.from_secondary = 0  # gathers served inside the node (tests, reports)

    def gather(self, key: Key, full: torch.Tensor, src: torch.Tensor, *, phase: str, grad: bool) -> Handle:
        what = f"all-gather of stage-3 params, buffer {key[0]} unit {key[1]}"
        if self.hpz is not None and phase == "bwd" and key in self.secondary:
            self.from_secondary += 1
            intra = self.hpz.intra
            assert intra is not None  # hpZ splits dp into nodes of k > 1 ranks (compression()): each has its group
            handle = all_gather_flat(
                full,
                self.secondary[key],
                intra,
                async_op=True,
                counter=self.counter,
                what=what + " (from the secondary shards inside the node)",
            )
        elif self.bits is not None:
            handle = all_gather_quantized(
                full,
                src,
                self.dp_group,
                bits=self.bits,
                block=self.block,
                async_op=True,
                counter=self.counter,
                what=what + " (quantized)",
            )
        else:
            handle = all_gather_flat(full, src, self.dp_group, async_op=True, counter=self.counter, what=what)
        if self.hpz is not None and phase == "fwd" and grad:
            self.keep.add(key)
        assert handle is not None
        return handle

    def landed(self, key: Key, full: torch.Tensor) -> None:
        """After a gather of ``key`` has landed in ``full``: keep the secondary slice when forward asked for it."""
        if key in self.keep and self.hpz is not None:
            self.keep.discard(key)
            n = full.numel() // self.hpz.per_node
            self.secondary[key] = full[self.hpz.local * n : (self.hpz.local + 1) * n].clone()

    def clear(self, keys=None) -> None:
        """Drop the secondary shards (all, or of ``keys``): the params changed or their backward is over."""
        if keys is None:
            self.secondary.clear()
            self.keep.clear()
        else:
            for key in keys:
                self.secondary.pop(key, None)
                self.keep.discard(key)

    def secondary_numel(self) -> int:
        return sum(t.numel() for t in self.secondary.values())


class GradQuantizer:
    """Packs + quantizes a unit's gradients and reduce-scatters the codes (``GradReducer`` calls it at stages 2/3)."""

    def __init__(
        self, *, split: NodeSplit, bits: int, block: int, error_feedback: bool, counter: CommCounter | None
    ) -> None:
        self.split, self.bits, self.block, self.counter = split, bits, block, counter
        self.error_feedback = error_feedback
        self.residual: dict[Key, torch.Tensor] = {}  # unit -> float32 [padded]: this rank's last compression error
        self.residual2: dict[Key, torch.Tensor] = {}  # unit -> float32 [nodes * chunk]: the second level's

    def _res(self, table: dict[Key, torch.Tensor], key: Key, numel: int, device: torch.device) -> torch.Tensor | None:
        if not self.error_feedback:
            return None
        if key not in table:
            table[key] = torch.zeros(numel, dtype=torch.float32, device=device)
        return table[key]

    def pack(
        self, key: Key, grads: list[torch.Tensor], padded: int, scale: float, device: torch.device
    ) -> torch.Tensor:
        """The unit's wire buffer: ``uint8 [dp, row_bytes(chunk)]``, row d the chunk dp rank d owns."""
        world = self.split.world
        return pack_quantize(
            grads,
            rows=world,
            m=padded // world,
            bits=self.bits,
            block=self.block,
            scale=scale,
            residual=self._res(self.residual, key, padded, device),
        )

    def reduce(self, key: Key, wire: torch.Tensor, out: torch.Tensor, *, accumulate: bool, what: str):
        """Launch the quantized reduce-scatter of ``wire`` into ``out [chunk]``; returns its handle."""
        n = out.numel()
        res2 = self._res(self.residual2, key, self.split.nodes * n, wire.device) if self.split.hierarchical else None
        return reduce_scatter_quantized(
            out,
            wire,
            self.split,
            n=n,
            bits=self.bits,
            block=self.block,
            accumulate=accumulate,
            residual=res2,
            counter=self.counter,
            what=what,
            async_op=True,
        )

    def reset_if_skipped(self, found_inf: torch.Tensor) -> bool | None:
        """After a step: when it was skipped (``found_inf`` != 0) the residuals are zeroed. A skipped step's
        gradients were never applied, and a non-finite one left inf / NaN in the residuals, which every later
        reduction would add back (every later step skipped, or with fp16 the scale halved down to the minimum).
        A flag in host memory is read (no cost) and the residuals dropped only on a skip: returns whether they were;
        on a device the flag stays there (no sync): each residual is masked in place (None)."""
        tables = [self.residual, self.residual2]
        if not self.error_feedback or not any(tables):
            return False
        if found_inf.device.type == "cpu":
            if float(found_inf) == 0:
                return False
            for t in tables:
                t.clear()  # made again, as zeros, by the next reduction
            return True
        self.mask_residuals(found_inf.reshape(()) != 0)
        return None

    def mask_residuals(self, skipped: torch.Tensor) -> None:
        """Zero every residual in place where the 0-d bool ``skipped`` is true (on the device, no sync)."""
        for t in (self.residual, self.residual2):
            for r in t.values():
                r.masked_fill_(skipped.to(r.device), 0.0)

    def held_elements(self, padded: int, dtype: torch.dtype) -> int:
        """Staging a reduction in flight holds (wire + what arrives), in elements of ``dtype``, for the budget."""
        nbytes = 2 * self.split.world * row_bytes(padded // self.split.world, self.bits, self.block)
        return -(-nbytes // dtype.itemsize)

    def residual_numel(self) -> int:
        return sum(t.numel() for t in self.residual.values()) + sum(t.numel() for t in self.residual2.values())


def compression(
    zcfg, dp_group, dp: int, counter: CommCounter | None, ranks_per_node: int | None
) -> tuple[GradQuantizer | None, WeightGather | None]:
    """The compressors a :class:`~llmpar.zero.config.ZeroConfig` asks for over ``dp_group`` (None: off). Builds the
    node split (a collective over the dp ranks) when one is needed: from ``zero_hpz_partition_size`` when set, else
    from ``ranks_per_node`` (torchrun's ``LOCAL_WORLD_SIZE`` when None)."""
    zcfg.check_dp(dp)
    hpz = zcfg.zero_hpz_partition_size
    if dp == 1 or not (zcfg.zero_quantized_gradients or zcfg.zero_quantized_weights or hpz > 1):
        return None, None
    split = None
    if zcfg.zero_quantized_gradients or hpz > 1:
        split = NodeSplit(dp_group, per_node=hpz if hpz > 1 else None, ranks_per_node=ranks_per_node)
    block = zcfg.zero_quantization_block_size
    quantizer = None
    if zcfg.zero_quantized_gradients:
        assert split is not None  # made above whenever the gradients are quantized
        quantizer = GradQuantizer(
            split=split,
            bits=zcfg.zero_quantized_gradients_bits,
            block=block,
            error_feedback=zcfg.zero_quantized_gradients_error_feedback,
            counter=counter,
        )
    weights = None
    if zcfg.zero_quantized_weights or (hpz > 1 and hpz < dp):
        weights = WeightGather(
            dp_group=dp_group,
            bits=zcfg.zero_quantized_weights_bits if zcfg.zero_quantized_weights else None,
            block=block,
            hpz=split if hpz > 1 and hpz < dp else None,
            counter=counter,
        )
    return quantizer, weights


__all__ = ["GradQuantizer", "WeightGather", "compression"]

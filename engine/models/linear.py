"""Linear layers' weights in the run's format, and the one call that multiplies by either kind.

A weight is a dense tensor in the engine dtype or a `QuantizedWeight` (ops/quant_weight.py). The
`quantization` setting decides, per weight, from what the checkpoint stores:
  none  every weight dense (quantized ones are dequantized once at load);
  auto  as stored: a GGUF's quantized weights stay quantized (Q6_K as int6), dense ones stay dense;
  int8  / int4  every weight in that format: stored int4 values widen to int8 losslessly, anything
        else is quantized from its dequantized values (groups of `group_size`).
Fused layers (q/k/v, gate/up) concatenate their parts. Under `auto`, quantized parts stored in
different formats stay as stored, each run of parts in one format one weight (`LinearParts`: Q4_K_M's
Q4_K q/k next to its Q6_K v); a dense part next to quantized ones is quantized to int8, and they meet there.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from itertools import groupby

import torch
import torch.nn.functional as F

from engine.huge_pages import HugePageArena
from ops import direct
from ops.quant_linear import quant_linear
from ops.quant_rows import quant_rows
from ops.quant_weight import QuantizedWeight, quantize_int4, quantize_int8

MODES = ("auto", "none", "int8", "int4")


@dataclass(frozen=True)
class LinearParts:
    """One layer's weight as parts along the outputs, each in its own format: one call per part, outputs
    side by side. Cheaper than one widened weight when the parts differ (1.5B Q4_K_M's q/k/v: 1.96 MB
    against 3.44 MB as int8 with mins, per layer)."""
    parts: tuple


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, LinearParts):
        out = torch.cat([linear(x, part) for part in weight.parts], dim=-1)
        return out if bias is None else out + bias
    if isinstance(weight, QuantizedWeight):
        return quant_linear(x, weight, bias)
    if x.device.type != "cpu":     # on GPUs inductor fuses and picks the GEMM itself
        return F.linear(x, weight, bias)
    out = direct.dense_linear(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def embedding(ids: torch.Tensor, table, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of an embedding table: dense in `dtype`, or kept quantized (only the looked-up rows are
    dequantized, to the values a dense table in `dtype` would hold)."""
    if isinstance(table, QuantizedWeight):
        return quant_rows(table, ids, dtype)
    return F.embedding(ids, table)


def weight_nbytes(weight) -> int:
    if isinstance(weight, LinearParts):
        return sum(map(weight_nbytes, weight.parts))
    if isinstance(weight, QuantizedWeight):
        return weight.nbytes
    return weight.numel() * weight.element_size()


def _to_bits(weight, bits: int, group_size: int) -> QuantizedWeight:
    if isinstance(weight, QuantizedWeight):
        if weight.bits == bits or (weight.bits, bits) == (4, 8):   # int4 values 0..15 fit int8 as they are
            return weight.with_bits(bits)
        weight = weight.dequantize()
    quantize = quantize_int8 if bits == 8 else quantize_int4
    return quantize(weight.float(), group_size)


class LinearLoader:
    """Reads linear weights from a checkpoint in the format `mode` asks for; counts what it made."""

    def __init__(self, ckpt, dtype: torch.dtype, device: torch.device, mode: str = "auto", group_size: int = 32):
        if mode not in MODES:
            raise ValueError(f"quantization {mode!r}: allowed are {', '.join(MODES)}")
        self.ckpt, self.dtype, self.device = ckpt, dtype, device
        self.mode, self.group_size = mode, group_size
        self.formats: Counter[str] = Counter()      # "int4 g32 asym" / "bfloat16" -> weights loaded
        # CPU weights live in huge pages: a decode step streams every one of them (engine/huge_pages.py)
        self._arena = HugePageArena() if device.type == "cpu" else None

    def _placed(self, weight):
        """`weight` with its tensors copied into the arena (on CPUs)."""
        if self._arena is None:
            return weight
        place = self._arena.place
        if isinstance(weight, LinearParts):
            return LinearParts(tuple(map(self._placed, weight.parts)))
        if isinstance(weight, QuantizedWeight):
            return replace(weight, qweight=place(weight.qweight), scales=place(weight.scales),
                           mins=None if weight.mins is None else place(weight.mins),
                           supers=None if weight.supers is None else place(weight.supers))
        return place(weight)

    def keeps_dense(self, names: list[str]) -> bool:
        return self.mode == "none" or (self.mode == "auto" and not any(map(self.ckpt.is_quantized, names)))

    def keeps_stored(self, name: str) -> bool:
        """Whether `name` loads as the checkpoint's own group form, unchanged."""
        return self.mode == "auto" and self.ckpt.is_quantized(name)

    def load(self, parts: list[tuple]):
        """The weight of the layer made of `parts` (name, out_features, in_features[, rows]), fused along
        the outputs in the given order; `rows` (int64 indices into the stored rows) takes those rows, in
        that order, of a tensor that holds more than this part (a query half of an interleaved q_proj)."""
        weights = [self.ckpt.get_linear(name, (n, k), self.dtype, *rows) for name, n, k, *rows in parts]
        if self.keeps_dense([name for name, *_ in parts]):
            dense = [w.dequantize().to(self.dtype) if isinstance(w, QuantizedWeight) else w for w in weights]
            self.formats[self._dense_format] += 1
            return self._placed((dense[0] if len(dense) == 1 else torch.cat(dense)).to(self.device))
        if self.mode == "auto" and all(isinstance(w, QuantizedWeight) for w in weights):
            runs = [QuantizedWeight.cat(list(run)) for _, run in groupby(weights, key=lambda w: w.bits)]
            self.formats.update(run.describe() for run in runs)
            return self._placed(runs[0] if len(runs) == 1 else LinearParts(tuple(runs)))
        bits = 4 if self.mode == "int4" else 8
        fused = QuantizedWeight.cat([_to_bits(w, bits, self.group_size) for w in weights])
        self.formats[fused.describe()] += 1
        return self._placed(fused)

    def assemble(self, parts: list[tuple]):
        """A hybrid layer's weight from `parts` as `load` takes them: stored quantized (a GGUF's group form),
        it loads as `load` makes it; stored dense, the parts are joined dense and `adopt`ed."""
        if any(self.ckpt.is_quantized(name) for name, *_ in parts):
            return self.load(parts)
        return self.adopt(torch.cat([self.ckpt.get_linear(name, (n, k), self.dtype, *rows)
                                     for name, n, k, *rows in parts]).to(self.device))

    def embedding_and_head(self, vocab: int, hidden: int, tied: bool) -> tuple:
        """(embedding table, output head). Under `auto` a table stored quantized stays so: lookups dequantize
        their rows to what the dense table holds, which is then never read (933 MB of fp32 for a 151936 x
        1536 vocabulary); tied, the same table is the head."""
        table = "model.embed_tokens.weight"
        head = table if tied else "lm_head.weight"
        if tied and self.keeps_dense([head]):
            embed = self._placed(self.ckpt.get(table, (vocab, hidden), self.dtype).to(self.device))
            return embed, embed                                 # one copy serves both
        if tied and self.keeps_stored(head):
            embed = self.load([(head, vocab, hidden)])
            return embed, embed
        embed = (self.ckpt.get_linear(table, (vocab, hidden), self.dtype) if self.keeps_stored(table)
                 else self.ckpt.get(table, (vocab, hidden), self.dtype).to(self.device))
        return embed, self.load([(head, vocab, hidden)])

    def adopt(self, dense: torch.Tensor):
        """A weight the model assembled itself from dense checkpoint tensors (rows regrouped or
        de-interleaved, as the hybrid layers do) in the run's format: dense unless `mode` is int8
        or int4, which quantize it as `load` would (an input width that is no multiple of the
        group size stays dense; `describe` counts it so)."""
        if self.mode in ("int8", "int4") and dense.shape[-1] % self.group_size == 0:
            weight = _to_bits(dense, 8 if self.mode == "int8" else 4, self.group_size)
            self.formats[weight.describe()] += 1
            return self._placed(weight)
        self.formats[self._dense_format] += 1
        return self._placed(dense)

    @property
    def _dense_format(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def all_quantized(self) -> bool:
        """Whether every linear weight loaded is quantized (embedding lookups do not count)."""
        return bool(self.formats) and self._dense_format not in self.formats

    def describe(self) -> str:
        """What was loaded, for /props and the console: "int4 g32x8 asym x84, int8 g32 sym x15"."""
        return ", ".join(f"{name} x{count}" for name, count in self.formats.most_common())

"""Merging partial attention states computed over disjoint sets of keys.

When the key wire is split across devices, each device ends with a partial
state for its keys and the states must be combined.  The rule comes from the
normaliser's streaming accumulator (background, section 1):

* softmax family: a partial state is (O_j, lse_j), O_j already normalised over
  the keys of part j and lse_j their log-sum-exp.  The merged state is
      lse = log sum_j exp(lse_j),   O = sum_j exp(lse_j - lse) O_j.
  It is computed in the overflow-safe form: subtract m = max_j lse_j before
  exponentiating, so every weight is <= 1 and nothing overflows.  A row whose
  keys are all masked in every part (all lse_j = -inf) merges to O = 0 and
  lse = -inf, the language's convention, never NaN.
* sum family (sigmoid attention and other normalisers without a denominator
  over the keys): O = sum_j O_j, no lse.

States must be in fp32 or fp64: merging bf16 partial outputs is a known source
of error build-up in other libraries, so it is refused here.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

NEG_INF = float("-inf")
_STATE_DTYPES = (torch.float32, torch.float64)


def _check_dtype(t: torch.Tensor, what: str) -> None:
    if t.dtype not in _STATE_DTYPES:
        raise ValueError(f"partial {what} must be float32 or float64 to merge, not {t.dtype}")


def merge_softmax(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge k partial softmax states stacked along dim 0.

    ``outs`` is [k, *rows, *value], ``lses`` is [k, *rows]; the trailing
    dimensions of ``outs`` beyond ``lses``'s are the value wires (d).
    """
    _check_dtype(outs, "outputs")
    _check_dtype(lses, "log-sum-exps")
    if outs.shape[: lses.dim()] != lses.shape:
        raise ValueError(f"partial outputs {tuple(outs.shape)} do not match log-sum-exps {tuple(lses.shape)}")
    m = lses.amax(0)
    # a row with no visible key anywhere has m = -inf: shift by 0 instead, so
    # every weight is exp(-inf) = 0 and the sum below is exactly 0
    shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lses - shift)                     # each <= 1: no overflow
    total = w.sum(0)
    lse = shift + torch.log(total)                   # log(0) = -inf for dead rows
    extra = outs.dim() - lses.dim()
    wv = w.reshape(w.shape + (1,) * extra)
    num = (wv * outs).sum(0)
    tv = total.reshape(total.shape + (1,) * extra)
    out = torch.where(tv > 0, num / torch.where(tv > 0, tv, torch.ones_like(tv)), torch.zeros_like(num))
    return out, lse


def merge_sum(outs: torch.Tensor) -> torch.Tensor:
    """Merge k partial sum-family outputs stacked along dim 0."""
    _check_dtype(outs, "outputs")
    return outs.sum(0)


def merge(outs: Sequence[torch.Tensor], lses: Optional[Sequence[torch.Tensor]]):
    """Merge a list of partial states: (O, lse) for the softmax family
    (``lses`` given), (O, None) for the sum family."""
    if lses is None:
        return merge_sum(torch.stack(list(outs))), None
    return merge_softmax(torch.stack(list(outs)), torch.stack(list(lses)))


def partial_weight(lse_part: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(lse_j - lse): the share of the merged output a partial state holds
    (used by the backward pass).  0 where the partial saw no key, and on rows
    whose merged lse is -inf (no key at all, or padding rows)."""
    dead = torch.isneginf(lse_part) | torch.isneginf(lse)
    diff = torch.where(dead, torch.zeros_like(lse_part), lse_part - lse)
    return torch.where(dead, torch.zeros_like(lse_part), torch.exp(diff))

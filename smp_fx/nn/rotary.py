"""Rotary position embeddings (RoPE) as SMP's GPT-NeoX (halves) and GPT-J (interleaved)
replacements apply them; the angles are built in fp32 for the sequence at hand, as a
tensor op, because an fx trace sees a symbolic length.
"""

from __future__ import annotations

import torch


def angles(seq: torch.Tensor, dim: int, base: float, interleaved: bool
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[S, dim]``, for the positions ``seq`` (``arange(S)``)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64,
                                            device=seq.device).float() / dim))
    theta = seq.float()[:, None] * inv_freq[None, :]
    if interleaved:
        theta = torch.repeat_interleave(theta, 2, dim=-1)
    else:
        theta = torch.cat([theta, theta], dim=-1)
    return theta.cos(), theta.sin()


def _rotated(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          interleaved: bool) -> torch.Tensor:
    """``x`` (``[N, heads, S, d]``) with its first ``cos.shape[-1]`` features rotated."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    rot = rot * cos.to(x.dtype) + _rotated(rot, interleaved) * sin.to(x.dtype)
    return torch.cat([rot, rest], dim=-1)


__all__ = ["angles", "apply"]

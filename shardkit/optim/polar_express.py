"""Muon with the Polar Express orthogonalization: a second matrix optimizer on the same transport.

Polar Express (Amsel, Persson, Musco, Gower, 2025) replaces Newton-Schulz's one fixed
quintic by a different quintic per iteration, each chosen to bring the singular values
closer to 1 in the fewest steps. Everything else is Muon's: the momentum on the shards, the
owners and the all-to-alls of ``owners.py``, the update; only ``orthogonalize`` (and its
cost, the same products per iteration) differs.
"""

from __future__ import annotations

import torch

from shardkit.optim.muon import Muon

# Per-iteration (a, b, c) of Polar Express, as modded-nanogpt uses them: each but the last
# divided by a safety factor (1.01, 1.01^3, 1.01^5); iterations past the list repeat the last.
_COEFFICIENTS = [
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
]
COEFFICIENTS = [(a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in _COEFFICIENTS[:-1]] + [_COEFFICIENTS[-1]]


def polar_express(matrix: torch.Tensor, steps: int, eps: float) -> torch.Tensor:
    """The Polar Express approximation of ``matrix``'s polar factor (bf16 result)."""
    x = matrix.bfloat16()
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T  # (n, m), n <= m
    x = x / (x.norm() * 1.01 + eps)
    for a, b, c in COEFFICIENTS[:steps] + [COEFFICIENTS[-1]] * max(0, steps - len(COEFFICIENTS)):
        gram = x @ x.T  # (n, n)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class PolarExpress(Muon):
    """``shardkit.optim.Muon`` with Polar Express in place of Newton-Schulz (``ns_steps``
    iterations; ``ns_coefficients`` is not used). The same constructor and sharding."""

    def orthogonalize(self, matrix: torch.Tensor, opt_group: dict) -> torch.Tensor:
        return polar_express(matrix, opt_group["ns_steps"], opt_group["eps"])

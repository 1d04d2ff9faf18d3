"""A fixed random projection of adapter gradients: a count sketch, so that many gradients can be kept and compared.

A probe keeps one gradient per (arm, repeat, trajectory); SD3.5-Medium's rank-32 LoRA has about 1.9e7 parameters, so
they are compressed to ``dim`` numbers by y[h(i)] += s(i)·x[i], with a bucket h(i) and a sign s(i) fixed per
coordinate by the seed. Inner products are unbiased, E⟨Sx, Sy⟩ = ⟨x, y⟩, with variance at most
2·‖x‖²‖y‖²/dim (Charikar et al., 2002; Weinberger et al., 2009): the inner-product distortion is about
‖x‖‖y‖·√(2/dim). It costs one pass over x (no dim × P matrix), and :func:`measured_distortion` states its size on
the vectors at hand.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tpflow.devices import cpu_generator


class CountSketch:
    """S: R^numel -> R^dim, fixed by ``seed``.

    Args:
        numel: P, the length of the vectors projected (the adapter's parameter count).
        dim: d, the length of the projections.
        seed: draws the buckets and signs (on a CPU generator: the same S on every machine).
    """

    def __init__(self, numel: int, dim: int, seed: int = 0) -> None:
        if numel < 1 or dim < 1:
            raise ValueError(f"numel and dim must be >= 1, got {numel} and {dim}.")
        generator = cpu_generator(seed)
        self.numel, self.dim = numel, dim
        self.bucket = torch.randint(dim, (numel,), generator=generator, device="cpu")  # [P] h(i)
        self.sign = torch.randint(2, (numel,), generator=generator, device="cpu").to(torch.int8) * 2 - 1  # [P] s(i)

    def __call__(self, x: Tensor) -> Tensor:
        """[..., P] -> [..., d] float64 (on x's device)."""
        if x.shape[-1] != self.numel:
            raise ValueError(f"the sketch projects vectors of length {self.numel}, got shape {tuple(x.shape)}.")
        signed = x.double() * self.sign.to(x.device)
        out = signed.new_zeros((*x.shape[:-1], self.dim))
        return out.index_add_(-1, self.bucket.to(x.device), signed)


def measured_distortion(sketch: CountSketch, vectors: Tensor) -> float:
    """The largest |⟨Sx, Sy⟩ − ⟨x, y⟩| / (‖x‖‖y‖) over the pairs (the same vector twice included) of ``vectors``
    [n, P]: the distortion a probe's cosines and inner products carry, as measured, to state beside them."""
    exact = vectors.double() @ vectors.double().T  # [n, n]
    sketched = sketch(vectors)
    approx = sketched @ sketched.T
    norms = exact.diagonal().clamp(min=1e-300).sqrt()
    return float(((approx - exact).abs() / (norms[:, None] * norms[None, :])).max())

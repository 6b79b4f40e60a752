"""Compressed K/V codecs: the TurboQuant "hb" codec (signs, Hadamard, norm, Lloyd-Max indices) and FP8 e4m3.

TurboQuant stores each (position, head) vector of length D as D one-byte codebook indices plus one fp32 L2 norm.
The vector is first multiplied by a fixed random-sign table and a normalised Walsh–Hadamard transform; that map is
orthogonal, so its output is close to N(0, ‖x‖²/D) per channel whatever the input's structure, and a codebook
optimal for N(0, 1) fits every head. Attention runs in the rotated domain: ⟨HDq, HDk⟩ = ⟨q, k⟩, so q is rotated
the same way and the attention output is rotated back once.

The codebooks are the exact Lloyd-Max optimum for N(0, 1), derived here (8-bit endpoints ±4.6035, 8-bit round-trip
NRMSE ≈ 0.0065); the reference system's shipped tables differ (±5.0653), so every stored form carries the codebook in
its fingerprint and a different table never reads another's codes.

FP8 stores each vector as e4m3 values with one power-of-two scale per (position, head), kept as its 8-bit exponent
(E8M0, as the OCP MX formats keep theirs): one side byte where an fp32 scale took four, and dividing by the scale
rounds nothing, so the only rounding is e4m3's.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import lru_cache

import torch

# The D1 sign table of the system we re-implement (32 bytes, 256 signs): element j is negated iff bit (j & 7) of
# byte j >> 3 is set, bits read LSB first. Smaller power-of-two head dims use its first D signs.
SIGN_TABLE_256 = bytes.fromhex("a73b91f46dc2580eb37f24d68945ea1c63afd852970be13d76c419fe4a852cdb")
TQ_BITS = (8, 6, 5)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_ZERO_NORM = 1e-10


def sign_vector(head_dim: int) -> torch.Tensor:
    """The ±1 fp32 signs of the D1 table for `head_dim` channels."""
    if head_dim < 1 or head_dim & (head_dim - 1) or head_dim > 8 * len(SIGN_TABLE_256):
        raise ValueError(f"the TurboQuant codec needs a power-of-two head_dim ≤ 256, got {head_dim}")
    bits = [(SIGN_TABLE_256[j >> 3] >> (j & 7)) & 1 for j in range(head_dim)]
    return torch.tensor([-1.0 if b else 1.0 for b in bits], dtype=torch.float32)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Normalised fast Walsh–Hadamard transform over the last dim (Sylvester order); orthonormal and involutory."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        pairs = y.reshape(-1, d // (2 * h), 2, h)  # [rows, blocks, (a, b), h]
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, d)
        h *= 2
    return (y * (1.0 / math.sqrt(d))).reshape(*lead, d)


def _normal_pdf(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _cell_mass(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    # Tail cells are measured on the side where the cdf difference does not cancel.
    upper = torch.special.ndtr(-lo) - torch.special.ndtr(-hi)
    lower = torch.special.ndtr(hi) - torch.special.ndtr(lo)
    return torch.where(lo >= 0, upper, lower)


def _x_pdf(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(x), torch.zeros_like(x), x * _normal_pdf(x))


def _cells(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inf = torch.tensor([math.inf], dtype=c.dtype)
    mid = (c[1:] + c[:-1]) / 2
    return torch.cat([-inf, mid]), torch.cat([mid, inf])


def lloyd_max_normal(levels: int, tol: float = 1e-11) -> torch.Tensor:
    """The Lloyd-Max (MSE-optimal) codebook of `levels` centroids for N(0, 1), fp64, sorted.

    Solves the fixed point c = centroid(cells(c)) on the exact density by Newton's method (plain Lloyd iterations
    need ~10⁵ steps at 256 levels), starting from the companding law's points (quantiles of N(0, 3)).
    """
    p = (torch.arange(levels, dtype=torch.float64) + 0.5) / levels
    c = math.sqrt(6.0) * torch.special.erfinv(2 * p - 1)
    for _ in range(100):
        lo, hi = _cells(c)
        mass = _cell_mass(lo, hi)
        m = (_normal_pdf(lo) - _normal_pdf(hi)) / mass
        residual = c - m
        if residual.abs().max().item() < tol:
            return c
        # ∂m_i/∂hi = φ(hi)(hi − m_i)/M_i and ∂m_i/∂lo = φ(lo)(m_i − lo)/M_i; hi, lo are midpoints of neighbours.
        d_hi = torch.where(torch.isinf(hi), torch.zeros_like(hi), _normal_pdf(hi) * (hi - m) / mass) / 2
        d_lo = torch.where(torch.isinf(lo), torch.zeros_like(lo), _normal_pdf(lo) * (m - lo) / mass) / 2
        jac = torch.eye(levels, dtype=torch.float64) - torch.diag(d_hi + d_lo)
        jac -= torch.diag(d_hi[:-1], 1) + torch.diag(d_lo[1:], -1)
        c = c - torch.linalg.solve(jac, residual)
        c = (c - c.flip(0)) / 2  # the density is symmetric; keep the codebook exactly so
    raise RuntimeError(f"Lloyd-Max for {levels} levels did not converge to {tol}")


@lru_cache(maxsize=None)
def codebook(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(centroids [2^bits], boundaries [2^bits − 1]) in fp32 for a TurboQuant width; boundaries are midpoints."""
    if bits not in TQ_BITS:
        raise ValueError(f"TurboQuant codebook width must be one of {TQ_BITS}, got {bits}")
    c = lloyd_max_normal(1 << bits)
    return c.float(), ((c[1:] + c[:-1]) / 2).float()


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class TurboQuantCodec:
    """The hb codec for one head_dim and codebook width: u8 index per channel + one fp32 norm per vector."""

    head_dim: int
    bits: int = 8
    side_dtype = torch.float32

    def __post_init__(self):
        sign_vector(self.head_dim)
        codebook(self.bits)

    @property
    def name(self) -> str:
        return f"tq{self.bits}"

    @property
    def signs(self) -> torch.Tensor:
        return sign_vector(self.head_dim)

    @property
    def centroids(self) -> torch.Tensor:
        return codebook(self.bits)[0]

    @property
    def sign_table_id(self) -> str:
        """Identity of the sign table: a digest of the signs actually used."""
        return _digest(SIGN_TABLE_256[: max(1, self.head_dim // 8)], str(self.head_dim).encode())

    @property
    def fingerprint(self) -> str:
        """Identity of the stored format: name, head_dim, sign table and the exact fp32 codebook bytes."""
        cb = self.centroids.numpy().tobytes()
        return _digest(f"{self.name}:{self.head_dim}:{self.sign_table_id}".encode(), cb)

    def bytes_per_vector(self) -> int:
        return self.head_dim + 4

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x ↦ H(s ⊙ x)/√D in fp32 over the last dim (applied to q, k and v)."""
        return fwht(x.float() * self.signs.to(x.device))

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """y ↦ s ⊙ (H y/√D): the inverse of `rotate`."""
        return fwht(y.float()) * self.signs.to(y.device)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., D] → (u8 indices [..., D], fp32 norms [...]); an all-zero vector stores norm 0."""
        y = self.rotate(x)
        norms = torch.linalg.vector_norm(y, dim=-1)
        scale = torch.where(norms > _ZERO_NORM, math.sqrt(self.head_dim) / norms, torch.zeros_like(norms))
        z = y * scale.unsqueeze(-1)
        # #{boundaries b : z > b}: bucketize counts boundaries strictly below z, so ties go to the lower index.
        idx = torch.bucketize(z, codebook(self.bits)[1].to(z.device), right=False)
        return idx.to(torch.uint8), norms

    def decode_rotated(self, codes: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        """(indices, norms) → the rotated-domain vectors C[idx]·n/√D in fp32."""
        c = self.centroids.to(codes.device)[codes.long()]
        return c * (norms / math.sqrt(self.head_dim)).unsqueeze(-1)

    def decode(self, codes: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        return self.unrotate(self.decode_rotated(codes, norms))


@dataclass(frozen=True)
class Fp8Codec:
    """FP8 e4m3 values with one E8M0 scale per vector: scale = 2^ceil(log2(amax/448)), the smallest power of two
    that puts amax at or below 448 (so the largest value lands in (224, 448]); a zero vector stores scale 1.

    The exponent is found from amax's bits alone (integer arithmetic, no rounding), so every device and the Triton
    store find the same one. Against an amax/448 scale the relative rounding of each value is the same (a power of
    two moves no mantissa bit); what is lost is up to one bit of headroom at the bottom of the range: e4m3's
    subnormal step times the scale, at most twice what it was, bounds the error of values below 2^-6 · scale."""

    head_dim: int
    name: str = "fp8"
    side_dtype = torch.uint8

    @property
    def fingerprint(self) -> str:
        return _digest(f"fp8_e4m3fn:{self.head_dim}:e8m0 scale 2^ceil(log2(amax/{FP8_MAX}))".encode())

    def bytes_per_vector(self) -> int:
        return self.head_dim + 1

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., D] → (e4m3 values [..., D], biased scale exponents u8 [...]: scale = 2^(e − 127))."""
        x = x.float()
        amax = x.abs().amax(dim=-1)
        exponent = fp8_scale_exponent(amax)
        inverse = ((254 - exponent) << 23).view(torch.float32)  # 1/scale, exactly
        return (x * inverse.unsqueeze(-1)).to(torch.float8_e4m3fn), exponent.to(torch.uint8)

    def decode(self, values: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
        return values.float() * fp8_scale(exponents).unsqueeze(-1)


def fp8_scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The biased E8M0 exponent (int32, in [1, 248]) of the smallest power of two s with amax ≤ 448·s; 127 (s = 1)
    for amax 0. With amax = m·2^E (m in [1, 2)) and 448 = 1.75·2^8: s = 2^(E−8) when m ≤ 1.75, else 2^(E−7).
    Clamped below at 2^-126 (fp32's smallest normal), which only vectors of amax ≤ 448·2^-127 reach."""
    bits = amax.float().view(torch.int32)
    exponent = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    return torch.where(amax > 0, exponent.clamp(min=1), torch.full_like(exponent, 127))


def fp8_scale(exponents: torch.Tensor) -> torch.Tensor:
    """fp32 scales 2^(e − 127) of biased E8M0 exponents (1 ≤ e ≤ 254)."""
    return (exponents.to(torch.int32) << 23).view(torch.float32)


def tq_attention(q: torch.Tensor, k: tuple[torch.Tensor, torch.Tensor], v: tuple[torch.Tensor, torch.Tensor],
                 codec: TurboQuantCodec, scale: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over TurboQuant K/V computed in the rotated domain (the CPU reference of the compressed kernels).

    q [T, Hq, D] (any float dtype); k, v = (codes [S, Hkv, D] u8, norms [S, Hkv] fp32); mask [T, S] bool, True
    where a query may attend (None: all). Scores use ⟨rotate(q), C[k_idx]·n/√D⟩; the output o' is un-rotated once.
    Returns fp32 [T, Hq, D].
    """
    t, hq, d = q.shape
    hkv = k[0].shape[1]
    qr = codec.rotate(q).reshape(t, hkv, hq // hkv, d)  # [T, Hkv, G, D]
    kr = codec.decode_rotated(*k)  # [S, Hkv, D]
    vr = codec.decode_rotated(*v)
    scores = torch.einsum("thgd,shd->hgts", qr, kr) * scale  # [Hkv, G, T, S]
    if mask is not None:
        scores = scores.masked_fill(~mask.to(scores.device), float("-inf"))
    out = torch.einsum("hgts,shd->thgd", torch.softmax(scores, dim=-1), vr)
    return codec.unrotate(out.reshape(t, hq, d))

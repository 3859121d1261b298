"""torch's CPU bfloat16 matrix product, bit for bit, several times faster.

torch.optim.Muon runs Newton–Schulz in bfloat16. On a CPU without native
bfloat16 matrix units (no AVX512-BF16 / AMX: oneDNN is not used), torch
multiplies two row-major bfloat16 matrices with its reference loop
(``gemm_notrans_`` in ATen's ``cpu/BlasKernel.cpp``), one scalar dot
product at a time: 0.3 GFLOP/s here, 25x slower than float32, and most of
Muon's step. That loop's arithmetic is fixed: each output element is the
sum of ``k`` float32 products (exact: bfloat16 x bfloat16 fits float32) in
4 interleaved partial sums (``l mod 4``, each in order of ``l``) added
``((s0 + s1) + s2) + s3``; ``addmm`` then takes ``fma(beta, c, alpha *
dot)`` and rounds to bfloat16. :func:`addmm` reproduces that order with
whole-matrix float32 operations (one ``addcmul_`` per 4 values of ``l``),
so the result is the same bits, computed 3-7x faster.

Used only where it was checked to give torch's bits on this machine
(:func:`reproduces_torch`, once per process) and only for the operand
layout that reaches the loop (both operands contiguous, on the CPU);
everything else is ``torch.addmm`` itself.
"""
import functools
import torch

PARTIAL_SUMS = 4  # the reference loop's interleaved accumulators


def reference_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in float32, summed in the reference loop's order."""
    k = a.size(1)
    whole = k - k % PARTIAL_SUMS
    a32, b32 = a.float(), b.float()
    sums = a32.new_zeros((PARTIAL_SUMS, a.size(0), b.size(1)))
    cols = a32[:, :whole].T.reshape(-1, PARTIAL_SUMS, a.size(0), 1)
    rows = b32[:whole].reshape(-1, PARTIAL_SUMS, 1, b.size(1))
    for col, row in zip(cols, rows):
        sums.addcmul_(col, row)  # the products are exact: one rounding
    for index in range(whole, k):
        sums[0].addcmul_(a32[:, index, None], b32[index, None, :])
    return sum(sums[1:], sums[0])  # ((s0 + s1) + s2) + s3


def emulated_addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   beta: float = 1.0, alpha: float = 1.0) -> torch.Tensor:
    """The reference loop's ``beta * c + alpha * (a @ b)`` in bfloat16."""
    scaled = reference_dot(a, b) * torch.tensor(alpha, dtype=torch.float32)
    # fma(beta, c, scaled): beta (float32) times c (bfloat16) is exact in
    # float64, so one float64 addition rounds as the fused operation.
    beta32 = float(torch.tensor(beta, dtype=torch.float32))
    return (c.double() * beta32 + scaled.double()).float().bfloat16()


@functools.lru_cache(maxsize=None)
def reproduces_torch() -> bool:
    """Whether :func:`emulated_addmm` gives torch's bits on this machine
    (checked on uneven shapes)."""
    gen = torch.Generator().manual_seed(0)
    for m, k, n in ((96, 203, 80), (128, 128, 128)):
        a, b, c = (torch.randn(shape, generator=gen).bfloat16()
                   for shape in ((m, k), (k, n), (m, n)))
        for beta, alpha in ((-4.775, 2.0315), (3.4445, 1.0)):
            if not torch.equal(
                    emulated_addmm(c, a, b, beta, alpha),
                    torch.addmm(c, a, b, beta=beta, alpha=alpha)):
                return False
    return True


def addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
          beta: float = 1.0, alpha: float = 1.0) -> torch.Tensor:
    """``torch.addmm(c, a, b, beta=beta, alpha=alpha)``: the same bits,
    faster where torch would run its reference loop."""
    if a.dtype == b.dtype == torch.bfloat16 and a.device.type == 'cpu' \
            and a.is_contiguous() and b.is_contiguous() \
            and reproduces_torch():
        return emulated_addmm(c, a, b, beta, alpha)
    return torch.addmm(c, a, b, beta=beta, alpha=alpha)

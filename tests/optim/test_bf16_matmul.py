"""mmpar.optim.bf16_matmul gives torch's CPU bfloat16 ``addmm`` bit for bit,
on shapes where float32 rounded to bfloat16 does not."""
import re

import pytest
import torch

from mmpar.optim.bf16_matmul import addmm, emulated_addmm, reproduces_torch


def _native_bf16_cpu() -> bool:
    """A CPU whose torch bfloat16 products go to oneDNN, not the loop."""
    try:
        with open('/proc/cpuinfo') as f:
            flags = f.read()
    except OSError:
        return True
    return bool(re.search(r'\b(avx512_bf16|amx_bf16)\b', flags))


@pytest.mark.skipif(_native_bf16_cpu(), reason='torch uses oneDNN here')
@pytest.mark.parametrize('m,k,n', [(96, 97, 200), (96, 255, 128)])
def test_emulated_addmm_is_torchs_bits(m, k, n):
    gen = torch.Generator().manual_seed(1)
    a, b, c = (torch.randn(shape, generator=gen).bfloat16()
               for shape in ((m, k), (k, n), (m, n)))
    beta, alpha = 3.4445, -4.775
    expected = torch.addmm(c, a, b, beta=beta, alpha=alpha)
    assert torch.equal(emulated_addmm(c, a, b, beta, alpha), expected)
    assert torch.equal(addmm(c, a, b, beta, alpha), expected)
    assert reproduces_torch()
    # The shapes tell the summation orders apart.
    plain = (beta * c.float() + alpha * (a.float() @ b.float())).bfloat16()
    assert not torch.equal(plain, expected)


def test_other_layouts_are_torchs_own():
    """A transposed operand reaches another torch kernel (a vectorised dot
    product, another summation order): left to torch."""
    gen = torch.Generator().manual_seed(2)
    a = torch.randn((96, 255), generator=gen).bfloat16()
    c = torch.randn((96, 96), generator=gen).bfloat16()
    assert torch.equal(addmm(c, a, a.T, 2.0, 0.5),
                       torch.addmm(c, a, a.T, beta=2.0, alpha=0.5))

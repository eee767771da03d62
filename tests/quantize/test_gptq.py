"""GPTQ on one layer: less output error than round-to-nearest on inputs like the calibration ones,
act order without a permuted layout, and dampening that grows until the Cholesky succeeds."""

from __future__ import annotations

import pytest
import torch

from kvforge.quantization.quantized_weight import quantize_rtn
from kvforge.quantize.gptq import gptq_quantize, inverse_hessian_factor


def _correlated_inputs(num_rows: int, width: int, seed: int) -> torch.Tensor:
    """Samples (by seed) of one distribution: correlated features, four of them ten times larger."""
    mixing = torch.randn(width, width, generator=torch.Generator().manual_seed(0)) / width**0.5
    generator = torch.Generator().manual_seed(seed)
    scales = torch.ones(width)
    scales[torch.randperm(width, generator=torch.Generator().manual_seed(0))[:4]] = 10  # outlier channels
    return (torch.randn(num_rows, width, generator=generator) @ mixing) * scales


@pytest.mark.parametrize("act_order", [False, True])
def test_output_error_below_rtn_on_held_out_inputs(act_order: bool) -> None:
    weight = torch.randn(96, 128, generator=torch.Generator().manual_seed(2))
    calibration = _correlated_inputs(2048, 128, seed=3)
    held_out = _correlated_inputs(512, 128, seed=4)  # same distribution, other samples
    hessian = 2 * calibration.t().double() @ calibration.double() / calibration.shape[0]
    gptq = gptq_quantize(weight, hessian, 4, 32, sym=False, act_order=act_order)
    rtn = quantize_rtn(weight, 4, 32, sym=False)
    reference = held_out @ weight.t()

    def error(w: torch.Tensor) -> float:
        return (held_out @ w.t() - reference).pow(2).mean().item()

    assert gptq.perm is None and torch.equal(gptq.g_idx(), torch.arange(128, dtype=torch.int32) // 32)
    assert error(gptq.dequantize()) < 0.7 * error(rtn.dequantize())


def test_dampening_grows_until_the_factor_exists() -> None:
    # An eigenvalue of -5% of the mean diagonal (as rounding leaves in a Hessian from few tokens): the
    # default 1% dampening leaves it negative, 10% does not.
    basis, _ = torch.linalg.qr(torch.randn(64, 64, dtype=torch.float64))
    eigenvalues = torch.ones(64, dtype=torch.float64)
    eigenvalues[0] = -0.05
    hessian = basis @ torch.diag(eigenvalues) @ basis.t()
    assert torch.linalg.cholesky_ex(hessian + 0.01 * torch.eye(64, dtype=torch.float64)).info.item() != 0
    factor = inverse_hessian_factor(hessian, 0.01)
    assert torch.isfinite(factor).all() and torch.equal(factor, factor.triu())
    with pytest.raises(ValueError, match="not positive definite"):
        inverse_hessian_factor(-torch.eye(8, dtype=torch.float64), 0.01)

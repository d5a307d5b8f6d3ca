"""Reduced precision (``workers/models/precision.py``) on small real torch modules.

What the text model relies on: the precision name is checked against the device at load,
smoothing leaves the fp32 function unchanged, and int8 quantizes exactly the Linear layers
not kept fp32.
"""

from __future__ import annotations

import pytest
import torch

from workers.models.precision import (
    apply_precision,
    input_absmax,
    parse_precision,
    quantize_int8,
    resolve_int8_engine,
    smooth,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(
    ("value", "device", "expected"),
    [(None, CPU, "fp32"), ("FP32", CPU, "fp32"), ("int8", CPU, "int8"), ("fp16", CUDA, "fp16"),
     (" bf16 ", CUDA, "bf16")],
)  # fmt: skip
def test_precision_names(value: object, device: torch.device, expected: str) -> None:
    assert parse_precision(value, device) == expected


@pytest.mark.parametrize(
    ("value", "device", "words"),
    [("int4", CPU, "must be one of"), ("int8", CUDA, "on CUDA use fp16 or bf16"),
     ("fp16", CPU, "needs a CUDA device"), ("bf16", CPU, "needs a CUDA device")],
)  # fmt: skip
def test_precision_refused_with_the_fix(value: str, device: torch.device, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_precision(value, device)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16), torch.nn.LayerNorm(16)
    )
    return m.eval().requires_grad_(False)


def _inputs() -> torch.Tensor:
    torch.manual_seed(1)
    x = torch.randn(32, 16)
    x[:, 3] *= 40.0  # one outlier channel, as transformers have
    return x


def test_smoothing_keeps_the_fp32_function() -> None:
    m, x = _mlp(), _inputs()
    amax = input_absmax(m, [lambda mod: mod(x)])
    assert set(amax) == {"0", "2"} and amax["0"][3] > 10 * amax["0"][0]
    s = smooth(m, amax, 0.8)
    with torch.inference_mode():
        assert torch.allclose(s(x), m(x), atol=1e-5)
    assert type(s[0]).__name__ == "_Smoothed" and isinstance(m[0], torch.nn.Linear)  # a copy
    with pytest.raises(ValueError, match="alpha"):
        smooth(m, amax, 0.0)


def test_int8_quantizes_what_is_not_kept_fp32() -> None:
    m, x = _mlp(), _inputs()
    q = quantize_int8(m, [lambda mod: mod(x)], keep_fp32=r"2")
    kinds = {n: type(mod).__module__ + "." + type(mod).__name__ for n, mod in q.named_modules()}
    assert "quantized" in kinds["0.linear"] and kinds["2"] == "torch.nn.modules.linear.Linear"
    with torch.inference_mode():
        ref, out = m(x), q(x)
    cos = torch.nn.functional.cosine_similarity(ref, out, dim=1)
    assert float(cos.min()) > 0.99  # close to fp32, not equal to it
    assert not torch.equal(ref, out)


def test_int8_options_refused() -> None:
    with pytest.raises(ValueError, match="keeps every Linear"):
        quantize_int8(_mlp(), keep_fp32=r"\d")
    with pytest.raises(ValueError, match="pattern"):
        quantize_int8(_mlp(), keep_fp32="(")


def test_fp32_is_the_model_itself() -> None:
    m = _mlp()
    assert apply_precision(m, "fp32") is m


def test_int8_engine_auto_is_onednn_where_the_cpu_has_int8_dot_products() -> None:
    default = torch.backends.quantized.engine
    has_onednn = "onednn" in torch.backends.quantized.supported_engines
    for flags in (["avx2", "avx512f", "avx512_vnni"], ["avx2", "avx_vnni"], ["amx_int8"]):
        assert resolve_int8_engine("auto", flags) == ("onednn" if has_onednn else default)
    assert resolve_int8_engine("auto", ["avx2", "fma"]) == default  # no int8 dot products
    assert resolve_int8_engine("auto", []) == default


def test_int8_engine_named_is_kept_or_refused() -> None:
    for engine in torch.backends.quantized.supported_engines:
        assert resolve_int8_engine(engine, []) == engine
    with pytest.raises(ValueError, match="not one of this torch's"):
        resolve_int8_engine("tpu-int8", [])

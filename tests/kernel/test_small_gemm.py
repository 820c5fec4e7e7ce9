"""The split-K GEMM (kernels/small_gemm.py, interpreted on the CPU) against torch.mm, and its
config rule. The interpreter computes bf16 wrongly: half precision is checked in float16 here and
bf16 in tests/kernel/test_small_gemm_gpu.py."""
import pytest
import torch

from kernels.small_gemm import M_MAX, SplitKConfig, max_tiles, new_counters, pick_config, splitk_linear

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
COUNTERS = 64  # enough for every tile count below


def _problem(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w, b


def _expected(x, w, b) -> torch.Tensor:
    y = torch.mm(x.float(), w.float().t())
    return y if b is None else y + b.float()


# (m, n, k, config): M = 1, M not a multiple of BLOCK_M, N not a multiple of BLOCK_N, K not a
# multiple of BLOCK_K (a short last split), splits that leave the last split shorter, no split.
CASES = [
    (1, 64, 512, SplitKConfig(16, 64, 128, splits=2)),
    (5, 64, 1024, SplitKConfig(16, 64, 128, splits=8)),
    (37, 96, 640, SplitKConfig(16, 32, 64, splits=3)),
    (20, 64, 1000, SplitKConfig(32, 64, 128, splits=4)),
    (70, 40, 384, SplitKConfig(64, 32, 64, splits=5)),
    (33, 64, 256, SplitKConfig(32, 64, 64, splits=1)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, n, k, config", CASES)
def test_matches_torch_mm(m, n, k, config, dtype):
    x, w, b = _problem(m, n, k, dtype, bias=m % 2 == 1)
    counters = torch.zeros(COUNTERS, dtype=torch.int32)
    out = splitk_linear(x, w, b, counters, config)
    assert out.dtype == dtype and out.shape == (m, n)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), _expected(x, w, b), atol=tol * 10, rtol=tol)
    assert counters.count_nonzero() == 0  # every tile's last program puts its counter back


def test_strided_input_and_out_buffer():
    x, w, b = _problem(24, 64, 768, torch.float32, bias=True)
    wide = torch.zeros(24, 1000)
    wide[:, 100:868] = x
    out = torch.full((24, 64), float("nan"))
    got = splitk_linear(wide[:, 100:868], w, b, new_counters(64, "cpu"), pick_config(24, 64, 768), out=out)
    assert got is out
    torch.testing.assert_close(out, _expected(x, w, b), atol=1e-4, rtol=1e-5)


def test_repeated_calls_give_identical_results():
    """The partials are summed in split order whichever program is last: bit-equal calls."""
    x, w, b = _problem(9, 64, 1024, torch.float32, bias=False)
    counters = new_counters(64, "cpu")
    config = pick_config(9, 64, 1024)
    assert config.splits == 4
    first = splitk_linear(x, w, b, counters, config)
    assert torch.equal(first, splitk_linear(x, w, b, counters, config))


def test_config_splits_only_where_output_tiles_leave_sms_idle():
    # Qwen3-0.6B's o_proj and down at decode batches: K split until ~2 programs per SM.
    for n, k in ((1024, 2048), (1024, 3072)):
        for m in (1, 16, 64, 128, 176, 256, 512):
            config = pick_config(m, n, k, num_sms=132)
            assert config is not None and config.splits >= 2
            assert config.tiles(m, n) * config.splits <= 2 * 132
            assert config.k_per_split(k) % config.block_k == 0 and config.k_per_split(k) >= 256
    assert pick_config(176, 4096, 4096, num_sms=132) is None  # 192 output tiles fill 132 SMs already
    assert pick_config(M_MAX + 1, 1024, 2048) is None  # a prefill: cuBLAS's
    assert pick_config(16, 1024, 256) is None  # too little K to split
    assert max_tiles(1024) >= max(pick_config(m, 1024, 2048).tiles(m, 1024) for m in range(1, M_MAX + 1))


def test_bad_inputs_name_the_field():
    x, w, _ = _problem(4, 64, 256, torch.float32, bias=False)
    counters, config = new_counters(64, "cpu"), SplitKConfig(16, splits=2)
    with pytest.raises(ValueError, match=r"x.shape=\(4, 128\), weight.shape=\(64, 256\)"):
        splitk_linear(x[:, :128], w, None, counters, config)
    with pytest.raises(ValueError, match="x.dtype=torch.float16"):
        splitk_linear(x.half(), w, None, counters, config)
    with pytest.raises(ValueError, match=r"bias.shape=\(3,\)"):
        splitk_linear(x, w, torch.zeros(3), counters, config)
    with pytest.raises(ValueError, match=r"counters \(dtype torch.int64, 4 on cpu\) are invalid: int32 zeros, at least 1"):
        splitk_linear(x, w, None, torch.zeros(4, dtype=torch.int64), config)
    with pytest.raises(ValueError, match="out .* is invalid"):
        splitk_linear(x, w, None, counters, config, out=torch.empty(4, 32))
    with pytest.raises(ValueError, match="block_m=24 is invalid"):
        SplitKConfig(24)
    with pytest.raises(ValueError, match="splits=0 is invalid"):
        SplitKConfig(16, splits=0)

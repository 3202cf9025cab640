"""The weighted average at the heart of neighbor_allreduce, fused groups, pair_gossip and
win_update, against float64 numpy: convex weights (the lerp chain), other weights (mul +
add_), in place and into a new tensor, integers rounded."""
import numpy as np
import pytest
import torch

from bluefog_lite._tasks import weighted_sum

# (weights summing to 1 + 5e-10 are not convex: used as given, not normalized by the
# lerp chain, which would be off by 5e-10 relative)
CASES = [(0.5, [0.5]), (1 / 3, [1 / 3, 1 / 3]), (0.0, [0.5, 0.5]), (0.2, [0.3, 0.0, 0.5]),
         (0.25, [0.25, 0.25, 0.25]), (0.5, [0.7]), (-0.1, [1.1]), (1.0, []), (0.3, [0.3]),
         (0.4, [0.3, 0.3 + 5e-10]), (0.1, [0.1] * 9)]


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-6), (np.float64, 1e-14)])
@pytest.mark.parametrize("self_weight,weights", CASES)
@pytest.mark.parametrize("in_place", [False, True])
def test_matches_numpy(dtype, tol, self_weight, weights, in_place):
    rng = np.random.default_rng(len(weights))
    x = rng.normal(size=(7, 33)).astype(dtype)
    vs = [rng.normal(size=(7, 33)).astype(dtype) for _ in weights]
    ref = self_weight * x.astype(np.float64) + sum(w * v.astype(np.float64) for v, w in zip(vs, weights))
    xt = torch.from_numpy(x.copy())
    out = xt if in_place else torch.empty_like(xt)
    y = weighted_sum(out, xt, self_weight, [(torch.from_numpy(v), w) for v, w in zip(vs, weights)])
    assert y is out and y.dtype == xt.dtype
    np.testing.assert_allclose(y.numpy(), ref, rtol=tol, atol=tol)
    if not in_place:
        np.testing.assert_array_equal(xt.numpy(), x)      # the input is left alone


def test_integers_are_summed_in_float64_and_rounded():
    x = torch.tensor([1, 2, 3, -7], dtype=torch.int32)
    v = torch.tensor([4, 4, 4, 2], dtype=torch.int32)
    y = weighted_sum(torch.empty_like(x), x, 0.5, [(v, 0.5)])
    np.testing.assert_array_equal(y.numpy(), np.round(0.5 * x.numpy() + 0.5 * v.numpy()).astype(np.int32))


@pytest.mark.parametrize("dtype, values, self_weight, weights, want", [
    # past an end by float64 rounding (int64's ends are 2**63 apart from their float64 neighbors
    # by 1024-2048): clamped to the end (the largest float64 within it at the top)
    (torch.int64, [2**63 - 1, -2**63], 0.33, [0.56, 0.11], [2**63 - 1024, -2**63]),
    (torch.int64, [2**62 + 4096], 0.5, [0.5], [2**62 + 4096]),
    # out of the range by more: raised, at unsigned dtypes' exact bottom 0 too (a slack taken
    # from uint64's top let -200000 through, clamped to 0)
    (torch.uint64, [0], 1.5, [-0.5], None),
    (torch.uint8, [0], 1.5, [-0.5], None),
    (torch.int8, [100], 2.0, [0.0], None),
    (torch.int64, [2**62], 2.5, [0.0], None),
])
def test_integer_results_at_and_beyond_the_ends_of_the_range(dtype, values, self_weight, weights, want):
    x = torch.tensor(values, dtype=dtype)
    other = min(100000, torch.iinfo(dtype).max)
    terms = [(torch.tensor([other] * len(values), dtype=dtype) if w < 0 else x.clone(), w) for w in weights]
    if want is None:
        with pytest.raises(ValueError, match=r"which does not fit in u?int(8|64)"):
            weighted_sum(torch.empty_like(x), x, self_weight, terms)
    else:
        assert weighted_sum(torch.empty_like(x), x, self_weight, terms).tolist() == want

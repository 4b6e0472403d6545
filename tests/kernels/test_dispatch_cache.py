"""Dispatch decisions cached per input signature: the audit still sees every call, path and refusal."""

from __future__ import annotations

import torch

from metainfer_gen import platform
from metainfer_gen.kernels import audit
from metainfer_gen.kernels.dispatch_cache import call_site, signature_key
from metainfer_gen.kernels.registry import Op


def _counting_op():
    calls = []

    def fast_supports(x):
        calls.append(tuple(x.shape))
        return None if x.shape[0] > 1 else f"only {x.shape[0]} row"

    op = Op("toy_cached")
    op.register("torch", lambda x: x * 2)
    op.register("fast", lambda x: x * 3, fast_supports, before="torch")
    return op, calls


def test_a_repeated_signature_walks_the_predicates_once_and_every_call_is_audited():
    op, calls = _counting_op()
    x, one = torch.ones(4, 2), torch.ones(1, 2)
    with audit() as report:
        for _ in range(3):
            assert torch.equal(op.dispatch(x, site="s"), x * 3)
            assert torch.equal(op.dispatch(one, site="s"), one * 2)
    assert calls == [(4, 2), (1, 2)]
    assert report.paths() == {"toy_cached": {"fast": 3, "torch": 3}}
    assert report.refusals() == {"toy_cached": {"fast: only 1 row"}}
    op.dispatch(torch.ones(5, 2), site="s")  # a new shape is a new signature
    assert calls[-1] == (5, 2)


def test_the_cache_is_dropped_when_the_machine_changes_or_on_request():
    op, calls = _counting_op()
    x = torch.ones(4, 2)
    op.dispatch(x, site="s")
    fake = platform.Capabilities(device_kind=platform.DeviceKind.CPU, cxx_compiler=None)
    with platform.override_capabilities(fake):
        op.dispatch(x, site="s")
    op.dispatch(x, site="s")
    assert len(calls) == 3
    op.clear_decisions()
    op.dispatch(x, site="s")
    assert len(calls) == 4


def test_the_cached_decision_follows_whether_triton_is_installed(monkeypatch):
    answer = ["3.0.0"]

    def triton_installed():  # one function object whose answer changes, as after installing triton
        return answer[0]

    monkeypatch.setattr(platform, "triton_installed", triton_installed)
    op = Op("toy_triton")
    op.register("torch", lambda x: x * 2)
    op.register("fast", lambda x: x * 3, lambda x: None if platform.triton_installed() else "triton not installed",
                before="torch")
    x = torch.ones(4, 2)
    with audit() as report:
        assert torch.equal(op.dispatch(x, site="s"), x * 3)
        answer[0] = None
        assert torch.equal(op.dispatch(x, site="s"), x * 2)  # the same signature, decided afresh
        answer[0] = "3.1.0"
        assert torch.equal(op.dispatch(x, site="s"), x * 3)
    assert report.paths() == {"toy_triton": {"fast": 2, "torch": 1}}
    assert report.refusals() == {"toy_triton": {"fast: triton not installed"}}


def test_signatures_capture_layout_grad_and_alignment_and_refuse_unknown_types():
    x = torch.randn(4, 8)
    assert signature_key((x,), {}) == signature_key((torch.randn(4, 8),), {})
    assert signature_key((x,), {}) != signature_key((x.t(),), {})
    assert signature_key((x,), {}) != signature_key((x.requires_grad_(),), {})
    with torch.no_grad():
        assert signature_key((x,), {}) != signature_key((x,), {"eps": 1e-6})
    flat = torch.zeros(16, dtype=torch.float16)
    assert signature_key((flat[1:9],), {}) != signature_key((flat[0:8],), {})  # 2-byte vs 16-byte aligned
    assert signature_key((1,), {}) != signature_key((True,), {})
    assert signature_key((object(),), {}) is None


def test_call_site_names_the_caller():
    def caller():
        return call_site(0)

    assert caller().startswith("test_dispatch_cache.py:") and caller().endswith("(caller)")

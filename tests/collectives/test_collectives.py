"""Shared-memory collectives on 2 CPU ranks (spawned processes, gloo): results equal gloo's, audit, errors, async,
low precision, thresholds cache. Every run has a hard deadline (see :mod:`tests.collectives.harness`)."""

from __future__ import annotations

from tests.collectives.harness import run_ranks


def test_results_equal_gloo_float32_bf16_1_element_to_64mb(tmp_path):
    results = run_ranks("equal_to_gloo", tmp_path, timeout_s=300)
    assert results == {0: [], 1: []}  # every (op, algorithm, size, dtype) matched gloo bit for bit


def test_audit_records_paths_and_bad_arguments_raise_clear_errors(tmp_path):
    results = run_ranks("audit_and_errors", tmp_path)
    for rank, out in results.items():
        assert out["paths"]["all_reduce"] == {"shm_one_shot": 1, "shm_two_shot": 1, "gloo": 2}
        assert out["paths"]["all_gather"] == {"shm_all_gather": 1}
        assert out["paths"]["reduce_scatter"] == {"shm_reduce_scatter": 1}
        refused = out["refusals"]["all_reduce"]
        assert "shm_one_shot: dtype torch.bool has no shared-memory kernel" in refused
        assert "shm_one_shot: ranks span 2 hosts" in refused
        assert out["last"][:2] == ("reduce_scatter", "shm_reduce_scatter")
        assert "> one-shot threshold 262144 B (default)" in out["last_reason"]
        assert out["strict"] is not None and "would fall back to 'gloo'" in out["strict"]
        errors = out["errors"]
        assert all(errors.values()), {k: v for k, v in errors.items() if v is None}
        assert errors["dtype"][0] == "TypeError" and "complex64" in errors["dtype"][1]
        assert errors["non_contiguous"][0] == "ValueError" and "contiguous" in errors["non_contiguous"][1]
        assert errors["not_tensor"][0] == "TypeError"
        assert errors["gather_size"][0] == "ValueError" and "needs 8" in errors["gather_size"][1]
        assert errors["gather_dtype"][0] == "TypeError"
        assert errors["scatter_divisible"][0] == "ValueError"
        assert errors["lowp_int"][0] == "TypeError"
        assert errors["algorithm"][0] == "ValueError" and errors["group"][0] == "ValueError"
        assert out["mismatch"] is not None and "100 elements" in out["mismatch"] and "101" in out["mismatch"]
        assert out["after_mismatch"], f"rank {rank}: communicator broken after a size mismatch"


def test_async_handles_and_low_precision_error_reported(tmp_path):
    results = run_ranks("async_and_low_precision", tmp_path)
    for out in results.values():
        assert out["async_equal"] == [True, True, True]
        assert out["async_returns_input"] and out["sync_after_async"] and out["async_gather"]
        for scheme, bound in (("bf16", 2 ** -8), ("int8", 0.02)):
            r = out[scheme]
            assert r["path"] == f"shm_lowp_{scheme}"
            assert 0 < r["reported"] < bound
            assert 0 < r["actual"] < bound  # the sum of two compressed inputs stays as close as each input
            assert r["same_on_all_ranks"]


def test_thresholds_measured_then_read_from_cache(tmp_path):
    results = run_ranks("thresholds_cache", tmp_path)
    # Each rank times for itself and the two can disagree under load; rank 0 writes its numbers, and every rank
    # loads rank 0's, so the ranks never pick different algorithms (CI once saw 0 on rank 0, unbounded on rank 1).
    _, rank0_max, rank0_chunk, _ = results[0]["measured"]
    for out in results.values():
        source, one_shot_max, chunk, keys = out["measured"]
        assert source == "measured" and chunk == 65536
        assert one_shot_max in (0, 4096, 65536) or one_shot_max >= 1 << 62
        assert keys == ["4096", "65536", "chunk65536"]
        assert out["loaded"] == ("cache", rank0_max, rank0_chunk)
        assert out["default_source"] == "default"  # tuning is off in the harness and no cache existed at init
    assert (tmp_path / "collectives.json").exists()

"""Leases, fencing and schema versions of the job store, on both backends; LISTEN/NOTIFY wake-ups and a restart of
the database server on PostgreSQL alone."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest

from metainfer_gen.serve.video.jobs import JobStatus, SchemaTooNew
from metainfer_gen.serve.video.sqlite_store import SQLiteJobStore


def test_a_heartbeat_keeps_the_lease_and_a_taken_over_claim_is_fenced(opener):
    mine, theirs = opener(lease_s=0.3), opener(lease_s=0.3)
    mine.add("a", {})
    first = mine.claim(0, owner="host-a/0")
    for _ in range(4):  # 0.4 s in all, longer than the lease: renewed, so never requeued
        time.sleep(0.1)
        assert mine.renew(first)
        assert theirs.claim(0, owner="host-b/0") is None
    time.sleep(0.45)  # host A stops beating
    second = theirs.claim(0, owner="host-b/0")
    assert second is not None and second.attempt == first.attempt + 1 and second.owner == "host-b/0"
    # the old claim can neither renew, report progress, finish, fail nor cancel the job now
    assert not mine.renew(first) and not mine.set_progress(first, 50)
    assert not mine.complete(first, 1.0) and not mine.fail(first, "x") and not mine.mark_cancelled(first)
    assert theirs.complete(second, 1.0)
    job = theirs.get("a")
    assert (job.status, job.renders, job.attempt, job.owner) == (JobStatus.COMPLETED, 1, 2, "host-b/0")


def test_the_attempt_cap_applies_to_expired_leases(opener):
    store = opener(lease_s=0.1, max_attempts=2)
    store.add("a", {})
    attempts = []
    for _ in range(5):  # bounded: more rounds than the cap
        job = store.claim(0)
        if job is None:
            break
        attempts.append(job.attempt)
        time.sleep(0.15)
    store.requeue_expired()
    job = store.get("a")
    assert attempts == [1, 2] and job.status is JobStatus.FAILED and "gave up after 2 attempts" in job.error


def test_a_cancel_from_another_connection_stops_the_running_job(opener):
    worker_side, api_side = opener(), opener()
    worker_side.add("a", {})
    job = worker_side.claim(0)
    assert worker_side.set_progress(job, 10)
    assert api_side.cancel("a").cancel_requested
    assert not worker_side.set_progress(job, 20) and worker_side.mark_cancelled(job)
    assert api_side.get("a").status is JobStatus.CANCELLED


def test_a_dead_workers_job_is_requeued_by_owner_alone_then_fails_at_max_attempts(opener):
    store = opener(max_attempts=2)
    store.add("a", {})
    store.add("b", {})
    store.claim(0, owner="host-a/0")
    store.claim(0, owner="host-b/0")  # the same worker index on another machine
    assert store.requeue_running_of("host-a/0", "exited") == 1
    assert store.get("a").status is JobStatus.QUEUED and store.get("b").status is JobStatus.IN_PROGRESS
    assert store.claim(0, owner="host-a/0").id == "a"  # its second claim: the last one max_attempts allows
    assert store.requeue_running_of("host-a/0", "the worker died") == 1
    failed = store.get("a")
    assert failed.status is JobStatus.FAILED and failed.attempt == 2 and failed.completed_at is not None
    assert failed.error == "gave up after 2 attempts: the worker died"
    assert store.get("b").status is JobStatus.IN_PROGRESS


def test_a_newer_sqlite_schema_is_refused_and_an_old_one_upgraded(tmp_path):
    newer = tmp_path / "newer.sqlite3"
    with sqlite3.connect(newer) as db:
        db.execute("PRAGMA user_version = 99")
    with pytest.raises(SchemaTooNew, match="schema version 99, newer than the 2"):
        SQLiteJobStore(newer)
    old = tmp_path / "old.sqlite3"  # what the store made before leases: no owner / lease_expires_at columns
    with sqlite3.connect(old) as db:
        db.execute("CREATE TABLE jobs (id TEXT PRIMARY KEY, seq INTEGER NOT NULL, created_at INTEGER NOT NULL, "
                   "status TEXT NOT NULL, request TEXT NOT NULL, progress INTEGER NOT NULL DEFAULT 0, error TEXT, "
                   "cancel_requested INTEGER NOT NULL DEFAULT 0, attempt INTEGER NOT NULL DEFAULT 0, "
                   "renders INTEGER NOT NULL DEFAULT 0, worker INTEGER, render_seconds REAL, completed_at INTEGER)")
        db.execute("INSERT INTO jobs (id, seq, created_at, status, request) VALUES ('kept', 1, 0, 'queued', '{}')")
    store = SQLiteJobStore(old)
    try:
        assert store.claim(0).id == "kept" and store.get("kept").lease_expires_at is not None
    finally:
        store.close()


def test_a_newer_postgresql_schema_is_refused(postgres_url):
    import psycopg

    from metainfer_gen.serve.video.stores import open_job_store

    open_job_store(postgres_url).close()
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("UPDATE schema_info SET version = 7")
    with pytest.raises(SchemaTooNew, match="schema version 7"):
        open_job_store(postgres_url)


def test_an_unreachable_postgresql_is_a_clear_error():
    from metainfer_gen.serve.video.jobs import JobStoreUnavailable
    from metainfer_gen.serve.video.postgres_store import PostgresJobStore
    from tests.serve.postgres_cluster import free_port

    pytest.importorskip("psycopg_pool")
    with pytest.raises(JobStoreUnavailable, match="cannot connect to the job store postgresql://u@127.0.0.1"):
        PostgresJobStore(f"postgresql://u:secret@127.0.0.1:{free_port()}/db", connect_timeout_s=1.0)


def test_notify_wakes_an_idle_worker_at_once(postgres_url):
    from metainfer_gen.serve.video.stores import open_job_store

    worker, api = open_job_store(postgres_url), open_job_store(postgres_url)
    try:
        worker.listen()
        woke = []

        def idle() -> None:
            started = time.monotonic()
            worker.wait_for_work(timeout_s=10.0)
            woke.append(time.monotonic() - started)

        thread = threading.Thread(target=idle)
        thread.start()
        time.sleep(0.3)
        api.add("a", {})
        thread.join(15)
        assert woke and woke[0] < 2.0  # well under the 10 s timeout: the NOTIFY woke it
        assert worker.claim(0).id == "a"
    finally:
        worker.close()
        api.close()


def test_the_store_survives_a_postgresql_restart():
    """A server restarted under open stores: the next operations reconnect, and nothing committed is lost."""
    pytest.importorskip("psycopg_pool")
    from metainfer_gen.serve.video.stores import open_job_store
    from tests.serve.postgres_cluster import PostgresCluster, postgres_bindir

    if postgres_bindir() is None:
        pytest.skip("no PostgreSQL binaries")
    cluster = PostgresCluster().start()
    try:
        store = open_job_store(cluster.create_database("restart"))
        try:
            store.listen()
            store.add("before", {})
            job = store.claim(0)
            cluster.restart()
            assert store.set_progress(job, 50)  # retried over a fresh connection
            store.wait_for_work(0.2)  # the listening connection was cut: reconnects on the next call
            store.add("after", {})
            assert store.complete(job, 1.0) and store.claim(0).id == "after"
            assert store.get("before").renders == 1
        finally:
            store.close()
    finally:
        cluster.remove()

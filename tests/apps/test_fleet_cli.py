"""The fleet flags of ``serve``, ``video-worker`` and ``render``: bad input is refused with a message naming the fix,
before any model loads."""

from __future__ import annotations

import pytest

from metainfer_gen.apps.cli import main


def test_an_unknown_store_scheme_is_refused(tmp_path, capsys):
    assert main(["video-worker", "--job-store", "mysql://db/jobs", "--clips-dir", str(tmp_path)]) == 2
    assert "unknown job store 'mysql://db/jobs'" in capsys.readouterr().err


def test_a_shared_store_needs_a_clips_folder(capsys):
    assert main(["serve", "--llm", "none", "--port", "0", "--job-store", "postgresql://u@127.0.0.1/db"]) == 2
    assert "needs a clips folder every machine mounts: give --clips-dir" in capsys.readouterr().err


def test_an_unreachable_postgresql_is_refused_without_its_password(tmp_path, capsys):
    pytest.importorskip("psycopg_pool")
    from tests.serve.postgres_cluster import free_port

    url = f"postgresql://u:hunter2@127.0.0.1:{free_port()}/db"
    assert main(["video-worker", "--job-store", url, "--clips-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cannot connect to the job store postgresql://u@127.0.0.1" in err and "hunter2" not in err


def test_render_through_a_store_needs_a_batch_and_a_clips_folder(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\n")
    store = str(tmp_path / "jobs.sqlite3")
    assert main(["render", "one prompt", "--job-store", store]) == 2
    assert "give --prompts FILE" in capsys.readouterr().err
    assert main(["render", "--prompts", str(prompts), "--job-store", store]) == 2
    assert "--job-store needs --clips-dir" in capsys.readouterr().err
    assert main(["render", "--prompts", str(prompts), "--job-store", store, "--clips-dir", str(tmp_path),
                 "--format", "gif"]) == 2
    assert "the fleet writes MP4 clips" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--video-workers", "-1"], ["--lease-seconds", "0"], ["--max-attempts", "0"]])
def test_bad_fleet_numbers_are_usage_errors(flags, capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--port", "0", *flags])
    assert info.value.code == 2 and flags[0] in capsys.readouterr().err

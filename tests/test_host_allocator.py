"""The host allocator the ``metainfer-gen`` command re-executes under (metainfer_gen.host_allocator)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from metainfer_gen import host_allocator as ha

pytestmark = pytest.mark.skipif(not ha._is_glibc(), reason="the allocator choice applies to Linux with glibc")


@pytest.fixture
def lib_dir(tmp_path):
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")
    return (str(tmp_path),)


def test_auto_preloads_tcmalloc_where_found(lib_dir):
    env = ha.allocator_env({"PATH": "/bin", "LD_PRELOAD": "/opt/libfoo.so"}, lib_dir)
    assert env["LD_PRELOAD"] == f"{lib_dir[0]}/libtcmalloc_minimal.so.4:/opt/libfoo.so"
    assert env[ha.ALLOCATOR_ENV] == "tcmalloc" and env["METAINFER_HOST_ALLOCATOR_SET"] == "1"
    assert int(env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40
    assert not any(k.startswith("MALLOC_") for k in env)


def test_auto_tunes_glibc_where_no_tcmalloc(tmp_path):
    env = ha.allocator_env({"PATH": "/bin"}, (str(tmp_path),))
    assert env[ha.ALLOCATOR_ENV] == "glibc-tuned" and "LD_PRELOAD" not in env
    assert {k: env[k] for k in ha.GLIBC_TUNING} == ha.GLIBC_TUNING
    forced = ha.allocator_env({ha.ALLOCATOR_ENV: "glibc-tuned"}, (str(tmp_path),))
    assert forced[ha.ALLOCATOR_ENV] == "glibc-tuned"


@pytest.mark.parametrize("environ", [
    {ha.ALLOCATOR_ENV: "system"},
    {"METAINFER_HOST_ALLOCATOR_SET": "1"},  # already re-executed: never loops
    {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"},  # the user's allocator stands
    {"MALLOC_ARENA_MAX": "2"},  # the user's glibc tuning stands under auto
])
def test_the_environment_is_kept_where_it_already_chose(environ, lib_dir):
    assert ha.allocator_env(environ, lib_dir) is None


def test_bad_choices_say_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="choose one of auto, tcmalloc, glibc-tuned, system"):
        ha.allocator_env({ha.ALLOCATOR_ENV: "jemalloc"})
    with pytest.raises(ValueError, match="apt-get install libtcmalloc-minimal4"):
        ha.allocator_env({ha.ALLOCATOR_ENV: "tcmalloc"}, (str(tmp_path),))
    assert ha.allocator_env({ha.ALLOCATOR_ENV: ""}, (str(tmp_path),))[ha.ALLOCATOR_ENV] == "glibc-tuned"


@pytest.mark.parametrize("tcmalloc", [True, False])
def test_without_ours_gives_back_the_environment_it_started_from(tcmalloc, lib_dir, tmp_path):
    base = {"PATH": "/bin", "LD_PRELOAD": "/opt/libfoo.so", "OMP_NUM_THREADS": "2"}
    env = ha.allocator_env(base, lib_dir if tcmalloc else (str(tmp_path / "none"),))
    assert env != base and ha.without_ours(env) == base
    assert ha.without_ours(base) == base


def _doctor_allocator(**extra) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("MALLOC_") or k.startswith("METAINFER_HOST_ALLOCATOR") or k == "LD_PRELOAD")}
    done = subprocess.run([sys.executable, "-m", "metainfer_gen.apps.cli", "doctor", "--json"], env={**env, **extra},
                          capture_output=True, text=True, timeout=120)
    allocator = json.loads(done.stdout)["machine"]["host_allocator"] if done.returncode == 0 else ""
    return done.returncode, allocator, done.stderr


def test_the_command_runs_under_the_fast_allocator_and_says_so():
    rc, allocator, err = _doctor_allocator()
    assert rc == 0, err
    assert allocator == ("tcmalloc" if ha.find_tcmalloc() else
                         "glibc malloc (tuned: MALLOC_TOP_PAD_, MALLOC_TRIM_THRESHOLD_)")
    rc, allocator, err = _doctor_allocator(METAINFER_HOST_ALLOCATOR="system")
    assert (rc, allocator) == (0, "glibc malloc"), err
    rc, _, err = _doctor_allocator(METAINFER_HOST_ALLOCATOR="fast")
    assert rc != 0 and "METAINFER_HOST_ALLOCATOR='fast': choose one of" in err

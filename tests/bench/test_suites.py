"""The suites' runners on the host: what a selftest copy runs as its server,
and how a script's exit status becomes its outcome (``bench/suites``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.suites import counts, side_by_side
from bench.suites.selftests import QUICK, UNPASSABLE, prepare, run_script, scripts, selftest_dir


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (selftest_dir() / "test_common.sh").is_file():
        pytest.fail(f"no ublk selftests in {selftest_dir()}: run scripts/setup")
    return prepare(tmp_path_factory.mktemp("st") / "ublk", "aioublk")


def test_the_copys_kublk_is_this_aioublk(copy: Path) -> None:
    out = subprocess.run([str(copy / "kublk"), "--version"], capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith("aioublk "), out
    assert (copy / "metadata_size").stat().st_mode & 0o111
    assert not list(copy.glob("*.c"))


def test_every_listed_script_exists(copy: Path) -> None:
    have = set(scripts(copy))
    assert len(have) > 40
    assert set(QUICK) <= have and set(UNPASSABLE) <= have
    assert not set(QUICK) & set(UNPASSABLE)


@pytest.mark.parametrize(("body", "result"), [("exit 0", "pass"), ("exit 4", "skip"),
                                               ("echo why; exit 255", "fail")])
def test_an_exit_status_is_an_outcome(copy: Path, body: str, result: str) -> None:
    (copy / "test_x_01.sh").write_text(f"echo 'ublk selftest: x_01 starting'\n{body}\n")
    rec = run_script(copy, "test_x_01.sh", timeout=30)
    assert (rec["test"], rec["result"]) == ("x_01", result)
    assert rec["tail"] == (["why"] if result == "fail" else [])


def test_a_script_past_its_time_fails_with_all_it_started(copy: Path, tmp_path: Path) -> None:
    child = tmp_path / "child.pid"
    (copy / "test_x_02.sh").write_text(f"sleep 600 & echo $! > {child}\nwait\n")
    rec = run_script(copy, "test_x_02.sh", timeout=2)
    assert rec["result"] == "fail" and rec["tail"][-1] == "timed out after 2 s"
    pid = int(child.read_text())
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text(
        ).split()[2]


def test_side_by_side_keeps_the_order_and_counts_per_server() -> None:
    recs = [{"test": t, "server": s, "result": r} for t, s, r in [
        ("a", "aioublk", "pass"), ("a", "kublk", "pass"), ("b", "aioublk", "fail"),
        ("b", "kublk", "skip"), ("c", "kublk", "pass")]]
    rows = side_by_side(recs, ["aioublk", "kublk"])
    assert [t for t, _ in rows] == ["a", "b", "c"] and "aioublk" not in rows[2][1]
    assert counts(recs, "aioublk") == {"pass": 1, "fail": 1, "skip": 0}


def test_what_a_script_leaves_in_its_tmpdir_is_gone_before_the_next(copy: Path) -> None:
    (copy / "test_x_03.sh").write_text('truncate -s 1M "$TMPDIR/left_behind"\nexit 1\n')
    assert run_script(copy, "test_x_03.sh", timeout=30)["result"] == "fail"
    assert not (copy / "tmp").exists() or not list((copy / "tmp").iterdir())

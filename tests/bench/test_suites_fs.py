"""bench.suites.fs on the host: reading each tool's output, judging qcow2 images,
and the report from a run's JSON."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from bench.suites import fs

FS_MARK = """\
FSUse%        Count         Size    Files/sec     App Overhead
    71           50        16384       2487.3              296
"""
DBENCH = " Flush 2306 0.350 6.102\n\nThroughput 345.875 MB/sec  1 clients  1 procs\n"


def test_each_tool_output_gives_its_number(tmp_path: Path) -> None:
    assert fs._fs_mark(tmp_path, FS_MARK) == (2487.3, None)
    assert fs._dbench(tmp_path, DBENCH) == (345.875, None)
    (tmp_path / "stress.yaml").write_text("metrics:\n    - stressor: hdd\n      bogo-ops: 17990\n")
    assert fs._yaml_bogo_ops(tmp_path, "") == (17990.0, None)
    job = {"jobs": [{"read": {"io_bytes": 4096}}]}
    (tmp_path / "write.json").write_text("fio: note\n" + json.dumps(job))
    (tmp_path / "verify.json").write_text(json.dumps(job))
    assert fs._fio(tmp_path, "") == (8192.0, 8192)
    assert fs._fs_mark(tmp_path, "no table") == (None, None)


def test_a_failing_workload_is_recorded_not_raised(tmp_path: Path) -> None:
    w = fs.Workload("false", "echo broken; exit 3", "ops", fs._dbench, 30, 1)
    got = fs.run_workload(w, tmp_path / "work", tmp_path / "out",
                          fs.Server("aioublk", ["true"], []), None)
    assert got["result"] == "fail" and got["error"] == "exit 3: broken", got
    slow = fs.Workload("slow", "sleep 30", "ops", fs._dbench, 0.5, 1)
    got = fs.run_workload(slow, tmp_path / "work", tmp_path / "out",
                          fs.Server("aioublk", ["true"], []), None)
    assert got["error"] == "timed out after 0 s", got


@pytest.mark.skipif(not shutil.which("qemu-img"), reason="needs qemu-img")
def test_qemu_img_check_tells_clean_from_corrupt(tmp_path: Path) -> None:
    img = tmp_path / "a.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(img), "64M"], check=True)
    assert fs.check_images([str(img)]) == "clean"
    assert fs.check_images([]) is None
    with open(img, "r+b") as f:  # the refcount table's offset: past the end of the file
        f.seek(48)
        f.write((1 << 40).to_bytes(8, "big"))
    assert str(fs.check_images([str(img)])).startswith("corrupt: a.qcow2"), fs.check_images(
        [str(img)])


def test_report_from_a_run(tmp_path: Path) -> None:
    def run(server: str, workload: str, result: str = "pass") -> dict[str, object]:
        return {"device": "loop", "fs": "xfs", "server": server, "workload": workload,
                "unit": "bogo ops", "ops": 10.0, "bytes_verified": None, "kills": 1,
                "kill_during": True, "seconds": 5.0, "result": result,
                "error": None if result == "pass" else "exit 2: verify failed"}

    data = {"kernel": "7.0", "cpus": 2, "guest": True, "quick": False, "seconds": 4,
            "size": fs.SIZE, "killed": list(fs.KILLED), "source": None, "build_on": [],
            "versions": {"stress-ng": "stress-ng 0.15"}, "complete": True,
            "runs": [run("aioublk", "stress-ng hdd", "fail"), run("kublk", "stress-ng hdd")],
            "checks": [{"device": "loop", "fs": "xfs", "server": s, "kills": 1,
                        "fsck": "clean", "check": None, "error": None}
                       for s in ("aioublk", "kublk")],
            "command": "python -m bench.suites fs"}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(data))
    assert fs.main(["--report", str(path), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "fs.md").read_text()
    assert "| loop | xfs | aioublk | 0/1 | 1 | clean | — (raw) |" in text, text
    assert "- aioublk loop xfs stress-ng hdd: `exit 2: verify failed`" in text, text


@pytest.mark.skipif(not shutil.which("qemu-io"), reason="needs qemu-img and qemu-io")
def test_the_overlay_base_holds_data_before_the_overlay_is_made(tmp_path: Path) -> None:
    b, err = fs.backing("overlay", str(tmp_path))
    assert err is None and b is not None, err
    assert b.args == ["-t", "qcow2", str(tmp_path / "disk.qcow2")]
    assert fs.check_images(b.qcow2) == "clean"
    mapped = subprocess.run(["qemu-img", "map", "--output=json", b.qcow2[0]],
                            capture_output=True, text=True, check=True).stdout
    data = [m for m in json.loads(mapped) if m["data"]]
    assert data and data[0]["start"] == 0 and data[0]["length"] == fs.BASE_DATA, mapped


def test_merge_replaces_the_kinds_run_again() -> None:
    def rows(device: str, result: str) -> list[dict[str, object]]:
        return [{"device": device, "fs": "ext4", "server": "aioublk", "result": result}]

    data = {"runs": rows("stripe", "pass") + rows("overlay", "fail"),
            "checks": rows("stripe", "pass") + rows("overlay", "fail"),
            "command": "first", "complete": True}
    fs.merge(data, {"runs": rows("overlay", "pass"), "checks": rows("overlay", "pass"),
                    "command": "second", "complete": True})
    assert [(r["device"], r["result"]) for r in data["runs"]] == [
        ("overlay", "pass"), ("stripe", "pass")]
    assert data["command"] == "first` then `second"

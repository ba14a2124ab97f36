"""bench.instructions on the host: its TCG plugin builds and QEMU loads it, a
window's counts split by address, and the ratios point the right way (fewer
instructions is less work)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bench import instructions


def test_a_window_splits_into_kernel_server_and_the_rest(tmp_path: Path) -> None:
    counts = tmp_path / "1.out"
    enter = 0xFFFFFFFF81000000
    counts.write_text(
        f"{enter:x} 10 3\n"                 # io_uring_enter, 3 calls of 10 instructions
        "ffffffff81000100 5 4\n"            # other kernel code
        "7f0000001000 7 2\n"                # the server's library
        "7f0000001ff0 1 1\n"                # still it, at the mapping's end
        "7f0000002000 100 1\n"              # past it: someone else (fio)
        "400000 2 3\n")                     # fio's own code
    maps = [(0x7F0000001000, 0x7F0000002000, "/usr/lib/x86_64-linux-gnu/liburing.so.2")]
    got = instructions.split(counts, maps, enter)
    assert got["kernel"] == 30 + 20
    assert got["server"] == 14 + 1
    assert got["rest"] == 100 + 6
    assert got["enters"] == 3
    assert got["server_files"] == {"liburing.so.2": 15}


def test_kernel_instructions_and_calls_are_named_by_their_function(tmp_path: Path) -> None:
    kallsyms = tmp_path / "kallsyms"
    kallsyms.write_text("ffffffff80000000 T __schedule\n"
                        "ffffffff81000000 T first\n"
                        "ffffffff81000100 d some_data\n"     # data: not a function
                        "ffffffff81000200 t second\n"
                        "ffffffffc0000000 t third\t[nbd]\n")  # a module's
    counts = tmp_path / "1.out"
    counts.write_text("ffffffff80000000 6 5\n"               # 5 calls
                      "ffffffff80000010 2 9\n"               # (inside it: no call)
                      "ffffffff81000000 10 3\n"
                      "ffffffff81000150 5 2\n"               # still in first
                      "ffffffff81000200 1 7\n"
                      "ffffffffc0000010 4 1\n"
                      "400000 2 3\n")                        # user space: no function
    symbols = instructions.KernelSymbols(kallsyms)
    got = instructions.split(counts, [], None, symbols)
    assert got["functions"] == {"__schedule": 48, "first": 40, "second": 7, "third": 4}
    assert got["kernel"] == 99
    assert got["calls"] == {"__schedule": 5}
    assert instructions.split(counts, [], None)["functions"] == {}

def _run(r: int, server: str, total: float) -> dict[str, Any]:
    return {"round": r, "device": "null", "workload": "4k randread qd1", "server": server,
            "error": None, "total": total, "enters": 1.0,
            "per_io": {"kernel": total - 10, "server": 5, "rest": 5}}


def test_ratios_take_kublks_fewest_instructions_as_its_best() -> None:
    runs = []
    for r, (per_io, batch, ours, ours_per_io) in enumerate(
            [(100, 80, 88, 90), (120, 100, 90, 110)], start=1):
        runs += [_run(r, "kublk", per_io), _run(r, "kublk -b", batch),
                 _run(r, "aioublk", ours), _run(r, "aioublk --no-batch", ours_per_io)]
    [row] = instructions.rows({"runs": runs})
    assert row["kublk_best"] == "kublk -b"
    assert row["vs_best"] == pytest.approx([1.1, 0.9])
    assert row["same_mode"]["aioublk"] == pytest.approx([1.1, 0.9])
    assert row["same_mode"]["aioublk --no-batch"] == pytest.approx([0.9, 110 / 120])
    assert row["settings"]["kublk"]["total"] == 110


def test_the_plugin_builds_and_qemu_loads_it(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    qemu = shutil.which("qemu-system-x86_64")
    if qemu is None or shutil.which("cc") is None:
        pytest.fail("qemu-system-x86_64 and cc are needed (scripts/setup installs them)")
    monkeypatch.setenv("HOME", str(tmp_path))
    plugin = instructions.build_plugin()
    assert instructions.build_plugin() == plugin  # cached by the source's hash

    def start(arg: str) -> subprocess.CompletedProcess[str]:
        # no machine, nothing to run: QEMU loads its plugins, then quits on the
        # monitor's command
        return subprocess.run(
            [qemu, "-machine", "none", "-accel", "tcg", "-nodefaults", "-display", "none",
             "-S", "-monitor", "stdio", "-plugin", f"{plugin},{arg}"],
            input="quit\n", capture_output=True, text=True, timeout=60)

    assert start(f"dir={tmp_path}").returncode == 0
    refused = start("nodir=1")
    assert refused.returncode != 0
    assert "dir=FOLDER" in refused.stderr

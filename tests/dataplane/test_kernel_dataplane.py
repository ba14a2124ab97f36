"""The C data plane against the real driver: mapped requests served without
Python on both queue paths and in every copy mode (files, stripes and NVMe
passthrough), and the ways a
request falls back to the coroutines (O_DIRECT refusing it, a file system
without O_DIRECT). The lifecycle tests (kill -9, recover, quiesce, delete
under fio) run on the data plane too: it is the default for null, loop and
stripe."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from aioublk.kernel import uapi
from aioublk.queue.options import CopyMode
from aioublk.target import Target
from aioublk.targets import LoopTarget, StripeTarget
from aioublk.targets.nvme import NvmeTarget
from tests.device.test_kernel_lifecycle import reads_done
from tests.support.kernel import fio, make_file, run, served
from tests.targets.test_kernel_targets import sectors_4k

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("no_devices_left")]

MiB = 1 << 20
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _concat(paths: list[str]) -> Target:
    spec = importlib.util.spec_from_file_location("aioublk_example_concat",
                                                  EXAMPLES / "concat.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    target: Target = module.Concat(paths)
    return target


def make(kind: str, tmp_path: Path) -> Target:
    if kind == "loop":
        return LoopTarget(str(make_file(tmp_path / "loop.img", 128 * MiB)))
    if kind == "nvme":  # the emulated namespace every guest boots with
        return NvmeTarget("/dev/ng0n1")
    files = [str(make_file(tmp_path / f"f{i}.img", 64 * MiB)) for i in range(2)]
    return StripeTarget(files) if kind == "stripe" else _concat(files)


def count_python(target: Target) -> list[int]:
    """Count the requests that reach the target's Python (coroutines and
    task-free path alike): patched on the instance, which is where the
    queues look them up."""
    calls = [0]

    def counted(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kw: Any) -> Any:
            calls[0] += 1
            return fn(*args, **kw)
        return wrapper

    for name in ("read", "write", "start_read", "start_write"):
        setattr(target, name, counted(getattr(target, name)))
    return calls


def verify(path: str, cwd: Path, *extra: str) -> dict[str, Any]:
    job = fio(path, cwd, "--rw=randwrite", "--bsrange=4k-256k", "--iodepth=32", "--size=24M",
              "--verify=crc32c", "--verify_fatal=1", "--do_verify=1", *extra)
    assert job["write"]["io_bytes"] > 0
    return job


COPY, AUTO_ZC, ZC, UC = CopyMode.COPY, CopyMode.AUTO_ZC, CopyMode.ZERO_COPY, CopyMode.USER_COPY


@pytest.mark.parametrize("kind,batch,copy", [
    ("loop", True, COPY), ("loop", False, COPY), ("loop", True, AUTO_ZC),
    ("loop", False, AUTO_ZC), ("stripe", True, COPY), ("stripe", False, AUTO_ZC),
    ("loop", True, ZC), ("stripe", False, ZC), ("concat", False, COPY),
    ("concat", True, COPY), ("loop", True, UC), ("loop", False, UC), ("stripe", True, UC),
    ("concat", False, UC), ("nvme", True, COPY), ("nvme", False, ZC), ("nvme", True, AUTO_ZC),
    ("nvme", False, UC)],
    ids=lambda v: {True: "batch", False: "per-io"}.get(v, getattr(v, "value", v)))
def test_mapped_requests_never_reach_python(kind: str, batch: bool, copy: CopyMode,
                                            tmp_path: Path) -> None:
    """fio verify (4k-256k, across stripe chunks and the concat seam) keeps
    its data, and C served it: the target's Python saw (almost) nothing."""
    target = make(kind, tmp_path)
    calls = count_python(target)
    with served(target, queues=2, batch=batch, copy=copy) as dev:
        verify(dev.path, tmp_path)
        ios = sum(row["ios"] for row in dev.stats())
    assert ios > 300
    assert calls[0] <= ios // 100, f"{calls[0]} of {ios} requests reached Python"


@contextmanager
def ramfs(tmp_path: Path) -> Iterator[Path]:
    """A file system without O_DIRECT at all (ramfs refuses it at open)."""
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    run("mount", "-t", "ramfs", "ramfs", str(mnt))
    try:
        yield mnt
    finally:
        run("umount", str(mnt))


@pytest.mark.parametrize("batch", [True, False], ids=["batch", "per-io"])
def test_loop_on_a_file_system_without_o_direct(batch: bool, tmp_path: Path) -> None:
    with ramfs(tmp_path) as mnt:
        target = LoopTarget(str(make_file(mnt / "loop.img", 64 * MiB)))
        assert not target.backing.direct
        calls = count_python(target)
        with served(target, batch=batch) as dev:
            verify(dev.path, tmp_path, "--size=16M")
        assert calls[0] < 100
        target.close()


@pytest.mark.parametrize("batch", [True, False], ids=["batch", "per-io"])
def test_o_direct_refusing_a_request_sends_it_to_python(batch: bool, tmp_path: Path) -> None:
    """A backing device with 4 KiB sectors under a device that (wrongly, on
    purpose) advertises 512-byte blocks: O_DIRECT refuses the 512-byte
    requests C sends (EINVAL), Python serves them again, the loop target
    goes buffered, and every byte is kept."""
    with sectors_4k(tmp_path) as back:
        target = LoopTarget(back)
        assert target.backing.direct
        target.geometry = replace(target.geometry, logical_block_size=512, io_min=512,
                                  dma_alignment=511)
        calls = count_python(target)
        with served(target, batch=batch) as dev:
            job = fio(dev.path, tmp_path, "--rw=randwrite", "--bs=512", "--iodepth=16",
                      "--size=8M", "--verify=crc32c", "--verify_fatal=1", "--do_verify=1")
            assert job["write"]["io_bytes"] == 8 * MiB
        assert calls[0] >= 1, "no request came back to Python"
        assert not target.backing.direct, "the loop target did not go buffered"
        subprocess.run(["sync"], check=False)


@pytest.mark.parametrize("batch", [True, False], ids=["batch", "per-io"])
def test_each_queue_worker_is_pinned_to_one_cpu_of_its_queue(batch: bool) -> None:
    """As kublk places its threads: a worker serving one queue runs on one
    CPU of that queue's affinity (the kernel's map), set before its ring."""
    from aioublk.kernel.control import Control, run_now
    from aioublk.targets import NullTarget

    queues = min(2, len(os.sched_getaffinity(0)))
    with served(NullTarget(size=64 * MiB), queues=queues, batch=batch) as dev:
        ctrl = Control(blocking=True)
        try:
            masks = [run_now(ctrl.queue_affinity(dev.id, q)) for q in range(queues)]
        finally:
            ctrl.close()
        for w in dev.workers:
            (q,) = [qm.q_id for qm, _tags in w.spec.work]
            tid = w.thread.native_id
            assert tid is not None
            pinned = os.sched_getaffinity(tid)
            assert len(pinned) == 1 and pinned <= set(masks[q]), (q, pinned, masks)
        assert len({w.thread.native_id for w in dev.workers}) == queues


def _io_uring_enters(tid: int, work: Callable[[], object], tmp_path: Path) -> int:
    """The io_uring_enter calls thread ``tid`` makes while ``work`` runs,
    as strace counts them (attached before ``work`` starts)."""
    out = tmp_path / "strace.out"
    p = subprocess.Popen(["strace", "-c", "-e", "trace=io_uring_enter", "-o", str(out),
                          "-p", str(tid)], stderr=subprocess.PIPE, text=True)
    try:
        assert p.stderr is not None
        line = p.stderr.readline()  # "strace: Process N attached", or why not
        assert "attached" in line, f"strace did not attach to {tid}: {line.strip()}"
        work()
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(timeout=60)
    calls = [ln.split() for ln in out.read_text().splitlines() if ln.endswith("io_uring_enter")]
    assert calls, f"strace counted no io_uring_enter: {out.read_text()}"
    return int(calls[0][3])


def test_a_batch_worker_enters_io_uring_once_per_request_at_qd1(tmp_path: Path) -> None:
    """At QD1 in batch mode, a worker submits a request's COMMIT_IO_CMDS and
    waits for the next request in one io_uring_enter. The commit's own CQE,
    posted while it is submitted, must not end that wait. It did: whenever
    the next request was not there yet, the worker entered twice per request
    (as kublk -b does). fio runs under strace too, slowed so that the next
    request is never there yet."""
    from aioublk.targets import NullTarget

    n = 300
    with served(NullTarget(size=64 * MiB), batch=True) as dev:
        assert dev.info is not None and dev.info.flags & uapi.Feature.BATCH_IO
        tid = dev.workers[0].thread.native_id
        assert tid is not None
        before = reads_done(dev.id)
        enters = _io_uring_enters(tid, lambda: run(
            "strace", "-f", "-o", os.devnull, "fio", "--name=qd1", f"--filename={dev.path}",
            "--rw=randread", "--bs=4k", "--iodepth=1", "--ioengine=io_uring", "--direct=1",
            f"--number_ios={n}", "--size=64M"), tmp_path)
        requests = reads_done(dev.id) - before
    assert requests >= n
    # one per request, and a few for the loop's own timers and wake-ups
    assert enters <= 1.25 * requests, (enters, requests)

"""Raw NIXL bandwidth between two processes' GPU buffers on one device (UCX picks the transport).

    python nixl_pair.py target DIR BYTES      # registers a buffer, waits for the data, checks it
    python nixl_pair.py initiator DIR BYTES   # WRITEs a random buffer into it, times each write

The two exchange NIXL metadata through files in DIR. The initiator prints one JSON line:
the median seconds of one WRITE of BYTES, and whether the target received the same bytes.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch


def _wait(path: Path, timeout: float = 60.0) -> Path:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)
    return path


def _agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def target(work: Path, n: int) -> None:
    agent = _agent("target")
    buf = torch.zeros(n, dtype=torch.uint8, device="cuda")
    agent.register_memory(buf)
    (work / "target.json").write_text(
        json.dumps({"addr": buf.data_ptr(), "len": n, "dev": buf.device.index or 0})
    )
    (work / "target.md").write_bytes(agent.get_agent_metadata())
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        notes = agent.get_new_notifs().get("initiator", [])
        if notes:
            want = int(notes[-1].decode())
            got = int(buf.to(torch.int64).sum().item())
            (work / "checked.json").write_text(json.dumps({"equal": got == want}))
            return
        time.sleep(0.001)


def initiator(work: Path, n: int, repeats: int = 20) -> None:
    agent = _agent("initiator")
    buf = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    agent.register_memory(buf)
    remote = agent.add_remote_agent(_wait(work / "target.md").read_bytes())
    meta = json.loads(_wait(work / "target.json").read_text())
    local = agent.get_xfer_descs(buf)
    dst = agent.get_xfer_descs([(meta["addr"], meta["len"], meta["dev"])], "VRAM")
    handle = agent.initialize_xfer("WRITE", local, dst, remote, b"")
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"transfer ended {state}")
        times.append(time.perf_counter() - t)
    agent.send_notif(remote, str(int(buf.to(torch.int64).sum().item())).encode())
    checked = json.loads(_wait(work / "checked.json").read_text())
    print(
        json.dumps({"seconds": statistics.median(times[2:]), "bytes": n, "equal": checked["equal"]}),
        flush=True,
    )


if __name__ == "__main__":
    role, folder, size = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    (target if role == "target" else initiator)(folder, size)

"""A receiving worker in its own process (multiprocessing spawn), driven through queues.

Commands: ("poll", seconds) -> (completed, failed) seen during that time;
("dump",) -> the KV tensor; ("exit",). The process polls its transport continuously, as a
decode worker's engine loop does.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time

import torch

SHAPE = dict(num_layers=3, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8)
MODEL = "test-model"


def make_cache(seed: int, num_blocks: int = SHAPE["num_blocks"], head_dim: int = SHAPE["head_dim"],
               dtype=torch.bfloat16) -> torch.Tensor:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    shape = (SHAPE["num_layers"], num_blocks, 2, SHAPE["block_size"], SHAPE["num_kv_heads"], head_dim)
    return torch.randn(shape, generator=g).to(dtype)


def _serve(kind: str, seed: int, num_blocks: int, head_dim: int, stall_timeout, commands, replies) -> None:
    from disagg.worker.kv_transfer import KVLayout, create_transport

    cache = make_cache(seed, num_blocks, head_dim)
    layout = KVLayout.from_tensor(cache, MODEL)
    server = None
    options = {"stall_timeout": stall_timeout}
    if kind == "grpc":
        from concurrent.futures import ThreadPoolExecutor

        import grpc

        from disagg.proto import kv_transfer_pb2_grpc as pb_grpc

        server = grpc.server(ThreadPoolExecutor(4), options=[("grpc.max_receive_message_length", 64 << 20)])
        port = server.add_insecure_port("127.0.0.1:0")
        options["advertise_address"] = f"127.0.0.1:{port}"
        options["reserved_only"] = (
            False  # these tests check the wire; reservations: test_transfer_grpc_receiver
        )
    transport = create_transport(kind, cache, layout, name="decode-0", **options)
    if server is not None:
        pb_grpc.add_KVTransferServicer_to_server(transport.servicer(), server)
        server.start()
    replies.put(transport.handshake_payload())
    completed: list[str] = []
    failed: list[tuple[str, str]] = []
    while True:
        completed += transport.poll_completed()
        failed += transport.poll_failed()
        try:
            cmd = commands.get(timeout=0.001)
        except queue.Empty:
            continue
        if cmd[0] == "poll":
            until = time.monotonic() + cmd[1]
            while time.monotonic() < until:
                completed += transport.poll_completed()
                failed += transport.poll_failed()
                time.sleep(0.001)
            replies.put((completed, failed))
            completed, failed = [], []
        elif cmd[0] == "dump":
            replies.put(cache.clone())
        elif cmd[0] == "exit":
            break
    transport.close()
    if server is not None:
        server.stop(None)


class Receiver:
    """Handle on a receiver process."""

    def __init__(self, kind: str, seed: int = 1, num_blocks: int = SHAPE["num_blocks"],
                 head_dim: int = SHAPE["head_dim"], stall_timeout: float | None = None):  # fmt: skip
        ctx = mp.get_context("spawn")
        self.commands, self.replies = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(
            target=_serve, args=(kind, seed, num_blocks, head_dim, stall_timeout, self.commands, self.replies),
            daemon=True,
        )  # fmt: skip
        self.proc.start()
        self._payload: bytes | None = None

    @property
    def payload(self) -> bytes:
        """The receiver's handshake payload (waits for the process to be up: start several, then ask)."""
        if self._payload is None:
            self._payload = self.replies.get(timeout=60)
        return self._payload

    def poll(self, seconds: float = 0.3):
        assert self.payload
        self.commands.put(("poll", seconds))
        return self.replies.get(timeout=30 + seconds)

    def poll_until_settled(self, transfer_id: str, limit: float = 20.0):
        """Everything reported until `transfer_id` completes or fails (bounded), plus a quiet period."""
        completed, failed = [], []
        until = time.monotonic() + limit
        while time.monotonic() < until:
            c, f = self.poll(0.1)
            completed += c
            failed += f
            if transfer_id in completed or any(t == transfer_id for t, _ in failed):
                c, f = self.poll(0.3)  # a duplicate report would show up here
                return completed + c, failed + f
        return completed, failed

    def dump(self) -> torch.Tensor:
        assert self.payload
        self.commands.put(("dump",))
        return self.replies.get(timeout=30)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.commands.put(("exit",))
            self.proc.join(10)
        if self.proc.is_alive():
            self.kill()

"""KV transfer bandwidth between two processes: NIXL and the gRPC fallback, against an in-process copy.

    python bench/kv_transfer.py [--sizes 64,256] [--reps 5] [--block-size 16]
        [--patterns contiguous,churned,scattered] [--backends nixl,grpc]
    python bench/kv_transfer.py --kv-dtypes float32,bfloat16,int8 [--prompt-tokens 512,2048]
        [--patterns churned] [--backends nixl]

The KV cache has the "small" preset's shape (12 layers, 4 KV heads, head dim 64, bfloat16), so
one (layer, block) region is 16 KiB at block size 16. A prefill worker process writes N blocks
of every layer into a decode worker process's cache (a pool of 2N blocks each), as one send and
layer by layer (12 sends, as overlapped with compute). Block id patterns:
  contiguous   a fresh pool: ids 0..N-1 into the top N ids
  churned      what the real BlockManager hands out (prefix caching on) after a churn of ragged
               prompts: the sender churned as a prefill worker, the receiver as a decode worker
               (requests also grow a block at a time), each with its own random sequence;
               "churned:W" with BlockManager(eviction_window=W)
  scattered    a random permutation of the pool on each side (the worst case)
  runs:K       the pool cut into runs of K ids, shuffled (a fixed fragmentation level)
A backend "nixl:prepped" or "nixl:merged" forces how NIXL descriptors are built (default: auto).
"runs/send" counts the stretches of regions adjacent on both sides (the separate copies a send
needs at best); "desc/send" is how many descriptors NIXL was given (prepared per-region lists
when runs do not pay, which NIXL merges itself). "copy_ 1 thread" is shown for reference: a
transport's copy runs on one thread (CMA: the sender's process_vm_writev). "CMA ceiling" rows
are the kernel's cross-memory copy alone: process_vm_writev of the same bytes into another
process's buffer (huge pages, faulted in) from 1 thread and from as many threads as NIXL's UCX
backend uses, in 4 MiB calls, no NIXL: what any CMA transport can reach on this host.
With --kv-dtypes, the figures are per request instead: a prompt of --prompt-tokens tokens moved
from prefill to decode with its KV stored as each dtype (int8 / fp8: the quantized cache's regions,
8-bit values and their float32 scales, as `disagg.kernels.kv_quant` lays them out), bytes and time
per request and per token, and both against float32 in the same command.
The baseline is `dst.copy_(src)` of the same number of bytes inside the sending process, timed
right before every transfer: "vs copy_" is the median of these paired ratios, so it holds up on a
machine whose load drifts. Figures are medians over --reps (plus the best run); the receiver
checks the bytes (a hash of its destination blocks against the sender's source blocks) after
every transfer. The scattered pattern copied in-process by tensor indexing is shown for reference.
Caches and the copy_ baseline's buffers are allocated as a worker allocates its KV cache
(`disagg.worker.model.kv_memory`: transparent huge pages); `--pages small` gives them torch's
4 KiB pages instead, the layout before huge pages, to compare.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import multiprocessing as mp
import os
import queue
import random
import statistics
import sys
import threading
import time

import torch

from disagg.worker.engine.args import EngineArgs
from disagg.worker.model import kv_memory
from disagg.worker.model.precisions import KV_CACHE_DTYPES

LAYERS, KV_HEADS, HEAD_DIM, DTYPE, MODEL = 12, 4, 64, "bfloat16", "small"
QUANTIZED = KV_CACHE_DTYPES
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
PAGES_ENV = "DISAGG_BENCH_KV_PAGES"  # --pages, for the spawned receiver too


def _zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Memory as a worker allocates its KV cache (`kv_memory.zeros`: huge pages), or, with
    `--pages small`, torch's own (4 KiB pages). Read from the environment: the receiver is a
    spawned process."""
    if os.environ.get(PAGES_ENV, "huge") == "small":
        return torch.zeros(shape, dtype=dtype)
    return kv_memory.zeros(shape, dtype)


def _cache(num_blocks: int, block_size: int, seed: int, kv_dtype: str = DTYPE) -> torch.Tensor:
    """Random bytes in a cache of `kv_dtype` (a quantized one: byte regions of values and scales)."""
    from disagg.kernels.kv_quant import region_bytes

    g = torch.Generator().manual_seed(seed)
    if kv_dtype in QUANTIZED:
        shape = (LAYERS, num_blocks, region_bytes(block_size, KV_HEADS, HEAD_DIM))
        return _zeros(shape, torch.uint8).copy_(torch.randint(0, 256, shape, generator=g, dtype=torch.uint8))
    dtype = getattr(torch, kv_dtype)
    shape = (LAYERS, num_blocks, 2, block_size, KV_HEADS, HEAD_DIM)
    bits = _BITS[dtype.itemsize]
    noise = torch.randint(torch.iinfo(bits).min, torch.iinfo(bits).max, shape, generator=g, dtype=bits)
    return _zeros(shape, dtype).view(bits).copy_(noise).view(dtype)


def _layout(cache: torch.Tensor, block_size: int, kv_dtype: str):
    from disagg.worker.kv_transfer import KVLayout

    if kv_dtype in QUANTIZED:  # values computed by the bfloat16 model
        geometry = (DTYPE, block_size, KV_HEADS, HEAD_DIM)
        return KVLayout.from_tensor(cache, MODEL, kv_cache_dtype=kv_dtype, quantized_geometry=geometry)
    return KVLayout.from_tensor(cache, MODEL)


def _digest(cache: torch.Tensor, blocks: list[int]) -> str:
    return hashlib.sha256(cache[:, blocks].contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _receiver(kind: str, num_blocks: int, block_size: int, kv_dtype: str, commands, replies) -> None:
    from disagg.worker.kv_transfer import create_transport

    cache = _cache(num_blocks, block_size, seed=1, kv_dtype=kv_dtype)
    options, server = {}, None
    if kind == "grpc":
        from concurrent.futures import ThreadPoolExecutor

        import grpc

        from disagg.proto import kv_transfer_pb2_grpc as pb_grpc

        server = grpc.server(ThreadPoolExecutor(2), options=[("grpc.max_receive_message_length", 64 << 20)])
        options["advertise_address"] = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        options["reserved_only"] = False  # measures the wire, with no worker reserving blocks
    transport = create_transport(kind, cache, _layout(cache, block_size, kv_dtype), "bench-decode", **options)
    if server is not None:
        pb_grpc.add_KVTransferServicer_to_server(transport.servicer(), server)
        server.start()
    replies.put(transport.handshake_payload())
    completed: list[str] = []
    while True:
        # The decode engine polls once per step; between polls the core is the sender's to use
        # (with CMA the receiver takes no part in moving the bytes).
        completed += transport.poll_completed()
        try:
            cmd = commands.get(timeout=0.001)
        except queue.Empty:
            continue
        if cmd[0] == "await":
            while cmd[1] not in completed:
                time.sleep(0.0005)
                completed += transport.poll_completed()
            completed.remove(cmd[1])
            replies.put(_digest(cache, cmd[2]))
        elif cmd[0] == "exit":
            break
    transport.close()
    if server is not None:
        server.stop(None)


class _Copier:
    """The in-process baseline: copy_ of the same number of bytes, pages faulted in beforehand
    as the transports' caches are."""

    def __init__(self, nbytes: int):
        self.src = _zeros((nbytes,), torch.uint8).copy_(torch.randint(0, 255, (nbytes,), dtype=torch.uint8))
        self.dst = _zeros((nbytes,), torch.uint8)
        self.dst.copy_(self.src)

    def seconds(self, threads: int | None = None) -> float:
        default = torch.get_num_threads()
        torch.set_num_threads(threads or default)
        try:
            t0 = time.perf_counter()
            self.dst.copy_(self.src)
            return time.perf_counter() - t0
        finally:
            torch.set_num_threads(default)


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_CMA_CALL_BYTES = 4 << 20


def _cma_target(nbytes: int, replies, done) -> None:
    buf = _zeros((nbytes,), torch.uint8)
    buf.fill_(1)  # fault the pages in, as a worker's cache is
    replies.put((os.getpid(), buf.data_ptr()))
    done.wait(600)


def _cma_ceiling(copier: _Copier, threads: int, reps: int) -> tuple[float, float, float] | None:
    """(median s, best s, median of copy_ s / CMA s): process_vm_writev of the copier's bytes into
    another process from `threads` threads; None where the kernel refuses (ptrace policy)."""
    libc = ctypes.CDLL(None, use_errno=True)
    write = libc.process_vm_writev
    write.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.POINTER(_IOVec),
                      ctypes.c_ulong, ctypes.c_ulong]  # fmt: skip
    write.restype = ctypes.c_ssize_t
    nbytes = copier.src.numel()
    ctx = mp.get_context("spawn")
    replies, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_cma_target, args=(nbytes, replies, done), daemon=True)
    proc.start()
    errors: list[int] = []

    def part(pid: int, remote: int, start: int, end: int) -> None:
        # ctypes drops the GIL for the call: the threads copy in parallel
        for off in range(start, end, _CMA_CALL_BYTES):
            n = min(_CMA_CALL_BYTES, end - off)
            local, far = _IOVec(copier.src.data_ptr() + off, n), _IOVec(remote + off, n)
            if write(pid, ctypes.byref(local), 1, ctypes.byref(far), 1, 0) != n:
                errors.append(ctypes.get_errno())
                return

    try:
        pid, remote = replies.get(timeout=120)
        cuts = [nbytes * i // threads // _CMA_CALL_BYTES * _CMA_CALL_BYTES for i in range(threads)] + [nbytes]
        times, ratios = [], []
        for rep in range(reps + 1):  # the first run warms up, as the transports' does
            baseline = copier.seconds()
            workers = [threading.Thread(target=part, args=(pid, remote, cuts[i], cuts[i + 1]))
                       for i in range(threads)]  # fmt: skip
            t0 = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            elapsed = time.perf_counter() - t0
            if errors:
                return None
            if rep:
                times.append(elapsed)
                ratios.append(baseline / elapsed)
        return statistics.median(times), min(times), statistics.median(ratios)
    finally:
        done.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def _pool(blocks: int) -> int:
    return 2 * blocks


def _in_process_scatter(blocks: int, block_size: int, reps: int) -> float:
    """The same scattered (layer, block) pattern as the transports move, copied inside one process."""
    src, dst = _cache(_pool(blocks), block_size, seed=2), _cache(_pool(blocks), block_size, seed=1)
    src_ids, dst_ids = (torch.tensor(ids) for ids in _block_ids("scattered", blocks, block_size))
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        dst[:, dst_ids] = src[:, src_ids]
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _churned(blocks: int, block_size: int, seed: int, decode: bool, window: int) -> list[int]:
    """N block ids as a worker's BlockManager (prefix caching on) hands them out after serving-like
    churn: ragged prompts are admitted while blocks last (their full blocks enter the cache with
    unique hashes), random ones finish; on a decode worker running requests also grow a block at
    a time. Then finished requests are freed until N blocks are free, and N are allocated."""
    from disagg.worker.engine.block_manager import BlockManager

    rng = random.Random(seed)
    pool = _pool(blocks)
    bm = BlockManager(pool, block_size, enable_prefix_caching=True, eviction_window=window)
    live: list[list[int]] = []
    next_hash = seed << 40
    handed_out = 0
    while handed_out < 8 * pool:
        want = rng.randint(1, max(1, blocks // 8))
        if bm.num_free_blocks - want > pool // 10:
            live.append(bm.allocate(want))
            handed_out += want
            for b in live[-1][:-1]:  # the prompt's full blocks; the last one is partial
                bm.register(b, next_hash)
                next_hash += 1
        for req in live if decode else ():
            if rng.random() < 0.3 and bm.num_free_blocks > 0:
                bm.register(req[-1], next_hash)  # the tail filled up before a new block is needed
                next_hash += 1
                req += bm.allocate(1)
                handed_out += 1
        while live and (rng.random() < 0.3 or bm.num_free_blocks < pool // 10):
            bm.free(live.pop(rng.randrange(len(live))))
    while bm.num_free_blocks < blocks:
        bm.free(live.pop(rng.randrange(len(live))))
    return bm.allocate(blocks)


def _block_ids(pattern: str, blocks: int, block_size: int) -> tuple[list[int], list[int]]:
    """Source and destination ids in pools of 2N blocks, see the module doc for the patterns."""
    pool = _pool(blocks)
    if pattern == "contiguous":
        return list(range(blocks)), list(range(pool - blocks, pool))
    if pattern.split(":")[0] == "churned":
        window = int(pattern.split(":")[1]) if ":" in pattern else 1
        return (
            _churned(blocks, block_size, 3, decode=False, window=window),
            _churned(blocks, block_size, 4, decode=True, window=window),
        )
    g = torch.Generator().manual_seed(3)
    if pattern == "scattered":
        return torch.randperm(pool, generator=g)[:blocks].tolist(), torch.randperm(pool, generator=g)[
            :blocks
        ].tolist()
    if pattern.startswith("runs:"):
        k = int(pattern.split(":")[1])
        sides = []
        for _ in range(2):
            starts = (torch.randperm(pool // k, generator=g) * k).tolist()
            sides.append([s + i for s in starts for i in range(k)][:blocks])
        return sides[0], sides[1]
    raise ValueError(f"patterns: unknown block id pattern {pattern!r}")


def _run_backend(kind: str, blocks: int, block_size: int, reps: int, patterns: list[str], copier, log,
                 kv_dtype: str = DTYPE):  # fmt: skip
    """Per (pattern, "one send" | "per layer"): (median s, best s, median of copy_ s / transfer s)."""
    from disagg.worker.kv_transfer import create_transport
    from disagg.worker.kv_transfer.region_runs import find_runs

    kind, _, descriptors = kind.partition(":")
    options = {"descriptors": descriptors} if descriptors else {}
    pool = _pool(blocks)
    ctx = mp.get_context("spawn")
    commands, replies = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(
        target=_receiver, args=(kind, pool, block_size, kv_dtype, commands, replies), daemon=True
    )
    proc.start()
    cache = _cache(pool, block_size, seed=2, kv_dtype=kv_dtype)
    sender = create_transport(kind, cache, _layout(cache, block_size, kv_dtype), "bench-prefill", **options)
    sender.add_peer("decode", replies.get(timeout=120))
    results = {}
    modes = [
        (pattern, mode, groups)
        for pattern in patterns
        for mode, groups in (("one send", [None]), ("per layer", [[layer] for layer in range(LAYERS)]))
    ]
    try:
        for pattern, mode, groups in modes:
            src, dst = _block_ids(pattern, blocks, block_size)
            want = _digest(cache, src)
            times, ratios, descs = [], [], []
            for rep in range(reps + 1):  # the first run warms up connections and is not counted
                tid = f"{kind}-{pattern}-{mode}-{rep}"
                baseline = copier.seconds()
                t0 = time.perf_counter()
                handles = []
                for layers in groups:
                    handles.append(sender.send("decode", tid, src, dst, layers=layers, timeout=120))
                    descs.append(getattr(sender, "last_descriptors", None))
                states = [h.wait(120) for h in handles]
                elapsed = time.perf_counter() - t0
                if states != ["done"] * len(handles):
                    raise RuntimeError(f"{kind} transfer failed: {[h for h in handles if h.state != 'done']}")
                sender.finish("decode", tid).wait(30)
                commands.put(("await", tid, dst))
                if replies.get(timeout=120) != want:
                    raise RuntimeError(f"{kind} {mode}: the receiver's blocks differ from the sender's")
                if rep:
                    times.append(elapsed)
                    ratios.append(baseline / elapsed)
                log(f"  {kind:5s} {pattern:10s} {mode:9s} rep {rep}{' (warm-up)' if rep == 0 else ''}: "
                    f"{elapsed * 1e3:8.1f} ms (copy_ {baseline * 1e3:.1f} ms)")  # fmt: skip
            runs = len(find_runs(src, dst)) * (LAYERS if mode == "one send" else 1)
            desc = "-" if descs[0] is None else f"{statistics.mean(descs):.0f}"
            results[(pattern, mode)] = (
                statistics.median(times), min(times), statistics.median(ratios), desc, str(runs),
            )  # fmt: skip
    finally:
        sender.close()
        commands.put(("exit",))
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64,256", help="MiB per transfer, comma-separated")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=EngineArgs.block_size)
    parser.add_argument("--backends", default="nixl,grpc", help="nixl, nixl:prepped, nixl:merged, grpc")
    parser.add_argument(
        "--patterns", default="contiguous,churned,scattered", help="block id patterns, see the module doc"
    )
    parser.add_argument("--kv-dtypes", default=None, help="per-request figures for these KV dtypes, e.g. "
                        "float32,bfloat16,int8 (fp8 too); see the module doc")  # fmt: skip
    parser.add_argument("--prompt-tokens", default="512,2048", help="with --kv-dtypes: prompt lengths")
    parser.add_argument("--pages", choices=("huge", "small"), default="huge",
                        help="the caches' memory: as workers allocate it (huge pages), or 4 KiB pages")  # fmt: skip
    args = parser.parse_args(argv)
    os.environ[PAGES_ENV] = args.pages

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.kv_dtypes:
        return per_request(args, log)
    block_bytes = _layout(_cache(1, args.block_size, 0), args.block_size, DTYPE).block_bytes
    from disagg.worker.kv_transfer.nixl_transport import DEFAULT_THREADS

    cma_threads = max(
        1, int(os.environ.get("DISAGG_NIXL_THREADS", DEFAULT_THREADS))
    )  # as the transport reads it
    rows = []
    for mib in (int(x) for x in args.sizes.split(",")):
        blocks = max(1, (mib << 20) // (LAYERS * block_bytes))
        nbytes = blocks * LAYERS * block_bytes
        log(
            f"{nbytes / 2**20:.0f} MiB: {blocks} blocks x {LAYERS} layers of {block_bytes // 1024} KiB regions"
        )
        copier = _Copier(nbytes)
        copies = [copier.seconds() for _ in range(args.reps)]
        copy_s = statistics.median(copies)
        rows.append((nbytes, "in-process copy_", "-", "-", (copy_s, min(copies), 1.0, "-", "1")))
        single = [copier.seconds(threads=1) for _ in range(args.reps)]
        figures = (statistics.median(single), min(single), copy_s / statistics.median(single), "-", "1")
        rows.append((nbytes, "copy_ 1 thread", "-", "-", figures))
        for threads in sorted({1, cma_threads}):
            ceiling = _cma_ceiling(copier, threads, args.reps)
            if ceiling is None:
                log("  CMA ceiling: process_vm_writev refused (ptrace policy): row left out")
                break
            log(f"  CMA ceiling, {threads} thread(s): {ceiling[0] * 1e3:.1f} ms")
            rows.append((nbytes, f"CMA ceiling {threads} thr", "-", "-", (*ceiling, "-", "1")))
        scatter = _in_process_scatter(blocks, args.block_size, args.reps)
        log(f"  in-process index copy, scattered ids: {scatter * 1e3:.1f} ms")
        rows.append(
            (
                nbytes,
                "in-process index",
                "scattered",
                "-",
                (scatter, scatter, statistics.median(copies) / scatter, "-", str(blocks * LAYERS)),
            )
        )
        for kind in args.backends.split(","):
            results = _run_backend(
                kind, blocks, args.block_size, args.reps, args.patterns.split(","), copier, log
            )
            for (pattern, mode), figures in results.items():
                rows.append((nbytes, kind, pattern, mode, figures))
        del copier

    print(f"\nKV transfer bandwidth, median of {args.reps} (torch threads: {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {args.pages} pages)")  # fmt: skip
    print(f"{'size':>8} {'transport':>17} {'block ids':>11} {'sends':>10} {'runs/send':>9} {'desc/send':>9} "
          f"{'ms':>8} {'GiB/s':>7} {'best':>6} {'vs copy_':>9}")  # fmt: skip
    for nbytes, kind, pattern, mode, (median, best, ratio, descs, runs) in rows:
        print(f"{nbytes / 2**20:6.0f}Mi {kind:>17} {pattern:>11} {mode:>10} {runs:>9} {descs:>9} {median * 1e3:8.1f} "
              f"{nbytes / median / 2**30:7.2f} {nbytes / best / 2**30:6.2f} {ratio:8.0%}")  # fmt: skip
    return 0


def per_request(args, log) -> int:
    """Bytes and time to move one prompt's KV, per KV dtype, against float32 in the same command."""
    kv_dtypes = args.kv_dtypes.split(",")
    if "float32" not in kv_dtypes:
        kv_dtypes.insert(0, "float32")  # the reference of the ratios
    rows = []
    for tokens in (int(x) for x in args.prompt_tokens.split(",")):
        blocks = -(-tokens // args.block_size)
        for kv_dtype in kv_dtypes:
            block_bytes = _layout(
                _cache(1, args.block_size, 0, kv_dtype), args.block_size, kv_dtype
            ).block_bytes
            nbytes = blocks * LAYERS * block_bytes
            log(
                f"{tokens} tokens, KV {kv_dtype}: {blocks} blocks x {LAYERS} layers of {block_bytes} B regions"
            )
            copier = _Copier(nbytes)
            for kind in args.backends.split(","):
                results = _run_backend(kind, blocks, args.block_size, args.reps, args.patterns.split(","), copier,
                                       log, kv_dtype)  # fmt: skip
                for (pattern, mode), (median, best, *_rest) in results.items():
                    rows.append((tokens, kind, pattern, mode, kv_dtype, nbytes, median, best))
            del copier
    reference = {(r[0], r[1], r[2], r[3]): r for r in rows if r[4] == "float32"}
    print(f"\nKV per request, median of {args.reps} (torch threads: {torch.get_num_threads()}, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {LAYERS} layers, {KV_HEADS} KV heads, head dim "
          f"{HEAD_DIM}, block size {args.block_size}; {args.pages} pages)")  # fmt: skip
    print(f"{'tokens':>6} {'transport':>9} {'block ids':>10} {'sends':>9} {'KV':>8} {'bytes':>10} {'B/token':>8} "
          f"{'ms':>8} {'best':>7} {'bytes vs f32':>12} {'time vs f32':>11}")  # fmt: skip
    for tokens, kind, pattern, mode, kv_dtype, nbytes, median, best in rows:
        ref = reference[(tokens, kind, pattern, mode)]
        print(f"{tokens:6d} {kind:>9} {pattern:>10} {mode:>9} {kv_dtype:>8} {nbytes:10d} {nbytes / tokens:8.0f} "
              f"{median * 1e3:8.2f} {best * 1e3:7.2f} {nbytes / ref[5]:12.3f} {median / ref[6]:11.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Pure pieces of the serving path: response shapes, the engine-loop thread, wire conversions."""

from __future__ import annotations

import threading

import pytest

from disagg.proto import worker_pb2 as pb
from disagg.worker.engine.outputs import TokenLogprob
from disagg.worker.router.openai_format import SSE_DONE, Logprob, ResponseBuilder, sse, usage_body
from disagg.worker.serving.convert import logprob_from_proto, logprob_to_proto, sampling_params
from disagg.worker.serving.engine_loop import EngineLoop


def _text(t: int) -> str:
    return f"<{t}>"


def test_chat_stream_chunks():
    b = ResponseBuilder("chat", "m", _text, want_logprobs=True)
    first = b.chunk("He", [Logprob(1, -0.5, [(1, -0.5), (2, -1.0)])], None, include_usage=True)
    assert first["object"] == "chat.completion.chunk" and first["id"].startswith("chatcmpl-")
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "He"}
    assert first["usage"] is None
    lp = first["choices"][0]["logprobs"]["content"][0]
    assert (
        lp["token"] == "<1>"
        and lp["logprob"] == -0.5
        and [t["token"] for t in lp["top_logprobs"]] == ["<1>", "<2>"]
    )
    last = b.chunk("llo", [], "length", include_usage=False)
    assert (
        last["choices"][0]["delta"] == {"content": "llo"} and last["choices"][0]["finish_reason"] == "length"
    )
    assert "usage" not in last
    u = b.usage_chunk(usage_body(3, 2, 1))
    assert (
        u["choices"] == []
        and u["usage"]["total_tokens"] == 5
        and u["usage"]["prompt_tokens_details"]["cached_tokens"] == 1
    )


def test_completion_bodies_and_logprob_offsets():
    b = ResponseBuilder("completion", "m", _text, want_logprobs=True)
    body = b.full("<1><2>", [Logprob(1, -0.1), Logprob(2, -0.2, [(2, -0.2)])], "stop", usage_body(4, 2))
    choice = body["choices"][0]
    assert (
        body["object"] == "text_completion"
        and choice["text"] == "<1><2>"
        and choice["finish_reason"] == "stop"
    )
    assert choice["logprobs"] == {
        "tokens": ["<1>", "<2>"],
        "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [{"<1>": -0.1}, {"<2>": -0.2}],  # the chosen token is always among them
        "text_offset": [0, 3],
    }
    plain = ResponseBuilder("completion", "m", _text, want_logprobs=False).chunk(
        "x", [Logprob(1, 0.0)], None, False
    )
    assert plain["choices"][0]["logprobs"] is None
    assert sse({"a": 1}) == b'data: {"a":1}\n\n' and SSE_DONE == b"data: [DONE]\n\n"


def test_sampling_params_from_wire():
    wire = pb.SamplingParams(
        temperature=0.5, top_p=0.9, top_k=-1, max_tokens=7, stop=["x"], repetition_penalty=1.1
    )
    p = sampling_params(wire)
    assert p.temperature == 0.5 and p.max_tokens == 7 and p.stop_strings == ["x"] and p.logprobs is None
    # on a prefill worker nothing may end the prompt early: the stop checks are the decode worker's
    pre = sampling_params(wire, prefill_only=True)
    assert pre.stop_strings == [] and pre.max_tokens is None and pre.ignore_eos
    wire.logprobs = 3
    assert sampling_params(wire).logprobs == 3
    with pytest.raises(ValueError, match="temperature"):
        sampling_params(pb.SamplingParams(temperature=-1, max_tokens=1))


def test_logprob_round_trip():
    lp = TokenLogprob(5, -0.25, {5: -0.25, 9: -2.0})
    back = logprob_from_proto(logprob_to_proto(lp))
    assert back.token_id == 5 and back.logprob == -0.25 and back.top_logprobs == {5: -0.25, 9: -2.0}


def test_engine_loop_runs_calls_on_its_thread_and_fails_pending_on_stop():
    loop = EngineLoop(idle_wait=0.01)
    seen = []
    steps = []
    work = {"n": 3}
    drained = threading.Event()

    def step():
        steps.append(threading.get_ident())
        work["n"] -= 1
        if not work["n"]:
            drained.set()

    loop.step_fn = step
    loop.has_work = lambda: work["n"] > 0
    loop.start(lambda: seen.append(threading.get_ident())).result(5)
    assert loop.call(lambda x: (x * 2, threading.get_ident()), 21).result(5) == (42, loop.thread_id)
    with pytest.raises(KeyError):
        loop.call(lambda: {}["missing"]).result(5)
    assert seen == [loop.thread_id]
    assert drained.wait(30)
    loop.call(lambda: None).result(5)  # an iteration after the last step: no step without work
    assert len(steps) == 3 and set(steps) == {loop.thread_id}
    loop.stop()
    assert not loop.alive
    with pytest.raises(RuntimeError, match="stopped"):
        loop.call(lambda: 1).result(1)


class VirtualTimeLoop(EngineLoop):
    """The engine loop on a virtual clock: every wait it asks for passes at once (and is recorded),
    then the queued closures run, so what it polls is counted per virtual second whatever the
    machine's load. It stops itself once `until` virtual seconds have passed."""

    def __init__(self, until: float, **kw):
        self.now, self.until, self.waits = 0.0, until, []
        super().__init__(clock=lambda: self.now, **kw)

    def _drain(self, wait: float) -> bool:
        self.waits.append(wait)
        self.now += wait
        if self.now >= self.until:
            self._stop.set()
        return super()._drain(0)

    def run_to_the_end(self) -> None:
        self.start(lambda: None).result(5)
        self._thread.join(60)
        assert not self.alive
        self.stop()


def test_engine_loop_polls_a_pending_transfer_without_spinning():
    """A poller with work pending (sends in flight, a decode worker awaiting a remote prefill's
    KV) is polled every spin_wait for spin_seconds after a step (the tail of the sends it posted),
    then every poll_wait: a bounded number of times, not back to back (which kept a core busy and
    the GIL from the thread sending the Prefill call), and a submitted closure is still served."""
    loop = VirtualTimeLoop(0.55, spin_seconds=0.05, spin_wait=0.002, poll_wait=0.05)
    polls, steps, served = [], [], []
    work = {"n": 1}

    def step():
        steps.append(loop.now)
        work["n"] -= 1

    def poll():
        polls.append(loop.now)
        if loop.now > 0.3 and not served:  # long after the spin: a closure comes in
            served.append(loop.call(lambda: loop.now))
        return True

    loop.step_fn = step
    loop.has_work = lambda: work["n"] > 0
    loop.add_poller(poll)
    loop.run_to_the_end()
    assert len(steps) == 1
    spinning = [t for t in polls if t - steps[0] < 0.05]
    later = [t for t in polls if t - steps[0] >= 0.05]
    # 0.05 s at 2 ms, then 0.45 s at 50 ms (back to back they were tens of thousands)
    assert 24 <= len(spinning) <= 26, len(spinning)
    assert 8 <= len(later) <= 10, len(later)
    assert loop.waits.count(0) == 1  # no wait only right after the step
    assert served[0].result(0) == pytest.approx(0.3, abs=0.06)  # served on the next iteration


def test_engine_loop_polls_at_the_spin_rate_while_a_poller_says_soon():
    """Long after any step, a poller answering SOON (a transfer whose FINAL came and whose last
    parts are landing) is polled every spin_wait; back to a plain True, every poll_wait."""
    from disagg.worker.serving.engine_loop import SOON

    loop = VirtualTimeLoop(0.5, spin_seconds=0.0, spin_wait=0.002, poll_wait=0.05)
    polls = []

    def poll():
        polls.append(loop.now)
        return SOON if loop.now < 0.2 else True

    loop.add_poller(lambda: False)  # another poller's answer does not hide it
    loop.add_poller(poll)
    loop.add_poller(lambda: True)
    loop.run_to_the_end()
    # the first poll comes after an idle wait of 0.05 s; at poll_wait it would be 3, not 75
    soon = [t for t in polls if t < 0.2]
    later = [t for t in polls if t >= 0.2]
    assert 74 <= len(soon) <= 76, len(soon)
    assert 5 <= len(later) <= 7, len(later)


def test_engine_loop_init_failure_is_reported():
    loop = EngineLoop()
    fut = loop.start(lambda: (_ for _ in ()).throw(FileNotFoundError("config.json")))
    with pytest.raises(FileNotFoundError):
        fut.result(5)


def test_core_publishes_prefilled_prompts_and_reports_evictions(tiny_model):
    """WorkerCore over a real engine with a small cache: what it publishes, what eviction takes back."""
    from disagg.worker.engine.block_hash import block_hashes
    from disagg.worker.engine.llm_engine import LLMEngine
    from disagg.worker.engine.sampling_params import SamplingParams
    from disagg.worker.serving.core import WorkerCore
    from disagg.worker.serving.metrics import ServingMetrics

    engine = LLMEngine(tiny_model, num_gpu_blocks=8, block_size=16)
    published: list[list[int]] = []
    core = WorkerCore(engine, None, 16, ServingMetrics("both", "tiny"), on_publish=published.append)
    outputs = []
    first = list(range(10, 58))  # 3 full blocks
    core.on_loop_add("a", first, SamplingParams(max_tokens=2, ignore_eos=True), outputs.append, 0.0)
    while core.has_work():
        core.step()
    assert outputs[-1].finished and published == [block_hashes(first, 16)]
    assert core.on_loop_cached_tokens(first) == 48
    assert core.on_loop_evicted(published[0]) == []
    # a prompt needing every block evicts the first prompt's cached blocks
    core.on_loop_add(
        "b", list(range(100, 220)), SamplingParams(max_tokens=1, ignore_eos=True), outputs.append, 0.0
    )
    while core.has_work():
        core.step()
    assert core.on_loop_evicted(published[0]) == published[0]
    core.refresh_load()
    assert core.load["used_blocks"] == 0 and core.load["inflight_requests"] == 0


def test_core_counts_its_engine_steps_by_kind_with_their_rows(tiny_model):
    """Step seconds and rows per kind: prefill for the steps that carry a prompt chunk, decode for
    the rest, whose rows over their count give the decode batch the step time belongs to."""
    from prometheus_client import CollectorRegistry

    from disagg.worker.engine.llm_engine import LLMEngine
    from disagg.worker.engine.sampling_params import SamplingParams
    from disagg.worker.serving.core import WorkerCore
    from disagg.worker.serving.metrics import ServingMetrics

    registry = CollectorRegistry()
    engine = LLMEngine(tiny_model, num_gpu_blocks=16, block_size=16)
    core = WorkerCore(engine, None, 16, ServingMetrics("both", "tiny", registry))
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    for rid, prompt in (("a", list(range(10, 30))), ("b", list(range(40, 52)))):
        core.on_loop_add(rid, prompt, params, lambda _out: None, 0.0)
    steps = 0
    while core.has_work():
        core.step()
        steps += 1

    def sample(name: str, kind: str) -> float:
        return registry.get_sample_value(name, {"role": "both", "model": "tiny", "kind": kind}) or 0.0

    prefill = sample("disagg_engine_step_seconds_count", "prefill")
    decode = sample("disagg_engine_step_seconds_count", "decode")
    # both prompts fit one step (their first tokens come out of it), then 4 steps of 2 rows each
    assert (prefill, decode) == (1, 4) and prefill + decode == steps
    assert sample("disagg_engine_step_rows_total", "prefill") == 2
    assert sample("disagg_engine_step_rows_total", "decode") == 8
    assert sample("disagg_engine_step_seconds_sum", "decode") > 0


def test_engine_step_that_keeps_failing_fails_its_requests_and_stops_the_loop(tiny_model):
    """A step that fails every time: after `max_step_failures` the requests get the error and the
    loop stops (liveness false), instead of retrying forever."""
    from disagg.worker.engine.llm_engine import LLMEngine
    from disagg.worker.engine.sampling_params import SamplingParams
    from disagg.worker.serving.core import WorkerCore
    from disagg.worker.serving.engine_loop import EngineFailed
    from disagg.worker.serving.metrics import ServingMetrics

    engine = LLMEngine(tiny_model, num_gpu_blocks=8, block_size=16)
    core = WorkerCore(engine, None, 16, ServingMetrics("both", "tiny"))

    def broken_step(**_kw):
        raise RuntimeError("device lost")

    engine.step = broken_step  # the fault: every step raises
    loop = EngineLoop(max_step_failures=3)
    loop.step_fn, loop.has_work = core.step, core.has_work
    fatal = threading.Event()
    loop.on_fatal = lambda e: (core.on_loop_fail_all(e), fatal.set())
    loop.start(lambda: None).result(10)
    got: list = []
    done = threading.Event()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    loop.call(core.on_loop_add, "r", [5, 6, 7], params, lambda out: (got.append(out), done.set()), 0.0)
    assert done.wait(10) and fatal.wait(10)
    assert isinstance(got[0], EngineFailed) and "device lost" in str(got[0])
    loop._thread.join(5)
    assert not loop.alive
    with pytest.raises(RuntimeError):
        loop.call(core.refresh_load).result(1)


def test_decode_quarantine_outlasts_the_prefill_timeout():
    """Blocks of an aborted transfer are held longer than a prefill worker may still write into them."""
    from disagg.worker.engine.args import EngineArgs
    from disagg.worker.serving.args import ServingArgs
    from disagg.worker.serving.main import WorkerConfig, quarantine_seconds

    for timeout in (5.0, 120.0, 600.0):
        serving = ServingArgs(prefill_timeout=timeout)
        cfg = WorkerConfig(EngineArgs(model="m"), "decode", "d", "m", serving=serving)
        assert quarantine_seconds(cfg) > timeout

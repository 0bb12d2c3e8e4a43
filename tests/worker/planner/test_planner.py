"""The planner's simulation, goodput search and advice, on synthetic engine profiles (pure)."""

from __future__ import annotations

import numpy as np
import pytest

from disagg.worker.cli import parse
from disagg.worker.planner import routing, simulate
from disagg.worker.planner.advisor import Settings, advise, split_candidates
from disagg.worker.planner.goodput import SLO, attainment, max_rate, unloaded_slo
from disagg.worker.planner.profile import Profile
from disagg.worker.planner.simulate import Outcome
from disagg.worker.planner.workload import WORKLOADS, Requests, Workload


def profile(prefill_per_token=2.5e-4, step=(0.025, 0.027, 0.035, 0.045, 0.065), kv_bytes=24576, bw=3 * 2**30):
    return Profile.from_json(
        {
            "prefill_seconds_by_tokens": [
                [64, 0.02 + 64 * prefill_per_token],
                [1024, 0.02 + 1024 * prefill_per_token],
            ],
            "decode_step_seconds_by_batch": [[b, s] for b, s in zip((1, 4, 16, 32, 64), step, strict=True)],
            "kv_bytes_per_token": kv_bytes,
            "transfer_bytes_per_second": bw,
        }
    )


def one(prompt: int, output: int, at: float = 1.0) -> Requests:
    return Requests(np.array([at]), np.array([prompt]), np.array([output]))


def test_a_lone_request_sees_the_unloaded_latencies():
    prof = profile()
    out = simulate.disaggregated(prof, one(512, 10), prefill=1, decode=1)
    assert out.ttft[0] == pytest.approx(float(prof.prefill_seconds(512) + prof.transfer_seconds(512)))
    assert out.tpot[0] == pytest.approx(float(prof.step_seconds(1)))
    out = simulate.colocated(prof, one(512, 10), replicas=1)
    assert out.ttft[0] == pytest.approx(float(prof.prefill_seconds(512)))
    assert out.tpot[0] == pytest.approx(float(prof.step_seconds(1)))


def test_a_long_context_slows_each_decode_step_by_its_tokens_beyond_the_measured_one():
    """Attention reads every cached token: a profile that measured it charges a step for each
    row's context beyond the short one its batch steps were measured at, in every simulation."""
    raw = {"prefill_seconds_by_tokens": [[64, 0.02], [1024, 0.3]],
           "decode_step_seconds_by_batch": [[1, 0.025], [64, 0.065]],
           "decode_context_tokens": 40, "decode_seconds_per_context_token": 2e-6}  # fmt: skip
    prof, flat = Profile.from_json(raw), profile()
    assert (
        Profile.from_json({k: v for k, v in raw.items() if "context" not in k}).context_seconds(1, 5000) == 0
    )
    assert prof.decode_seconds(2, 2 * 40) == pytest.approx(float(prof.step_seconds(2)))
    assert prof.decode_seconds(2, 1080) == pytest.approx(float(prof.step_seconds(2)) + 1000 * 2e-6)
    lone = one(1500, 21)  # decodes over 1500 + 10 tokens of context on average
    expected = float(prof.step_seconds(1)) + (1510 - 40) * 2e-6
    for out in (simulate.disaggregated(prof, lone, 1, 1), simulate.colocated(prof, lone, 1),
                routing.simulate(prof, lone, 1, 1, None, placement="threshold", threshold=0)):  # fmt: skip
        assert out.tpot[0] == pytest.approx(expected)
    assert unloaded_slo(prof, Workload("long", (1500, 1500), (21, 21))).tpot == pytest.approx(expected)
    assert simulate.disaggregated(flat, lone, 1, 1).tpot[0] == pytest.approx(float(flat.step_seconds(1)))


def test_requests_decoding_together_share_batched_steps():
    prof = profile()
    req = Requests(np.array([0.0, 0.0]), np.array([64, 64]), np.array([11, 11]))
    out = simulate.disaggregated(prof, req, prefill=2, decode=1)
    assert out.tpot == pytest.approx([float(prof.step_seconds(2))] * 2)


def test_a_full_batch_makes_the_next_request_wait_for_a_slot():
    prof = profile()
    req = Requests(np.array([0.0, 0.0, 0.0]), np.array([64] * 3), np.array([5, 5, 5]))
    out = simulate.disaggregated(prof, req, prefill=3, decode=1, max_batch=2)
    # the third request's tokens come only after the first two finished their 4 steps
    assert out.tpot[2] > 1.9 * float(prof.step_seconds(1))
    assert out.tpot[:2] == pytest.approx([float(prof.step_seconds(2))] * 2)


def test_colocated_decode_steps_carry_the_prefill_chunks_of_new_prompts():
    """Prefill interference: a long prompt arriving mid-decode slows the running request's steps."""
    prof = profile()
    req = Requests(np.array([0.0, 0.05]), np.array([64, 4000]), np.array([50, 2]))
    alone = simulate.colocated(prof, one(64, 50, at=0.0), replicas=1)
    mixed = simulate.colocated(prof, req, replicas=1, chunk_tokens=512)
    assert mixed.tpot[0] > 1.5 * alone.tpot[0]
    split = simulate.disaggregated(prof, req, prefill=1, decode=1)
    assert split.tpot[0] < 1.1 * alone.tpot[0]  # disaggregated decode does not see the prompt


def test_attainment_counts_requests_meeting_both_slos_in_the_steady_part():
    out = Outcome(np.array([0.1, 0.1, 0.5, 0.1, 0.1] * 2), np.array([0.01, 0.09, 0.01, 0.01, 0.01] * 2))
    assert attainment(out, SLO(0.2, 0.05), trim=0.0) == pytest.approx(0.6)
    assert attainment(out, SLO(1.0, 0.1), trim=0.1) == 1.0


def test_max_rate_finds_the_threshold_of_a_falling_curve():
    assert max_rate(lambda r: 1.0 - r / 100, guess=1.0, target=0.9) == pytest.approx(10.0, rel=0.01)
    assert max_rate(lambda r: 0.0, guess=1.0) == 0.0


def test_attainment_falls_as_the_rate_rises():
    prof, wl = profile(), WORKLOADS["chat"]
    slo = unloaded_slo(prof, wl).scaled(4)
    seen = [
        attainment(simulate.colocated(prof, wl.sample(800, rate, 1), 2), slo) for rate in (0.5, 4, 16, 64)
    ]
    assert seen == sorted(seen, reverse=True) and seen[0] > 0.95 and seen[-1] < 0.5


def test_prefill_heavy_mixes_get_more_prefill_replicas():
    prof, s = profile(), Settings()
    chat = advise(
        prof, WORKLOADS["chat"], unloaded_slo(prof, WORKLOADS["chat"]).scaled(4), 8, s, served=False
    )
    summ = advise(
        prof, WORKLOADS["summarization"], unloaded_slo(prof, WORKLOADS["summarization"]).scaled(4), 8, s,
        served=False,
    )  # fmt: skip
    assert summ.prefill > chat.prefill
    assert chat.prefill + chat.decode == summ.prefill + summ.decode == 8
    assert all(1 <= n <= 7 for n in split_candidates(prof, WORKLOADS["chat"], 8, s))


def test_disaggregation_wins_where_prompts_interfere_with_decoding():
    """Long prompts with a tight TPOT: colocated decode steps carry prefill chunks and miss the TPOT
    SLO, so the split serves more within the SLOs."""
    prof = profile()
    wl = Workload("interfering", (1500, 2000), (32, 64))
    slo = SLO(ttft=4 * float(prof.prefill_seconds(2000)), tpot=3 * float(prof.step_seconds(1)))
    plan = advise(prof, wl, slo, 8, Settings(chunk_tokens=2048))
    assert plan.ratio > 1.2, plan


# ---- the product's routing and placement, simulated -----------------------------------------------
def cpu_like_profile() -> Profile:
    """No batching economy to speak of (a CPU core: each decode row costs ~6 ms over a 45 ms step),
    prefill linear in tokens without a fixed cost."""
    return Profile.from_json({
        "prefill_seconds_by_tokens": [[64, 64 * 3e-3], [1024, 1024 * 3e-3]],
        "decode_step_seconds_by_batch": [[1, 0.045], [4, 0.061], [16, 0.146], [32, 0.236], [64, 0.379]],
        "kv_bytes_per_token": 24576, "transfer_bytes_per_second": 3e9,
    })  # fmt: skip


def test_routing_with_every_prompt_remote_and_no_lending_is_distserves_split():
    """Strict placement, no lending, prompts computed one token a step (prompt by prompt): the
    same timeline as the per-replica simulation of the same split."""
    prof, req = cpu_like_profile(), WORKLOADS["chat"].sample(60, 0.5, 3)
    ours = routing.simulate(prof, req, 1, 1, None, chunk_tokens=1, placement="threshold", threshold=0)
    theirs = simulate.disaggregated(prof, req, prefill=1, decode=1)
    assert ours.ttft == pytest.approx(theirs.ttft) and ours.tpot == pytest.approx(theirs.tpot)


def test_routing_lends_an_idle_prefill_replica_requests_when_decode_is_busier():
    """A decode-heavy stream past what one decode replica serves within the TPOT: lending the idle
    prefill replica whole requests recovers the attainment (colocated's, on this profile)."""
    prof, wl = cpu_like_profile(), WORKLOADS["chat"]
    slo, req = unloaded_slo(prof, wl).scaled(4), wl.sample(600, 0.6, 1)
    strict = attainment(routing.simulate(prof, req, 1, 1, None, 64, 512), slo)
    lent = attainment(routing.simulate(prof, req, 1, 1, 2.0, 64, 512), slo)
    colocated = attainment(simulate.colocated(prof, req, 2, 64, 512), slo)
    assert strict < 0.5 and lent > 0.9 and lent >= colocated - 0.05, (strict, lent, colocated)


def test_routing_does_not_lend_requests_whose_prompt_costs_more_than_it_relieves():
    """Long prompts, short answers: a lent request's prompt would stall the lender's streams for
    longer than its few decode steps relieve the decode replica. Lending every request past the
    margin lost attainment here (0.812 vs 0.835 without lending, scale 4); judged per request,
    lending loses nothing."""
    prof, wl = cpu_like_profile(), WORKLOADS["summarization"]
    req = wl.sample(600, 0.3, 1)
    for scale in (2, 4):
        slo = unloaded_slo(prof, wl).scaled(scale)
        strict = attainment(routing.simulate(prof, req, 1, 1, None, 64, 512), slo)
        lent = attainment(routing.simulate(prof, req, 1, 1, 2.0, 64, 512), slo)
        assert lent >= strict, (scale, lent, strict)


def test_routing_prefills_on_the_decode_replica_when_the_prefill_pool_is_backlogged():
    """Long prompts faster than one prefill replica computes them: load-aware placement lets the
    decode replica take prompts, where strict placement queues them all on the prefill replica."""
    prof, wl = cpu_like_profile(), WORKLOADS["summarization"]
    slo, req = unloaded_slo(prof, wl).scaled(4), wl.sample(400, 0.3, 1)
    strict = routing.simulate(prof, req, 1, 1, None, 64, 512, placement="threshold")
    load = routing.simulate(prof, req, 1, 1, None, 64, 512, placement="load")
    assert np.median(load.ttft) < 0.5 * np.median(strict.ttft)
    assert attainment(load, slo) > attainment(strict, slo) + 0.3


def test_routing_refuses_a_split_without_both_roles():
    with pytest.raises(ValueError, match="prefill and a decode"):
        routing.simulate(cpu_like_profile(), one(64, 4), 0, 2, None)
    with pytest.raises(ValueError, match="placement"):
        routing.simulate(cpu_like_profile(), one(64, 4), 1, 1, None, placement="random")


def test_the_advice_includes_the_served_split():
    prof, wl = cpu_like_profile(), WORKLOADS["chat"]
    plan = advise(
        prof, wl, unloaded_slo(prof, wl).scaled(4), 2, Settings(chunk_tokens=512, overflow_margin=2.0)
    )
    assert (plan.served_prefill, plan.served_decode) == (1, 1)
    # decode-heavy on a CPU-like engine: DistServe's 1P+1D idles its prefill replica, the served
    # split lends it requests and matches colocated serving
    assert plan.ratio < 0.8 and plan.served_ratio > 0.9, plan


def test_plan_command_prints_the_advice(tmp_path, capsys):
    import json

    path = tmp_path / "profile.json"
    path.write_text(json.dumps({
        "prefill_seconds_by_tokens": [[64, 0.036], [1024, 0.276]],
        "decode_step_seconds_by_batch": [[1, 0.025], [64, 0.065]],
    }))  # fmt: skip
    module, args = parse(["plan", "--profile", str(path), "--workload", "summarization", "--replicas", "4"])
    assert module.run(args) == 0
    out = capsys.readouterr().out
    assert "DistServe P:D" in out and "served P:D" in out and "\n       4 " in out and "TTFT <=" in out
    assert "whole requests never" in out
    module, args = parse(["plan", "--profile", str(path), "--replicas", "2", "--overflow-margin", "1.5"])
    assert module.run(args) == 0 and "busier by > 1.5 requests" in capsys.readouterr().out
    for bad in ("-1", "many"):
        with pytest.raises(SystemExit):
            parse(["plan", "--profile", str(path), "--overflow-margin", bad])
    with pytest.raises(SystemExit):
        parse(["plan", "--profile", str(path), "--replicas", "1"])


def test_the_engine_profile_measures_batches_and_the_cost_of_context(tmp_path, monkeypatch):
    """On the real engine (tiny model), timed by a clock that counts the work of each forward pass
    the engine runs (its prompt tokens, its decode rows and the context those rows attend to), so
    what is measured does not depend on the machine's load: decode steps by batch at a short
    context, and what each further token of context adds to a step."""
    from disagg.worker.model.runner import ModelRunner
    from disagg.worker.planner import profile as profiles
    from disagg.worker.tools.make_model import make_model

    prefill_fixed, per_token = 2e-3, 5e-6  # a prompt's forward pass
    step_fixed, per_row, per_context = 1e-3, 2e-5, 3e-7  # a decode step

    clock = {"now": 0.0}
    forward = ModelRunner.forward

    def counted(self, batch, *args, **kwargs):
        if batch.is_prefill:
            clock["now"] += prefill_fixed + per_token * len(batch.input_ids)
        else:
            rows, context = len(batch.seq_lens), int(batch.seq_lens.sum())
            clock["now"] += step_fixed + per_row * rows + per_context * context
        return forward(self, batch, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "forward", counted)
    tiny = make_model(tmp_path / "tiny", preset="tiny")
    data = profiles.measure(tiny, progress=lambda _m: None, clock=lambda: clock["now"])
    prof = Profile.from_json(data)
    assert [tokens for tokens, _s in data["prefill_seconds_by_tokens"]] == [64, 256, 512, 1024]
    assert prof.prefill_fixed == pytest.approx(prefill_fixed)
    assert prof.prefill_per_token == pytest.approx(per_token)
    # 12 steps over prompts of 32 tokens and their first token: 33 to 44 tokens of context per row
    assert data["decode_context_tokens"] == 39
    for batch, seconds in data["decode_step_seconds_by_batch"]:
        assert seconds == pytest.approx(step_fixed + per_row * batch + per_context * batch * 38.5), batch
    assert [b for b, _s in data["decode_step_seconds_by_batch"]] == [1, 4, 16, 32, 64]
    # the same batch of 4 over long prompts: the difference is the context alone
    assert prof.context_seconds_per_token == pytest.approx(per_context)
    assert prof.decode_seconds(4, 4 * 1031) - prof.decode_seconds(4, 4 * 39) == pytest.approx(
        per_context * 4 * (1031 - 39)
    )
    assert "per further context token" in prof.describe()


def test_a_benchmark_length_window_attains_more_near_the_knee_than_the_steady_state():
    """What a 60 s sweep measures is not the steady state: its queues never build up fully, so
    the planner predicts a sweep with streams of the same length, averaged over seeds."""
    from disagg.worker.planner.advisor import _requests, goodput_colocated

    prof, wl = cpu_like_profile(), WORKLOADS["chat"]
    slo, steady = unloaded_slo(prof, wl).scaled(4), Settings(chunk_tokens=512)
    window = Settings(chunk_tokens=512, window_seconds=60, windows=4)
    assert len(_requests(prof, wl, 0.5, window)) == 30 and len(_requests(prof, wl, 0.5, steady)) >= 600
    assert goodput_colocated(prof, wl, slo, 2, window) > 1.15 * goodput_colocated(prof, wl, slo, 2, steady)

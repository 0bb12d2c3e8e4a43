"""One source of truth for engine settings: `EngineArgs` defaults are what every command line, the
Python API and the CRD use, and a bad value is refused with the setting named."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from pathlib import Path

import pytest
import yaml

from disagg.worker.cli import parse
from disagg.worker.engine import args as engine_args
from disagg.worker.engine.args import EngineArgs, cli_flag
from disagg.worker.engine.llm import LLM
from disagg.worker.engine.llm_engine import LLMEngine

ROOT = Path(__file__).resolve().parents[3]
FIELDS = {f.name: f.default for f in dataclasses.fields(EngineArgs)}


@pytest.fixture(autouse=True)
def _no_disagg_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("DISAGG_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(
    "argv",
    [["worker", cli_flag("model"), "m"], ["generate", "m", "hello"], ["up"]],
    ids=["worker", "generate", "up"],
)
def test_every_command_takes_every_setting_with_its_default(argv):
    _module, args = parse(argv)
    for name, default in FIELDS.items():
        if name == "model":
            continue
        assert getattr(args, name) == default, f"disagg {argv[0]}: {name}"


def test_python_api_has_no_defaults_of_its_own():
    for fn in (LLM.__init__, LLMEngine.__init__):
        params = inspect.signature(fn).parameters
        settings = [p for p in params.values() if p.name in FIELDS and p.name != "model"]
        assert settings == [], f"{fn.__qualname__} redeclares {[p.name for p in settings]}"
        assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def test_crd_defaults_agree():
    for path in (
        ROOT / "crds" / "inferencedeployment.yaml",
        ROOT / "charts" / "disagg" / "crds" / "inferencedeployment.yaml",
    ):
        crd = yaml.safe_load(path.read_text())
        spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        assert spec["model"]["properties"]["dtype"]["default"] == FIELDS["dtype"], path
        assert set(spec["model"]["properties"]["dtype"]["enum"]) == {"auto", *engine_args.DTYPES}, path
        quantization = spec["model"]["properties"]["quantization"]
        assert quantization["default"] == FIELDS["quantization"], path
        assert set(quantization["enum"]) == {"auto", "none", *engine_args.QUANTIZATIONS}, path
        kv_dtype = spec["model"]["properties"]["kvCacheDtype"]
        assert kv_dtype["default"] == FIELDS["kv_cache_dtype"], path
        assert set(kv_dtype["enum"]) == {"auto", *engine_args.KV_CACHE_DTYPES}, path
        speculative = spec["speculativeDecoding"]["properties"]
        assert speculative["numTokens"]["default"] == FIELDS["num_speculative_tokens"], path
        assert set(speculative["method"]["enum"]) == set(engine_args.SPECULATIVE_METHODS), path
        for role in ("prefill", "decode"):
            kv = spec[role]["properties"]["kvCache"]["properties"]
            assert kv["blockSize"]["default"] == FIELDS["block_size"], (path, role)
            assert kv["memoryFraction"]["default"] == FIELDS["gpu_memory_utilization"], (path, role)


def test_router_block_size_default_is_the_engines():
    _module, args = parse(["router", "--model", "m"])
    assert args.block_size == FIELDS["block_size"]


def test_environment_gives_worker_defaults(monkeypatch):
    monkeypatch.setenv("DISAGG_MAX_NUM_SEQS", "12")
    monkeypatch.setenv("DISAGG_ENABLE_PREFIX_CACHING", "false")
    _module, args = parse(["worker", cli_flag("model"), "m"])
    assert args.max_num_seqs == 12 and args.enable_prefix_caching is False
    _module, args = parse(["worker", *EngineArgs.cli_args(model="m", max_num_seqs=3)])
    assert args.max_num_seqs == 3  # a flag beats the environment


@pytest.mark.parametrize(
    "settings, named",
    [
        ({"block_size": 0}, "block_size must be >= 1"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization must be > 0"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be <= 1"),
        ({"dtype": "int4"}, "dtype must be one of"),
        ({"max_model_len": 1}, "max_model_len must be >= 2"),
        ({"max_num_seqs": True}, "max_num_seqs must be int"),
        (
            {"num_gpu_blocks": 8, "kv_cache_memory": 1 << 20},
            "at most one of num_gpu_blocks and kv_cache_memory",
        ),
        ({"speculative_method": "medusa"}, "speculative_method must be one of"),
        ({"speculative_method": "draft"}, "speculative_draft_model must be set"),
        ({"speculative_draft_model": "d"}, "only used with speculative_method draft"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1"),
        ({"speculative_ngram_min": 3, "speculative_ngram_max": 2}, "speculative_ngram_min must be <="),
    ],
)
def test_invalid_settings_name_the_setting(settings, named):
    with pytest.raises(ValueError, match=named):
        EngineArgs(model="m", **settings)


def test_unknown_setting_is_refused():
    with pytest.raises(TypeError, match="max_num_seq"):
        EngineArgs(model="m", max_num_seq=4)


def test_command_line_errors_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse(["worker", "--model", "m", "--block-size", "0"])
    err = capsys.readouterr().err
    assert "--block-size" in err and "must be >= 1" in err
    with pytest.raises(SystemExit):
        parse(["worker", "--model", "m", "--dtype", "int4"])
    assert "--dtype" in capsys.readouterr().err


def test_flags_round_trip_through_the_worker_parser():
    chosen = EngineArgs(model="m", dtype="bfloat16", block_size=32, enable_prefix_caching=False, cuda_graphs=False,
                        kv_cache_memory=1 << 28, threads=2, speculative_method="draft",
                        speculative_draft_model="/d", num_speculative_tokens=3,
                        speculative_min_acceptance=0.5)  # fmt: skip
    _module, args = parse(["worker", cli_flag("model"), "m", *chosen.to_cli_args()])
    assert EngineArgs.from_cli_args(args) == chosen


def test_cli_flag_refuses_names_that_are_not_settings():
    assert cli_flag("gpu_memory_utilization") == "--gpu-memory-utilization"
    with pytest.raises(KeyError):
        cli_flag("kv_cache_memory_fraction")


def test_auto_dtype_reads_the_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    assert EngineArgs(model=str(tmp_path)).resolved_dtype() == "bfloat16"
    (tmp_path / "config.json").write_text('{"torch_dtype": "float64"}')
    assert EngineArgs(model=str(tmp_path)).resolved_dtype() == "float32"  # not one we run
    # both keys (a 4.x checkpoint re-saved by 5.x): `dtype` wins, as in ModelConfig, which loads it
    (tmp_path / "config.json").write_text('{"torch_dtype": "float16", "dtype": "bfloat16"}')
    assert EngineArgs(model=str(tmp_path)).resolved_dtype() == "bfloat16"


def test_parser_types_are_real_argparse_types():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert parser.parse_args(["--max-model-len", "none"]).max_model_len is None

"""Bad input gets a clear error: a ValueError naming the field in the Python API, a message
naming the flag and exit status 2 on the command line, never a traceback."""

from __future__ import annotations

import json
import logging
import math
import socket

import pytest
import tokenizers

from metrale.cli import build_parser, main
from metrale.config import EngineConfig, ModelConfig, SpecConfig
from metrale.default_model import default_model_dir
from metrale.engine.model_setup import num_pages_for
from metrale.server import check_serve_options
from metrale.tokenizer import Tokenizer
from metrale.train import CorpusSpec, TrainOptions
from metrale.train.dflash import train_dflash
from metrale.train.state import load_state


def _usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def _run(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


# 1. the KV pool's size


@pytest.mark.parametrize("value", [math.inf, math.nan, None, "4", True])
def test_kv_cache_memory_gb_must_be_a_finite_number(value):
    with pytest.raises(ValueError, match="kv_cache_memory_gb"):
        EngineConfig(kv_cache_memory_gb=value)


@pytest.mark.parametrize("value", ["0.5", math.nan, True])
def test_gpu_memory_utilization_must_be_a_number(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=value)


@pytest.mark.parametrize(
    "field, value",
    [
        # bools passed as integers; values whose tables took gigabytes of host memory, a
        # timeout a timedelta overflowed on, a device torch names but metrale does not run
        # on (all found in review)
        ("max_num_seqs", True),
        ("page_size", True),
        ("num_lookahead_rows", True),
        ("max_num_seqs", 100_000_000),
        ("max_num_batched_tokens", 100_000_000),
        ("distributed_timeout_s", math.inf),
        ("distributed_timeout_s", 1e300),
        ("seed", -(2**63) - 1),
        ("seed", 2**64),
        ("device", "meta"),
    ],
)
def test_engine_options_out_of_range_name_their_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value}).resolve_device()


def test_a_kv_pool_beyond_the_device_memory_names_num_kv_pages():
    model = ModelConfig.from_hf(default_model_dir())
    cfg = EngineConfig(device="cpu", num_kv_pages=10**12)
    with pytest.raises(ValueError, match="num_kv_pages"):
        num_pages_for(model, cfg, 128, model.dtype, 0, model.num_hidden_layers)


def test_cli_kv_cache_memory_gb_inf_exits_2(capsys):
    assert "kv_cache_memory_gb" in _run(["generate", "--kv-cache-memory-gb", "inf", "hi"], capsys)


# 2. a corrupt resume state


@pytest.mark.parametrize("content", [b"", b"garbage, not a torch file"])
def test_an_unreadable_state_file_is_named(tmp_path, content):
    path = tmp_path / "mtp_train_state.pt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="unreadable.*remove it to start over"):
        load_state(path)


# 3. serve's listener options


@pytest.mark.parametrize(
    "argv",
    [
        ["--port", "-1"],
        ["--port", "70000"],
        ["--max-body-bytes", "-1"],
        ["--shutdown-grace", "-5"],
        ["--allowed-origins", ""],  # (an empty origin allowed no browser and looked set)
        ["--allowed-origins", "https://a.example", " https://b.example"],
        ["--allowed-origins", "https://a.example/"],
        ["--allowed-origins", "https://a.example,https://b.example"],
        ["--allowed-origins", "a.example"],
    ],
)
def test_serve_refuses_bad_listener_flags_at_parse_time(argv, capsys):
    assert argv[0] in _usage_error(["serve", *argv], capsys)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"port": 70000}, "port"),
        ({"port": -1}, "port"),
        ({"max_body_bytes": 0}, "max_body_bytes"),
        ({"shutdown_grace": -5.0}, "shutdown_grace"),
        ({"shutdown_grace": math.inf}, "shutdown_grace"),
        ({"api_key": ""}, "api_key"),  # (it turned authentication off: found in review)
        ({"api_key": "  "}, "api_key"),
        ({"host": "999.1.1.1"}, "host"),
        ({"host": "no such host.invalid"}, "host"),
    ],
)
def test_serve_options_are_checked_before_the_model_loads(kwargs, field):
    options = {"port": 0, "max_body_bytes": 1024, "shutdown_grace": 30.0, **kwargs}
    with pytest.raises(ValueError, match=field):
        check_serve_options(**options)


def test_a_port_in_use_is_named_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"port: cannot listen on 127.0.0.1:{port}"):
            check_serve_options(port, 1024, 30.0)
    check_serve_options(port, 1024, 30.0)  # free again


def test_the_listen_probe_binds_as_the_server_does():
    """As asyncio's create_server binds (found in review: one dual-stack socket refused '::'
    beside an IPv4 listener, and '' for all interfaces did not resolve)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        check_serve_options(port, 1024, 30.0, host="::1") if socket.has_ipv6 else None
        with pytest.raises(ValueError, match="port: cannot listen"):
            check_serve_options(port, 1024, 30.0, host="")  # every interface: 0.0.0.0 too
    check_serve_options(0, 1024, 30.0, host="")


# 4. a checkpoint's invalid sampling defaults


def test_invalid_generation_config_defaults_are_dropped_with_a_warning(caplog):
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    gen = {"temperature": -3, "top_p": 7, "top_k": 20, "min_p": "x"}
    with caplog.at_level(logging.WARNING, logger="metrale.tokenizer"):
        defaults = Tokenizer(tok, generation_config=gen).sampling_defaults
    assert defaults == {"top_k": 20}
    for name in ("temperature", "top_p", "min_p"):
        assert f"ignoring {name}=" in caplog.text


# 5. an --out path the command cannot write


def test_an_os_error_from_a_command_exits_2(monkeypatch, capsys):
    def refuse(args):
        raise FileExistsError(17, "File exists", "out")

    monkeypatch.setattr("metrale.cli.cmd_train", refuse)
    assert "File exists" in _run(["train", "tokenizer", "--out", "out"], capsys)


# 6. a corrupt checkpoint


def test_a_corrupt_tokenizer_json_names_the_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"bad')
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_a_config_json_list_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json: expected a JSON object"):
        ModelConfig.from_hf(tmp_path)


def test_a_non_numeric_rope_factor_names_the_field():
    cfg = json.loads((default_model_dir() / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": "x"}
    with pytest.raises(ValueError, match="rope_scaling.factor"):
        ModelConfig.from_dict(cfg)


# 7. bench's device and server


def test_bench_refuses_an_unknown_device(capsys):
    assert "--device" in _usage_error(["bench", "--device", "foo"], capsys)


def test_bench_serve_names_an_unreachable_server(capsys):
    url = "http://127.0.0.1:9"
    argv = ["bench", "serve", "--base-url", url, "--num-prompts", "1"]
    assert f"cannot reach the server at {url}" in _run(argv, capsys)


# 8. DFlash's target layers


def test_train_dflash_refuses_a_non_integer_layer_list(capsys):
    argv = ["train", "dflash", "--target", "t", "--target-layers", "a"]
    assert "--target-layers" in _usage_error(argv, capsys)


@pytest.mark.parametrize("kwargs, match", [({"target_layers": (1, 1)}, "twice")])
def test_train_dflash_refuses_repeated_or_too_many_taps(tmp_path, kwargs, match):
    opts = TrainOptions(steps=1, device="cpu", progress=False)
    corpus = CorpusSpec(dirs=(str(tmp_path),))  # empty: a missed check fails fast, not trains
    with pytest.raises(ValueError, match=match):
        train_dflash(default_model_dir(), corpus, opts, out_dir=tmp_path, **kwargs)


# 9. types of the engine's and the drafter's fields


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"prefix_caching": "no"}, "prefix_caching"),
        ({"deterministic": 0.5}, "deterministic"),
        ({"cuda_graphs": None}, "cuda_graphs"),
        ({"async_scheduling": 1}, "async_scheduling"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "4"}, "seed"),
        ({"seed": True}, "seed"),
        ({"device": None}, "device"),
        ({"spec": {"method": "ngram", "dcut": "no"}}, "spec.dcut"),
        ({"spec": {"method": "ngram", "verify_raw_argmax": 1}}, "spec.verify_raw_argmax"),
        ({"spec": {"method": "ngram", "dcut_prior": "x"}}, "spec.dcut_prior"),
        ({"spec": {"method": "ngram", "model": "/nonexist"}}, "spec.model"),
        ({"spec": {"method": "mtp", "model": "/nonexist"}}, "spec.model"),
    ],
)
def test_engine_config_field_types(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_a_dflash_drafter_may_name_its_checkpoint():
    assert SpecConfig(method="dflash", model="/some/dir").model == "/some/dir"


# 10. training's float options


@pytest.mark.parametrize("field", ["lr", "weight_decay", "grad_clip", "time_limit"])
@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_train_options_must_be_finite(field, value):
    with pytest.raises(ValueError, match=field):
        TrainOptions(**{field: value})


@pytest.mark.parametrize("flag", ["--lr", "--beta1", "--depth-decay"])
def test_train_cli_refuses_non_finite_floats(flag, capsys):
    assert flag in _usage_error(["train", "mtp", "--target", "t", flag, "inf"], capsys)


@pytest.mark.parametrize(
    "device, gpus, match",
    [
        ("cuda:1", 4, r"^device: 'cuda:1' with tensor_parallel_size=2"),  # every rank on cuda:1
        ("cuda", 1, r"^tensor_parallel_size=2, but only 1 GPU"),  # a worker failed to start
        ("auto", 1, r"^tensor_parallel_size=2, but only 1 GPU"),
    ],
)
def test_tensor_parallelism_refuses_devices_its_ranks_cannot_use(monkeypatch, device, gpus, match):
    """Rank r runs on cuda:r: an indexed device, or fewer GPUs than ranks, is refused before any
    worker starts (found in review: a worker that failed while the group formed left rank 0
    waiting out the 10-minute start-up timeout)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    cfg = EngineConfig(device=device, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=match):
        cfg.resolve_device()
    assert EngineConfig(device="cuda", tensor_parallel_size=1).resolve_device().type == "cuda"

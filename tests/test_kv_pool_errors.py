"""A KV pool the device has no room for is a ValueError naming the pool's size and the settings
that lower it (the runner's pools and a tensor-parallel worker's `bind_kv`), with anything
allocated before it dropped; any other failure of the allocation is raised as it is. And
`metrale bench serve --multi-turn` against a server whose `/v1/models` lists no model exits 2
naming --served-model."""

from __future__ import annotations

import gc
import sys
import threading
import weakref
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch

import metrale.distributed.shard as shard
import metrale.engine.model_setup as model_setup
from metrale import LLM
from metrale.cli import main
from metrale.config import EngineConfig, ModelConfig
from metrale.distributed.parallel import TPGroup

OUT_OF_MEMORY = {
    "torch": lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB"),
    "cuda-error": lambda: RuntimeError("CUDA error: out of memory"),
    "host": lambda: RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: can't allocate memory: "
        "you tried to allocate 8589934592 bytes. Error code 12 (Cannot allocate memory)"
    ),
}


def failing_allocation(monkeypatch, module, error: Exception, fail_at: int = 0) -> list:
    """Make `module`'s `allocate_kv_cache` raise `error` on call `fail_at` (the calls before it
    allocate); the arguments of every call are recorded in the list returned."""
    real, calls = module.allocate_kv_cache, []

    def allocate(*args):
        calls.append(args)
        if len(calls) > fail_at:
            raise error
        return real(*args)

    monkeypatch.setattr(module, "allocate_kv_cache", allocate)
    return calls


@pytest.mark.parametrize("kind", sorted(OUT_OF_MEMORY))
def test_an_out_of_memory_pool_names_the_settings(tiny_model_dir, monkeypatch, kind):
    error = OUT_OF_MEMORY[kind]()
    calls = failing_allocation(monkeypatch, model_setup, error)
    with pytest.raises(ValueError, match="num_kv_pages") as e:
        LLM(tiny_model_dir, device="cpu", max_num_seqs=4)
    message, (_, num_pages, page_size, dtype, _, num_layers) = str(e.value), calls[0]
    pool_bytes = num_pages * page_size * num_layers * 2 * 2 * 16 * dtype.itemsize  # K, V: 2 heads
    assert f"({num_pages} pages, {pool_bytes} bytes = " in message
    # 4 sequences, not the 4 GiB budget, sized the pool: lowering the budget would change nothing
    assert "for max_num_seqs=4 full-length sequences" in message
    assert "lower max_num_seqs or max_model_len, or kv_cache_memory_gb" in message
    assert "free cpu memory" in message and e.value.__cause__ is error


def test_a_pool_the_budget_sized_names_the_budget(tiny_model_dir, monkeypatch):
    """Where the budget affords fewer pages than `max_num_seqs` full sequences take, the budget
    is the setting that lowers the pool (lowering max_num_seqs would change nothing)."""
    calls = failing_allocation(monkeypatch, model_setup, torch.OutOfMemoryError("out of memory"))
    with pytest.raises(ValueError) as e:
        LLM(tiny_model_dir, device="cpu", max_num_seqs=64, kv_cache_memory_gb=0.001)
    num_pages = calls[0][1]
    assert str(e.value).startswith(
        f"the KV pool that kv_cache_memory_gb=0.001 affords ({num_pages}"
    )
    assert str(e.value).endswith("; lower kv_cache_memory_gb, or set num_kv_pages")
    assert " MiB)" in str(e.value)  # not "0.0 GiB"


def test_an_out_of_memory_pool_of_num_kv_pages_names_it(tiny_model_dir, monkeypatch):
    failing_allocation(monkeypatch, model_setup, torch.OutOfMemoryError("CUDA out of memory"))
    with pytest.raises(ValueError, match=r"^num_kv_pages=40: the KV pool \(40 pages, .*; lower"):
        LLM(tiny_model_dir, device="cpu", num_kv_pages=40)


def test_the_target_pool_is_dropped_when_the_drafter_pool_fails(tiny_model_dir, monkeypatch):
    """The drafters' pool (after the target's) failing: the target's goes before the error,
    though the error's traceback (kept, as a REPL keeps the last one) holds the runner's frame."""
    real, kept = model_setup.allocate_kv_cache, []

    def allocate(*args):
        if kept:
            raise torch.OutOfMemoryError("CUDA out of memory")
        pool = real(*args)
        kept.append(weakref.ref(pool))
        return pool

    monkeypatch.setattr(model_setup, "allocate_kv_cache", allocate)
    with pytest.raises(ValueError, match="num_kv_pages=12") as e:
        LLM(tiny_model_dir, device="cpu", num_kv_pages=12)
    gc.collect()
    assert e.value.__traceback__ is not None and kept and kept[0]() is None


def test_any_other_allocation_error_is_raised_as_it_is(tiny_model_dir, monkeypatch):
    error = RuntimeError("device-side assert triggered")
    failing_allocation(monkeypatch, model_setup, error)
    with pytest.raises(RuntimeError) as e:
        LLM(tiny_model_dir, device="cpu")
    assert e.value is error


class _Shard(torch.nn.Module):
    """What `bind_kv` reads of a rank's model: a parameter (its dtype and device) and the
    attention layers it binds a pool to."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.attention_layers = [torch.nn.Module(), torch.nn.Module()]


def test_bind_kv_names_the_settings_when_out_of_memory(tiny_model_dir, monkeypatch):
    model_cfg, model = ModelConfig.from_hf(tiny_model_dir), _Shard()
    cfg = EngineConfig(device="cpu", num_kv_pages=10, page_size=4)
    shard.bind_kv(model, model_cfg, cfg, 10, TPGroup(0, 1))  # room: each layer gets its pool
    assert [layer.kv_cache.shape for layer in model.attention_layers] == [(2, 10, 4, 2, 16)] * 2
    failing_allocation(monkeypatch, model_setup, torch.OutOfMemoryError("CUDA out of memory"))
    with pytest.raises(ValueError, match="num_kv_pages=10") as e:
        shard.bind_kv(_Shard(), model_cfg, cfg, 10, TPGroup(0, 1))
    # 10 pages of 4 rows, 2 layers, K and V, 2 heads of 16 float32s
    assert f"(10 pages, {10 * 4 * 2 * 2 * 2 * 16 * 4} bytes = " in str(e.value)
    error = RuntimeError("device-side assert triggered")
    failing_allocation(monkeypatch, model_setup, error)
    with pytest.raises(RuntimeError) as e:
        shard.bind_kv(_Shard(), model_cfg, cfg, 10, TPGroup(0, 1))
    assert e.value is error


class _NoModels(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = b'{"object": "list", "data": []}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_bench_serve_multi_turn_names_served_model_when_none_is_listed(capsys):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NoModels)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        argv = ["bench", "serve", "--base-url", url, "--multi-turn", "--num-clients", "1"]
        assert main(argv + ["--num-turns", "1", "--system-prompt-len", "4"]) == 2
    finally:
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err
    assert "no model listed (HTTP 200); give --served-model" in err and "Traceback" not in err


def test_a_dflash_context_pool_without_room_names_the_whole_pool_and_drops_it(monkeypatch):
    """The DFlash drafter's context K/V pool, budgeted with the KV pool and allocated after it,
    failing for room: the error names their pages and bytes together (the setting lowers
    both), and the KV pool goes before it, as when the drafters' pool fails."""
    from metrale.default_model import default_model_dir
    from metrale.models.dflash import DFlashConfig

    real_zeros, real_allocate, kept = torch.zeros, model_setup.allocate_kv_cache, []

    def zeros(*shape, **kw):
        if sys._getframe(1).f_code.co_name == "allocate_kv_pools":  # the DFlash pool alone
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real_zeros(*shape, **kw)

    def allocate(*args):
        pool = real_allocate(*args)
        kept.append(weakref.ref(pool))
        return pool

    monkeypatch.setattr(torch, "zeros", zeros)
    monkeypatch.setattr(model_setup, "allocate_kv_cache", allocate)
    spec = {"method": "dflash", "num_drafts": 3}
    with pytest.raises(ValueError, match="num_kv_pages=16: the KV pool") as e:
        LLM(default_model_dir(), device="cpu", num_kv_pages=16, spec=spec)
    model = ModelConfig.from_hf(default_model_dir())
    dflash = DFlashConfig.from_dir(default_model_dir() / "dflash")
    page_size, itemsize = EngineConfig().page_size, torch.float32.itemsize
    target = model.num_hidden_layers * 2 * page_size * model.num_key_value_heads * model.head_dim
    pool_bytes = 16 * (target * itemsize + dflash.page_bytes(page_size, torch.float32))
    assert f"(16 pages, {pool_bytes} bytes = " in str(e.value)
    gc.collect()
    assert e.value.__traceback__ is not None and kept and all(k() is None for k in kept)


def test_a_worker_that_refuses_the_settings_is_a_value_error():
    """A tensor-parallel worker whose KV pool has no room reports a ValueError naming the
    settings: rank 0 raises it as one (the CLI's exit 2), not as a failed group."""
    import multiprocessing

    from metrale.distributed.parallel import DistributedError
    from metrale.distributed.startup import ShardSettingsError, _expect

    ours, theirs = multiprocessing.Pipe()
    alive, _ = multiprocessing.Pipe()  # a worker's sentinel that never fires
    proc = SimpleNamespace(sentinel=alive, exitcode=None, join=lambda timeout=None: None)
    theirs.send(("ValueError", "num_kv_pages=40: the KV pool (40 pages) does not fit"))
    with pytest.raises(ShardSettingsError, match=r"^rank 1: num_kv_pages=40: the KV pool"):
        _expect(1, proc, ours, "ready", 5.0)
    theirs.send(("RuntimeError", "NCCL error"))
    with pytest.raises(DistributedError, match="rank 2 could not build its shard: Runtime"):
        _expect(2, proc, ours, "ready", 5.0)
    theirs.send("ready")
    _expect(1, proc, ours, "ready", 5.0)
    assert issubclass(ShardSettingsError, ValueError)


def test_a_budget_below_one_sequence_names_kv_cache_memory_gb(tiny_model_dir):
    """Found in review: the message read 'the KV budget of 0.00 GiB' and named no option."""
    with pytest.raises(ValueError, match=r"^kv_cache_memory_gb: the KV budget of 1e-05 GiB"):
        LLM(tiny_model_dir, device="cpu", max_model_len=1024, kv_cache_memory_gb=1e-5)

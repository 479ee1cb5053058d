"""`metrale generate | chat | serve | bench | train`: the command line.

`generate` streams one completion to the terminal; `chat` is a multi-turn loop over the model's
chat template, reading user turns from standard input. Without `--model` both run the embedded
default model. `train tokenizer | target | mtp` runs the training stages of `metrale.train`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from metrale.bench.serve_bench import add_serve_bench_args
from metrale.cli_config import ORIGIN, add_config_flags, add_spec_flags, arg_type, engine_options
from metrale.config import HYBRID_VERIFY_STATES, SamplingParams
from metrale.train.cli import add_train_parsers, cmd_train


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The model and the drafter; every EngineConfig field's flag comes after the command's own
    (`add_config_flags`, called last so a command's own flag of the same name wins)."""
    p.add_argument(
        "--model",
        default=None,
        help="HF checkpoint directory or Hub id ORG/NAME (default: the embedded model)",
    )
    add_spec_flags(p)
    p.add_argument("-v", "--verbose", action="store_true", help="log engine start-up details")


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest (-1: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * max prob")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="HF-style, 1 = off")
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="generate past end-of-sequence tokens")


_PORT = arg_type(int, lambda v: 0 <= v <= 65535, "a port in 0..65535")
_POSITIVE = arg_type(int, lambda v: v > 0, "a positive integer")
_COUNT_OR_ZERO = arg_type(int, lambda v: v >= 0, "an integer >= 0")
_SECONDS = arg_type(float, lambda v: 0 <= v < float("inf"), "a finite number >= 0")
# (an empty name was taken as no name: review)
_served_name = arg_type(str, lambda v: v.strip() == v != "", "a name (not empty or padded)")


def _device(text: str) -> str:
    import torch

    return text if text == "auto" else str(torch.device(text))


_DEVICE = arg_type(
    _device, lambda v: v.split(":")[0] in ("auto", "cpu", "cuda"), "auto, cpu, cuda or cuda:N"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="metrale", description="metrale: LLM inference built around speculative decoding"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete a prompt, streaming the text")
    gen.add_argument("prompt", help="the text to continue")
    _add_engine_args(gen)
    _add_sampling_args(gen, max_tokens=64)
    add_config_flags(gen)
    chat = sub.add_parser("chat", help="multi-turn chat on stdin/stdout (chat template applied)")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_engine_args(chat)
    _add_sampling_args(chat, max_tokens=256)
    add_config_flags(chat)
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, ...)")
    _add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    srv.add_argument("--port", type=_PORT, default=8000, help="TCP port")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    srv.add_argument(
        "--served-model-name",
        type=_served_name,
        default=None,
        help="the model's name in the API (default: the Hub id, or the directory's name)",
    )
    srv.add_argument("--no-access-log", action="store_true", help="no stderr line per request")
    srv.add_argument(
        "--allowed-origins",
        nargs="*",
        type=ORIGIN,
        default=(),
        help="CORS: origins allowed to call the API from a browser (off by default)",
    )
    srv.add_argument(
        "--max-body-bytes", type=_POSITIVE, default=32 << 20, help="larger request bodies get a 413"
    )
    srv.add_argument(
        "--reasoning-parser",
        choices=("qwen3",),
        default=None,
        help="chat: return the model's <think> block as reasoning_content (off by default)",
    )
    srv.add_argument(
        "--shutdown-grace",
        type=_SECONDS,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds in-flight requests get to finish before being aborted",
    )
    add_config_flags(srv)
    bench = sub.add_parser("bench", help="step times vs roofline, verify cost, speculation speedup")
    bench.add_argument(
        "--model", default=None, help="HF checkpoint directory (default: the embedded model)"
    )
    bench.add_argument(
        "--shape",
        default=None,
        help="instead of a checkpoint, random bf16 weights of a published shape: qwen3-8b | "
        "qwen3-1.7b | qwen3-0.6b | qwen3-next-a3b-64e | qwen3-next-tiny | tiny",
    )
    bench.add_argument("--device", type=_DEVICE, default="auto", help="torch device")
    bench.add_argument("--dtype", default="auto", help="auto: bf16 on GPU, float32 on CPU")
    bench.add_argument("--batch-sizes", type=_int_list, default=[1, 4], help="e.g. 1,8,64,256")
    bench.add_argument(
        "--q", type=_int_list, default=[1, 2, 4], help="rows per sequence, 1,2,4,8,16"
    )
    bench.add_argument("--context", type=_POSITIVE, default=128, help="cached tokens per sequence")
    bench.add_argument(
        "--alpha",
        type=_float_list,
        default=[0.8],
        help="draft acceptance of the end-to-end runs, e.g. 0,0.5,0.8",
    )
    bench.add_argument(
        "--forced-acceptance",
        action="store_true",
        help="bench only: accept each draft at rate alpha whatever it is (the target's own "
        "tokens emitted), so a speculative step's cost can be measured on random weights",
    )
    bench.add_argument("--num-drafts", type=int, default=3, help="K for the end-to-end run")
    bench.add_argument(
        "--max-tokens", type=_POSITIVE, default=32, help="tokens per end-to-end request"
    )
    bench.add_argument("--e2e-batch-sizes", type=_int_list, default=[1, 4], help="e.g. 1,8,64")
    bench.add_argument(
        "--dcut",
        action="store_true",
        help="end-to-end runs let D-Cut pick depths (from the measured verify cost curve)",
    )
    bench.add_argument("--max-num-batched-tokens", type=int, default=8192, help="rows per step")
    bench.add_argument(
        "--hybrid-verify-state",
        choices=HYBRID_VERIFY_STATES,
        default="write_on_accept",
        help="hybrid targets: how a verify writes the recurrent state",
    )
    bench.add_argument(
        "--mamba-ssm-cache-dtype",
        default="float32",
        help="hybrid targets: the delta-rule state's storage (float32; auto: the model's dtype)",
    )
    bench.add_argument("--kv-cache-memory-gb", type=float, default=4.0, help="KV pool size")
    bench.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant kernels (the engine option): the same bits alone, in a batch, "
        "with speculation",
    )
    bench.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the engine option: launch each step while the device runs the one before (steps "
        "that draft stay synchronous; default: on)",
    )
    bench.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="ranks the target is split across"
    )
    bench.add_argument(
        "--expert-parallel",
        action="store_true",
        help="with --tensor-parallel-size: split a MoE target's experts across ranks",
    )
    bench.add_argument(
        "--distributed-timeout-s",
        type=float,
        default=None,
        help="seconds a tensor-parallel collective may wait before the engine fails",
    )
    bench.add_argument("--out", default="bench-out", help="folder for bench.json and bench.png")
    bench.add_argument(
        "--acceptance",
        action="store_true",
        help="instead: per-position acceptance of each drafter on held-out text, greedy "
        "(default model unless --model)",
    )
    bench.add_argument(
        "--heldout", default=None, help="held-out text: a folder or file (default: the stdlib)"
    )
    bench.add_argument("--num-prompts", type=_POSITIVE, default=16, help="held-out prompts")
    bench.add_argument("--prompt-tokens", type=_POSITIVE, default=128, help="tokens per prompt")
    bench.add_argument("--ks", type=_int_list, default=[1, 2, 3, 4, 5], help="draft depths K")
    bench.add_argument("--drafters", default="mtp,ngram,dflash", help="drafters to report")
    bench.add_argument(
        "--e2e-drafter",
        choices=("mtp", "ngram", "dflash"),
        default=None,
        help="instead: real tokens/s with and without this drafter on --model, held-out prompts",
    )
    bench.add_argument(
        "--steady-requests-per-slot",
        type=_COUNT_OR_ZERO,
        default=None,
        help="also stream this many requests per slot through each end-to-end batch size's "
        "slots (steady state, as a server sees; 0: closed batches only; default 4 with "
        "--e2e-drafter, 0 otherwise)",
    )
    modes = bench.add_subparsers(dest="bench_mode", metavar="serve")
    serve_bench = modes.add_parser(
        "serve", help="load an OpenAI-compatible server: TTFT, TPOT, ITL, e2e percentiles"
    )
    add_serve_bench_args(serve_bench)
    add_train_parsers(sub)
    return parser


def _float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"expected numbers in [0, 1], got {text!r}")
    return values


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def cmd_serve(args: argparse.Namespace) -> int:
    from metrale.server import serve

    serve(
        args.model,
        args.host,
        args.port,
        args.api_key,
        max_body_bytes=args.max_body_bytes,
        shutdown_grace=args.shutdown_grace,
        access_log=not args.no_access_log,
        allowed_origins=tuple(args.allowed_origins),
        reasoning_parser=args.reasoning_parser,
        served_name=args.served_model_name,
        **engine_options(args),
    )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if getattr(args, "bench_mode", None) == "serve":
        from metrale.bench.serve_bench import main as serve_main

        return serve_main(args)
    from metrale.bench.command import main

    return main(args)


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def _llm(args: argparse.Namespace):
    """The engine of `generate` and `chat`: one for the process, so the heap is frozen."""
    from metrale.api import LLM
    from metrale.engine.heap import freeze_startup_heap

    llm = LLM(args.model, **engine_options(args))
    freeze_startup_heap()
    return llm


def spec_summary(llm) -> str:
    """One line of speculative-decoding statistics for the end of a run."""
    tel = llm.engine.telemetry
    spec = tel.spec
    by_pos = " ".join(f"{a:.2f}" for a in spec.acceptance_by_position())
    tokens_per_step = tel.decode_tokens / tel.steps if tel.steps else 0.0
    return (
        f"spec {llm.engine.spec.drafter.name}: {spec.num_drafts} verifies, "
        f"{spec.num_draft_tokens} drafts, {spec.num_accepted_tokens} accepted, "
        f"mean acceptance length {spec.mean_acceptance_length:.2f}, "
        f"acceptance by position [{by_pos}], {tokens_per_step:.2f} tokens per step"
    )


def cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling(args)
    with _llm(args) as llm:
        return _generate(llm, args, params)


def _generate(llm, args: argparse.Namespace, params) -> int:
    out = sys.stdout
    stream = llm.stream(args.prompt, params)
    # the request is checked as it is queued, at the first output: a prompt refused (too long,
    # not UTF-8) is never echoed, its error glued to it (found in review)
    final = next(stream)
    out.write(args.prompt + final.outputs[0].delta_text)
    out.flush()
    for final in stream:
        out.write(final.outputs[0].delta_text)
        out.flush()
    out.write("\n")
    if llm.engine.spec is not None:
        print(spec_summary(llm), file=sys.stderr)
    completion = final.outputs[0]
    if completion.finish_reason == "error":
        print(f"error: {completion.error}", file=sys.stderr)
        return 1
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from metrale.chat_repl import run_repl

    params = _sampling(args)  # (checked before the model loads, as generate's are)
    with _llm(args) as llm:
        code = run_repl(llm, params, args.system)
        if llm.engine.spec is not None:
            print(spec_summary(llm), file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    handler = {
        "generate": cmd_generate,
        "chat": cmd_chat,
        "bench": cmd_bench,
        "serve": cmd_serve,
        "train": cmd_train,
    }[args.command]
    try:
        return handler(args)
    except KeyboardInterrupt:  # Ctrl-C: the request was aborted; no traceback (found in review)
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`metrale generate ... | head`): quiet, as Unix tools are; stdout
        # points at /dev/null so that the interpreter's last flush does not complain again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for such a writer
    except (ValueError, OSError) as e:
        # OSError: an --out path that exists as a file, a directory without write permission,
        # ... (FileNotFoundError is one); a clear message, not a traceback
        print(f"metrale {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as e:
        # (torch.OutOfMemoryError is a RuntimeError; the CPU allocator raises a plain one)
        text = str(e).strip() or repr(e)
        if not isinstance(e, MemoryError) and not ("out of memory" in text or "allocate" in text):
            raise
        print(
            f"metrale {args.command}: error: out of memory ({text.splitlines()[0]}); lower "
            "max_num_seqs, max_num_batched_tokens, max_model_len or the KV cache's size",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())

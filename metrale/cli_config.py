"""Command-line flags generated from `EngineConfig`, so the CLI and the Python API cannot drift
apart: one `--field-name` per field (vLLM's names where the meaning is the same), its help and
default from the field itself; and the speculative options (`--spec`/`--num-drafts` or vLLM's
`--speculative-config JSON`)."""

from __future__ import annotations

import argparse
import json
import urllib.parse
from dataclasses import fields

from metrale.config import HYBRID_VERIFY_STATES, SPEC_METHODS, EngineConfig

_TYPES = {"str": str, "int": int, "float": float, "bool": bool}
_CHOICES = {"hybrid_verify_state": HYBRID_VERIFY_STATES, "load_format": ("safetensors", "dummy")}
# vLLM's --speculative-config keys that metrale names otherwise
_SPEC_RENAMES = {"num_speculative_tokens": "num_drafts"}


def arg_type(convert, check, expected: str):
    """An argparse type: a bad value is a usage error naming the flag (exit 2), at parse time,
    rather than a failure after the model has loaded."""

    def parse(text: str):
        try:
            value = convert(text)
        except (ValueError, RuntimeError):  # RuntimeError: torch.device's refusal
            value = None
        if value is None or not check(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    parse.__name__ = expected  # argparse names the type in some messages
    return parse


def _is_origin(text: str) -> bool:
    """ "*" or scheme://host[:port], as a browser sends it (CORS matches origins exactly: an
    empty one, a trailing slash, a path or a comma-joined list allowed no browser and looked
    set; found in review)."""
    if text == "*":
        return True
    parts = urllib.parse.urlsplit(text)
    return (
        bool(parts.scheme and parts.netloc)
        and text == f"{parts.scheme}://{parts.netloc}"
        and not any(c in text for c in ", \t")
    )


ORIGIN = arg_type(str, _is_origin, "an origin such as https://a.example (or *)")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """A flag per EngineConfig field (but `spec`) the parser does not have already (a command's
    own `--seed` is the sampling seed); `engine_options` collects them."""
    existing = set(parser._option_string_actions)
    names = []
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "spec" or flag in existing:
            continue
        kind = _TYPES[str(f.type).split(" | ")[0]]
        help_text = f.metadata.get("help", f.name)
        if "default" not in help_text:
            help_text += " (default: %(default)s)"
        if kind is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
            )
        else:
            parser.add_argument(
                flag, type=kind, default=f.default, choices=_CHOICES.get(f.name), help=help_text
            )
        names.append(f.name)
    parser.set_defaults(engine_fields=tuple(names))


def add_spec_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spec",
        choices=SPEC_METHODS,
        default=None,
        help="speculative decoding drafter (output is unchanged; acceptance is printed at the end)",
    )
    parser.add_argument(
        "--draft-model",
        default=None,
        help="the drafter's own checkpoint (--spec dflash; default: the model's dflash/ folder)",
    )
    parser.add_argument(
        "--num-drafts",
        type=int,
        default=None,
        help="drafts per verify at most (K; default 4, DFlash: its block size - 1)",
    )
    parser.add_argument(
        "--no-dcut",
        action="store_true",
        help="verify every sequence at full depth instead of D-Cut's per-sequence depths",
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='vLLM\'s form, e.g. \'{"method": "mtp", "num_speculative_tokens": 3}\' (any '
        "SpecConfig field too); instead of --spec",
    )


def spec_options(args: argparse.Namespace) -> dict | None:
    flags = (
        ("--num-drafts", args.num_drafts),
        ("--draft-model", args.draft_model),
        ("--no-dcut", args.no_dcut or None),
    )
    if args.speculative_config is not None:
        given = [flag for flag, value in (("--spec", args.spec), *flags) if value is not None]
        if given:
            raise ValueError(
                f"--speculative-config and {', '.join(given)}: say it all in one of them"
            )
        try:
            raw = json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config: not JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config: expected a JSON object")
        spec = {}
        for key, value in raw.items():
            name = _SPEC_RENAMES.get(key, key)
            if name in spec:
                raise ValueError(f"--speculative-config: {name} given twice (as {key})")
            spec[name] = value
        if spec.get("method") is None:  # (it ran without speculation, saying nothing)
            raise ValueError("--speculative-config: give a method (ngram, mtp or dflash)")
        return spec
    if args.spec is None:
        given = [flag for flag, value in flags if value is not None]
        if given:  # (they were ignored: found in review)
            raise ValueError(f"{', '.join(given)}: speculative options need --spec")
        return None
    # (None: the drafter's default, 4; DFlash's block - 1)
    spec = {"method": args.spec, "num_drafts": args.num_drafts, "dcut": not args.no_dcut}
    if args.draft_model is not None:
        spec["model"] = args.draft_model
    return spec


def engine_options(args: argparse.Namespace) -> dict:
    """The EngineConfig keyword arguments the command line gave (every generated flag)."""
    options = {name: getattr(args, name) for name in args.engine_fields}
    spec = spec_options(args)
    if spec is not None:
        options["spec"] = spec
    return options

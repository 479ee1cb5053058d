"""The command line as a user meets it: `metrale generate` and `metrale chat` in a subprocess, on
the shipped default model and on a given checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def metrale(*args: str, home, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "METRALE_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "metrale.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_generate_on_the_default_model(tmp_path):
    res = metrale("generate", "def fibonacci(n):", "--max-tokens", "12", home=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("def fibonacci(n):")
    assert len(res.stdout) > len("def fibonacci(n):\n")
    assert not (tmp_path / "models").exists()  # the shipped model: nothing built or downloaded


def test_generate_is_deterministic_when_greedy(tiny_model_dir, tmp_path):
    args = ("generate", "hello", "--model", str(tiny_model_dir), "--max-tokens", "10")
    first, second = metrale(*args, home=tmp_path), metrale(*args, home=tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout


def test_chat_reads_turns_from_stdin(tiny_model_dir, tmp_path):
    res = metrale(
        "chat",
        "--model",
        str(tiny_model_dir),
        "--max-tokens",
        "5",
        "--system",
        "be brief",
        home=tmp_path,
        stdin="hi\n/bogus\n/usr/lib is a path\nhow are you?\n/exit now\nnot read\n",
    )
    assert res.returncode == 0, res.stderr
    # a mistyped command is said, not sent as a message (review); a path is a message
    assert res.stdout.count("assistant> ") == 3
    assert "(unknown command /bogus; /help lists them)" in res.stdout


@pytest.mark.parametrize(
    "args, field",
    [
        (("--temperature", "-1"), "temperature"),
        (("--top-p", "0"), "top_p"),
        (("--max-tokens", "0"), "max_tokens"),
    ],
)
def test_bad_options_exit_with_a_named_error(tiny_model_dir, tmp_path, args, field):
    res = metrale("generate", "x", "--model", str(tiny_model_dir), *args, home=tmp_path)
    assert res.returncode == 2
    assert field in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("command", [("generate", "x"), ("chat",), ("bench",)])
def test_bad_sampling_options_are_refused_before_the_model_loads(tmp_path, command):
    """Found in review: `chat` and `bench` loaded the model before refusing --max-tokens 0 (a
    model that does not exist shows which came first)."""
    res = metrale(*command, "--model", str(tmp_path / "absent"), "--max-tokens", "0", home=tmp_path)
    assert res.returncode == 2 and "max" in res.stderr and "absent" not in res.stderr, res.stderr


def test_a_refused_prompt_is_not_echoed(tiny_model_dir, tmp_path):
    """`generate` checks the prompt before it writes it: a prompt past the model's length is
    an error on stderr, not echoed to stdout with the error glued on (found in review)."""
    res = metrale(
        "generate", "x = 1\n" * 400, "--model", str(tiny_model_dir), "--max-model-len", "64",
        home=tmp_path,
    )  # fmt: skip
    assert res.returncode == 2 and "prompt" in res.stderr and "Traceback" not in res.stderr
    assert res.stdout == ""


def test_help_lists_options(tmp_path):
    res = metrale("generate", "--help", home=tmp_path)
    assert res.returncode == 0 and "--temperature" in res.stdout and "--model" in res.stdout


def test_generate_with_speculation_prints_acceptance(tiny_model_dir, tmp_path):
    args = ("generate", "ab ab ab ab ab", "--model", str(tiny_model_dir), "--max-tokens", "16")
    spec = metrale(*args, "--spec", "ngram", "--num-drafts", "3", home=tmp_path)
    assert spec.returncode == 0, spec.stderr
    assert "spec ngram:" in spec.stderr and "mean acceptance length" in spec.stderr
    assert spec.stdout == metrale(*args, home=tmp_path).stdout  # the text is unchanged


def test_a_reader_that_goes_away_ends_generate_quietly(tiny_model_dir, tmp_path):
    """`metrale generate ... | head -c 5`: the closed pipe ends the command without an error
    message (as Unix tools end), exit status 141 (128 + SIGPIPE)."""
    env = {**os.environ, "METRALE_HOME": str(tmp_path)}
    args = ["generate", "hello", "--model", str(tiny_model_dir), "--max-tokens", "400"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "metrale.cli", *args, "--ignore-eos"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    proc.stdout.read(1)  # it started writing; the reader leaves
    proc.stdout.close()
    _, err = proc.communicate(timeout=300)
    assert b"Broken pipe" not in err and b"Traceback" not in err, err
    assert proc.returncode in (0, 141)

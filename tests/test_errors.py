"""Bad input: one `error:` line on stderr, a non-zero exit, no traceback, no rank left behind."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, launch, run_python
from fixtures import write_hf_model


def generate_args(model, *extra: str) -> list[str]:
    return [
        "-m",
        "llama_tp.generate",
        "--model",
        str(model),
        "--prompt",
        "hi",
        "--max-tokens",
        "2",
        *extra,
    ]


def assert_every_rank_failed(r, n: int) -> None:
    """The launcher reports each rank's code (and exits with the first failing one's);
    a rank that is still running after the grace period is stopped (SIGTERM: -15)."""
    for rank in range(n):
        assert re.search(rf"Node with rank {rank} exited with code (1|-15)\b", r.stderr), r.stderr


def assert_one_error(r, expected: str, code: int = 1) -> None:
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    assert expected in errors[0], errors[0]
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == code, (r.returncode, r.stderr)


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory, tiny_dir):
    """name -> (path, expected text of the error line)."""
    root = tmp_path_factory.mktemp("bad")
    out = {"missing": (root / "nope", "no such file or directory")}
    # Looks like a hub repo id: this machine (and CI) has no hub, and a real hub
    # would answer that the repo does not exist; either way one line.
    out["repo_id"] = ("no-such-org/no-such-model", "fetching it from the Hugging Face hub failed")
    (root / "empty").mkdir()
    out["no_config"] = (root / "empty", "not a model: expected a .gguf file or a directory")

    def variant(name: str, edit) -> None:
        path = root / name
        shutil.copytree(tiny_dir, path)
        config = json.loads((path / "config.json").read_text())
        edit(config)
        (path / "config.json").write_text(json.dumps(config))
        out[name] = path

    # neither native nor in mlx-lm (which runs every architecture it has: test_generic.py)
    variant("unknown_type", lambda c: c.update(model_type="nonesuch"))
    out["unknown_type"] = (out["unknown_type"], "unsupported model_type 'nonesuch': not native")
    variant("mismatch", lambda c: c.update(intermediate_size=128))
    out["mismatch"] = (
        out["mismatch"],
        "weights do not match the config: Expected shape (128, 64) but received shape (96, 64)",
    )
    bad_json = root / "bad_json"
    shutil.copytree(tiny_dir, bad_json)
    (bad_json / "config.json").write_text("{oops")
    out["bad_json"] = (bad_json, "config.json: not valid JSON")
    return out


@pytest.mark.parametrize(
    "name", ["missing", "repo_id", "no_config", "unknown_type", "mismatch", "bad_json"]
)
def test_bad_model_single_process(bad_models, name):
    path, expected = bad_models[name]
    assert_one_error(run_python(generate_args(path)), expected)


def test_bad_model_every_rank_exits(bad_models):
    path, expected = bad_models["mismatch"]
    r = launch(2, generate_args(path), timeout=120)
    assert_one_error(r, expected, code=1)
    assert_every_rank_failed(r, 2)


def test_more_ranks_than_heads(tmp_path):
    path = write_hf_model(tmp_path, tokenizer=True, n_heads=2, n_kv_heads=1, dim=32)
    r = launch(3, generate_args(path), timeout=120, ring=True)
    assert_one_error(r, "cannot split 2 query heads over 3 ranks: at most 2 ranks", code=1)
    assert_every_rank_failed(r, 3)


@pytest.mark.parametrize(
    "flag, expected",
    [
        (["--temp", "-1"], "--temp must be >= 0, got -1.0"),
        (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
        (["--max-tokens", "0"], "--max-tokens must be positive, got 0"),
    ],
)
def test_bad_sampling_values(tiny_dir, flag, expected):
    assert_one_error(run_python(generate_args(tiny_dir, *flag)), expected, code=2)


def test_empty_prompt_from_stdin(tiny_dir):
    args = generate_args(tiny_dir)
    args[args.index("hi")] = "-"
    assert_one_error(run_python(args, input=""), "the prompt is empty", code=2)


def test_prompt_from_stdin_is_used(tiny_dir):
    args = generate_args(tiny_dir, "--ignore-chat-template")
    from_arg = run_python(args)
    args[args.index("hi")] = "-"
    from_stdin = launch(2, args, input="hi")
    assert from_stdin.stdout == from_arg.stdout and from_arg.stdout.strip()


def test_unknown_flag_is_a_usage_error(tiny_dir):
    r = run_python(generate_args(tiny_dir, "--no-such-flag"))
    assert r.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in r.stderr


def test_invalid_utf8_on_stdin(tiny_dir):
    args = generate_args(tiny_dir)
    args[args.index("hi")] = "-"
    r = subprocess.run(
        [sys.executable, *args], cwd=ROOT, input=b"\xff\xfehi", capture_output=True, timeout=120
    )
    assert r.returncode == 2
    assert r.stderr.decode().strip() == "error: stdin is not valid UTF-8 (byte 0xff at 0)"


def test_quantized_heads_off_group_boundaries(tmp_path):
    path = write_hf_model(tmp_path, quantize=(8, 32))  # 8 heads of 8 columns, groups of 32
    r = launch(3, generate_args(path), timeout=120, ring=True)
    assert_one_error(
        r,
        "cannot split 8 query heads of 8 quantized columns over 3 ranks: rank 1 would start "
        "at column 24, not a multiple of the group size 32",
        code=1,
    )
    assert_every_rank_failed(r, 3)

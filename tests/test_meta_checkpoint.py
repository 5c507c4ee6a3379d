"""Original Meta Llama checkpoints (params.json, consolidated.NN.pth, tokenizer.model).

A tiny model is written twice from the same weights: as a Hugging Face directory
(tests/fixtures.py) and in Meta's format (tests/pth_writer.py, the bytes torch.save
writes), with the q/k rows in Meta's interleaved RoPE order and, once more, split
over two model-parallel files as Meta's reference code splits them.
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import launch, run_python
from fixtures import CORPUS, write_hf_model
from pth_writer import TensorView, contiguous, pickle_state_dict, save, write_archive

from llama_tp.checkpoints import open_checkpoint
from llama_tp.checkpoints.base import CheckpointError
from llama_tp.checkpoints.hf import to_model_name
from llama_tp.checkpoints.pth import load as load_pth
from llama_tp.checkpoints.tokenizer import encode_prompt
from llama_tp.engine.generation import generate_step
from llama_tp.loading.loader import load

CONFIG = dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, hidden_dim=96, vocab_size=388)
# Meta's FeedForward rule gives 96 for dim 64: int(0.5 * int(2 * 256 / 3)) = 85, up to 32s.
PARAMS = {
    "dim": 64,
    "n_layers": 2,
    "n_heads": 8,
    "n_kv_heads": 2,
    "vocab_size": -1,
    "multiple_of": 32,
    "ffn_dim_multiplier": 0.5,
    "norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
PROMPT = "The quick brown fox"
N_TOKENS = 16
TEXTS = [
    "Hello world",
    "héllo wörld, naïve café: 日本語 🙂",
    "  two  spaces\n\ttab 12345",
    "",
    " x",
]


def train_meta_tokenizer(out: Path) -> None:
    """A sentencepiece BPE model trained with the options of Llama's tokenizer.model."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 4),
        model_writer=model,
        vocab_size=CONFIG["vocab_size"],
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    (out / "tokenizer.model").write_bytes(model.getvalue())


def to_meta_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo convert_llama_weights_to_hf's q/k permutation: split halves -> interleaved pairs."""
    rows, cols = w.shape
    hd = rows // n_heads
    return w.reshape(n_heads, 2, hd // 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def meta_weights(hf_dir: Path) -> dict[str, mx.array]:
    out = {}
    for name, w in mx.load(str(hf_dir / "model.safetensors")).items():
        new = to_model_name(name)
        if new.endswith("attention.wq.weight"):
            w = to_meta_rows(w, CONFIG["n_heads"])
        elif new.endswith("attention.wk.weight"):
            w = to_meta_rows(w, CONFIG["n_kv_heads"])
        out[new] = w
    # Llama 1/2 checkpoints carry precomputed rotary frequencies; readers drop them.
    out["rope.freqs"] = mx.arange(CONFIG["dim"] // CONFIG["n_heads"] // 2, dtype=mx.float32)
    return out


# Meta's model-parallel split: ColumnParallelLinear by rows, RowParallelLinear and
# ParallelEmbedding (Llama 2) by columns; everything else replicated.
SPLIT_AXIS = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0}
SPLIT_AXIS |= {"wo": 1, "w2": 1, "tok_embeddings": 1}


def write_meta_model(path: Path, weights: dict[str, mx.array], n_files: int = 1) -> Path:
    path.mkdir(parents=True)
    (path / "params.json").write_text(json.dumps(PARAMS))
    for i in range(n_files):
        shard = {}
        for name, w in weights.items():
            axis = SPLIT_AXIS.get(name.split(".")[-2])
            shard[name] = w if axis is None else mx.split(w, n_files, axis=axis)[i]
        save(shard, path / f"consolidated.{i:02d}.pth")
    return path


@pytest.fixture(scope="module")
def twins(tmp_path_factory) -> dict[str, Path]:
    """The HF model, its Meta twin in one file, and in two model-parallel files."""
    root = tmp_path_factory.mktemp("meta")
    hf = write_hf_model(root / "hf", seed=5, tokenizer=False, **CONFIG)
    train_meta_tokenizer(hf)
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "legacy": False}
    (hf / "tokenizer_config.json").write_text(json.dumps(config))
    weights = meta_weights(hf)
    dirs = {"hf": hf}
    for name, n in (("meta", 1), ("meta2", 2)):
        dirs[name] = write_meta_model(root / name, weights, n)
        shutil.copy(hf / "tokenizer.model", dirs[name])
    return dirs


@pytest.fixture(scope="module")
def models(twins):
    return {name: load(path) for name, path in twins.items()}


def logits(model, ids: list[int]) -> mx.array:
    out = model(mx.array([ids]))
    mx.eval(out)
    return out


def greedy_tokens(model, prompt: list[int]) -> list[int]:
    steps = generate_step(model, prompt, lambda x: mx.argmax(x, axis=-1), N_TOKENS)
    return [token for token, _ in steps]


def test_reads_meta_format(twins):
    ckpt = open_checkpoint(twins["meta"])
    assert ckpt.format == "meta"
    a = ckpt.args
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads) == (64, 2, 8, 2)
    assert (a.hidden_dim, a.vocab_size) == (96, 388)  # Meta's rule; vocab -1 -> embedding rows
    assert a.rope_traditional and not a.tie_word_embeddings and a.rope_scaling is None
    assert "rope.freqs" not in ckpt.weights
    assert (ckpt.metadata["bos_token_id"], ckpt.metadata["eos_token_id"]) == (1, 2)
    hf = mx.load(str(twins["hf"] / "model.safetensors"))
    assert mx.array_equal(
        ckpt.weights["layers.1.feed_forward.w2.weight"], hf["model.layers.1.mlp.down_proj.weight"]
    )


def test_logits_equal_hf_twin(models):
    ids = list(range(3, 40))
    meta, hf = logits(models["meta"][0], ids), logits(models["hf"][0], ids)
    assert meta.shape == (1, len(ids), CONFIG["vocab_size"])
    assert mx.abs(meta - hf).max().item() < 1e-4


def test_greedy_generation_equals_hf_twin(models):
    prompt = encode_prompt(models["meta"][1], PROMPT, use_chat_template=False)
    assert prompt == encode_prompt(models["hf"][1], PROMPT, use_chat_template=False)
    tokens = greedy_tokens(models["meta"][0], prompt)
    assert len(tokens) == N_TOKENS
    assert tokens == greedy_tokens(models["hf"][0], prompt)


def test_two_files_merge_to_the_same_model(twins, models):
    ckpt = open_checkpoint(twins["meta2"])
    assert ckpt.metadata["shards"] == 2
    assert ckpt.args.hidden_dim == 96
    ids = list(range(3, 40))
    assert mx.array_equal(logits(models["meta2"][0], ids), logits(models["meta"][0], ids))


def test_sharded_over_two_ranks_equals_one_process(twins):
    r = launch(2, ["tests/mp_check_logits.py", str(twins["meta2"])], timeout=120)
    assert f"OK n=2 {twins['meta2']} " in r.stdout, r.stdout + r.stderr[-2000:]


def test_tokenizer_is_sentencepiece_with_bos(twins, models):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(twins["meta"] / "tokenizer.model"))
    tok = models["meta"][1]
    assert tok.eos_token_ids == {2} and not tok.has_chat_template
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == [1, *sp.encode(text)], text  # Meta's Tokenizer.encode(s, bos=True)
        assert tok.decode(ids, skip_special_tokens=True) == sp.decode(ids[1:]), text
    detok = tok.detokenizer
    detok.reset()
    for i in tok.encode(TEXTS[1])[1:]:
        detok.add_token(i)
    detok.finalize()
    assert detok.text == TEXTS[1]


def test_pth_reader_dtypes_and_views(tmp_path):
    base = np.arange(24, dtype=np.float32)
    shared = TensorView(contiguous(base).storage, 0, (4, 6), (6, 1))
    tensors = {
        "f32": np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4),
        "f16": np.linspace(-2, 2, 6, dtype=np.float16),
        "bf16": mx.array([[1.5, -2.25], [3e-3, 65280.0]]).astype(mx.bfloat16),
        "i64": np.array([[-(2**40), 7]], dtype=np.int64),
        "scalar": np.array(3.0, dtype=np.float32),
        "shared": shared,  # this and the next two share one storage, as views do in torch
        "transposed": TensorView(shared.storage, 0, (6, 4), (1, 6)),
        "offset_strided": TensorView(shared.storage, 7, (2, 3), (12, 2)),
    }
    got = load_pth(save(tensors, tmp_path / "x.pth"))
    assert list(got) == list(tensors)
    for name in ("f32", "f16", "i64", "scalar"):
        assert got[name].array.dtype == tensors[name].dtype, name
        assert np.array_equal(got[name].native(), tensors[name]), name
    bf16 = got["bf16"].to_mx()
    assert bf16.dtype == mx.bfloat16 and mx.array_equal(bf16, tensors["bf16"])
    grid = base.reshape(4, 6)
    assert np.array_equal(got["shared"].native(), grid)
    assert np.array_equal(got["transposed"].native(), grid.T)
    assert np.array_equal(
        got["offset_strided"].native(), base[7:].reshape(-1)[[0, 2, 4, 12, 14, 16]].reshape(2, 3)
    )
    assert np.array_equal(np.array(got["transposed"].to_mx()), grid.T)


def poisoned_pickle(module: str, name: str, arg: str) -> bytes:
    """Protocol-2 pickle of {'w': module.name(arg)}: what a malicious .pth could hold."""
    call = b"c" + f"{module}\n{name}\n".encode() + pickle.dumps(arg, protocol=2)[2:-1]
    return b"\x80\x02}q\x00X\x01\x00\x00\x00w" + call + b"\x85R" + b"s."


@pytest.mark.parametrize("module,name", [("os", "system"), ("builtins", "exec")])
def test_forbidden_global_is_refused_not_run(tmp_path, module, name):
    marker = tmp_path / "pwned"
    code = f"touch {marker}" if name == "system" else f"open({str(marker)!r}, 'w')"
    data = poisoned_pickle(module, name, code)
    assert pickle.loads(data) is not None and marker.exists()  # the payload is real
    marker.unlink()
    _, storages = pickle_state_dict({})
    meta = tmp_path / "meta"
    meta.mkdir()
    (meta / "params.json").write_text(json.dumps(PARAMS))
    write_archive(meta / "consolidated.00.pth", data, storages)
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(meta)
    assert str(e.value) == (
        f"{meta / 'consolidated.00.pth'}: refused: data.pkl contains the global "
        f"{module}.{name} (only torch tensors and storages are allowed)"
    )
    assert not marker.exists()


def test_truncated_pth_is_one_error_line(twins, tmp_path):
    meta = tmp_path / "meta"
    shutil.copytree(twins["meta"], meta)
    pth = meta / "consolidated.00.pth"
    pth.write_bytes(pth.read_bytes()[: pth.stat().st_size // 2])
    r = run_python(["-m", "llama_tp.generate", "--model", str(meta), "--prompt", "hi"], timeout=60)
    assert r.returncode == 1, r.stderr
    assert r.stderr == f"error: {pth}: truncated or damaged zip archive (no central directory)\n"
    assert r.stdout == ""


def test_missing_shard_and_legacy_files(twins, tmp_path):
    meta = tmp_path / "meta2"
    shutil.copytree(twins["meta2"], meta)
    (meta / "consolidated.01.pth").rename(meta / "consolidated.02.pth")
    with pytest.raises(CheckpointError, match=r"missing consolidated\.01\.pth \(found 2 shards\)"):
        open_checkpoint(meta)
    legacy = tmp_path / "old.pth"
    legacy.write_bytes(pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2) + b"rest")
    with pytest.raises(CheckpointError, match=r"old\.pth: a legacy \(pre-1\.6\) torch\.save file"):
        load_pth(legacy)


def test_params_that_contradict_the_weights(twins, tmp_path):
    meta = tmp_path / "meta"
    shutil.copytree(twins["meta"], meta)
    (meta / "params.json").write_text(json.dumps({**PARAMS, "ffn_dim_multiplier": 1.0}))
    with pytest.raises(
        CheckpointError, match="feed-forward size of 192, but layers.0.feed_forward.w1 has 96 rows"
    ):
        open_checkpoint(meta)


def test_converts_for_mlx_lm(twins, models, tmp_path):
    """convert turns the Meta checkpoint into a directory mlx-lm generates the same tokens from."""
    import mlx_lm
    from mlx_lm.generate import generate_step as mlx_lm_step

    out = tmp_path / "out"
    r = run_python(["-m", "llama_tp.convert", "--model", str(twins["meta"]), "--out", str(out)])
    assert r.returncode == 0, r.stderr
    model, tok = mlx_lm.load(str(out))
    prompt = encode_prompt(models["meta"][1], PROMPT, use_chat_template=False)
    assert list(tok.encode(PROMPT)) == prompt
    tokens = [int(t) for t, _ in mlx_lm_step(mx.array(prompt), model, max_tokens=N_TOKENS)]
    assert tokens == greedy_tokens(models["hf"][0], prompt)

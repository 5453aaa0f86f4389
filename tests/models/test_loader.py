"""Loading model folders: clear errors, hub-cache resolution, EOS lists, chat template, prompt validation."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer import LLM, SamplingParams, kernels
from infer.backends.onednn import PackedLinear, count_weights, cpu_packing_available
from infer.data.tokenizer import IM_END_ID, IM_START_ID
from infer.kernels.cpu import GemvLinear
from infer.loader import (
    CheckpointError,
    cpu_bf16_feature,
    load_config,
    load_model,
    load_tokenizer,
    resolve_model_path,
)

pytestmark = pytest.mark.usefixtures("torch_single_thread")

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def greedy(max_tokens: int = 32, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)  # type: ignore[arg-type]


# ------------------------------------------------------------------------- folder and config errors


def test_missing_folder(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_model"
    with pytest.raises(CheckpointError, match="not found") as err:
        load_model(missing, "float32", "cpu")
    assert str(missing) in str(err.value)


def test_file_instead_of_folder(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match="folder") as err:
        load_model(path, "float32", "cpu")
    assert str(path) in str(err.value)


def test_missing_config(tiny_llama: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny_llama, tmp_path / "m")
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json not found"):
        load_model(folder, "float32", "cpu")


def test_unsupported_model_type_is_named(tiny_llama: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny_llama, tmp_path / "m")
    edit_json(folder / "config.json", model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match="gpt2") as err:
        load_model(folder, "float32", "cpu")
    message = str(err.value)
    assert "config.json" in message and "unsupported" in message
    assert all(t in message for t in ("llama", "qwen2", "qwen3"))  # says what is supported


def test_invalid_config_json(tiny_llama: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny_llama, tmp_path / "m")
    (folder / "config.json").write_text('{"model_type": "llama", ')
    with pytest.raises(CheckpointError, match="not valid JSON") as err:
        load_model(folder, "float32", "cpu")
    assert "config.json" in str(err.value)


def test_invalid_generation_config_json(tiny_llama: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny_llama, tmp_path / "m")
    (folder / "generation_config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="generation_config.json"):
        load_model(folder, "float32", "cpu")


def test_required_config_field_missing(tiny_llama: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny_llama, tmp_path / "m")
    edit_json(folder / "config.json", hidden_size=None)
    with pytest.raises(CheckpointError, match="hidden_size") as err:
        load_model(folder, "float32", "cpu")
    assert "config.json" in str(err.value)


def test_unsupported_rope_scaling_is_named(tiny_llama: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny_llama, tmp_path / "m")
    edit_json(folder / "config.json", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(CheckpointError, match="yarn"):
        load_model(folder, "float32", "cpu")


# ------------------------------------------------------------------------- weight errors


def test_wrong_tensor_shape_names_tensor_and_file(tiny_llama: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny_llama, tmp_path / "m")
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors[Q_PROJ] = tensors[Q_PROJ][:-8].contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="shape") as err:
        load_model(folder, "float32", "cpu")
    message = str(err.value)
    assert Q_PROJ in message and "model.safetensors" in message
    assert "(56, 64)" in message and "(64, 64)" in message


def test_wrong_shape_in_a_shard_names_the_shard(tiny_llama_sharded: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny_llama_sharded, tmp_path / "m")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.norm.weight"]
    tensors = load_file(folder / shard)
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, folder / shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.norm.weight") as err:
        load_model(folder, "float32", "cpu")
    assert shard in str(err.value)


def test_missing_weights_are_named(tiny_llama: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny_llama, tmp_path / "m")
    path = folder / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.norm.weight"], tensors["lm_head.weight"]  # untied: lm_head is required
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing") as err:
        load_model(folder, "float32", "cpu")
    assert "model.norm.weight" in str(err.value) and "lm_head.weight" in str(err.value)


def test_unexpected_tensor_is_named(tiny_llama: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny_llama, tmp_path / "m")
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.7.mlp.up_proj.weight"] = torch.zeros(128, 64)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.7\.mlp\.up_proj\.weight"):
        load_model(folder, "float32", "cpu")


def test_only_pickle_weights_says_safetensors_only(tiny_llama: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny_llama, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not unpickled, ever")
    with pytest.raises(CheckpointError, match="safetensors only") as err:
        load_model(folder, "float32", "cpu")
    assert str(folder) in str(err.value)


def test_no_weights_at_all(tiny_llama: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny_llama, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(folder, "float32", "cpu")


def test_corrupt_safetensors_names_the_file(tiny_llama: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny_llama, tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(folder, "float32", "cpu")


def test_missing_shard_is_named(tiny_llama_sharded: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny_llama_sharded, tmp_path / "m")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (folder / shard).unlink()
    with pytest.raises(CheckpointError, match="missing") as err:
        load_model(folder, "float32", "cpu")
    assert shard in str(err.value)


# ------------------------------------------------------------------------- dtype / device


@pytest.mark.parametrize("dtype", ["float64", "fp32", "int8", "bf16"])
def test_bad_dtype(tiny_llama: Path, dtype: str) -> None:
    with pytest.raises(ValueError, match="dtype"):
        load_model(tiny_llama, dtype, "cpu")


@pytest.mark.parametrize("device", ["tpu", "gpu", "CPU", "mps:0"])
def test_bad_device(tiny_llama: Path, device: str) -> None:
    with pytest.raises(ValueError, match="device"):
        load_model(tiny_llama, "float32", device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="CUDA"):
        load_model(tiny_llama, "float32", "cuda")


def test_dtype_is_applied(tiny_llama: Path) -> None:
    model, _ = load_model(tiny_llama, "bfloat16", "cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    model, _ = load_model(tiny_llama, "auto", "cpu")
    expected = torch.bfloat16 if cpu_bf16_feature() else torch.float32  # auto: bf16 where the CPU has it
    assert all(p.dtype == expected for p in model.parameters())


@pytest.mark.parametrize("kernel", ["gemv", "onednn"])
# bfloat16: the two paths round partial sums differently; one ulp of a logit near 4 is 0.03.
@pytest.mark.parametrize(("dtype", "tol"), [("bfloat16", 3e-2), ("float32", 1e-5)])
def test_cpu_weights_are_packed_and_compute_the_same(tiny_llama: Path, dtype: str, tol: float, kernel: str) -> None:
    available = (kernels.library_for(getattr(torch, dtype)) is not None if kernel == "gemv"
                 else cpu_packing_available(getattr(torch, dtype)))
    if not available:
        pytest.skip(f"this machine does not run {dtype} CPU linears with {kernel}")
    packed, _ = load_model(tiny_llama, dtype, "cpu", backend="cpu-kernels" if kernel == "gemv" else "torch")
    unpacked, _ = load_model(tiny_llama, dtype, "cpu", pack=False)
    assert isinstance(packed.lm_head, GemvLinear if kernel == "gemv" else PackedLinear)
    assert type(unpacked.lm_head) is torch.nn.Linear
    assert count_weights(packed) == count_weights(unpacked)
    ids = torch.randint(0, packed.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ours, reference = (m.compute_logits(m(ids)).float() for m in (packed, unpacked))
    torch.testing.assert_close(ours, reference, rtol=tol, atol=tol)
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))
    with pytest.raises(RuntimeError, match="fused"):
        load_model(tiny_llama, dtype, "cpu", fuse=False, pack=True)


# ------------------------------------------------------------------------- hub cache


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("infer tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def test_hub_id_not_in_cache_never_downloads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              no_network: None) -> None:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache") as err:
        load_model("some-org/some-model", "float32", "cpu")
    message = str(err.value)
    assert "some-org/some-model" in message and "never downloads" in message and str(cache) in message
    assert list(cache.iterdir()) == []  # nothing was fetched or created
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache"):
        LLM("some-org/some-model", dtype="float32", device="cpu")


def _fake_hub_cache(cache: Path, repo_id: str, source: Path, revision: str) -> Path:
    """The huggingface_hub layout: blobs/ with the content, snapshots/<rev>/ of symlinks, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = repo / "blobs", repo / "snapshots" / revision
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(source.iterdir())):
        blob = blobs / f"{i:040x}"
        shutil.copyfile(f, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def test_hub_id_in_local_cache_resolves_and_loads(tiny_llama: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch, no_network: None) -> None:
    cache = tmp_path / "hub"
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = _fake_hub_cache(cache, "tiny-org/tiny-llama", tiny_llama, revision)
    # A newer but incomplete snapshot that refs/main does not point at must not be picked.
    (snapshot.parent / ("f" * 40)).mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("tiny-org/tiny-llama") == snapshot

    model, config = load_model("tiny-org/tiny-llama", "float32", "cpu")
    reference, _ = load_model(tiny_llama, "float32", "cpu")
    ids = torch.tensor([[10, 20, 30, 40, 50]])
    with torch.no_grad():
        torch.testing.assert_close(model.compute_logits(model(ids)), reference.compute_logits(reference(ids)))
    assert config.model_type == "llama"

    params = greedy(8, ignore_eos=True)
    from_hub = LLM("tiny-org/tiny-llama", dtype="float32", device="cpu").generate("import os", params)[0]
    local = LLM(str(tiny_llama), dtype="float32", device="cpu").generate("import os", params)[0]
    assert from_hub.token_ids == local.token_ids


def test_hub_home_fallback(tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without HF_HUB_CACHE the cache is $HF_HOME/hub."""
    snapshot = _fake_hub_cache(tmp_path / "home" / "hub", "org/name", tiny_llama, "a" * 40)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("org/name") == snapshot


# ------------------------------------------------------------------------- EOS from generation_config


def test_generation_config_eos_list(tiny_qwen3: Path) -> None:
    config = load_config(tiny_qwen3)
    assert config.eos_token_ids == [IM_END_ID, 1]
    tokenizer = load_tokenizer(tiny_qwen3, config)
    assert set(tokenizer.eos_token_ids) == {IM_END_ID, 1}
    llm = LLM(str(tiny_qwen3), dtype="float32", device="cpu")
    assert set(llm.engine.tokenizer.eos_token_ids) == {IM_END_ID, 1}


def _first_new_token_index(tokens: list[int], after: int) -> int:
    """Index of the first token after ``after`` that has not appeared before it."""
    return next(i for i in range(after + 1, len(tokens)) if tokens[i] not in tokens[:i])


def test_generation_stops_on_any_eos_of_generation_config(tiny_qwen3: Path, tmp_path: Path) -> None:
    prompt = "class Foo:\n    def __init__(self, x):"
    free = LLM(str(tiny_qwen3), dtype="float32", device="cpu").generate(prompt, greedy(ignore_eos=True))[0]
    tokens = free.token_ids
    early = _first_new_token_index(tokens, 1)
    late = _first_new_token_index(tokens, early + 2)
    assert not {1, IM_END_ID} & set(tokens[: late + 1])

    # generation_config.json (not config.json, which still says [4, 1]) decides what ends generation.
    folder = copy_checkpoint(tiny_qwen3, tmp_path / "eos_both")
    edit_json(folder / "generation_config.json", eos_token_id=[tokens[late], tokens[early]])
    assert load_config(folder).eos_token_ids == [tokens[late], tokens[early]]
    out = LLM(str(folder), dtype="float32", device="cpu").generate(prompt, greedy())[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == tokens[: early + 1]  # the second id of the list stops it

    folder = copy_checkpoint(tiny_qwen3, tmp_path / "eos_late")
    edit_json(folder / "generation_config.json", eos_token_id=[tokens[late], 511 if 511 not in tokens else 510])
    out = LLM(str(folder), dtype="float32", device="cpu").generate(prompt, greedy())[0]
    assert out.finish_reason == "stop" and out.token_ids == tokens[: late + 1]

    # a single int works too, and ignore_eos overrides it
    folder = copy_checkpoint(tiny_qwen3, tmp_path / "eos_int")
    edit_json(folder / "generation_config.json", eos_token_id=tokens[early])
    llm = LLM(str(folder), dtype="float32", device="cpu")
    assert llm.generate(prompt, greedy())[0].token_ids == tokens[: early + 1]
    assert llm.generate(prompt, greedy(ignore_eos=True))[0].token_ids == tokens


# ------------------------------------------------------------------------- chat template


MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Write a function."},
]


def test_chat_template_renders_like_transformers(tiny_llama: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    tokenizer = load_tokenizer(tiny_llama)
    text = tokenizer.apply_chat_template(MESSAGES)
    assert text == ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                    "<|im_start|>user\nWrite a function.<|im_end|>\n<|im_start|>assistant\n")
    hf = PreTrainedTokenizerFast.from_pretrained(tiny_llama)
    assert text == hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False) == hf.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=False)
    ids = tokenizer.encode_chat(MESSAGES)
    assert ids[0] == IM_START_ID and ids.count(IM_END_ID) == 2
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_llm_chat(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu")
    out = llm.chat(MESSAGES, greedy(6, ignore_eos=True))
    assert out.prompt_token_ids == llm.tokenizer.encode_chat(MESSAGES)
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    assert out.token_ids == llm.generate([out.prompt_token_ids], greedy(6, ignore_eos=True))[0].token_ids


def test_missing_chat_template_is_a_clear_error(tiny_llama: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny_llama, tmp_path / "m")
    edit_json(folder / "tokenizer_config.json", chat_template=None)
    with pytest.raises(ValueError, match="chat_template"):
        load_tokenizer(folder).apply_chat_template(MESSAGES)


def test_chat_template_jinja_file_is_read(tiny_llama: Path, tmp_path: Path) -> None:
    """transformers 5 saves the template as chat_template.jinja instead of in tokenizer_config.json."""
    from transformers import PreTrainedTokenizerFast

    folder = copy_checkpoint(tiny_llama, tmp_path / "m")
    template = json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    edit_json(folder / "tokenizer_config.json", chat_template=None)
    (folder / "chat_template.jinja").write_text("{{ bos_token }}" + template)
    tokenizer = load_tokenizer(folder)
    hf = PreTrainedTokenizerFast.from_pretrained(folder)
    assert tokenizer.apply_chat_template(MESSAGES) == hf.apply_chat_template(MESSAGES, tokenize=False,
                                                                             add_generation_prompt=True)
    assert tokenizer.apply_chat_template(MESSAGES).startswith(str(tokenizer.bos_token) + "<|im_start|>system")


def test_missing_tokenizer_is_named(tiny_llama: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny_llama, tmp_path / "m")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json"):
        LLM(str(folder), dtype="float32", device="cpu")


def test_invalid_tokenizer_config_is_named(tiny_llama: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny_llama, tmp_path / "m")
    (folder / "tokenizer_config.json").write_text('{"eos_token": ')
    with pytest.raises(CheckpointError, match="tokenizer_config.json"):
        load_tokenizer(folder)


def test_malformed_safetensors_index_is_named(tiny_llama_sharded: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny_llama_sharded, tmp_path / "m")
    (folder / "model.safetensors.index.json").write_text('{"weight_map": ["model-00001-of-00002.safetensors"]}')
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json"):
        load_model(folder, "float32", "cpu")


def test_invalid_safetensors_index_json_is_named(tiny_llama_sharded: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny_llama_sharded, tmp_path / "m")
    (folder / "model.safetensors.index.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json"):
        load_model(folder, "float32", "cpu")


# ------------------------------------------------------------------------- prompt validation


@pytest.fixture(scope="module")
def short_llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", device="cpu", max_seq_len=16)


@pytest.mark.parametrize("length", [16, 40])
def test_prompt_longer_than_max_seq_len(short_llm: LLM, length: int) -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        short_llm.generate([list(range(10, 10 + length))], greedy(4))
    assert not short_llm.engine.has_unfinished()


def test_prompt_that_just_fits(short_llm: LLM) -> None:
    out = short_llm.generate([list(range(10, 25))], greedy(4, ignore_eos=True))[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt(short_llm: LLM, prompt: str | list[int]) -> None:
    with pytest.raises(ValueError, match="empty"):
        short_llm.generate([prompt], greedy(4))


def test_token_ids_outside_vocab(short_llm: LLM) -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        short_llm.generate([[5, 512]], greedy(4))


def test_one_bad_prompt_admits_nothing(short_llm: LLM) -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        short_llm.generate(["import os", list(range(10, 40))], greedy(4))
    assert not short_llm.engine.has_unfinished()
    assert short_llm.generate("import os", greedy(2, ignore_eos=True))[0].finish_reason == "length"


def test_loading_does_not_import_torch_dynamo(tiny_llama: Path) -> None:
    """The loader builds the model skeleton on the meta device, where PyTorch computes some
    operators (normal_, arange's arithmetic) in Python through torch._refs, whose first use imports
    torch._dynamo: about a second of every start-up. Eager loading and a decode step need none of it."""
    import subprocess
    import sys

    code = ("import sys; from infer.loader import load_model; import torch; "
            f"model, _ = load_model({str(tiny_llama)!r}, 'float32', 'cpu'); "
            "model(torch.tensor([[1, 2, 3]]), torch.arange(3).unsqueeze(0), None); "
            "print('torch._dynamo' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_models_built_off_the_meta_device_are_still_initialised(tiny_llama: Path) -> None:
    config = load_config(tiny_llama)
    torch.manual_seed(0)
    from infer.models import MODEL_REGISTRY

    model = MODEL_REGISTRY[config.model_type](config)
    assert model.model.embed_tokens.weight.std() > 0.5  # nn.Embedding's N(0, 1) init
    torch.testing.assert_close(model.inv_freq, load_model(tiny_llama, "float32", "cpu")[0].inv_freq)

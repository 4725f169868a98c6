"""forge_ext.engine.lora against PEFT itself: the names and config PEFT writes and reads, and the
merged weights against PEFT's adapted model."""

import json

import pytest
import torch

from forge_ext.engine import lora
from forge_ext.engine.checkpoint_files import ADAPTER_CONFIG_NAME
from forge_ext.engine.schema import HF_TARGETS, check_targets

peft = pytest.importorskip("peft")


def _tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         tie_word_embeddings=False)
    return Qwen3ForCausalLM(config).float().eval()


def _peft_model(base, targets):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=0.0)
    model = peft.get_peft_model(base, config)
    torch.manual_seed(1)
    with torch.no_grad():  # PEFT initialises B to zero: give the adapter an effect
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)
    return model.eval()


def test_a_folder_we_write_is_what_peft_writes_and_peft_loads_it(tmp_path):
    model = _peft_model(_tiny_qwen3(), ["q_proj", "down_proj"])
    model.save_pretrained(tmp_path / "peft")
    theirs, their_config = lora.read_peft_folder(tmp_path / "peft")

    ours = lora.write_peft_folder(tmp_path / "ours", theirs,
                                  lora.peft_adapter_config(4, 8, ["q_proj", "down_proj"]))
    assert set(theirs) == {lora.peft_key(f"model.layers.{i}.{m}", x) for i in range(2)
                           for m in ("self_attn.q_proj", "mlp.down_proj") for x in "AB"}
    loaded = peft.PeftModel.from_pretrained(_tiny_qwen3(), ours).eval()
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    config = json.loads((ours / ADAPTER_CONFIG_NAME).read_text())
    for field in ("peft_type", "r", "lora_alpha", "target_modules", "bias"):
        assert config[field] == (sorted(their_config[field]) if field == "target_modules"
                                 else their_config[field]), field


def test_merged_weights_give_the_adapted_models_logits(tmp_path):
    model = _peft_model(_tiny_qwen3(), HF_TARGETS)
    model.save_pretrained(tmp_path / "peft")
    tensors, config = lora.read_peft_folder(tmp_path / "peft")
    base = _tiny_qwen3()
    merged = lora.merge_into(base.state_dict(), tensors, config)
    base.load_state_dict(merged)
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        torch.testing.assert_close(base(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    assert lora.scaling(config) == 2.0


def test_bad_targets_and_tensors_are_refused_by_name():
    assert check_targets(None) == HF_TARGETS
    assert check_targets("all-linear") == HF_TARGETS
    with pytest.raises(ValueError, match=r"trainer.lora.target_modules.*'qkv'"):
        check_targets(["q_proj", "qkv"])
    with pytest.raises(ValueError, match="adapts no layer"):
        check_targets([])
    with pytest.raises(ValueError, match="without both"):
        lora.adapter_modules({lora.peft_key("model.layers.0.self_attn.q_proj", "A"): torch.ones(1)})
    with pytest.raises(ValueError, match="not a PEFT LoRA tensor name"):
        lora.adapter_modules({"model.layers.0.self_attn.q_proj.weight": torch.ones(1)})

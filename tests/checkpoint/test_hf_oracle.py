"""Hugging Face `transformers` as an oracle: the same weights give the same logits.

Tiny random Llama (grouped-query attention, tied and untied) and Mixtral models are
imported into fivefold's Transformer and must give the same fp32 logits on CPU within 1e-5;
export must reproduce the Hugging Face weights exactly and load back into `transformers`.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fivefold.checkpoint.hf import (
    HFConversionError,
    config_from_hf,
    hf_config_from,
    read_hf_folder,
    state_dict_from_hf,
    state_dict_to_hf,
    write_hf_folder,
)
from fivefold.model import Transformer  # noqa: E402

LOGIT_ATOL = 1e-5
SMALL = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=48, max_position_embeddings=64, rms_norm_eps=1e-5)


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Perturb every weight (norms included) so a swapped or transposed tensor cannot go unnoticed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return model.eval()


def hf_llama(tied: bool, seed: int = 0):
    config = transformers.LlamaConfig(**SMALL, tie_word_embeddings=tied, rope_theta=500.0)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 500.0}
    return _randomize(transformers.LlamaForCausalLM(config), seed)


def hf_mixtral(seed: int = 0):
    config = transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)
    return _randomize(transformers.MixtralForCausalLM(config), seed)


def fivefold_model(config, state) -> Transformer:
    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device="cpu")
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(m.endswith(("tokens_per_expert", "dropped_slots")) for m in missing), (missing, unexpected)
    for name, buf in model.named_buffers():
        if name.endswith(("tokens_per_expert", "dropped_slots")):
            buf.zero_()
    return model.eval()


def tokens(vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(seed))  # (B, T)


def assert_same_logits(hf_model, model: Transformer) -> None:
    ids = tokens(model.config.vocab_size)
    with torch.no_grad():
        expected = hf_model(input_ids=ids).logits
        got, _ = model(ids)
    assert got.shape == expected.shape
    diff = (got - expected).abs().max().item()
    assert diff < LOGIT_ATOL, f"logits differ by {diff:.2e}"


@pytest.mark.parametrize("make", [lambda: hf_llama(tied=False), lambda: hf_llama(tied=True), hf_mixtral],
                         ids=["llama-gqa", "llama-tied", "mixtral"])
def test_import_matches_hf_logits_and_export_round_trips(make):
    hf_model = make()
    config = config_from_hf(hf_model.config)
    state = state_dict_from_hf(hf_model.state_dict(), config)
    model = fivefold_model(config, state)
    assert_same_logits(hf_model, model)
    # Export back to the installed transformers' module names: bit-for-bit the original weights.
    exported = state_dict_to_hf(model.state_dict(), config, naming="module")
    original = hf_model.state_dict()
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    # A config made from ours builds the same architecture.
    rebuilt = type(hf_model)(hf_config_from(config))
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {k: v.shape for k, v in original.items()}


def test_folder_round_trip_through_transformers(tmp_path):
    """save_pretrained -> import; export -> from_pretrained: same logits (Mixtral files use per-expert names)."""
    hf_model = hf_mixtral(seed=3)
    hf_model.save_pretrained(tmp_path / "hf")
    config, state = read_hf_folder(tmp_path / "hf")
    model = fivefold_model(config, state)
    assert_same_logits(hf_model, model)
    write_hf_folder(model.state_dict(), config, tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(reloaded).__name__ == "MixtralForCausalLM"
    assert_same_logits(reloaded, model)


def test_tied_llama_folder_export_loads(tmp_path):
    hf_model = hf_llama(tied=True, seed=5)
    config = config_from_hf(hf_model.config)
    model = fivefold_model(config, state_dict_from_hf(hf_model.state_dict(), config))
    write_hf_folder(model.state_dict(), config, tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert reloaded.config.tie_word_embeddings
    assert_same_logits(reloaded, model)


def test_unrepresentable_configs_are_rejected_with_reasons():
    from fivefold.config import ModelConfig

    with pytest.raises(HFConversionError, match="shared experts"):
        hf_config_from(ModelConfig(num_experts=4, shared_experts=1))
    with pytest.raises(HFConversionError, match="token dropping"):
        hf_config_from(ModelConfig(num_experts=4, dropless=False))
    scaled = dict(SMALL, model_type="llama", rope_parameters={"rope_type": "llama3", "rope_theta": 5e5})
    with pytest.raises(HFConversionError, match="scaled RoPE"):
        config_from_hf(scaled)
    with pytest.raises(HFConversionError, match="model_type"):
        config_from_hf(dict(SMALL, model_type="gpt2"))
    with pytest.raises(HFConversionError, match="no 'model.norm.weight'"):
        state_dict_from_hf({"model.embed_tokens.weight": torch.zeros(1)}, config_from_hf(dict(SMALL, model_type="llama")))

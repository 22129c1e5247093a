"""What the gateway reads from a checkpoint's config.json, for either family, as JSON only: the
family, the voices (Qwen2.5-Omni's are in spk_dict.pt: none from config.json), the end token, and
the default voice the thinker of that family would pick."""

from __future__ import annotations

import pytest

from gateway.config import (
    GatewayConfig,
    end_token_from_config,
    family_from_config,
    read_checkpoint_config,
    voices_from_config,
)
from services.base.errors import UserError
from services.base.families import Family


def test_qwen3_omni_config_gives_its_speakers_and_im_end(tiny_checkpoint):
    config = read_checkpoint_config(tiny_checkpoint)
    assert family_from_config(config) is Family.QWEN3_OMNI
    assert sorted(voices_from_config(config)) == ["aiden", "chelsie", "ethan"]
    assert end_token_from_config(config) == config["im_end_token_id"]


def test_qwen2_5_omni_config_gives_no_voices_and_the_thinkers_eos(tiny_qwen2_5_checkpoint):
    from transformers import AutoTokenizer

    config = read_checkpoint_config(tiny_qwen2_5_checkpoint)
    assert family_from_config(config) is Family.QWEN2_5_OMNI
    assert voices_from_config(config) == ()  # spk_dict.pt's: the launcher passes them as --voices
    im_end = AutoTokenizer.from_pretrained(tiny_qwen2_5_checkpoint).convert_tokens_to_ids("<|im_end|>")
    assert end_token_from_config(config) == im_end


def test_default_voice_is_the_familys_when_the_checkpoint_has_it():
    both = ("chelsie", "ethan")
    assert GatewayConfig(voices=both).default_voice == "ethan"
    assert GatewayConfig(voices=both, family=Family.QWEN2_5_OMNI).default_voice == "chelsie"
    assert GatewayConfig(voices=("aiden",), family=Family.QWEN2_5_OMNI).default_voice == "aiden"
    assert GatewayConfig(family=Family.QWEN2_5_OMNI).default_voice is None  # unknown: the thinker picks


def test_a_config_of_another_model_is_a_user_error():
    assert family_from_config({}) is Family.QWEN3_OMNI  # no --checkpoint
    with pytest.raises(UserError, match="model_type 'llama'"):
        family_from_config({"model_type": "llama"})

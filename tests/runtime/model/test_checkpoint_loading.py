"""load_stage: each stage alone, exactly the weights the full model holds, from one file or shards.

The real checkpoint (Qwen/Qwen3-Omni-30B-A3B-Instruct) is checked without its weights: both the
full model and each stage class are built on the meta device at the real sizes, and the stage
keys must equal the full model's keys under the stage prefix, which is what load_stage's
prefix stripping (`base_model_prefix`) relies on.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from services.base.errors import UserError
from services.runtime.model.checkpoint import Stage, check_folder, load_stage
from services.runtime.model.full_size import REAL_LAYOUT

# Files of a checkpoint folder besides the weights.
NON_WEIGHT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json")

# The real checkpoint's sizes, from its config.json (transformers' config defaults differ, e.g.
# 28 thinker layers and 32 code groups). Only fields that shape the state dict; kept in one place,
# shared with `omni-tiny-checkpoint --full-size`.
REAL_CONFIG = REAL_LAYOUT


def n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.fixture(scope="module")
def full_model(tiny_checkpoint):
    import transformers
    from transformers import Qwen3OmniMoeForConditionalGeneration

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return Qwen3OmniMoeForConditionalGeneration.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    finally:
        transformers.logging.set_verbosity(verbosity)


@pytest.fixture(scope="module")
def sharded_checkpoint(full_model, tiny_checkpoint, tmp_path_factory) -> Path:
    """The same weights re-saved in 500 kB shards with an index file, plus the other files."""
    folder = tmp_path_factory.mktemp("sharded") / "tiny"
    full_model.save_pretrained(folder, max_shard_size="500KB")
    for name in NON_WEIGHT_FILES:
        shutil.copy(tiny_checkpoint / name, folder / name)
    return folder


def assert_stage_equals_submodule(loaded, submodule: torch.nn.Module) -> None:
    got, want = loaded.state_dict(), submodule.state_dict()
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype, key
        assert torch.equal(got[key], tensor), key


@pytest.mark.parametrize("stage", list(Stage), ids=lambda s: s.value)
def test_load_stage_equals_the_full_models_submodule(tiny_checkpoint, full_model, stage):
    loaded = load_stage(tiny_checkpoint, stage)
    submodule = getattr(full_model, stage.value)

    assert loaded.stage is stage
    assert loaded.config.model_type == "qwen3_omni_moe"
    assert not loaded.model.training
    assert_stage_equals_submodule(loaded.model, submodule)


@pytest.mark.parametrize("stage", list(Stage), ids=lambda s: s.value)
def test_load_stage_materialises_only_that_stage(tiny_checkpoint, full_model, stage):
    model = load_stage(tiny_checkpoint, stage).model
    submodule = getattr(full_model, stage.value)

    assert n_params(model) == n_params(submodule) < n_params(full_model)
    assert {name for name, _ in model.named_children()} == {name for name, _ in submodule.named_children()}
    for other in Stage:
        assert not hasattr(model, other.value), f"{stage.value} module has a {other.value} attribute"
    # No tensor of the stage module lives on the meta device (every weight was read from disk).
    assert all(t.device.type == "cpu" for t in model.state_dict().values())


def test_load_stage_reads_a_folder_holding_only_that_stages_weights(tiny_checkpoint, tmp_path):
    """A folder with the thinker's tensors alone: the thinker loads, the talker is reported missing."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = tmp_path / "thinker_only"
    folder.mkdir()
    shutil.copy(tiny_checkpoint / "config.json", folder / "config.json")
    with safe_open(str(tiny_checkpoint / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith("thinker.")}
        metadata = f.metadata()
    save_file(tensors, str(folder / "model.safetensors"), metadata=metadata)

    thinker = load_stage(folder, Stage.THINKER).model
    assert n_params(thinker) > 0
    with pytest.raises(UserError, match="talker weights missing") as err:
        load_stage(folder, Stage.TALKER)
    assert str(folder) in str(err.value)


def checkpoint_keys(folder: str | Path) -> list[str]:
    """Every tensor name in the checkpoint, read from the safetensors headers only."""
    keys: list[str] = []
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            keys.extend(f.keys())
    return keys


def test_checkpoint_keys_are_the_three_stage_prefixes(tiny_checkpoint):
    keys = checkpoint_keys(tiny_checkpoint)
    assert len(keys) == len(set(keys))
    assert {k.split(".", 1)[0] for k in keys} == {s.value for s in Stage}


def test_sharded_checkpoint_loads_every_stage(sharded_checkpoint, tiny_checkpoint, full_model):
    shards = sorted(sharded_checkpoint.glob("*.safetensors"))
    assert len(shards) > 2
    assert (sharded_checkpoint / "model.safetensors.index.json").is_file()
    assert sorted(checkpoint_keys(sharded_checkpoint)) == sorted(checkpoint_keys(tiny_checkpoint))
    # The index maps tensor name -> shard file; some stage must span several shards.
    weight_map = json.loads((sharded_checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    files_per_stage = {s.value: {f for k, f in weight_map.items() if k.startswith(s.value + ".")} for s in Stage}
    assert max(len(files) for files in files_per_stage.values()) > 1, files_per_stage

    for stage in Stage:
        loaded = load_stage(sharded_checkpoint, stage).model
        assert_stage_equals_submodule(loaded, getattr(full_model, stage.value))


def test_the_real_layout_gives_the_real_checkpoints_sizes():
    """REAL_LAYOUT (the project's copy of the 30B-A3B sizes) over transformers' config; what
    transformers' own defaults are is transformers' business, not tested here."""
    from transformers import Qwen3OmniMoeConfig

    real = Qwen3OmniMoeConfig(**REAL_CONFIG)
    assert real.thinker_config.text_config.num_hidden_layers == 48
    assert real.talker_config.num_code_groups == 16


def test_real_layout_stage_keys_are_the_full_models_keys_without_prefix():
    """Meta device, real sizes: stripping `<stage>.` from the full model's keys gives the stage's keys."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as qm

    config = Qwen3OmniMoeConfig(**REAL_CONFIG)
    with torch.device("meta"):
        full = Qwen3OmniMoeForConditionalGeneration(config)
        stages = {
            Stage.THINKER: qm.Qwen3OmniMoeThinkerForConditionalGeneration(config.thinker_config),
            Stage.TALKER: qm.Qwen3OmniMoeTalkerForConditionalGeneration(config.talker_config),
            Stage.CODE2WAV: qm.Qwen3OmniMoeCode2Wav(config.code2wav_config),
        }
    # About 35 B parameters in all: the 30B-A3B thinker plus audio/vision encoders, talker, vocoder.
    assert 34e9 < n_params(full) < 36e9
    full_shapes = {k: v.shape for k, v in full.state_dict().items()}  # key -> shape
    assert {k.split(".", 1)[0] for k in full_shapes} == {s.value for s in Stage}
    for stage, module in stages.items():
        prefix = stage.value + "."
        want = {k[len(prefix):]: shape for k, shape in full_shapes.items() if k.startswith(prefix)}
        got = {k: v.shape for k, v in module.state_dict().items()}
        assert sorted(got) == sorted(want), stage
        assert got == want, stage


def test_missing_folder_is_a_user_error(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(UserError, match="not found") as err:
        load_stage(missing, Stage.THINKER)
    assert str(missing) in str(err.value)


def test_folder_without_config_is_a_user_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match="no config.json") as err:
        load_stage(tmp_path, Stage.TALKER)
    assert str(tmp_path) in str(err.value)


def test_wrong_model_type_is_a_user_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UserError, match="'llama'") as err:
        load_stage(tmp_path, Stage.CODE2WAV)
    assert str(tmp_path) in str(err.value)


def test_invalid_config_json_is_a_user_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON") as err:
        check_folder(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_config_json_that_is_not_an_object_is_a_user_error(tmp_path):
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(UserError):
        check_folder(tmp_path)


def test_folder_without_weights_is_a_user_error(tiny_checkpoint, tmp_path):
    shutil.copy(tiny_checkpoint / "config.json", tmp_path / "config.json")
    with pytest.raises(UserError, match="no .safetensors") as err:
        check_folder(tmp_path)
    assert str(tmp_path) in str(err.value)

"""load_stage, load_voices and the full-size layout for Qwen2.5-Omni: each stage alone, exactly the
weights the full model holds; the voices as transformers loads them; and Qwen/Qwen2.5-Omni-7B's
state-dict keys, on the meta device, are the per-stage loaders' keys under the stage prefixes.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from services.base.errors import UserError
from services.base.families import Family
from services.runtime.model.checkpoint import Stage, Voice, check_folder, load_config, load_stage, load_voices
from services.runtime.model.full_size_qwen2_5 import REAL_LAYOUT, check_layout
from services.tools.tiny_checkpoint import main

PREFIXES = {Stage.THINKER: "thinker", Stage.TALKER: "talker", Stage.CODE2WAV: "token2wav"}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.fixture(scope="module")
def full_model(tiny_qwen2_5_checkpoint):
    import transformers
    from transformers import Qwen2_5OmniForConditionalGeneration

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return Qwen2_5OmniForConditionalGeneration.from_pretrained(tiny_qwen2_5_checkpoint).eval()
    finally:
        transformers.logging.set_verbosity(verbosity)


@pytest.mark.parametrize("stage", list(Stage), ids=lambda s: s.value)
def test_load_stage_equals_the_full_models_submodule(tiny_qwen2_5_checkpoint, full_model, stage):
    loaded = load_stage(tiny_qwen2_5_checkpoint, stage)
    want = getattr(full_model, PREFIXES[stage]).state_dict()
    got = loaded.model.state_dict()

    assert loaded.family is Family.QWEN2_5_OMNI and loaded.config.model_type == "qwen2_5_omni"
    assert not loaded.model.training
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    assert n_params(loaded.model) < n_params(full_model)
    assert all(t.device.type == "cpu" for t in got.values())


def test_the_stage_classes_are_transformers_own(tiny_qwen2_5_checkpoint):
    names = {stage: type(load_stage(tiny_qwen2_5_checkpoint, stage).model).__mro__ for stage in Stage}
    assert names[Stage.THINKER][0].__name__ == "Qwen2_5OmniThinkerForConditionalGeneration"
    assert names[Stage.TALKER][0].__name__ == "Qwen2_5OmniTalkerForConditionalGeneration"
    assert "Qwen2_5OmniToken2WavModel" in [cls.__name__ for cls in names[Stage.CODE2WAV]]


def test_token2wav_stays_float32_when_another_dtype_is_asked(tiny_qwen2_5_checkpoint):
    assert load_stage(tiny_qwen2_5_checkpoint, Stage.CODE2WAV, dtype="bfloat16").model.dtype == torch.float32
    assert load_stage(tiny_qwen2_5_checkpoint, Stage.TALKER, dtype="bfloat16").model.dtype == torch.bfloat16


def test_a_folder_with_only_the_thinkers_weights_loads_the_thinker_and_reports_the_talker(tiny_qwen2_5_checkpoint,
                                                                                          tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = tmp_path / "thinker_only"
    folder.mkdir()
    shutil.copy(tiny_qwen2_5_checkpoint / "config.json", folder / "config.json")
    with safe_open(str(tiny_qwen2_5_checkpoint / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith("thinker.")}
        metadata = f.metadata()
    save_file(tensors, str(folder / "model.safetensors"), metadata=metadata)

    assert n_params(load_stage(folder, Stage.THINKER).model) > 0
    for stage in (Stage.TALKER, Stage.CODE2WAV):
        with pytest.raises(UserError, match=f"{stage.value} weights missing"):
            load_stage(folder, stage)


def test_load_config_gives_the_familys_config(tiny_qwen2_5_checkpoint, tmp_path):
    assert type(load_config(tiny_qwen2_5_checkpoint)).__name__ == "Qwen2_5OmniConfig"
    assert check_folder(tiny_qwen2_5_checkpoint) == tiny_qwen2_5_checkpoint
    shutil.copy(tiny_qwen2_5_checkpoint / "config.json", tmp_path / "config.json")
    with pytest.raises(UserError, match="no .safetensors"):
        check_folder(tmp_path)
    assert type(load_config(tmp_path, need_weights=False)).__name__ == "Qwen2_5OmniConfig"


def test_load_voices_gives_what_transformers_loads(tiny_qwen2_5_checkpoint, full_model):
    voices = load_voices(tiny_qwen2_5_checkpoint)
    assert sorted(voices) == sorted(full_model.speaker_map) == ["Chelsie", "Ethan"]
    for name, voice in voices.items():
        want = full_model.speaker_map[name]
        assert isinstance(voice, Voice) and voice.name == name
        assert voice.bos_token == want["bos_token"]
        assert torch.equal(voice.cond, want["cond"]) and torch.equal(voice.ref_mel, want["ref_mel"])
    assert voices["Chelsie"].bos_token != voices["Ethan"].bos_token


def test_load_voices_refuses_missing_foreign_and_damaged_files(tiny_qwen2_5_checkpoint, tiny_checkpoint, tmp_path):
    with pytest.raises(UserError, match="Qwen2.5-Omni checkpoints only"):
        load_voices(tiny_checkpoint)
    shutil.copy(tiny_qwen2_5_checkpoint / "config.json", tmp_path / "config.json")
    with pytest.raises(UserError, match="no spk_dict.pt"):
        load_voices(tmp_path)
    (tmp_path / "spk_dict.pt").write_bytes(b"not a torch file")
    with pytest.raises(UserError, match="not a readable voice file"):
        load_voices(tmp_path)
    torch.save({"Ethan": {"bos_token": 1, "cond": torch.zeros(1, 4)}}, tmp_path / "spk_dict.pt")
    with pytest.raises(UserError, match="needs bos_token, cond and ref_mel"):
        load_voices(tmp_path)


@pytest.mark.parametrize("stage", list(Stage), ids=lambda s: s.value)
def test_random_weights_build_each_stage_from_config_alone(tiny_qwen2_5_checkpoint, tmp_path, stage):
    folder = tmp_path / "config_only"
    folder.mkdir()
    shutil.copy(tiny_qwen2_5_checkpoint / "config.json", folder / "config.json")
    loaded = load_stage(folder, stage, random_weights=True, seed=3)
    real = load_stage(tiny_qwen2_5_checkpoint, stage).model.state_dict()
    got = loaded.model.state_dict()
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in real.items()}
    assert all(torch.isfinite(v).all() for v in got.values())
    if stage is Stage.TALKER:  # no id outside the codebook can win: greedy runs to max tokens
        assert not loaded.model.codec_head.weight[8192:].any()
    if stage is Stage.CODE2WAV:
        gen = torch.Generator().manual_seed(0)
        codes = torch.randint(0, 8192, (1, 12), generator=gen)
        voice = load_voices(tiny_qwen2_5_checkpoint)["Ethan"]
        torch.manual_seed(0)
        with torch.inference_mode():
            wav = loaded.model(codes, conditioning=voice.cond, reference_mel=voice.ref_mel).reshape(-1)
        assert 0.01 < wav.pow(2).mean().sqrt().item() and wav.abs().max().item() < 1.0


def test_full_size_folder_has_the_7b_layout_in_every_listed_field(tmp_path, capsys):
    """`--family qwen2_5_omni --full-size --no-weights` writes REAL_LAYOUT's values into config.json."""
    folder = tmp_path / "full"
    assert main(["--family", "qwen2_5_omni", "--full-size", "--no-weights", "--out", str(folder)]) == 0
    assert "wrote full-size Qwen2.5-Omni checkpoint" in capsys.readouterr().out
    assert not list(folder.glob("*.safetensors")) and (folder / "spk_dict.pt").is_file()
    config = load_config(folder, need_weights=False)

    def walk(layout: dict, node, path: str) -> None:
        for key, value in layout.items():
            got = getattr(node, key)
            if isinstance(value, dict) and key != "rope_parameters":
                walk(value, got, f"{path}.{key}")
            else:
                got = json.loads(json.dumps(got, default=list))  # tuples as lists
                want = json.loads(json.dumps(value))
                if key == "rope_parameters":
                    got = {k: got[k] for k in want}
                assert got == want, f"{path}.{key}"

    walk(REAL_LAYOUT, config, "config")
    assert config.thinker_config.text_config.vocab_size == 152064  # the real vocabulary, tiny tokenizer ids below it
    assert main(["--family", "qwen2_5_omni", "--full-size", "--out", str(tmp_path / "x")]) == 2
    assert "writes no weights (20.0 GiB in bfloat16)" in capsys.readouterr().err


def test_real_layout_state_dict_keys_are_the_stage_loaders_keys_under_their_prefixes():
    """Meta device, Qwen2.5-Omni-7B sizes (REAL_LAYOUT over transformers' defaults, whose special ids are
    the real ones): every thinker./talker./token2wav. key of the full model, prefix stripped, is a
    parameter or buffer of the class load_stage loads for that stage, with the same shape, and the
    stage class has no key the checkpoint lacks."""
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    from services.runtime.model.checkpoint import _stage_classes

    config = Qwen2_5OmniConfig(**REAL_LAYOUT)
    check_layout(config)
    classes = _stage_classes(Family.QWEN2_5_OMNI)
    with torch.device("meta"):
        full = Qwen2_5OmniForConditionalGeneration(config)
        stages = {stage: cls(getattr(config, sub)) for stage, (cls, sub) in classes.items()}
    # 10.73 B parameters: the published model's 10.7 B.
    assert 10.6e9 < n_params(full) < 10.8e9
    full_shapes = {k: v.shape for k, v in full.state_dict().items()}  # key -> shape
    assert {k.split(".", 1)[0] for k in full_shapes} == set(PREFIXES.values())
    for stage, module in stages.items():
        prefix = PREFIXES[stage] + "."
        assert module.base_model_prefix == PREFIXES[stage]  # what from_pretrained strips
        want = {k[len(prefix):]: shape for k, shape in full_shapes.items() if k.startswith(prefix)}
        got = {k: v.shape for k, v in module.state_dict().items()}
        assert got == want, stage
    assert 8.9e9 < n_params(stages[Stage.THINKER]) < 9.0e9
    assert 1.3e9 < n_params(stages[Stage.TALKER]) < 1.4e9
    assert 0.44e9 < n_params(stages[Stage.CODE2WAV]) < 0.46e9


@pytest.mark.parametrize("change, message", [
    ({"talker_config": {"embedding_size": 64}}, "talker embedding_size"),
    ({"talker_config": {"tts_codec_end_token_id": 100}}, "tts_codec_end_token_id"),
    ({"token2wav_config": {"dit_config": {"look_ahead_layers": [30]}}}, "look-ahead"),
    ({"thinker_config": {"text_config": {"rope_parameters": {"rope_type": "default", "mrope_section": [8, 8, 8]}}}},
     "mrope_section"),
])
def test_check_layout_names_what_disagrees(change, message):
    from transformers import Qwen2_5OmniConfig

    from services.runtime.model.full_size import merge_layout

    with pytest.raises(ValueError, match=message):
        check_layout(Qwen2_5OmniConfig(**merge_layout(REAL_LAYOUT, change)))

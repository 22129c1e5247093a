"""The thinker tests' shared fixture: `family`, each tiny checkpoint's thinker with its prompt builder
and adapter (module-scoped: a module's tests share one load per family)."""

from __future__ import annotations

import dataclasses

import pytest

from services.base.families import family_of
from services.runtime.inputs.prompt import PromptBuilder
from services.runtime.model.checkpoint import Stage, load_stage
from services.thinker.server import ADAPTERS


@dataclasses.dataclass
class Family_:
    checkpoint: str
    thinker: object
    builder: PromptBuilder
    adapter: object
    im_start: int


@pytest.fixture(scope="module", params=["qwen3", "qwen2_5"])
def family(request) -> Family_:
    checkpoint = str(request.getfixturevalue("tiny_checkpoint" if request.param == "qwen3"
                                             else "tiny_qwen2_5_checkpoint"))
    thinker = load_stage(checkpoint, Stage.THINKER)
    builder = PromptBuilder(checkpoint, thinker.config)
    adapter = ADAPTERS[family_of(checkpoint)](checkpoint, thinker.config, builder)
    return Family_(checkpoint, thinker, builder, adapter, builder.tokenizer.convert_tokens_to_ids("<|im_start|>"))

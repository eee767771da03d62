"""A bad adapter is a ValueError naming it (and what is wrong) when a request brings it; the engine goes on."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from kvforge import LLM, LoRARequest, SamplingParams
from tests.lora.adapters import save_adapter
from tests.tiny_models import save_model

PARAMS = SamplingParams(temperature=0.0, max_tokens=2)


@pytest.fixture(scope="module")
def engine_and_base(tiny_llama_dir):
    folder = tiny_llama_dir[0]
    llm = LLM(str(folder), kv_cache_memory="16MiB", enable_lora=True, max_loras=2, max_lora_rank=8)
    yield llm, folder
    llm.shutdown()


def _refused(llm: LLM, lora: LoRARequest, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate("The quick brown fox", PARAMS, lora_request=lora)
    assert not llm.engine.has_unfinished_requests()


def test_bad_adapters_are_named(engine_and_base, tmp_path) -> None:
    llm, base = engine_and_base
    _refused(llm, LoRARequest("missing", 1, str(tmp_path / "nowhere")), r"'missing'.*has no adapter_config\.json")
    too_big = save_adapter(base, tmp_path / "big", 16, ["q_proj"], seed=0)
    _refused(llm, LoRARequest("big", 2, str(too_big)), r"'big'.*rank 16, above max_lora_rank=8")
    odd = save_adapter(base, tmp_path / "odd", 4, ["q_proj"], seed=0)
    weights = odd / "adapter_model.safetensors"
    save_file({key.replace("q_proj", "qa_proj"): t for key, t in load_file(weights).items()}, weights)
    _refused(llm, LoRARequest("odd", 3, str(odd)), r"'odd' targets module 'layers\.0\.self_attn\.qa_proj'")
    other_base = tmp_path / "other-base"
    other_base.mkdir()
    save_model(other_base, "llama", hidden_size=32, intermediate_size=64)
    other = save_adapter(other_base, tmp_path / "other", 4, ["o_proj"], seed=0)
    _refused(llm, LoRARequest("other", 4, str(other)), r"'other': module 'layers\.0\.self_attn\.o_proj'.*base layer")
    no_weights = tmp_path / "no-weights"
    shutil.copytree(odd, no_weights)
    (no_weights / "adapter_model.safetensors").unlink()
    _refused(llm, LoRARequest("no-weights", 5, str(no_weights)), r"'no-weights'.*has no adapter_model\.safetensors")
    param = save_adapter(base, tmp_path / "param", 4, ["q_proj"], seed=0, parameters=["mlp.down_proj.weight"])
    _refused(llm, LoRARequest("param", 6, str(param)), r"'param': target_parameters entry 'mlp\.down_proj\.weight' is "
                                                       r"not supported \(only the experts'")
    good = save_adapter(base, tmp_path / "good", 8, ["q_proj", "down_proj"], seed=1)
    # a refused folder binds nothing: its id serves a good folder, and then no other
    assert len(llm.generate("The quick brown fox", PARAMS, lora_request=LoRARequest("good", 2, str(good)))) == 1
    _refused(llm, LoRARequest("again", 2, str(other)), r"'again': int_id 2 already names")


def test_an_engine_without_lora_refuses_an_adapter(tiny_llm, tmp_path) -> None:
    _refused(tiny_llm, LoRARequest("any", 1, str(tmp_path)), r"'any'.*enable_lora=True")
    with pytest.raises(ValueError, match="int_id must be an integer >= 1"):
        LoRARequest("zero", 0, str(tmp_path))

"""Wan 2.1 SCAIL / SCAIL-2, Wan 2.2 Bernini-R's in-context latents and ChronoEdit (Wan I2V + ScaleROPE) against
ComfyUI's own code (needs COMFYUI_PATH at a ComfyUI with SCAILWanModel and context_latents, e.g. the newest tier;
skipped otherwise): the pool at degrees 1-4 equals ComfyUI's SCAIL2WanModel, SCAILWanModel and WanModel
(context_latents; rope_options in transformer_options) on the same tiny files and the cases of
tests/families/test_wan_scail.py, test_wan_in_context.py and test_wan_chronoedit.py; ComfyUI's model classes of the
variants exist."""
from __future__ import annotations

import pytest
import torch

import comfy_support as cs
from family_support import assert_parity
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_lab.tiny_models.wan import tiny_config
from test_wan_chronoedit import SEED as CHRONO_SEED, SIZE as CHRONO_SIZE, cases as chrono_cases
from test_wan_in_context import SEED as IN_CONTEXT_SEED, cases as in_context_cases
from test_wan_scail import SEEDS as SCAIL_SEEDS, cases as scail_cases

pytestmark = pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)
pytest_plugins = ["family_pools"]  # the shared per-degree worker pools

# name -> (tiny variant, seed, cases, size)
MODELS = {"scail2": ("scail2", SCAIL_SEEDS["scail2"], lambda: scail_cases("scail2"), {}),
          "scail": ("scail", SCAIL_SEEDS["scail"], lambda: scail_cases("scail"), {}),
          "bernini": ("t2v", IN_CONTEXT_SEED, in_context_cases, {}),
          "chronoedit": ("i2v", CHRONO_SEED, chrono_cases, CHRONO_SIZE)}


def comfy_network(variant: str, **size) -> torch.nn.Module:
    """ComfyUI's own network of the variant at the tiny model's sizes (fp32, CPU)."""
    import comfy.ldm.wan.model as comfy_wan
    import comfy.ops
    if not hasattr(comfy_wan, "SCAIL2WanModel"):
        pytest.skip("this ComfyUI has no SCAIL2WanModel (the newest tier has)")
    config = tiny_config(variant, **size)
    heads, dim = config["num_attention_heads"], config["num_attention_heads"] * config["attention_head_dim"]
    common = dict(dim=dim, ffn_dim=config["ffn_dim"], text_dim=config["text_dim"], num_heads=heads,
                  num_layers=config["num_layers"], in_dim=config["in_channels"], out_dim=config["out_channels"],
                  device="cpu", dtype=torch.float32, operations=comfy.ops.disable_weight_init)
    if variant == "scail2":
        return comfy_wan.SCAIL2WanModel(**common)
    if variant == "scail":
        return comfy_wan.SCAILWanModel(**common)
    return comfy_wan.WanModel(model_type="i2v" if config.get("image_dim") else "t2v", **common)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    cs.import_comfy()
    folder = tmp_path_factory.mktemp("wan_tokens_comfy")
    return {name: write_tiny_checkpoint("wan", str(folder / f"{name}.safetensors"), seed=seed, variant=variant,
                                        prefix=COMFY_PREFIX, **size)
            for name, (variant, seed, _, size) in MODELS.items()}


@pytest.fixture(scope="module")
def comfy_outputs(files):
    import comfy.utils
    outputs = {}
    for name, (variant, _, cases, size) in MODELS.items():
        network = comfy_network(variant, **size)
        state = comfy.utils.state_dict_prefix_replace(comfy.utils.load_torch_file(files[name]), {COMFY_PREFIX: ""},
                                                      filter_keys=True)
        network.load_state_dict(state, strict=True)
        with torch.no_grad():
            outputs[name] = {case: network.eval()(x, t, inputs["context"], transformer_options=_options(inputs),
                                                  **{k: v for k, v in inputs.items()
                                                     if k not in ("context", "rope_options")})
                             for case, (x, t, inputs) in cases().items()}
    return outputs


def _options(inputs: dict) -> dict:
    """ScaleROPE's options reach ComfyUI's model in transformer_options (the pool takes them as an input)."""
    return {"rope_options": inputs["rope_options"]} if "rope_options" in inputs else {}


@pytest.mark.parametrize("name", MODELS)
def test_pool_equals_comfys_own_model_class(name, family_pool, files, comfy_outputs):
    handle = family_pool.load_model(files[name])
    for case, (x, t, inputs) in MODELS[name][2]().items():
        assert_parity(handle(x, t, **inputs), comfy_outputs[name][case], "float32", f"comfy/{name}/{case}")
    handle.unload()


def test_comfy_has_the_variants_model_classes():
    cs.import_comfy()
    import comfy.supported_models
    from sp_runtime.families.wan import COMFY
    if not hasattr(comfy.supported_models, COMFY.model_class("scail")):
        pytest.skip("this ComfyUI predates Wan SCAIL (0.3.64 has no WAN21_SCAIL)")
    for variant in ("scail", "scail2"):
        assert getattr(comfy.supported_models, COMFY.model_class(variant), None) is not None, variant

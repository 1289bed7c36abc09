"""LTX-2, 2.3 and 2.5 key plan: ComfyUI / original key names -> diffusers' LTX2VideoTransformer3DModel plus the two
text-embedding connectors (diffusers' converter drops them; we keep them as `*_embeddings_connector` submodules)."""
from __future__ import annotations

from typing import Iterable

from ...checkpoints.loading import KeyPlan
from ...contract import Detection
from .detection import CONNECTORS

# original names diffusers' converter leaves alone (LTX-2.3 / 2.5 additions) -> diffusers' names
NEWER_RENAMES = (("audio_prompt_adaln_single.", "audio_prompt_adaln."), ("prompt_adaln_single.", "prompt_adaln."))


def weight_plan(detection: Detection, keys: Iterable[str]) -> KeyPlan:
    return ltx2_key_plan(keys)


def ltx2_key_plan(keys: Iterable[str]) -> KeyPlan:
    """Original-layout key (prefix stripped) -> [(model key, None)]: the transformer's through diffusers' own
    converter (it only renames, so a {key: key} dict gives the mapping), the connectors' by their block names."""
    from diffusers.loaders.single_file_utils import convert_ltx2_transformer_to_diffusers
    keys = list(keys)
    transformer = [key for key in keys if not key.startswith(CONNECTORS)]
    renamed = convert_ltx2_transformer_to_diffusers({key: key for key in transformer})
    plan = {original: [(_renamed_newer(model_key), None)] for model_key, original in renamed.items()}
    plan.update({key: [(connector_key(key), None)] for key in keys if key.startswith(CONNECTORS)})
    return plan


def _renamed_newer(key: str) -> str:
    for original, diffusers_name in NEWER_RENAMES:
        if key.startswith(original):
            return diffusers_name + key[len(original):]
    return key


def connector_key(key: str) -> str:
    """ComfyUI's Embeddings1DConnector names -> diffusers' LTX2ConnectorTransformer1d names."""
    return (key.replace(".transformer_1d_blocks.", ".transformer_blocks.")
            .replace(".q_norm.", ".norm_q.").replace(".k_norm.", ".norm_k."))

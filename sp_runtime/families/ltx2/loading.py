"""LTX-2, 2.3 and 2.5 loading: diffusers' LTX2VideoTransformer3DModel plus the two text connectors ComfyUI keeps in
the diffusion model, with ComfyUI's q / k norm eps and time origin, and the checkpoint's weights; MODEL declares the
load and the worker running PLAN."""
from __future__ import annotations

from ...checkpoints.loading import WeightDtypes, build_empty_model
from ...contract import Detection
from ..family import PlanModel
from .detection import CONNECTORS, FAMILY, detect
from .keys import weight_plan
from .plan import PLAN

CONNECTOR_ROPE_MAX_POS = 4096   # ComfyUI's Embeddings1DConnector positions: index / 4096
QK_NORM_EPS = 1e-5              # ComfyUI's CrossAttention q_norm / k_norm (diffusers' LTX2Attention: 1e-6)
INFO_KEYS = ("in_channels", "audio_in_channels", "num_attention_heads", "attention_head_dim",
             "audio_num_attention_heads", "audio_attention_head_dim", "num_layers", "caption_channels",
             "cross_attention_dim", "audio_cross_attention_dim", "use_prompt_embeddings")


def attach_connectors(model, connectors: dict, theta: float) -> None:
    """The video and audio text connectors (ComfyUI's Embeddings1DConnector = diffusers' LTX2ConnectorTransformer1d)
    as submodules `video_embeddings_connector` / `audio_embeddings_connector` of the transformer; `connectors`
    holds each one's sizes by that name."""
    from diffusers.pipelines.ltx2.connectors import LTX2ConnectorTransformer1d
    for name in CONNECTORS:
        sizes = connectors[name]
        setattr(model, name, LTX2ConnectorTransformer1d(
            num_attention_heads=sizes["num_attention_heads"], attention_head_dim=sizes["attention_head_dim"],
            num_layers=sizes["num_layers"], num_learnable_registers=sizes["num_learnable_registers"],
            rope_base_seq_len=CONNECTOR_ROPE_MAX_POS, rope_theta=theta, rope_double_precision=True,
            rope_type=sizes["rope_type"], gated_attention=sizes["gated_attention"]))


def use_comfy_time_origin(model, causal: bool) -> None:
    """Video frame times as ComfyUI places them: with the file's causal_temporal_positioning the first latent frame
    (one pixel frame) starts at 0 and the others 7 pixel frames earlier than index x 8, as diffusers' rope does with
    causal_offset 1; without it at index x 8 (an offset of the temporal VAE factor cancels diffusers' shift)."""
    model.rope.causal_offset = 1 if causal else model.rope.scale_factors[0]


def use_comfy_qk_norm_eps(model) -> None:
    """ComfyUI's q / k RMS norms (eps 1e-5) in every attention of the transformer and the connectors."""
    from diffusers.models.transformers.transformer_ltx2 import LTX2Attention
    for module in model.modules():
        if isinstance(module, LTX2Attention):
            module.norm_q.eps = module.norm_k.eps = QK_NORM_EPS


def build_model(model_class, config: dict, dtypes: WeightDtypes):
    """The empty transformer (meta weights) with its connectors, ComfyUI's q / k norm eps and time origin."""
    from accelerate import init_empty_weights
    model = build_empty_model(model_class, {key: value for key, value in config.items()
                                            if key not in ("connector", "positions")}, dtypes)
    with init_empty_weights():
        attach_connectors(model, config["connector"], config["rope_theta"])
    use_comfy_qk_norm_eps(model)
    use_comfy_time_origin(model, config["positions"]["causal_temporal_positioning"])
    return model


def describe(model, detection: Detection) -> dict:
    """The host sees x as [B, 1, N] (both latents packed, plan.py); the token placement facts for ComfyUI."""
    return {**detection.config["positions"], "unbatched_inputs": ["latent_shapes", "frame_rate"]}


MODEL = PlanModel(FAMILY, "LTX-2", "LTX2VideoTransformer3DModel", detect, weight_plan, PLAN, 3, INFO_KEYS,
                  channels=lambda model: (1, 1), build=build_model, describe=describe)
load, load_model = MODEL.load, MODEL.load_model

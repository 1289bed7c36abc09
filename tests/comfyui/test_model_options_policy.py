"""nodes/model_options_policy.py, the allow-list of model options on an SP MODEL: every option key the core nodes of
ComfyUI set is classified (a table here; with COMFYUI_PATH also a scan of that ComfyUI's comfy_extras), an unknown
key is refused naming the node that set it, and sp_runtime.sp.rope_options places ScaleROPE positions as
ComfyUI does with rotary factors equal to diffusers' tables at integer positions.
"""
import os
import re

import pytest

import comfy_support as cs

# core node (comfy_extras of ComfyUI 0.33.0 - newest) -> the option keys it sets on a MODEL
CORE_NODE_KEYS = {
    "ScaleROPE": ["transformer_options.rope_options"],
    "TorchCompileModel": ["model_options.torch_compile_kwargs", "wrappers.apply_model.torch.compile"],
    "SkipLayerGuidanceDiT": ["model_options.sampler_post_cfg_function", "patches_replace.dit"],
    "SkipLayerGuidanceDiTSimple": ["model_options.sampler_calc_cond_batch_function", "patches_replace.dit"],
    "PerpNeg": ["model_options.sampler_cfg_function"],
    "CFGNorm": ["model_options.sampler_post_cfg_function"],
    "CFGZeroStar": ["model_options.sampler_post_cfg_function"],
    "RescaleCFG": ["model_options.sampler_post_cfg_function"],
    "APG": ["model_options.sampler_pre_cfg_function"],
    "ModelSamplingSD3": ["object_patches.model_sampling"], "ModelSamplingFlux": ["object_patches.model_sampling"],
    "ModelSamplingDiscrete": ["object_patches.model_sampling"],
    "ModelSamplingAuraFlow": ["object_patches.model_sampling"],
    "ModelSamplingContinuousEDM": ["object_patches.model_sampling", "object_patches.latent_format"],
    "ModelComputeDtype": ["model_options.dtype"],
    "FreeU": ["patches.output_block_patch"], "FreeU_V2": ["patches.output_block_patch"],
    "PatchModelAddDownscale": ["patches.input_block_patch", "patches.output_block_patch"],
    "HyperTile": ["patches.attn1_patch", "patches.attn1_output_patch"],
    "TomePatchModel": ["patches.attn1_patch", "patches.attn1_output_patch"],
    "SelfAttentionGuidance": ["patches_replace.attn1", "model_options.sampler_post_cfg_function"],
    "PerturbedAttentionGuidance": ["patches_replace.attn1", "model_options.sampler_post_cfg_function"],
    "DifferentialDiffusion": ["model_options.denoise_mask_function"],
    "EasyCache": ["wrappers.outer_sample.easycache", "wrappers.calc_cond_batch.easycache",
                  "wrappers.diffusion_model.easycache", "transformer_options.easycache"],
    "LazyCache": ["wrappers.outer_sample.lazycache", "wrappers.predict_noise.lazycache"],
    "ContextWindowsManual": ["model_options.context_handler"],
    "WanContextWindowsManual": ["model_options.context_handler"],
    "SetHookKeyframes / hooks": ["transformer_options.hooks"],
    "LTXVApplySTG": ["transformer_options.stg_self_attn_blocks"],
    "FluxKontextMultiReferenceLatentMethod": ["object_patches.diffusion_model.default_ref_method"],
    "FluxKVCache": ["patches.attn1_patch", "patches.post_input", "object_patches.diffusion_model.default_ref_method",
                    "object_patches.diffusion_model.params.default_ref_method"],
    "WanAnimate2 cache": ["transformer_options.animate2_cache", "callbacks.on_cleanup.None"],
    "WanInfiniteTalkToVideo": ["transformer_options.audio_embeds", "wrappers.outer_sample.infinite_talk_outer_sample"],
    "MultiGPU CFG Split": ["model_options.multigpu_clones"],
    "NAG / attention patches": ["patches.attn1_output_patch"],
    "QwenImageDiffsynthControlnet / model patches": ["patches.double_block", "patches.post_input",
                                                    "patches.noise_refiner"],
    "LoRA (Ulysses SP)": ["object_patches.diffusion_model"],
    # newer than the 0.33.0 tree (read from the newest stored comfy_extras files of Comfy-Org/ComfyUI, 0.38.x)
    "ModelPatchSeamlessTiling": ["model_options.model_function_wrapper"],
    "BlockSparseAttention": ["transformer_options.optimized_attention_override", "patches_replace.dit",
                             "callbacks.on_prepare_state.block_sparse_attention",
                             "callbacks.on_cleanup.block_sparse_attention"],
    "ModelAttentionBackend": ["transformer_options.optimized_attention_override"],
    "PrismAttention": ["transformer_options.prism_attention", "transformer_options.prism_sparsity",
                       "transformer_options.prism_cdf_threshold"],
}
# ModelPatcher setters the core nodes call -> the key they set (for the scan of a ComfyUI checkout)
SETTER_KEYS = {
    "set_model_sampler_cfg_function": "model_options.sampler_cfg_function",
    "set_model_sampler_post_cfg_function": "model_options.sampler_post_cfg_function",
    "set_model_options_post_cfg_function": "model_options.sampler_post_cfg_function",
    "set_model_sampler_pre_cfg_function": "model_options.sampler_pre_cfg_function",
    "set_model_sampler_calc_cond_batch_function": "model_options.sampler_calc_cond_batch_function",
    "set_model_unet_function_wrapper": "model_options.model_function_wrapper",
    "set_model_denoise_mask_function": "model_options.denoise_mask_function",
    "set_model_rope_options": "transformer_options.rope_options",
    "set_model_optimized_attention": "transformer_options.optimized_attention_override",
    "set_model_compute_dtype": "model_options.dtype",
    "set_model_attn1_patch": "patches.attn1_patch", "set_model_attn2_patch": "patches.attn2_patch",
    "set_model_attn1_output_patch": "patches.attn1_output_patch",
    "set_model_attn2_output_patch": "patches.attn2_output_patch",
    "set_model_attn1_replace": "patches_replace.attn1", "set_model_attn2_replace": "patches_replace.attn2",
    "set_model_options_patch_replace": "patches_replace.dit",
    "set_model_input_block_patch": "patches.input_block_patch",
    "set_model_input_block_patch_after_skip": "patches.input_block_patch_after_skip",
    "set_model_output_block_patch": "patches.output_block_patch",
    "set_model_emb_patch": "patches.emb_patch",
    "set_model_forward_timestep_embed_patch": "patches.forward_timestep_embed_patch",
    "set_model_double_block_patch": "patches.double_block", "set_model_post_input_patch": "patches.post_input",
    "set_model_noise_refiner_patch": "patches.noise_refiner",
    "set_model_middle_block_after_patch": "patches.middle_block_after_patch",
    "set_torch_compile_wrapper": "wrappers.apply_model.torch.compile",
}


@pytest.fixture(scope="module")
def policy():
    return cs.import_node_module("model_options_policy")


def test_every_key_the_core_nodes_set_is_classified(policy):
    unclassified = {node: [key for key in keys if key not in policy.RULES] for node, keys in CORE_NODE_KEYS.items()}
    assert not {node: keys for node, keys in unclassified.items() if keys}
    assert policy.rule_for("transformer_options.rope_options").kind == policy.WORKERS
    assert policy.rule_for("patches_replace.dit").kind == policy.WORKERS  # SkipLayerGuidanceDiT's skips only


@pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)
def test_every_option_the_core_nodes_of_this_comfyui_set_is_classified(policy):
    """A scan of comfy_extras/nodes_*.py: every ModelPatcher setter, keyed wrapper / callback and literal option key
    the core nodes use maps to a classified key."""
    folder = os.path.join(cs.comfyui_path(), "comfy_extras")
    found = {}
    for name in sorted(os.listdir(folder)):
        if not (name.startswith("nodes_") and name.endswith(".py")):
            continue
        text = open(os.path.join(folder, name), encoding="utf-8").read()
        for key in scanned_option_keys(text):
            found.setdefault(key, set()).add(name)
    assert found
    missing = {key: sorted(files) for key, files in found.items() if key not in policy.RULES}
    assert not missing, f"option keys set by core nodes but not classified in nodes/model_options_policy.py: {missing}"


def scanned_option_keys(text: str) -> set:
    """The option keys a comfy_extras file sets: setters, generic patch setters, keyed or unkeyed wrappers and
    callbacks, object patches and literal transformer_options keys."""
    keys = set()
    for setter in re.findall(r"\.(set_model_\w+|set_model_options_\w+|set_torch_compile_wrapper)\(", text):
        if setter not in ("set_model_patch", "set_model_patch_replace"):  # generic: their names are read below
            keys.add(SETTER_KEYS.get(setter, f"setter {setter}"))
    keys.update(f"patches.{patch}" for patch in re.findall(r"\.set_model_patch\(.*,\s*\"(\w+)\"\)", text))
    keys.update(f"patches_replace.{group}"
                for group in re.findall(r"\.set_model_patch_replace\([^\n]*?,\s*[\"'](\w+)[\"']", text))
    group_of = {"wrapper": "wrappers", "callback": "callbacks"}
    for kind, mp_type, key in re.findall(r"add_(wrapper|callback)_with_key\(\s*[\w.]*(?:WrappersMP|CallbacksMP)"
                                         r"\.(\w+),\s*\"([^\"]+)\"", text):
        keys.add(f"{group_of[kind]}.{mp_type.lower()}.{key}")
    for kind, mp_type in re.findall(r"add_(wrapper|callback)\(\s*[\w.]*(?:WrappersMP|CallbacksMP)\.(\w+)", text):
        keys.add(f"{group_of[kind]}.{mp_type.lower()}.None")
    keys.update(f"object_patches.{name}" for name in re.findall(r"add_object_patch\(\s*\"([\w.]+)\"", text))
    for key in re.findall(r"transformer_options\"?\]?\s*\[\"(\w+)\"\]\s*=(?!=)", text) + \
            re.findall(r"\bto\[\"(\w+)\"\]\s*=(?!=)", text):
        keys.add(f"transformer_options.{key}")
    for updated in re.findall(r"(?:options|to)\.update\(((?:\w+=[^,()]+,?\s*)+)\)", text):
        keys.update(f"transformer_options.{key}" for key in re.findall(r"(\w+)=", updated))
    return keys


def test_the_scan_reads_every_way_a_node_sets_an_option():
    """The scan itself, on lines as the newest core nodes write them (BlockSparseAttention, WanAnimate2's cache,
    PrismAttention, ModelSamplingSD3): a scan that misses a form would pass any ComfyUI."""
    text = """
    m.add_callback_with_key(comfy.patcher_extension.CallbacksMP.ON_PREPARE_STATE, "block_sparse_attention",
    m.set_model_patch_replace(make_h3_block_patch(block, i, patch), "dit", "double_block", i)
    m.add_callback(comfy.patcher_extension.CallbacksMP.ON_CLEANUP, lambda patcher: cache.free())
    m.add_wrapper(comfy.patcher_extension.WrappersMP.PREDICT_NOISE, predict_noise_wrapper)
    model.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, "easycache", wrapper)
    options.update(prism_attention=attention,prism_sparsity=sparsity,prism_cdf_threshold=cdf_threshold)
    m.add_object_patch("model_sampling", model_sampling)
    m.set_model_rope_options(scale_x, shift_x, scale_y, shift_y, scale_t, shift_t)
    """
    assert scanned_option_keys(text) == {
        "callbacks.on_prepare_state.block_sparse_attention", "patches_replace.dit", "callbacks.on_cleanup.None",
        "wrappers.predict_noise.None", "wrappers.outer_sample.easycache", "transformer_options.prism_attention",
        "transformer_options.prism_sparsity", "transformer_options.prism_cdf_threshold",
        "object_patches.model_sampling", "transformer_options.rope_options"}


def test_an_unknown_key_is_refused_naming_the_node_that_set_it(policy):
    origins = policy.OptionOrigins().cloned("node 3 (ScaleROPE)", {}).cloned(
        "node 7 (MadeUpPatchNode)", {"transformer_options.rope_options"})
    keys = {"transformer_options.rope_options": {"scale_x": 2.0}, "transformer_options.made_up": 1,
            "model_options.sampler_cfg_function": print}
    with pytest.raises(policy.RefusedOption, match=r"made_up' set by node 7 \(MadeUpPatchNode\)") as error:
        policy.check(keys, origins.origin)
    assert "rope_options" not in str(error.value) and "sampler_cfg_function" not in str(error.value)
    assert origins.origin("transformer_options.rope_options") == "node 3 (ScaleROPE)"
    policy.check({"transformer_options.run_ax": True, "transformer_options.stg_self_attn_blocks": []})
    with pytest.raises(policy.RefusedOption, match="run_ax"):
        policy.check({"transformer_options.run_ax": False})


def test_option_keys_name_patches_wrappers_and_callbacks(policy):
    options = {"sampler_cfg_function": print, "disable_cfg1_optimization": False,
               "transformer_options": {"patches": {"attn1_patch": [print], "attn2_patch": []},
                                       "patches_replace": {"dit": {("double_block", 0): print}},
                                       "rope_options": {"scale_x": 2.0}}}
    keys = policy.model_option_keys(options, {"outer_sample": {"easycache": [print]}},
                                    {"on_cleanup": {None: [print]}}, ["model_sampling"])
    assert set(keys) == {"model_options.sampler_cfg_function", "model_options.disable_cfg1_optimization",
                         "patches.attn1_patch", "patches_replace.dit",
                         "transformer_options.rope_options", "wrappers.outer_sample.easycache",
                         "callbacks.on_cleanup.None", "object_patches.model_sampling"}
    assert policy.refused(keys) == ["patches.attn1_patch", "patches_replace.dit"]


def test_rope_positions_are_placed_as_comfy_places_them_and_integer_ones_match_the_tables():
    import torch
    from diffusers.models.embeddings import get_1d_rotary_pos_embed
    from sp_runtime.sp.rope_options import is_identity, rotary_axis, scaled_positions
    positions = torch.tensor([[0, 0, 0], [1, 2, 3], [2, 4, 5]])
    placed = scaled_positions(positions, {"scale_t": 2.0, "shift_t": 1.0, "scale_y": 0.5, "shift_x": -3.0})
    assert placed.tolist() == [[1.0, 0.0, -3.0], [3.0, 1.0, 0.0], [5.0, 2.0, 2.0]]
    for axis in range(3):  # ComfyUI: linspace(start + shift, start + shift + (len - 1) * scale, len)
        line = torch.linspace(0 + [1.0, 0.0, -3.0][axis], [1.0, 0.0, -3.0][axis] + 2 * [2.0, 0.5, 1.0][axis], 3,
                              dtype=torch.float64)
        assert torch.allclose(scaled_positions(torch.tensor([[0, 0, 0], [1, 1, 1], [2, 2, 2]]),
                                               {"scale_t": 2.0, "shift_t": 1.0, "scale_y": 0.5,
                                                "shift_x": -3.0})[:, axis], line)
    cos_table, sin_table = get_1d_rotary_pos_embed(16, 40, 10000.0, use_real=True, repeat_interleave_real=True,
                                                   freqs_dtype=torch.float64)
    cos, sin = rotary_axis(torch.arange(40), 16, 10000.0)
    assert cos.equal(cos_table) and sin.equal(sin_table)
    assert is_identity(None) and is_identity({"scale_x": 1.0, "shift_t": 0.0}) and not is_identity({"scale_x": 2})


def test_block_skips_are_served_and_other_block_replacements_refused(policy):
    """SkipLayerGuidanceDiT's replacement returns its arguments (a skip): served as {kind: indices}; one that runs
    the original block, a builtin, or a key that is not (kind, index) is refused."""
    def skip(args, extra_args):
        return args

    served = {("double_block", 9): skip, ("double_block", 7): skip, ("single_block", 1): skip}
    assert policy.block_skips(served) == {"double_block": [7, 9], "single_block": [1]}
    assert policy.refused({"patches_replace.dit": served}) == []
    for entries in ({("double_block", 0): lambda args, extra: extra["original_block"](args)},
                    {("double_block", 0): print}, {"double_block": skip}, {**served, ("single_block", 2): dict}):
        assert policy.block_skips(entries) is None
        assert policy.refused({"patches_replace.dit": entries}) == ["patches_replace.dit"]

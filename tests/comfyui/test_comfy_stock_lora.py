"""ComfyUI's stock LoraLoaderModelOnly on the SP loader's MODEL (devices cpu:2): the KSampler latent equals ComfyUI's
own model patched by the same node, for Qwen-Image, Flux and Wan tiny checkpoints, with LoRA files in kohya,
diffusers / peft, LyCORIS LoHa and LoKr formats written with the real key names (Flux: diffusers names land at
offsets in the fused qkv / linear1, one with a DoRA scale), at strengths 1.0, 0.5 and -0.7, two stacked, and the
base MODEL afterwards bitwise as before; a hook LoRA with scheduled strengths on the positive prompt only (cond and
uncond then run with different weights). Unsupported patches are a clear error; status() lists the patches.

Needs COMFYUI_PATH (a ComfyUI checkout whose requirements are installed in this Python); skipped otherwise.
"""
import os

import pytest

import comfy_support as cs

pytestmark = pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)

FAMILIES = ["qwen_image", "flux", "wan"]
FRAMES = {"wan": 3}
STEPS = 2
RANK = 4
# per family and format: (LoRA module name as trainers write it, [rows, columns] of the weight it changes)
MODULES = {
    "qwen_image": {
        "kohya": [("lora_unet_transformer_blocks_0_attn_to_q", (96, 96)),
                  ("lora_unet_transformer_blocks_1_img_mlp_net_2", (96, 384))],
        "diffusers": [("transformer.transformer_blocks.0.attn.add_k_proj", (96, 96)),
                      ("transformer.transformer_blocks.1.attn.to_out.0", (96, 96))],
        "loha": [("lycoris_transformer_blocks_0_attn_to_v", (96, 96))],
        "lokr": [("lora_unet_transformer_blocks_1_attn_to_q", (96, 96))],
    },
    "flux": {
        "kohya": [("lora_unet_double_blocks_0_img_attn_qkv", (288, 96)),
                  ("lora_unet_single_blocks_1_linear1", (672, 96))],
        "diffusers": [("transformer.transformer_blocks.0.attn.to_q", (96, 96)),
                      ("transformer.transformer_blocks.0.attn.to_v", (96, 96)),
                      ("transformer.single_transformer_blocks.1.proj_mlp", (384, 96)),
                      ("transformer.transformer_blocks.1.ff_context.net.2", (96, 384))],
        "loha": [("lycoris_transformer_blocks_1_attn_to_k", (96, 96))],
        "lokr": [("lora_unet_single_blocks_0_linear1", (672, 96))],
    },
    "wan": {
        "kohya": [("lora_unet_blocks_0_self_attn_q", (96, 96)), ("lora_unet_blocks_1_ffn_2", (96, 128))],
        "diffusers": [("diffusion_model.blocks.1.cross_attn.k", (96, 96)),
                      ("diffusion_model.blocks.0.self_attn.o", (96, 96))],
        "loha": [("lora_unet_blocks_1_self_attn_v", (96, 96))],
        "lokr": [("lora_unet_blocks_0_ffn_0", (128, 96))],
    },
}
DORA = {("flux", "diffusers")}  # a DoRA scale on top: the decomposition needs the whole fused weight's rows


def lora_state(family: str, form: str, seed: int) -> dict:
    import torch
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=0.2):
        return torch.randn(*shape, generator=generator) * scale

    state = {}
    for module, (rows, columns) in MODULES[family][form]:
        if form == "kohya":
            state.update({f"{module}.lora_up.weight": randn(rows, RANK), f"{module}.lora_down.weight":
                          randn(RANK, columns), f"{module}.alpha": torch.tensor(2.0)})
        elif form == "diffusers":
            state.update({f"{module}.lora_B.weight": randn(rows, RANK), f"{module}.lora_A.weight":
                          randn(RANK, columns)})
            if (family, form) in DORA:
                state[f"{module}.dora_scale"] = 1.0 + randn(rows, 1, scale=0.1)
        elif form == "loha":
            state.update({f"{module}.hada_w1_a": randn(rows, RANK), f"{module}.hada_w1_b": randn(RANK, columns),
                          f"{module}.hada_w2_a": randn(rows, RANK), f"{module}.hada_w2_b": randn(RANK, columns),
                          f"{module}.alpha": torch.tensor(3.0)})
        else:  # LoKr: a full 2x2 left factor, a low-rank right one
            state.update({f"{module}.lokr_w1": randn(2, 2, scale=1.0), f"{module}.lokr_w2_a":
                          randn(rows // 2, RANK), f"{module}.lokr_w2_b": randn(RANK, columns // 2),
                          f"{module}.alpha": torch.tensor(2.0)})
    return state


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cs.import_comfy()
    import folder_paths
    from safetensors.torch import save_file
    models = tmp_path_factory.mktemp("models")
    folder_paths.add_model_folder_path("diffusion_models", str(models / "diffusion_models"), is_default=True)
    folder_paths.add_model_folder_path("loras", str(models / "loras"), is_default=True)
    os.makedirs(models / "loras")
    owner = cs.import_node_module("pool_owner").OWNER
    loader = cs.import_node_module("loader")
    checkpoints = {family: cs.write_tiny(family, str(models / "diffusion_models")) for family in FAMILIES}
    sp_models, references = {}, {}
    for family, path in checkpoints.items():
        for seed, form in enumerate(MODULES[family]):
            save_file(lora_state(family, form, seed), str(models / "loras" / f"{family}_{form}.safetensors"))
        sp_models[family] = loader.SPModelLoader.execute(
            unet_name=os.path.basename(path), weight_dtype="fp32", devices="cpu:2", ulysses_degree=0, ring_degree=1,
            cfg_parallel=False).result[0]
        references[family] = cs.comfy_reference_model(family, path)
    yield {"sp": sp_models, "ref": references, "owner": owner}
    owner.close_all()


def with_loras(model, family, loras):
    import nodes  # ComfyUI's own nodes.py (ComfyUI is first on sys.path)
    for form, strength in loras:
        model = nodes.LoraLoaderModelOnly().load_lora_model_only(model, f"{family}_{form}.safetensors", strength)[0]
    return model


def run(model, family):
    return cs.sample(model, cs.conditioning(family, 1), cs.conditioning(family, 2), steps=STEPS,
                     frames=FRAMES.get(family, 0))


@pytest.mark.parametrize("family", FAMILIES)
def test_stock_lora_node_on_sp_model_equals_comfys_model(family, env):
    sp, ref = env["sp"][family], env["ref"][family]
    base = run(sp, family)
    cs.assert_close(base, run(ref, family))
    stacks = [[("kohya", 1.0)], [("diffusers", 0.5)], [("loha", -0.7)], [("lokr", 1.0)],
              [("kohya", 0.5), ("lokr", -0.7)]]
    for loras in stacks:
        actual = run(with_loras(sp, family, loras), family)
        cs.assert_close(actual, run(with_loras(ref, family, loras), family))
        assert (actual - base).abs().max() > 1e-3, f"{loras} changed nothing"
    assert run(sp, family).equal(base)  # the patches came off exactly


def test_switching_back_to_a_kept_patch_set_sends_nothing_new(env, monkeypatch):
    import sp_runtime.pool.pool as pool_module
    family = "qwen_image"
    first, second = (with_loras(env["sp"][family], family, [(form, 1.0)]) for form in ("kohya", "lokr"))
    expected = run(first, family)
    run(second, family)
    sent = []
    monkeypatch.setattr(pool_module, "stage_patch_set", lambda *args: sent.append(args) or None)
    assert run(first, family).equal(expected)  # the workers kept the set: only its digest went
    assert run(second, family).abs().max() > 0 and sent == []
    pool = next(iter(env["owner"]._pools.values()))
    model = next(entry for entry in pool.status()["models"] if entry["family"] == family)
    assert model["weight_patches"]["loras"] == [["lokr on 1 weights", 1.0]]


def test_status_lists_patches_and_unsupported_patches_are_clear_errors(env):
    import comfy.sd
    import torch
    patched = with_loras(env["sp"]["wan"], "wan", [("loha", 0.5), ("kohya", -0.7)])
    run(patched, "wan")
    pool = next(iter(env["owner"]._pools.values()))
    model = next(entry for entry in pool.status()["models"] if entry["family"] == "wan")
    assert model["weight_patches"]["loras"] == [["loha on 1 weights", 0.5], ["lora on 2 weights", -0.7]]
    merge = {"diffusion_model.blocks.0.self_attn.q.weight": [(torch.zeros(96, 96), lambda weight, **kw: weight)]}
    with pytest.raises(RuntimeError, match="model merge"):
        env["sp"]["wan"].clone().add_patches(merge, 0.5)
    flux_control = {"diffusion_model.img_in.lora_up.weight": torch.zeros(96, 4),
                    "diffusion_model.img_in.lora_down.weight": torch.zeros(4, 64),
                    "diffusion_model.img_in.reshape_weight": torch.tensor([96, 128])}
    with pytest.raises(RuntimeError, match="reshape"):
        comfy.sd.load_lora_for_models(env["sp"]["flux"], None, flux_control, 1.0, 0)


@pytest.mark.parametrize("family", ["flux"])
def test_hook_lora_with_scheduled_strengths_equals_comfys_model(family, env):
    """CreateHookLora + SetHookKeyframes + conditioning hooks, as the hook nodes build them, with a stock LoRA on
    the MODEL as well: the hook's weights apply to the positive prompt only, at 1.0 then 0.3 from half-way."""
    import comfy.hooks
    hooks = comfy.hooks.create_hook_lora(lora_state(family, "loha", 5), strength_model=0.8, strength_clip=0.0)
    keyframes = comfy.hooks.HookKeyframeGroup()
    keyframes.add(comfy.hooks.HookKeyframe(strength=1.0, start_percent=0.0))
    keyframes.add(comfy.hooks.HookKeyframe(strength=0.3, start_percent=0.5))
    hooks.set_keyframes_on_hooks(keyframes)
    positive = comfy.hooks.set_hooks_for_conditioning(cs.conditioning(family, 1), hooks)
    negative = cs.conditioning(family, 2)

    def hooked(model):
        return cs.sample(with_loras(model, family, [("kohya", 0.5)]), positive, negative, steps=4)
    actual = hooked(env["sp"][family])
    cs.assert_close(actual, hooked(env["ref"][family]))
    plain = cs.sample(with_loras(env["sp"][family], family, [("kohya", 0.5)]), cs.conditioning(family, 1), negative,
                      steps=4)
    assert (actual - plain).abs().max() > 1e-3  # the hook matters

"""ComfyUI tier: SkipLayerGuidanceDiT and SkipLayerGuidanceDiTSimple (comfy_extras.nodes_slg) on an SP Wan 2.1 at
Ulysses 2 equal the same nodes on ComfyUI's own Wan, through the stock sampler: their per-call block skips
(patches_replace["dit"]) reach the workers as skip_blocks. A block replacement that does more than skip is refused,
naming the node; so is FluxKVCache (a cross-step cache of reference keys / values). Skips without COMFYUI_PATH."""
import pytest

import comfy_support as cs
from test_comfy_newest import run, wan  # noqa: F401 - the tiny SP Wan at cpu:2 (Ulysses 2), ComfyUI's own Wan

pytestmark = pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)


def result(out):
    return out.result[0] if hasattr(out, "result") else out[0]


def slg(model):
    from comfy_extras.nodes_slg import SkipLayerGuidanceDiT
    return result(SkipLayerGuidanceDiT.execute(model, 3.0, 0.0, 1.0, double_layers="1", single_layers="0"))


def slg_simple(model):
    from comfy_extras.nodes_slg import SkipLayerGuidanceDiTSimple
    return result(SkipLayerGuidanceDiTSimple.execute(model, 0.0, 1.0, double_layers="0", single_layers="1"))


@pytest.mark.parametrize("node", [slg, slg_simple], ids=["SkipLayerGuidanceDiT", "SkipLayerGuidanceDiTSimple"])
def test_skip_layer_guidance_equals_comfyuis_wan(wan, node):
    """The guidance pass without block 1 (DiT: a third pass; Simple: the uncond pass without block 0) at every
    step; the skipped pass changes the result (else the test could not fail)."""
    actual, expected = run(node(wan["sp"])), run(node(wan["ref"]))
    print(f"{node.__name__}: max abs diff {cs.assert_close(actual, expected):.2e} (scale "
          f"{expected.abs().max().item():.2f})")
    plain = run(wan["ref"])
    assert (expected - plain).abs().max() > 1e-3 * plain.abs().max()


def test_a_block_replacement_that_runs_the_block_is_refused_by_name(wan):
    """Only skips are served: a 'dit' replacement that calls the original block is refused, naming the node."""
    import comfy.model_patcher
    from comfy_api.latest import io

    class ReplacesABlock(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            return io.Schema(node_id="ReplacesABlock", inputs=[io.Model.Input("model")],
                             outputs=[io.Model.Output()])

        @classmethod
        def execute(cls, model):
            m = model.clone()
            m.model_options = comfy.model_patcher.set_model_options_patch_replace(
                m.model_options, lambda args, extra: extra["original_block"](args), "dit", "double_block", 0)
            return io.NodeOutput(m)

    proxy = cs.import_node_module("proxy")
    policy = cs.import_node_module("model_options_policy")
    with pytest.raises((proxy.SPPoolError, policy.RefusedOption), match=r"patches_replace\.dit' set by ReplacesABlock"):
        run(result(ReplacesABlock.execute(wan["sp"])))
    run(wan["sp"])  # the pool stays usable


def test_flux_kv_cache_is_refused_naming_the_node_and_why(wan):
    """FluxKVCache keeps the reference tokens' keys / values across steps inside ComfyUI's network: refused when the
    patcher checks its options, naming the node and the cross-step cache (the node does not look at the family)."""
    FluxKVCache = getattr(pytest.importorskip("comfy_extras.nodes_flux"), "FluxKVCache", None)
    if FluxKVCache is None:
        pytest.skip("this ComfyUI has no FluxKVCache node (added after 0.3.64)")
    policy = cs.import_node_module("model_options_policy")
    model = result(FluxKVCache.execute(wan["sp"]))
    with pytest.raises(policy.RefusedOption, match=r"(?s)set by FluxKVCache.*cross-step state the SP workers do "
                                                   r"not keep.*remove FluxKVCache"):
        model.check_options()

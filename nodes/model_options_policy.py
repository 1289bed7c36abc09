"""The allow-list of what a node may put on an Ulysses SP MODEL: every key of model_options, transformer_options,
patches, patches_replace, wrappers, callbacks and object patches is host-only (runs in this process around the
diffusion call, harmless), served by the workers, or refused with an error naming the node that set it. A key not
listed here is refused: an option the workers do not implement is never dropped silently. No ComfyUI import.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

HOST, WORKERS, REFUSED = "host-only", "served by the workers", "refused"
_ANY = object()


@dataclass(frozen=True)
class Rule:
    kind: str
    why: str  # host / workers: what it does; refused: why and what to do
    harmless_value: Any = _ANY  # a refused switch is harmless (host-only) while it holds this value
    serves: Optional[Callable[[Any], bool]] = None  # a served key is refused at values for which this is False


class RefusedOption(RuntimeError):
    """A model option the Ulysses SP workers cannot serve (the message names it, the node and what to do)."""


_SAMPLER_MATH = "sampler maths on the model's outputs, run in this process"
_IN_NETWORK = ("runs inside ComfyUI's own network, which an SP model does not have in this process (the workers run "
               "diffusers' transformer)")
_REMOVE = "remove that node from the SP model's path (or sample that branch with a model from the stock loader)"


def _family_rules() -> dict[str, Rule]:
    """The transformer options the families' host hooks refuse (contract.HostHooks.refused_options)."""
    from sp_runtime.families import families
    return {f"transformer_options.{key}": Rule(REFUSED, f"{why}: {_REMOVE}", harmless_value=harmless)
            for entry in families() if entry.comfy is not None
            for key, (harmless, why) in entry.comfy.hooks.refused_options.items()}


_KV_CACHE = ("FluxKVCache (Flux.2 klein's reference KV cache) sets it to index_timestep_zero together with its "
             "attn1_patch and post_input patches: the first step's reference keys / values per block are cached "
             "in ComfyUI's network and reused by later steps without the reference tokens, a cross-step state the "
             "SP workers do not keep (they run every step in full, references included: ComfyUI's result without "
             "the node); remove FluxKVCache")

# "<group>.<key>": group model_options / transformer_options / patches / patches_replace / object_patches, and
# wrappers.<type> / callbacks.<type> (key None: added without a key).
RULES: dict[str, Rule] = {
    # ---- model_options: set by sampler / guidance nodes; everything there runs on the host ----
    "model_options.transformer_options": Rule(HOST, "the container of the options below (checked key by key)"),
    "model_options.sampler_cfg_function": Rule(HOST, f"CFG combination ({_SAMPLER_MATH}; PerpNeg, CFGNorm, ...)"),
    "model_options.sampler_post_cfg_function": Rule(HOST, f"post-CFG ({_SAMPLER_MATH}; RescaleCFG, CFGZeroStar, "
                                                          f"Mahiro, SLG's second pass, ...)"),
    "model_options.sampler_pre_cfg_function": Rule(HOST, f"pre-CFG ({_SAMPLER_MATH}; APG, FreSca, TCFG, ...)"),
    "model_options.sampler_calc_cond_batch_function": Rule(HOST, "batches the conditionings and calls the model "
                                                                 "(which is the SP model) on the host"),
    "model_options.model_function_wrapper": Rule(HOST, "wraps BaseModel.apply_model on the host, which calls the "
                                                       "SP model"),
    "model_options.denoise_mask_function": Rule(HOST, "DifferentialDiffusion's mask (sampler maths)"),
    "model_options.disable_cfg1_optimization": Rule(HOST, "a sampler switch"),
    "model_options.context_handler": Rule(HOST, "context windows: the host calls the SP model window by window"),
    "model_options.torch_compile_kwargs": Rule(WORKERS, "TorchCompileModel: the SP model's blocks are compiled in "
                                                        "the workers (the loaders' `compile` option)"),
    "model_options.dtype": Rule(HOST, "set by model loaders"),
    "model_options.load_device": Rule(HOST, "set by model loaders"),
    "model_options.offload_device": Rule(HOST, "set by model loaders"),
    "model_options.multigpu_clones": Rule(REFUSED, "MultiGPU CFG Split copies the model to other GPUs; an SP model "
                                                   "already runs on all its devices: remove the MultiGPU node and "
                                                   "set cfg_parallel on the SP loader instead"),
    "model_options.multigpu_options": Rule(REFUSED, "MultiGPU options: remove the MultiGPU node and set "
                                                    "cfg_parallel on the SP loader instead"),
    # ---- transformer_options: what ComfyUI adds per call, then what nodes set ----
    **{f"transformer_options.{key}": Rule(HOST, "set by ComfyUI's sampler for each call") for key in (
        "cond_or_uncond", "uuids", "sigmas", "sample_sigmas", "multigpu_thread_device", "prefetch_dynamic_vbars",
        "patches", "patches_replace", "wrappers", "callbacks", "transformer_index", "hooks")},
    "transformer_options.rope_options": Rule(WORKERS, "ScaleROPE: the workers scale and shift the rotary "
                                                      "positions (Wan, Flux, Flux.2; ignored as ComfyUI ignores it "
                                                      "for Qwen-Image, HunyuanVideo, LTX-2; refused for the "
                                                      "others)"),
    "transformer_options.easycache": Rule(HOST, "EasyCache / LazyCache state (caches the SP model's outputs)"),
    "transformer_options.lazycache": Rule(HOST, "LazyCache state (caches the SP model's outputs)"),
    "transformer_options.optimized_attention_override": Rule(
        REFUSED, f"an attention override {_IN_NETWORK}; the workers' attention is chosen with the SP loader's "
                 f"`attention` input: {_REMOVE}"),
    "transformer_options.stg_self_attn_blocks": Rule(REFUSED, f"STG skips self-attention in chosen blocks, "
                                                              f"{_IN_NETWORK}: {_REMOVE}", harmless_value=()),
    "transformer_options.stg_skip_self_attn": Rule(REFUSED, f"STG: {_IN_NETWORK}: {_REMOVE}", harmless_value=False),
    **_family_rules(),  # what a family's host hooks refuse (LTX-2's stream switches)
    "transformer_options.chroma_radiance_options": Rule(REFUSED, f"Chroma Radiance options {_IN_NETWORK}: {_REMOVE}"),
    "transformer_options.animate2_cache": Rule(REFUSED, f"Wan Animate 2's cache {_IN_NETWORK}: {_REMOVE}"),
    "transformer_options.audio_embeds": Rule(REFUSED, f"InfiniteTalk's audio embeddings go into ComfyUI's own "
                                                      f"network ({_IN_NETWORK}): {_REMOVE}"),
    "transformer_options.minimax_h3_sigma_shift_video": Rule(REFUSED, f"a MiniMax H3 option {_IN_NETWORK}"),
    "transformer_options.minimax_h3_sigma_shift_audio": Rule(REFUSED, f"a MiniMax H3 option {_IN_NETWORK}"),
    **{f"transformer_options.{key}": Rule(REFUSED, f"Prism Sparse Attention Settings (PrismAttention) for "
                                                   f"ComfyUI's Prism model, {_IN_NETWORK}: {_REMOVE}")
       for key in ("prism_attention", "prism_sparsity", "prism_cdf_threshold")},
    # ---- patches / patches_replace: all run inside ComfyUI's network ----
    **{f"patches.{name}": Rule(REFUSED, f"a model patch ('{name}', e.g. from {nodes}) {_IN_NETWORK}: {_REMOVE}")
       for name, nodes in {
           "attn1_patch": "Hypernetwork, HyperTile, ToMe, FluxKVCache, model-patch nodes",
           "attn2_patch": "Hypernetwork, IP-Adapter style nodes",
           "attn1_output_patch": "HyperTile, ToMe, NAG", "attn2_output_patch": "attention output patches",
           "input_block_patch": "PatchModelAddDownscale", "input_block_patch_after_skip": "PatchModelAddDownscale",
           "output_block_patch": "FreeU / FreeU_V2, PatchModelAddDownscale, SDPose",
           "middle_block_after_patch": "middle-block patches", "emb_patch": "embedding patches",
           "forward_timestep_embed_patch": "timestep-embedding patches",
           "double_block": "model-patch ControlNets (QwenImageDiffsynthControlnet, USO, ...)",
           "post_input": "FluxKVCache, Flux / model-patch nodes", "noise_refiner": "Z-Image model patches",
           "mlp_patch": "Anima LLLite model patches",
           "post_cfg_function": "model patches"}.items()},
    **{f"patches_replace.{name}": Rule(REFUSED, f"block / attention replacements ('{name}', e.g. from {nodes}) "
                                                f"{_IN_NETWORK}: {_REMOVE}")
       for name, nodes in {"attn1": "SelfAttentionGuidance, PerturbedAttention",
                           "attn2": "cross-attention replacements", "double_block": "block replacements",
                           "single_block": "block replacements"}.items()},
    "patches_replace.dit": Rule(
        WORKERS, "block skips (SkipLayerGuidanceDiT / SkipLayerGuidanceDiTSimple: the blocks their guidance pass "
                 "leaves out, carried per call as the workers' skip_blocks input); other block replacements "
                 f"('dit' entries that do more than return their input) {_IN_NETWORK}: {_REMOVE}",
        serves=lambda entries: block_skips(entries) is not None),
    # ---- wrappers (key None: added without a key) ----
    "wrappers.outer_sample.easycache": Rule(HOST, "EasyCache: skips model calls on the host"),
    "wrappers.calc_cond_batch.easycache": Rule(HOST, "EasyCache: skips model calls on the host"),
    "wrappers.diffusion_model.easycache": Rule(HOST, "EasyCache: caches the SP model's outputs"),
    "wrappers.outer_sample.lazycache": Rule(HOST, "LazyCache: skips model calls on the host"),
    "wrappers.predict_noise.lazycache": Rule(HOST, "LazyCache: skips model calls on the host"),
    "wrappers.predict_noise.None": Rule(HOST, "a core sampler node's guidance schedule around the prediction"),
    "wrappers.outer_sample.triposplat_sampling_preview": Rule(HOST, "a preview of the sampling"),
    "wrappers.apply_model.torch.compile": Rule(WORKERS, "TorchCompileModel: mapped to the workers' `compile` "
                                                        "option (no host wrapper is added)"),
    "wrappers.outer_sample.infinite_talk_outer_sample": Rule(REFUSED, f"InfiniteTalk {_IN_NETWORK}: {_REMOVE}"),
    "wrappers.diffusion_model.hidream_o1_patch_seam_smoothing": Rule(HOST, "HiDream-O1 seam smoothing: averages "
                                                                           "the SP model's outputs on rolled inputs"),
    # ---- callbacks ----
    "callbacks.on_cleanup.None": Rule(HOST, "frees a node's host-side cache after sampling"),
    **{f"callbacks.{kind}.block_sparse_attention": Rule(
        REFUSED, f"Model Sparse Attention (BlockSparseAttention) puts its attention override back at every step, "
                 f"{_IN_NETWORK}; the workers' attention is chosen with the SP loader's `attention` input: {_REMOVE}")
       for kind in ("on_prepare_state", "on_cleanup")},
    # ---- object patches ----
    "object_patches.model_sampling": Rule(HOST, "ModelSampling* nodes (sigma schedule and shift, host maths)"),
    "object_patches.latent_format": Rule(HOST, "latent format (host maths)"),
    "object_patches.diffusion_model": Rule(HOST, "the SP proxy itself (LoRA (Ulysses SP), TorchCompileModel)"),
    "object_patches.diffusion_model.default_ref_method": Rule(
        REFUSED, f"Flux Kontext's reference-latent method set on ComfyUI's network: use the `ReferenceLatent` "
                 f"conditioning's method instead, or remove FluxKontextMultiReferenceLatentMethod ({_KV_CACHE})"),
    "object_patches.diffusion_model.params.default_ref_method": Rule(
        REFUSED, f"Flux Kontext's reference-latent method set on ComfyUI's network: remove "
                 f"FluxKontextMultiReferenceLatentMethod ({_KV_CACHE})"),
}
_UNKNOWN = Rule(REFUSED, "not on ulysses-sp's list of options the workers serve or that are safe on the host "
                         "(an option the workers do not implement would be dropped silently): remove that node for "
                         "SP models, or, for a node that only works on the host, call "
                         "nodes.model_options_policy.allow_host_only(key) from it")


def allow_host_only(key: str, why: str = "declared host-only by a custom node") -> None:
    """For custom nodes whose option runs only in the ComfyUI process (e.g. a cache around the model's outputs)."""
    RULES[key] = Rule(HOST, why)


def rule_for(key: str) -> Rule:
    return RULES.get(key, _UNKNOWN)


def _present(value) -> bool:
    return value is not None and not (hasattr(value, "__len__") and len(value) == 0)


def transformer_option_keys(options: dict) -> dict[str, Any]:
    """{policy key: value} of a transformer_options dict (patch lists, replacements, wrappers and callbacks by name)."""
    keys = {}
    for key, value in (options or {}).items():
        if key in ("patches", "patches_replace"):
            keys.update({f"{key}.{name}": entry for name, entry in (value or {}).items() if _present(entry)})
        elif key in ("wrappers", "callbacks"):
            keys.update(_by_type(key, value))
        else:
            keys[f"transformer_options.{key}"] = value
    return keys


def _by_type(group: str, by_type: Optional[dict]) -> dict[str, Any]:
    return {f"{group}.{kind}.{name}": entries for kind, named in (by_type or {}).items()
            for name, entries in (named or {}).items() if _present(entries)}


def model_option_keys(model_options: dict, wrappers: Optional[dict] = None, callbacks: Optional[dict] = None,
                      object_patches: Iterable[str] = ()) -> dict[str, Any]:
    """{policy key: value} of everything a patcher carries besides weight patches."""
    keys = {f"model_options.{key}": value for key, value in (model_options or {}).items()
            if key != "transformer_options" and _present(value)}
    keys.update(transformer_option_keys(model_options.get("transformer_options", {})))
    keys.update(_by_type("wrappers", wrappers))
    keys.update(_by_type("callbacks", callbacks))
    keys.update({f"object_patches.{name}": True for name in object_patches})
    return keys


def refused(keys: dict[str, Any]) -> list[str]:
    """The keys among `keys` that are refused at their value, in order."""
    out = []
    for key, value in keys.items():
        rule = rule_for(key)
        if rule.kind == REFUSED and not _harmless(rule, value):
            out.append(key)
        elif rule.kind == WORKERS and rule.serves is not None and not rule.serves(value):
            out.append(key)
    return out


# ----- block skips (patches_replace["dit"]) -----
class _Probe(dict):
    """The arguments a block replacement gets, as a marker: a skip returns them unchanged."""


def _never_called(args):
    raise RuntimeError("not a block skip: it runs the original block")


def is_block_skip(replacement) -> bool:
    """Whether a patches_replace["dit"] entry skips its block (returns its arguments unchanged, as
    SkipLayerGuidanceDiT's `skip` does). Only plain Python functions are probed (no builtins, no bound objects)."""
    if not inspect.isfunction(replacement):
        return False
    probe = _Probe()
    try:
        return replacement(probe, {"original_block": _never_called}) is probe
    except Exception:  # noqa: BLE001 - any replacement that does more than return its input is not a skip
        return False


def block_skips(entries) -> Optional[dict[str, list[int]]]:
    """patches_replace["dit"] ({(kind, index): replacement}) -> {kind: sorted indices} when every entry is a block
    skip; None when any is not (then refused)."""
    skips: dict[str, set[int]] = {}
    for key, replacement in (entries or {}).items():
        if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str) and isinstance(key[1], int)
                and is_block_skip(replacement)):
            return None
        skips.setdefault(key[0], set()).add(key[1])
    return {kind: sorted(indices) for kind, indices in sorted(skips.items())}


def _harmless(rule: Rule, value) -> bool:
    if rule.harmless_value is _ANY:
        return False
    if isinstance(rule.harmless_value, tuple) and not rule.harmless_value:
        return not _present(value)
    return bool(value) == rule.harmless_value


def check(keys: dict[str, Any], origin=lambda key: None) -> None:
    """Raise RefusedOption for the first refused key, naming the node that set it (origin(key)) and what to do."""
    bad = refused(keys)
    if not bad:
        return
    lines = []
    for key in bad:
        node = origin(key)
        lines.append(f"- option '{key}'{f' set by {node}' if node else ''}: {rule_for(key).why}")
    raise RefusedOption("Ulysses SP model: options the workers cannot serve (refused rather than dropped "
                        "silently):\n" + "\n".join(lines))


# ----- which node set a key -----
def current_node() -> Optional[str]:
    """'node 12 (ScaleROPE)' for the node running now (ComfyUI's executing context and the calling node class on
    the stack), or None outside a node."""
    node_id = None
    try:
        from comfy_execution.utils import get_executing_context
        context = get_executing_context()
        node_id = context.node_id if context is not None else None
    except ImportError:
        pass
    name = _calling_node_class()
    if name and node_id is not None:
        return f"node {node_id} ({name})"
    if name:
        return name
    return f"node {node_id}" if node_id is not None else None


def _calling_node_class() -> Optional[str]:
    """The nearest caller that is a ComfyUI node (a V3 io.ComfyNode class or a V1 node object)."""
    frame = inspect.currentframe()
    while frame is not None:
        for local in ("cls", "self"):
            owner = frame.f_locals.get(local)
            cls = owner if isinstance(owner, type) else type(owner) if owner is not None else None
            if cls is not None and (hasattr(cls, "define_schema") or hasattr(cls, "INPUT_TYPES")):
                return _node_name(cls)
        frame = frame.f_back
    return None


def _node_name(cls) -> str:
    try:
        schema = cls.GET_SCHEMA() if hasattr(cls, "GET_SCHEMA") else None
        node_id = getattr(schema, "node_id", None)
        return node_id or cls.__name__
    except Exception:  # noqa: BLE001 - a name is only for the message
        return cls.__name__


class OptionOrigins:
    """Which node set which key: each clone of an SP patcher records the node making it and the keys it got; a key
    belongs to the latest clone made before it appeared."""

    def __init__(self, history: tuple = ()):
        self.history = history  # ((node, frozenset(keys before that node)), ...)

    def cloned(self, node: Optional[str], keys_before: Iterable[str]) -> "OptionOrigins":
        return OptionOrigins(self.history + ((node, frozenset(keys_before)),))

    def origin(self, key: str) -> Optional[str]:
        for node, before in reversed(self.history):
            if key not in before:
                return node
        return None

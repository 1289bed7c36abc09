"""The plan type: a family's sequence-parallel forward as data, which sp.executor.PlanWorker runs.

A Plan names the steps of one call: check the inputs, lay the call out as token streams (Layout: split streams
are cut in balanced shards over the sequence group, replicated ones are whole on every rank; each Part of a stream
says how its tokens are embedded, where they sit (position ids) and where its outputs go), compute the conditioning,
run the Stages of blocks (each names the model's ModuleList, how one block is called, which streams its attention
spans and how its attention modules project q, k, v), and the head. Everything between is the executor's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch

from .tensor_parallel import GENERIC, TensorParallelPlan

Embed = Union[str, Callable[[Any, torch.Tensor], torch.Tensor]]  # a model attribute, or (model, raw) -> states


@dataclass(frozen=True)
class Output:
    """Where a part's tokens go: the token grid of the output latent (frame `frame` of a 5-D output; None: the grid
    covers the whole output, e.g. a video's VideoGrid)."""

    grid: Any  # TokenGrid or VideoGrid: write(out, tokens, first)
    frame: Optional[int] = 0


@dataclass
class Part:
    """A run of tokens of a stream: raw features, position ids, how they are embedded and where they go out.

    tokens: [B or 1, n, F] (a batch-1 part serves every item); ids: [n, axes] position ids (None: no rotary);
    embed: a model attribute name or (model, raw [B, m, F]) -> [B, m, width]; consecutive parts with the same
    embed are embedded together.
    """

    tokens: torch.Tensor
    ids: Optional[torch.Tensor]
    embed: Embed
    output: Optional[Output] = None

    @property
    def count(self) -> int:
        return self.tokens.shape[1]


@dataclass
class Stream:
    """A token stream: split across the sequence ranks (balanced shards, sizes differ by at most one) or replicated.

    key_mask (replicated streams): bool [B, n] (True = attend) or None. mask (split streams): an
    attention.SequenceMask over the stream's global positions, or None.
    """

    name: str
    parts: list[Part]
    split: bool = True
    key_mask: Optional[torch.Tensor] = None
    mask: Any = None

    @property
    def total(self) -> int:
        return sum(part.count for part in self.parts)


def project_qkv(attn, hidden: torch.Tensor):
    """q, k, v [B, S, H, D] of diffusers' Attention modules (to_q / to_k / to_v, then norm_q / norm_k)."""
    qkv = [proj(hidden).unflatten(-1, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k, attn.to_v)]
    return _normed(qkv, attn.norm_q, attn.norm_k), None


def project_added_qkv(attn, text: torch.Tensor):
    """The text stream's q, k, v in joint (double-stream) attention: add_q_proj ..., norm_added_q / norm_added_k."""
    qkv = [proj(text).unflatten(-1, (attn.heads, -1)) for proj in (attn.add_q_proj, attn.add_k_proj,
                                                                     attn.add_v_proj)]
    return _normed(qkv, getattr(attn, "norm_added_q", None), getattr(attn, "norm_added_k", None))


def _normed(qkv, norm_q, norm_k):
    query, key, value = qkv
    query = query if norm_q is None else norm_q(query)
    key = key if norm_k is None else norm_k(key)
    return [query.to(value.dtype), key.to(value.dtype), value]


def project_out(attn, out: torch.Tensor, extra) -> torch.Tensor:
    """attn.to_out applied (a ModuleList in turn: Linear, Dropout); modules without one return `out`."""
    to_out = getattr(attn, "to_out", None)
    if to_out is None:
        return out
    for module in (to_out if isinstance(to_out, torch.nn.ModuleList) else [to_out]):
        out = module(out)
    return out


@dataclass(frozen=True)
class AttentionSpec:
    """How the attention modules of a stage's blocks compute: project (attn, hidden) -> ([q, k, v], extra),
    finish (attn, out [B, S, H*D], extra) -> the module's output. A text stream joins either through
    encoder_hidden_states (projected by project_text (attn, text) -> [q, k, v], by default add_*_proj; returned
    through to_add_out where the module has one, or finish_text (attn, text out [B, L, H*D])) or, with text_prefix,
    as the first tokens of hidden_states (single-stream blocks: out is [text, own tokens]). text_first: the text
    keys lead the joint sequence (False: they follow, as HunyuanVideo orders them)."""

    project: Callable = project_qkv
    finish: Callable = project_out
    text_prefix: bool = False
    project_text: Callable = project_added_qkv
    text_first: bool = True
    finish_text: Optional[Callable] = None


@dataclass(frozen=True)
class Stage:
    """A ModuleList of blocks run in turn: run(block, call) updates the call's states (attributes named after the
    streams); attends: the split stream(s) the attention spans (a tuple: their rank-wise union, each rank's parts
    in stream order), text: the replicated stream joined to it (or None); before(call): runs once first.
    attention=None declares a custom block (the documented escape, e.g. LTX-2's audio-video block): the executor
    sets no processor and makes no geometry current; the block attends through attention.sp_attention itself, with
    the shards of call.shards.
    local: attention modules of each block (by name inside the block) that attend locally to a replicated
    sp.cross.Context passed as their encoder_hidden_states; also: more ModuleLists whose blocks the stage's run
    calls (e.g. Wan VACE's hint blocks), their attention set up like the stage's.
    skips_in_run: the run itself leaves out the main block of the indices in call.skip (a run that does more per
    block than call it, e.g. Wan's variant hooks, which ComfyUI runs around a skipped block too); otherwise the
    executor does not call run for those blocks."""

    blocks: str
    run: Callable[[torch.nn.Module, Any], None]
    attends: Union[str, tuple[str, ...]] = "image"
    text: Optional[str] = "text"
    attention: Optional[AttentionSpec] = AttentionSpec()
    before: Optional[Callable[[Any], None]] = None
    local: tuple[str, ...] = ()
    also: tuple[str, ...] = ()
    skips_in_run: bool = False


@dataclass(frozen=True)
class Control:
    """Where ControlNet residuals enter a model (input controlnets, sp.control): after block i of the stage `stage`,
    residual i is added to the leading tokens of the split stream `stream` (the ControlNet runs on the same shards of
    those tokens); `families`: the ControlNet families that may steer it."""

    stage: str
    stream: str
    families: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    """A family's sequence-parallel forward (see the module docstring); run by sp.executor.PlanWorker.

    check(call): refuse what the plan cannot serve, by name. layout(call) -> [Stream]. condition(call): the
    per-call conditioning (time embedding, ...), set on the call. head(call) -> this rank's tokens of the `output`
    stream (a tuple of names: a tuple of their tokens, in that order; a replicated output stream is written by
    sequence rank 0 only). rope(config) -> (axes, theta) of the rotary tables (diffusers' FluxPosEmbed) for the parts' ids, or
    None. output_tokens(call, tokens): what becomes of the output tokens before they are unpatchified (e.g.
    Z-Image's feature order and sign). tensor_parallel: which Linears of the stages' blocks TP splits
    (sp.tensor_parallel; by default the generic plan of diffusers' attention, FeedForward and modulation Linears,
    which the conformance suite checks at TP for every family; a string: why the family refuses TP, named in the
    error). comfy_blocks: ComfyUI's block kinds
    of patches_replace["dit"] (the blocks SkipLayerGuidanceDiT skips, input skip_blocks) -> the stage (its `blocks`)
    whose blocks they index, as ComfyUI's model for the family counts them (kinds it does not address are ignored,
    as ComfyUI's model ignores them); None: block skips are refused for the family. control: where ControlNet
    residuals enter (None: ControlNets are refused for the family).
    """

    check: Callable[[Any], None]
    layout: Callable[[Any], Sequence[Stream]]
    condition: Callable[[Any], None]
    stages: Sequence[Stage]
    head: Callable[[Any], torch.Tensor]
    rope: Optional[Callable[[Any], tuple[Sequence[int], float]]] = None
    output: Union[str, tuple[str, ...]] = "image"
    output_tokens: Optional[Callable[[Any, torch.Tensor], torch.Tensor]] = None
    tensor_parallel: Union[TensorParallelPlan, str] = GENERIC
    comfy_blocks: Optional[dict[str, str]] = None
    control: Optional[Control] = None

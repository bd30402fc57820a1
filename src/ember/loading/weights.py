"""Builds a Decoder on the meta device and fills it from a weight source, name by name.

Each Ember parameter comes from the checkpoint parameter of the same name; for fused parameters, from the
parts its family's `packed` table names (concatenated on dim 0); for MoE expert parameters, from the
per-expert parts its `stacked` table names (each expert's parts concatenated, then stacked on a new dim 0).
Anything missing or left over is an error naming the weights: a silently random layer is the worst bug a
loader can have.

With `quantize`, each projection that the scheme swaps is quantized as soon as its weight is read, so a
large checkpoint never needs its whole float model in memory (with a lazy source such as `GGUFSource`);
`ember.quant.quantize_model` then does the rest (the output projection, the record of the scheme).
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from ember.config import ModelConfig
from ember.errors import CheckpointError
from ember.models.decoder import Decoder
from ember.models.registry import Family

log = logging.getLogger(__name__)


class WeightSource(Protocol):
    def names(self) -> set[str]: ...

    def get(self, name: str) -> torch.Tensor: ...


def _parts(name: str, family: Family) -> list[str] | None:
    """'...self_attn.qkv_proj.weight' -> ['...self_attn.q_proj.weight', ...] when the family packs it."""
    prefix, _, leaf = name.rpartition(".")
    module_path, _, module = prefix.rpartition(".")
    if module not in family.packed:
        return None
    return [f"{module_path}.{part}.{leaf}" for part in family.packed[module]]


def _expert_parts(name: str, family: Family, num_experts: int) -> list[list[str]] | None:
    """'...mlp.experts.down_proj' -> [['...mlp.experts.0.down_proj.weight'], ...], one list per expert."""
    for suffix, parts in family.stacked.items():
        if name.endswith("." + suffix):
            prefix = name[: -len(suffix)]
            return [[prefix + p.format(e=e) for p in parts] for e in range(num_experts)]
    return None


def _concat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)


def free_memory(device: torch.device) -> int | None:
    """Bytes `device` can still hold: free CUDA memory, or the host's MemAvailable (Linux); None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def check_memory(
    model: nn.Module,
    dtype: torch.dtype,
    device: torch.device | str,
    what: str,
    hint: str,
    need: int | None = None,
) -> None:
    """Raises CheckpointError, naming both sizes, when `model`'s parameters (a tied one once) in `dtype` (or
    `need` bytes, where the caller knows better) need more than `device` has available; `what` names the
    model, `hint` what to try instead."""
    if need is None:
        need = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    free = free_memory(torch.device(device))
    if free is not None and need > free:
        raise CheckpointError(
            f"{what} needs {need / 1e9:.1f} GB of {str(dtype).removeprefix('torch.')} weights but {device} has "
            f"{free / 1e9:.1f} GB available (try {hint})"
        )


def _describe(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(sorted(names)[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def build_model(
    cfg: ModelConfig,
    family: Family,
    source: WeightSource,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    origin: str,
    progress: bool = True,
    quantize: str | None = None,
    keep_codes: bool = False,
) -> Decoder:
    """Materialises a Decoder for `cfg` from `source`; `origin` names the checkpoint in error messages.

    keep_codes (without `quantize`): the projections, and the output projection, that the source holds in
    blocks Ember's kernels take as they are stay those codes, computed with float activations: int4 groups
    where every part is 4-bit (GGUF's Q4_0 / Q4_1 / Q4_K: `Int4WeightOnlyLinear.float_activations`), else int8
    blocks (those and Q8_0, Q6_K, Q5_0/1, Q5_K, Q3_K, Q2_K: `Int8BlockLinear`). The float model's values,
    without its float weights; a tied embedding kept so is looked up in those codes (`CodesEmbedding`); the
    rest is read as float, as without it."""
    from ember.quant import GGUF_GROUP, QuantSpec, check_fits, quantized_projections
    from ember.quant.linear import (
        CodesEmbedding,
        Int4WeightOnlyLinear,
        Int8BlockLinear,
        JoinedLinear,
        QuantLinear,
    )

    with torch.device("meta"):
        model = Decoder(cfg)
    spec, targets = None, set()
    keep_codes = keep_codes and not quantize and hasattr(source, "get_int4")
    if quantize:
        spec = QuantSpec.parse(quantize)
        targets = set(check_fits(model, spec))  # refuses a scheme that does not fit before reading anything
    elif keep_codes:  # the projections, and an untied output projection (a tied one's codes come later)
        targets = set(quantized_projections(model)) | (set() if cfg.tie_word_embeddings else {"lm_head"})
    available = source.names()
    if family.rename is not None:
        renamed = {family.rename(n): n for n in available}
    else:
        renamed = {n: n for n in available}
    if cfg.tie_word_embeddings:
        # Tied checkpoints sometimes still carry a copy of the output matrix; it is the same tensor.
        renamed.pop("lm_head.weight", None)

    # Ember name -> groups of checkpoint names: each group is concatenated on dim 0; several groups (experts)
    # are then stacked on a new dim 0.
    plan: dict[str, tuple[list[list[str]], bool]] = {}
    missing: list[str] = []
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()  # filled by Decoder.tie_weights
    for name in model.state_dict():
        if name in tied:
            continue
        if name in renamed:
            plan[name] = ([[name]], False)
            continue
        experts = _expert_parts(name, family, cfg.num_experts)
        groups = experts if experts is not None else [_parts(name, family) or [name]]
        wanted = [p for group in groups for p in group]
        if all(p in renamed for p in wanted):
            plan[name] = (groups, experts is not None)
        else:
            missing.extend(p for p in wanted if p not in renamed)
    used = {p for groups, _ in plan.values() for group in groups for p in group}
    unexpected = [n for n in renamed if n not in used and not n.endswith("rotary_emb.inv_freq")]
    if missing:
        raise CheckpointError(f"{origin}: missing weights for {cfg.architecture}: {_describe(missing)}")
    if unexpected:
        raise CheckpointError(f"{origin}: unexpected weights for {cfg.architecture}: {_describe(unexpected)}")

    if not quantize and not keep_codes:  # else each projection shrinks as it is read: no whole float model
        check_memory(
            model,
            dtype,
            device,
            f"{origin}: {cfg.architecture}",
            "--quantize int8 or int4, or --dtype bfloat16",
        )

    expected = model.state_dict()

    def read(name: str) -> torch.Tensor:
        groups, stack = plan[name]
        fused = [_concat([source.get(renamed[p]) for p in group]) for group in groups]
        tensor = torch.stack(fused) if stack else fused[0]
        if tensor.shape != expected[name].shape:
            raise CheckpointError(
                f"{origin}: weight {name} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(expected[name].shape)} from the config"
            )
        return tensor.to(device=device, dtype=dtype)

    # A source that holds 4-bit weights in int4's groups (GGUF's Q4_0 / Q4_1 / Q4_K, groups of 32) gives
    # their codes as they are: no dequantize and quantize again, and the file's own grid kept exactly.
    takes_int4 = keep_codes or (spec is not None and spec.scheme in ("int4", "gguf"))
    get_int4 = getattr(source, "get_int4", None) if takes_int4 else None
    group_size = GGUF_GROUP if spec is None else spec.group_size

    def read_int4(name: str) -> tuple[torch.Tensor, ...] | None:
        groups, stack = plan[name]
        if get_int4 is None or stack:
            return None
        parts = []
        for p in groups[0]:  # a fused projection is taken whole or not at all
            if (part := get_int4(renamed[p], group_size)) is None:
                return None
            parts.append(part)
        codes, scales, mins = (torch.cat(t) for t in zip(*parts, strict=True))
        if codes.shape != expected[name].shape:
            raise CheckpointError(
                f"{origin}: weight {name} has shape {tuple(codes.shape)}, "
                f"expected {tuple(expected[name].shape)} from the config"
            )
        return codes.to(device), scales.to(device), mins.to(device)

    get_int8 = getattr(source, "get_int8", None) if keep_codes else None

    def kept_codes(name: str, bias: torch.Tensor | None) -> QuantLinear | None:
        """keep_codes: weight `name` as the source's own codes where it holds them in int4 groups or int8 blocks
        and their float-activation kernel runs here (else None: it is read as float). A fused projection whose
        parts are of different kinds (int4 groups, int8 blocks of 5, 6 or 8 bits) runs each kind's parts as
        their own module (`JoinedLinear`), not all of it in the widest kind."""
        groups, stack = plan[name]
        if stack:
            return None
        if (int4 := read_int4(name)) is not None:
            runs = [[("int4", int4)]]
        else:
            parts = []
            for p in groups[0]:
                if get_int4 is not None and (codes := get_int4(renamed[p], group_size)) is not None:
                    parts.append(("int4", codes))
                elif get_int8 is not None and (codes := get_int8(renamed[p])) is not None:
                    bits = Int8BlockLinear.code_bits(codes[0])
                    parts.append((bits, codes))
                else:
                    return None
            runs = [[parts[0]]]
            for part in parts[1:]:  # parts one after another, a run a kind
                if part[0] == runs[-1][-1][0]:
                    runs[-1].append(part)
                else:
                    runs.append([part])
        width = expected[name].shape[1]
        if any(codes[0].shape[1] != width for run in runs for _, codes in run):
            raise CheckpointError(
                f"{origin}: weight {name} has parts of widths {[c[0].shape[1] for run in runs for _, c in run]}, "
                f"expected {width} from the config"
            )
        modules = []
        for run in runs:
            whole = bias if len(runs) == 1 else None
            if run[0][0] == "int4":
                codes = (
                    run[0][1]
                    if len(run) == 1
                    else [torch.cat(t) for t in zip(*(c for _, c in run), strict=True)]
                )
                module = Int4WeightOnlyLinear.from_codes(*(t.to(device) for t in codes), whole, dtype)
                module.float_activations = True
            else:
                module = Int8BlockLinear.joined([codes for _, codes in run], whole, dtype).to(device)
            module.prepare()
            if module._kernel != "cpu_f32":
                return None
            modules.append(module)
        module = modules[0] if len(modules) == 1 else JoinedLinear(modules, bias)
        if (module.out_features, module.in_features) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{origin}: weight {name} has shape {(module.out_features, module.in_features)}, "
                f"expected {tuple(expected[name].shape)} from the config"
            )
        return module

    state: dict[str, torch.Tensor] = {}
    swapped: dict[str, nn.Module] = {}
    embedding = "model.embed_tokens.weight"
    tied_head = keep_codes and cfg.tie_word_embeddings and embedding in plan
    for name in tqdm(plan, desc="loading weights", unit="tensor", disable=not progress, leave=False):
        module, _, leaf = name.rpartition(".")
        if name == embedding and tied_head and (kept := kept_codes(name, None)) is not None:
            # A tied embedding's codes: the output projection, and the table its lookups dequantize rows of
            # (the float table never made).
            swapped["lm_head"], swapped[module] = kept, CodesEmbedding(kept, dtype)
            continue
        if module not in targets:
            state[name] = read(name)
        elif leaf == "weight":  # its bias, if any, comes next in the plan and is read with it
            bias = read(f"{module}.bias") if f"{module}.bias" in plan else None
            if spec is None:  # keep_codes: the source's own codes where it has them, else float
                if (kept := kept_codes(name, bias)) is not None:
                    swapped[module] = kept
                    continue
                state[name] = read(name)
                if bias is not None:
                    state[f"{module}.bias"] = bias
            elif (int4 := read_int4(name)) is not None:
                swapped[module] = Int4WeightOnlyLinear.from_codes(*int4, bias, dtype)
                swapped[module].prepare()
            else:
                swapped[module] = spec.quantize(read(name), bias)
    unassigned, _ = model.load_state_dict(state, strict=False, assign=True)
    assert {n.rpartition(".")[0] for n in unassigned if n not in tied} <= set(swapped), unassigned
    for module, quantized in swapped.items():
        parent, _, leaf = module.rpartition(".")
        setattr(model.get_submodule(parent), leaf, quantized)
    model.tie_weights()
    model.init_buffers(device)
    model.eval().requires_grad_(False)
    return model

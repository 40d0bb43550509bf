"""Parallelism applied from outside the model, as torchtitan does: a ``DeviceMesh`` and what goes on it.

    mesh = make_mesh(replicate=R, context_parallel=P)    # world = R x S x P processes
    model = parallelize(model, mesh, fsdp=True)          # then Trainer(model, ..., mesh=mesh)

The mesh has three named dimensions, ranks laid out row-major (the P ranks sharing a sequence are
consecutive):

    dp_replicate  R   HSDP's replicas: each holds a full set of shards; gradients are all-reduced across them
    dp_shard      S   FSDP2 (``fully_shard``): parameters, gradients and AdamW's moments split S ways
    cp            P   context parallelism: the P ranks split every sequence (``subquad.distributed``)

Data: the R x S data-parallel ranks draw their own batches; the P ranks of a context group share one.
Gradients: each rank's loss is the mean over an equal share of the tokens, so the mean of all the ranks'
gradients is the gradient of the global loss. FSDP reduces over ``dp_shard`` and ``cp`` flattened into
one dimension (torchtitan's ``dp_shard_cp``: the context ranks shard the parameters too) and HSDP
all-reduces over ``dp_replicate``; without FSDP, DDP averages over the whole world. Either way the trainer
has no gradient code of its own.

FSDP2 is applied per block, then to the root (embeddings, final norm, head), so one block's parameters are
gathered at a time. ``bf16``: ``MixedPrecisionPolicy`` gathers and computes with bfloat16 parameters and
reduces gradients in float32 (the float32 masters stay sharded); the trainer's autocast still runs the
ops' precision rules on top. ``activation_checkpointing`` recomputes each block's activations in backward
(``torch.distributed._composable.checkpoint``: the parameter names stay the model's own), and ``compile``
compiles each block (``nn.Module.compile``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

DIMS = ("dp_replicate", "dp_shard", "cp")


def make_mesh(replicate: int = 1, context_parallel: int = 1, device_type: str | None = None):
    """The (dp_replicate, dp_shard, cp) mesh of the initialised process group: world = replicate x shard x
    context_parallel, shard = what is left. ValueError naming the setting when the world does not divide."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise ValueError("make_mesh needs torch.distributed initialised (torchrun, or init_process_group)")
    world = dist.get_world_size()
    for name, n in (("replicate", replicate), ("context_parallel", context_parallel)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive integer, got {n!r}")
    if world % (replicate * context_parallel):
        raise ValueError(f"replicate={replicate} x context_parallel={context_parallel} must divide the number of "
                         f"processes ({world})")
    shard = world // (replicate * context_parallel)
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (replicate, shard, context_parallel), mesh_dim_names=DIMS)


@dataclass(frozen=True)
class Layout:
    """What the trainer reads off a mesh: this rank's data replica and the context group."""
    replica: int           # which data-parallel batch stream this rank draws (0 .. replicas-1)
    replicas: int
    cp_group: object       # the process group of the ranks sharing this rank's sequences, or None

    @staticmethod
    def of(mesh) -> "Layout":
        if mesh is None:
            return Layout(0, 1, None)
        R, S, P = (mesh.size(mesh.mesh_dim_names.index(d)) for d in DIMS)
        coord = mesh.get_coordinate()
        replica = coord[0] * S + coord[1]
        return Layout(replica, R * S, mesh["cp"].get_group() if P > 1 else None)


def _fsdp_mesh(mesh):
    """FSDP's mesh: (dp_shard x cp) flattened, with dp_replicate before it for HSDP (2-D)."""
    R = mesh.size(0)
    shard = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh["dp_replicate", "dp_shard_cp"] if R > 1 else shard


def parallelize(model: nn.Module, mesh, fsdp: bool = True, bf16: bool = False,
                activation_checkpointing: bool = False, compile: bool | str = False) -> nn.Module:
    """Apply per-block activation checkpointing, compilation and FSDP2 (with ``mesh``'s replicas: HSDP) to
    ``model`` in place and return it; without ``fsdp``, a world of more than one process trains through a
    ``DistributedDataParallel`` wrapper, which is returned (its ``.module`` is the model). ``mesh`` None: one
    process (only the per-block options apply). ``compile``: True, or a torch.compile backend name."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError("parallelize takes a model with a ModuleList of blocks (model.blocks), such as "
                         "subquad's LanguageModel")
    if activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for b in blocks:
            checkpoint(b)
    if compile:
        for b in blocks:
            b.compile(**({} if compile is True else {"backend": compile}))
    world = 1 if mesh is None else mesh.size()
    if mesh is not None and mesh.size(0) > 1 and not fsdp:
        raise ValueError("replicate (HSDP) > 1 needs fsdp=True; without FSDP every rank is a replica already")
    if world == 1:
        return model
    if not fsdp:
        from torch.nn.parallel import DistributedDataParallel

        # buffers are made from the config on every rank alike (rotary tables): nothing to broadcast at each
        # forward (torch 2.13 renamed the flag and warns at the old name; the once-at-start sync it keeps is cheap)
        renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
        # a layer whose forward leaves some parameters without a gradient (``unused_parameters``: the first
        # RWKV-7 layer's v_lora) makes DDP look for them each step; without, it stops at the second step
        unused = any(getattr(m, "unused_parameters", False) for m in model.modules())
        return DistributedDataParallel(model, find_unused_parameters=unused,
                                       **{"forward_sync_buffers" if renamed else "broadcast_buffers": False})
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # fully_shard replaces each parameter by a DTensor one: the marks layers set on theirs (Mamba's
    # ``_no_weight_decay``) are carried over, or the optimizer's groups would change under FSDP
    marks = {n: dict(vars(p)) for n, p in model.named_parameters() if vars(p)}
    fmesh = _fsdp_mesh(mesh)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    for i, b in enumerate(blocks):
        # the last block's parameters are gathered again at once by backward: keep them (torchtitan's choice)
        fully_shard(b, mesh=fmesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=fmesh, mp_policy=mp)
    for n, p in model.named_parameters():
        for k, v in marks.get(n, {}).items():
            setattr(p, k, v)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (FSDP2 works in place: the model itself)."""
    return getattr(model, "module", model)


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 shards this model's parameters (they are DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in unwrap(model).parameters())


def local_bytes(model: nn.Module, optimizer=None) -> int:
    """Bytes of the parameters (and the optimizer's state) this rank holds: its shards under FSDP."""
    from torch.distributed.tensor import DTensor

    def size(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()
    total = sum(size(p) for p in unwrap(model).parameters())
    if optimizer is not None:
        total += sum(size(v) for st in optimizer.state.values() for v in st.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total

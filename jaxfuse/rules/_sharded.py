"""A chunked region run on each device's shards, under a mesh.

A train step is partitioned over a mesh (data parallel, tensor parallel,
FSDP). Left to XLA's partitioner, the chunk loop of a region (_chunking.py)
communicates per chunk: it sums each chunk's share of the head weight's
gradient into a replicated buffer, so the all-reduce jit's program does once
happens once per chunk, and a weight split along its rows turns every
chunk's logits into a sum across devices.

So the region is wrapped in `custom_partitioning`. The axis classes of its
analysis say what every dimension of its operands and results is (a token
axis, the vocabulary, the head's hidden axis, ...); the Shardy rule built
from them lets propagation split the token and vocabulary classes and keeps
the hidden axis whole (a weight split along its rows is gathered once,
before the region, as jit's program gathers it). At partition time the
operands' shardings say which mesh axes split which class, and every device
runs the region on its shards (`_chunking.Layout`): reductions across a
split class are completed by a collective, a sum over tokens the loop
accumulates once after the loop, a pick at the label along a split
vocabulary by the device that holds it.

Only a region that holds its own gradient (a train step traced with
`jax.value_and_grad`) is wrapped: custom_partitioning has no derivative
rule, and a loss differentiated outside the optimized function needs one.
"""

from __future__ import annotations

import math

from jax.experimental.custom_partitioning import (ArrayMapping, SdyShardingRule,
                                                   custom_partitioning)
from jax.sharding import NamedSharding, PartitionSpec

from .. import _compat as C
from . import _chunking as K


def mesh_size(plan: K.Plan) -> int:
    """The devices of the mesh the region's operands are traced over (1: none)."""
    sizes = [1]
    for a in plan.operands:
        mesh, _ = C.aval_mesh(getattr(a, "aval", None))
        if mesh is not None:
            sizes.append(int(mesh.size))
    return max(sizes)


def holds_its_gradient(plan: K.Plan) -> bool:
    """The region accumulates a contraction over tokens (the head weight's gradient)."""
    return any(e.primitive.name == "dot_general" for e in plan.partial)


def wanted(plan: K.Plan) -> bool:
    return mesh_size(plan) > 1 and holds_its_gradient(plan)


class _Factors:
    """Shardy factor names: one per (class, size) of a class that may split;
    every other dimension a factor of its own, kept whole."""

    def __init__(self, plan: K.Plan, splittable: frozenset):
        self.plan, self.splittable = plan, splittable
        self.names: dict = {}
        self.fixed: list = []
        self.own = 0

    def mapping(self, var) -> ArrayMapping:
        out = []
        for n, c in zip(K._shape(var), self.plan.classes(var)):
            if c is None or c not in self.splittable:
                # kept whole, and a factor of its own: a weight's split rows
                # propagate neither to the other operands nor to the results
                self.own += 1
                name = f"u{self.own}"
                self.fixed.append(name)
            else:
                key = (c, n)
                if key not in self.names:
                    self.names[key] = f"c{len(self.names)}"
                name = self.names[key]
            out.append(name)
        return ArrayMapping(*out)


def _entries(sharding, rank: int) -> tuple:
    spec = tuple(getattr(sharding, "spec", ()) or ())
    return spec + (None,) * (rank - len(spec))


def _names(entry) -> tuple:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _spec(plan: K.Plan, var, layout: K.Layout) -> PartitionSpec:
    entries = []
    for c in plan.classes(var):
        names = layout.axes.get(c, ()) if c is not None else ()
        entries.append(None if not names else names[0] if len(names) == 1 else names)
    return PartitionSpec(*entries)


def _class_sizes(plan: K.Plan) -> dict:
    sizes: dict = {}
    for v in [*plan.operands, *plan.outputs]:
        for n, c in zip(K._shape(v), plan.classes(v)):
            if c is not None:
                sizes[c] = n
    return sizes


def layout_for(plan: K.Plan, splittable: frozenset, mesh, shardings) -> K.Layout:
    """Which mesh axes split which class, read off the operands' shardings as
    propagation left them: the first operand to split a class decides it, a
    mesh axis splits one class at most, and a class splits only into equal
    shards."""
    sizes = _class_sizes(plan)
    axes, used = {}, set()
    for a, sharding in zip(plan.operands, shardings):
        if not isinstance(sharding, (NamedSharding, _Typed)):
            continue
        for c, entry in zip(plan.classes(a), _entries(sharding, len(K._shape(a)))):
            names = _names(entry)
            if c is None or c not in splittable or c in axes or not names or used & set(names):
                continue
            count = math.prod(mesh.shape[n] for n in names)
            if sizes.get(c, 0) % count:
                continue
            axes[c] = names
            used.update(names)
    shards = {c: math.prod(mesh.shape[n] for n in names) for c, names in axes.items()}
    return K.Layout(axes, shards, plan.token_classes())


def _explicit_mesh(plan: K.Plan):
    """The mesh the operands' types carry where some of its axes are
    Explicit (their shardings are then in the types), else None."""
    for a in plan.operands:
        mesh, _ = C.aval_mesh(getattr(a, "aval", None))
        if mesh is not None and any("Explicit" in str(t) for t in getattr(mesh, "axis_types", ())):
            return mesh
    return None


class _Typed:
    """An operand's sharding as its type states it (explicit sharding)."""

    def __init__(self, spec):
        self.spec = spec


def _in_types(plan: K.Plan, mesh, splittable, piece_for):
    """The region under `jax.shard_map` over `mesh` (explicit sharding: the
    operands' types say how they are split, as they are traced)."""
    specs = [C.aval_mesh(a.aval)[1] or PartitionSpec() for a in plan.operands]
    layout = layout_for(plan, splittable, mesh, [_Typed(sp) for sp in specs])
    local = K.localize(plan, layout)
    fn = K.build_function(local, piece_for(local))
    in_specs = tuple(_spec(plan, a, layout) for a in plan.operands)
    out_specs = tuple(_spec(plan, v, layout) for v in plan.outputs)
    out_types = [C.aval_mesh(v.aval)[1] or PartitionSpec() for v in plan.outputs]
    mapped = C.shard_map(fn, mesh, in_specs, out_specs)

    def region(*args):
        args = [C.reshard(x, mesh, sp) for x, sp in zip(args, in_specs)]
        return tuple(C.reshard(y, mesh, sp) for y, sp in zip(mapped(*args), out_types))

    return region


def partitioned(plan: K.Plan, whole, piece_for):
    """`whole` (the region's function at its global shapes) wrapped so the
    partitioner runs it per device; `piece_for(local_plan)`: the chunk size
    on one device's shards. Over a mesh with Explicit axes the operands'
    types already say how they are split: the region is then mapped over the
    mesh (`jax.shard_map`) as it is traced."""
    splittable = frozenset({*plan.token_classes(), plan.vocab_cls}) - K.unsplittable(plan)
    explicit = _explicit_mesh(plan)
    if explicit is not None:
        return _in_types(plan, explicit, splittable, piece_for)
    factors = _Factors(plan, splittable)
    operands = tuple(factors.mapping(a) for a in plan.operands)
    results = tuple(factors.mapping(v) for v in plan.outputs)
    rule = SdyShardingRule(operands, results, need_replication_factors=tuple(factors.fixed))

    @custom_partitioning
    def region(*args):
        return whole(*args)

    def shardings(mesh, arg_shapes):
        layout = layout_for(plan, splittable, mesh, [s.sharding for s in arg_shapes])
        args = tuple(NamedSharding(mesh, _spec(plan, a, layout)) for a in plan.operands)
        outs = tuple(NamedSharding(mesh, _spec(plan, v, layout)) for v in plan.outputs)
        return layout, args, outs

    def partition(mesh, arg_shapes, result_shape):
        layout, args, outs = shardings(mesh, arg_shapes)
        local = K.localize(plan, layout)
        return mesh, K.build_function(local, piece_for(local)), outs, args

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes)[2]

    region.def_partition(partition=partition, infer_sharding_from_operands=infer,
                         sharding_rule=rule)
    return region


__all__ = ["partitioned", "wanted", "layout_for", "mesh_size", "holds_its_gradient"]

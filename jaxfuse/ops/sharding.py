"""How the SPMD partitioner may split the fused ops.

The ops are elementwise, so every output dimension is a pass-through factor
shared with each operand dimension of the same size. A size-1 (broadcast)
operand dimension gets a factor of its own, of size 1, so a bias `(1, C)`
sharded along C partitions with the output's C and is never gathered. Without
this, the partitioner treats the custom call as opaque and all-gathers it.

XLA's SPMD partitioner does not split a bare custom call even when Shardy has
propagated a rule onto it (seen: it all-gathers the operands). So in a module
partitioned across devices the call is wrapped in `custom_partitioning`: Shardy
propagates through it with the rule below, GSPMD (where a jax still offers it)
with the `infer_sharding_from_operands` callback, and the partition callback
hands every device the kernel on its own shards.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental.custom_partitioning import (ArrayMapping, SdyShardingRule,
                                                   custom_partitioning)
from jax.extend.mlir import ir
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

from .. import _compat as C
from .primitive import check_broadcast


def _factor(i: int) -> str:
    return f"d{i}"


def elementwise_rule(operand_shapes, out_shape, n_results: int = 1) -> SdyShardingRule:
    """The Shardy rule for a size-1-broadcasting elementwise op."""
    result = ArrayMapping(*(_factor(i) for i in range(len(out_shape))))
    operands = []
    for k, shape in enumerate(operand_shapes):
        names = [
            _factor(i) if d == o else f"b{k}x{i}"  # broadcast: a size-1 factor of its own
            for i, (d, o) in enumerate(zip(shape, out_shape))
        ]
        operands.append(ArrayMapping(*names))
    return SdyShardingRule(tuple(operands), (result,) * n_results)


def _rule_from_types(mesh, operand_types, result_types) -> SdyShardingRule:
    del mesh
    shape = lambda t: tuple(ir.RankedTensorType(t).shape)  # noqa: E731
    return elementwise_rule([shape(t) for t in operand_types], shape(result_types[0]),
                            len(result_types))


def is_partitioned(ctx: mlir.LoweringRuleContext) -> bool:
    """True when this module will be split across devices by the partitioner."""
    axis_context = ctx.module_context.axis_context
    if isinstance(axis_context, mlir.ShardingContext):
        return axis_context.num_devices > 1
    if isinstance(axis_context, mlir.SPMDAxisContext):  # shard_map: local unless some axes are auto
        return set(axis_context.manual_axes) != set(axis_context.mesh.axis_names)
    return False


def _spec_entries(sharding, rank):
    spec = tuple(sharding.spec)
    return spec + (None,) * (rank - len(spec))


def _operand_spec(shape, out_shape, out_entries) -> PartitionSpec:
    # A broadcast (size-1) dimension cannot be split; every other dimension is
    # split exactly like the output's.
    return PartitionSpec(
        *(e if d == o else None for d, o, e in zip(shape, out_shape, out_entries)))


def _infer(mesh, arg_shapes, result_shape):
    # Each output dimension follows the first operand that is not broadcast there.
    shapes = result_shape if isinstance(result_shape, (tuple, list)) else (result_shape,)
    rank = len(shapes[0].shape)
    entries = []
    for i, o in enumerate(shapes[0].shape):
        entry = None
        for arg in arg_shapes:
            if len(arg.shape) == rank and arg.shape[i] == o and isinstance(arg.sharding, NamedSharding):
                entry = _spec_entries(arg.sharding, rank)[i]
                break
        entries.append(entry)
    out = NamedSharding(mesh, PartitionSpec(*entries))
    return tuple(out for _ in shapes) if isinstance(result_shape, (tuple, list)) else out


def _partition_shardings(mesh, arg_shapes, out_shape, out_sharding):
    """(result sharding, operand shardings) for the per-device call."""
    if isinstance(out_sharding, NamedSharding):
        entries = _spec_entries(out_sharding, len(out_shape))
        return out_sharding, tuple(
            NamedSharding(mesh, _operand_spec(a.shape, out_shape, entries)) for a in arg_shapes)
    # Inside a partially manual shard_map the partitioner hands a positional
    # (GSPMD) sharding over the remaining auto axes. Operands of the output's
    # shape take it as it is; a broadcast operand can too unless one of its
    # size-1 dims is split, in which case everything is replicated.
    shard = out_sharding.shard_shape(tuple(out_shape))
    split = [o != s for o, s in zip(out_shape, shard)]
    if any(d != o and cut for a in arg_shapes for d, o, cut in zip(a.shape, out_shape, split)):
        out_sharding = C.replicated_like(out_sharding)
    return out_sharding, tuple(out_sharding for _ in arg_shapes)


# Elements of the pacing value: its flops (one multiply each) must outweigh
# XLA:CPU's inline threshold (1000) plus the -1 it counts per custom call.
PACING_ELEMENTS = 2048
# The temp bytes XLA:CPU reports for the pacing value (tests/fusion/policy/test_pacing.py):
# all a program that is one paced call holds beyond XLA's own.
PACING_TEMP_BYTES = 256


def pacing_value(operands):
    """A scalar XLA computes at run time from the first element of the largest
    operand: passed to a CPU kernel that ignores it, its flops keep a program
    of nothing but kernel calls off XLA:CPU's inline path (see
    `rewrite.pacing.paced`). Reading one element, it costs the same whatever the
    operands' shapes; a scalar (the sum of PACING_ELEMENTS products) rather
    than the products themselves, so the buffer it holds is as small as a
    value can be (PACING_TEMP_BYTES of temp, where the vector held 8 KiB)."""
    src = max(operands, key=lambda x: x.size)
    first = jax.lax.reshape(jax.lax.slice(jax.lax.reshape(src, (src.size,)), (0,), (1,)), ())
    return jax.lax.reduce_sum(jax.lax.iota(src.dtype, PACING_ELEMENTS) * first, (0,))


def local_call(target: str, n_results: int, attrs: tuple, inplace: int | None = None,
               pace: bool = False):
    """The kernel on one device's operands (the shapes it is given); with
    `inplace`, its result may take that operand's buffer (XLA copies the
    operand first if anything still reads it); with `pace`, it is also handed
    `pacing_value` of its operands, which the kernel ignores."""

    def call(*operands):
        out_shape = check_broadcast(target, [(str(k), x.shape, x.dtype) for k, x in enumerate(operands)])
        rank = len(out_shape)
        operands = [x if x.ndim == rank else jax.lax.reshape(x, (1,) * rank) for x in operands]
        results = [jax.ShapeDtypeStruct(out_shape, operands[0].dtype)]
        if n_results == 2:
            results.append(jax.ShapeDtypeStruct(out_shape, bool))
        aliases = {inplace: 0} if inplace is not None else None
        if pace:
            operands = [*operands, pacing_value(operands)]
        outs = jax.ffi.ffi_call(target, results, input_output_aliases=aliases)(
            *operands, **dict(attrs))
        return tuple(outs) if n_results > 1 else outs[0]

    return call


@functools.cache
def _partitioned(target: str, n_results: int, attrs: tuple):
    """The kernel wrapped so the partitioner runs it on each device's shards
    (built on first use: custom_partitioning registers callbacks)."""
    per_device = local_call(target, n_results, attrs)

    @custom_partitioning
    def call(*operands):
        return per_device(*operands)

    def partition(mesh, arg_shapes, result_shape):
        shapes = result_shape if isinstance(result_shape, (tuple, list)) else (result_shape,)
        out_sharding, arg_shardings = _partition_shardings(
            mesh, arg_shapes, shapes[0].shape, shapes[0].sharding)
        outs = tuple(out_sharding for _ in shapes) if n_results > 1 else out_sharding
        return mesh, per_device, outs, arg_shardings

    call.def_partition(
        partition=partition, infer_sharding_from_operands=_infer, sharding_rule=_rule_from_types)
    return call


def lower_partitioned(ctx, *args, target: str, attrs: tuple = ()):
    n_results = len(ctx.avals_out)
    return mlir.lower_fun(_partitioned(target, n_results, attrs),
                          multiple_results=n_results > 1)(ctx, *args)


__all__ = ["elementwise_rule", "is_partitioned", "local_call", "lower_partitioned"]

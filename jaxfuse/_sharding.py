"""How the SPMD partitioner may split the fused op.

The op is elementwise, so every output dimension is a pass-through factor
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
from jax._src.custom_partitioning_sharding_rule import ArrayMapping, SdyShardingRule
from jax._src.lib.mlir import ir
from jax._src.sharding_impls import ShardingContext, SPMDAxisContext
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

from ._kernels import TARGET
from ._primitive import check_operands


def _factor(i: int) -> str:
    return f"d{i}"


def elementwise_rule(operand_shapes, out_shape) -> SdyShardingRule:
    """The Shardy rule for a size-1-broadcasting elementwise op."""
    results = (ArrayMapping(*(_factor(i) for i in range(len(out_shape)))),)
    operands = []
    for k, shape in enumerate(operand_shapes):
        names = [
            _factor(i) if d == o else f"b{k}x{i}"  # broadcast: a size-1 factor of its own
            for i, (d, o) in enumerate(zip(shape, out_shape))
        ]
        operands.append(ArrayMapping(*names))
    return SdyShardingRule(tuple(operands), results)


def _rule_from_types(mesh, operand_types, result_types) -> SdyShardingRule:
    del mesh
    shape = lambda t: tuple(ir.RankedTensorType(t).shape)
    return elementwise_rule([shape(t) for t in operand_types], shape(result_types[0]))


def is_partitioned(ctx: mlir.LoweringRuleContext) -> bool:
    """True when this module will be split across devices by the partitioner."""
    axis_context = ctx.module_context.axis_context
    if isinstance(axis_context, ShardingContext):
        return axis_context.num_devices > 1
    if isinstance(axis_context, SPMDAxisContext):  # inside shard_map: local unless some axes are auto
        return set(axis_context.manual_axes) != set(axis_context.mesh.axis_names)
    return False


def _spec_entries(sharding, rank):
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    return spec + (None,) * (rank - len(spec))


def _operand_spec(shape, out_shape, out_entries) -> PartitionSpec:
    # A broadcast (size-1) dimension cannot be split; every other dimension is
    # split exactly like the output's.
    return PartitionSpec(
        *(e if d == o else None for d, o, e in zip(shape, out_shape, out_entries))
    )


def _infer(mesh, arg_shapes, result_shape):
    # Each output dimension follows the first operand that is not broadcast there.
    rank = len(result_shape.shape)
    entries = []
    for i, o in enumerate(result_shape.shape):
        entry = None
        for arg in arg_shapes:
            if len(arg.shape) == rank and arg.shape[i] == o:
                entry = _spec_entries(arg.sharding, rank)[i]
                break
        entries.append(entry)
    return NamedSharding(mesh, PartitionSpec(*entries))


def _local_call(a, b):
    """The kernel on one device's shards."""
    out_shape = check_operands(a.shape, a.dtype, b.shape, b.dtype)
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(out_shape, a.dtype))(a, b)


@functools.cache
def _partitioned():
    """The kernel wrapped so the partitioner runs it on each device's shards
    (built on first use: custom_partitioning registers callbacks)."""

    @custom_partitioning
    def call(a, b):
        return _local_call(a, b)

    def partition(mesh, arg_shapes, result_shape):
        out_shape = result_shape.shape
        out_sharding = result_shape.sharding
        entries = _spec_entries(out_sharding, len(out_shape))
        arg_shardings = tuple(
            NamedSharding(mesh, _operand_spec(a.shape, out_shape, entries)) for a in arg_shapes
        )
        return mesh, _local_call, out_sharding, arg_shardings

    call.def_partition(
        partition=partition, infer_sharding_from_operands=_infer, sharding_rule=_rule_from_types
    )
    return call


def lower_partitioned(ctx, a, b):
    return mlir.lower_fun(_partitioned(), multiple_results=False)(ctx, a, b)


__all__ = ["elementwise_rule", "is_partitioned", "lower_partitioned"]
